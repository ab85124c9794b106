"""Faust's livelock detector against aiokafka's real partition state: a partition whose position
is being reset is skipped (it crashed the worker), one with a position is still checked.

The consumer thread is a stand-in that holds a real aiokafka SubscriptionState; the detector's
own code (Faust's verify_event_path, as kvledger's worker patches it) runs unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka.structs import TopicPartition
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.types import TP

from kvledger.stream_app.worker import faust_fixes
from kvledger.stream_app.worker.faust_fixes import close_faust_holes

TOPIC = "kvledger.events"
STARTED_LONG_AGO = 10_000.0  # seconds since the worker started: past every Faust timeout


class Thread:
    """What verify_event_path reads of AIOKafkaConsumerThread, around a real SubscriptionState."""

    def __init__(self, subscriptions, log: logging.Logger) -> None:
        self._consumer = SimpleNamespace(_fetcher=SimpleNamespace(_subscriptions=subscriptions))
        self.time_started = 0.0
        self.tp_fetch_request_timeout_secs = 60.0
        self.tp_stream_timeout_secs = 60.0
        self.log = log
        monitor = SimpleNamespace(stream_inbound_time={})
        self.consumer = SimpleNamespace(app=SimpleNamespace(monitor=monitor, topics=SimpleNamespace(
            acks_enabled_for=lambda topic: True)))  # fmt: skip

    def _ensure_consumer(self):
        return self._consumer

    def verify_event_path(self, now: float, tp: TP) -> None:
        return AIOKafkaConsumerThread.verify_event_path(self, now, tp)  # as the worker patched it

    def _verify_aiokafka_event_path(self, now: float, tp: TP) -> bool:
        return AIOKafkaConsumerThread._verify_aiokafka_event_path(self, now, tp)


async def _assigned(*partitions: int):
    from aiokafka.consumer.subscription_state import SubscriptionState

    subscriptions = SubscriptionState()
    subscriptions.subscribe({TOPIC})
    subscriptions.assign_from_subscribed({TopicPartition(TOPIC, p) for p in partitions})
    return subscriptions


def _state(subscriptions, partition: int):
    return subscriptions.subscription.assignment.state_value(TopicPartition(TOPIC, partition))


def test_a_partition_being_reset_is_skipped_and_one_with_a_position_is_still_checked(caplog):
    close_faust_holes()  # as the worker does when it is built

    async def run() -> None:
        subscriptions = await _assigned(0, 1)
        for p in (0, 1):  # both fetched once (a highwater), long ago
            _state(subscriptions, p).highwater = 42
            _state(subscriptions, p).timestamp = 1_000
        _state(subscriptions, 0).await_reset(strategy=0)  # seek_to_beginning, not yet carried out
        _state(subscriptions, 1).seek(7)
        thread = Thread(subscriptions, logging.getLogger("faust-detector"))
        with caplog.at_level(logging.ERROR, logger="faust-detector"):
            assert thread.verify_event_path(STARTED_LONG_AGO, TP(TOPIC, 0)) is None  # raised AssertionError
            assert not caplog.records
            thread.verify_event_path(STARTED_LONG_AGO, TP(TOPIC, 1))
        # The partition with a position still meets Faust's check: its last fetch is stale.
        assert [r.args[0] for r in caplog.records] == [TP(TOPIC, 1)], caplog.text

    asyncio.run(run())


# -- the guard: the fixes run on the client libraries they were tested with, or the worker says so ----------


@pytest.fixture
def unpatched(monkeypatch):
    """A process whose fixes are not applied yet; whatever a test applies is undone after it."""
    from aiokafka.client import AIOKafkaClient
    from faust.transport.consumer import Consumer
    from mode.utils.queues import FlowControlEvent

    monkeypatch.setattr(faust_fixes, "_PATCHED", False)
    for owner, name in [
        (AIOKafkaConsumerThread, "getmany"),
        (AIOKafkaConsumerThread, "topic_partitions"),
        (AIOKafkaConsumerThread, "verify_event_path"),
        (Consumer, "perform_seek"),
        (FlowControlEvent, "resume"),
        (AIOKafkaClient, "_metadata_update"),
    ]:
        monkeypatch.setattr(owner, name, vars(owner)[name])
    return monkeypatch


def _installed_but(package: str, installed: str):
    real = faust_fixes.version
    return lambda name: installed if name == package else real(name)


def test_the_guard_passes_on_the_installed_client_libraries(unpatched):
    assert faust_fixes.client_library_problems() == ([], {})
    assert faust_fixes.close_faust_holes() == [1, 2, 3, 4, 5, 6]
    assert faust_fixes.close_faust_holes() == []  # once per process


def test_the_guard_lists_every_private_name_the_fixes_reach():
    checked = {str(t) for fix in faust_fixes.FIXES for t in fix.targets}
    for name in [
        "faust.transport.drivers.aiokafka.Consumer._committed_offset",
        "faust.transport.drivers.aiokafka.Consumer._thread",
        "faust.transport.drivers.aiokafka.Consumer._is_changelog_tp",
        "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread._ensure_consumer",
        "aiokafka.AIOKafkaConsumer._fetcher",
        "aiokafka.consumer.fetcher.Fetcher._subscriptions",
        "aiokafka.consumer.subscription_state.TopicPartitionState.has_valid_position",
        "aiokafka.client.AIOKafkaClient._retry_backoff",
        "aiokafka.client.AIOKafkaClient._metadata_update",
    ]:
        assert name in checked


def test_another_version_refuses_in_one_line_naming_the_versions(unpatched):
    unpatched.setattr(faust_fixes, "version", _installed_but("aiokafka", "0.14.1"))
    before = AIOKafkaConsumerThread.getmany
    with pytest.raises(faust_fixes.UntestedClientLibraries) as refused:
        faust_fixes.close_faust_holes()
    line = str(refused.value)
    assert "\n" not in line
    assert "aiokafka 0.14.1 is not the tested 0.14.0" in line
    assert "tested with faust-streaming 0.15.3, mode-streaming 0.7.1, aiokafka 0.14.0" in line
    assert "installed faust-streaming 0.15.3, mode-streaming 0.7.1, aiokafka 0.14.1" in line
    assert "--untested-client-libraries" in line
    assert AIOKafkaConsumerThread.getmany is before  # nothing applied
    assert faust_fixes._PATCHED is False


def test_a_missing_private_method_refuses_naming_it(unpatched):
    unpatched.delattr(AIOKafkaConsumerThread, "_ensure_consumer")
    with pytest.raises(faust_fixes.UntestedClientLibraries) as refused:
        faust_fixes.close_faust_holes()
    assert "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread._ensure_consumer is missing" in str(refused.value)


def test_an_attribute_no_init_assigns_any_more_refuses_naming_it(unpatched):
    from aiokafka.client import AIOKafkaClient

    real_init = AIOKafkaClient.__init__

    def __init__(self, *args, **kwargs):  # a version that renamed it: no `self._retry_backoff =` left
        real_init(self, *args, **kwargs)

    unpatched.setattr(AIOKafkaClient, "__init__", __init__)
    with pytest.raises(faust_fixes.UntestedClientLibraries) as refused:
        faust_fixes.close_faust_holes()
    assert "aiokafka.client.AIOKafkaClient._retry_backoff is missing" in str(refused.value)
    assert "tested with faust-streaming 0.15.3" in str(refused.value)


def test_a_property_turned_method_refuses(unpatched):
    from aiokafka.consumer.subscription_state import TopicPartitionState

    unpatched.setattr(TopicPartitionState, "has_valid_position", lambda self: True)  # would read as always true
    with pytest.raises(faust_fixes.UntestedClientLibraries) as refused:
        faust_fixes.close_faust_holes()
    assert "TopicPartitionState.has_valid_position is no longer a property" in str(refused.value)


def test_the_override_starts_with_a_warning_and_the_fixes_whose_targets_are_present(unpatched, caplog):
    from aiokafka.client import AIOKafkaClient

    unpatched.setattr(faust_fixes, "version", _installed_but("mode-streaming", "0.7.2"))
    unpatched.delattr(AIOKafkaConsumerThread, "_ensure_consumer")  # what fix 5 reads
    verify_before, metadata_before = AIOKafkaConsumerThread.verify_event_path, AIOKafkaClient._metadata_update
    with caplog.at_level(logging.WARNING, logger="kvledger.worker"):
        assert faust_fixes.close_faust_holes(untested_client_libraries=True) == [1, 2, 3, 4, 6]
    assert AIOKafkaConsumerThread.verify_event_path is verify_before  # not applied: it would raise
    assert AIOKafkaClient._metadata_update is not metadata_before
    [warning] = [r for r in caplog.records if r.name == "kvledger.worker"]
    assert warning.levelno == logging.WARNING
    text = warning.getMessage()
    assert "untested" in text
    assert "mode-streaming 0.7.2 is not the tested 0.7.1" in text
    assert "AIOKafkaConsumerThread._ensure_consumer is missing" in text
    assert "holes left open: 5" in text


def test_the_stream_command_refuses_in_one_line_without_a_traceback(unpatched):
    from click.testing import CliRunner

    from kvledger.stream_app.cli import main

    unpatched.setattr(faust_fixes, "version", _installed_but("faust-streaming", "0.15.4"))
    result = CliRunner().invoke(main, ["stream", "--bootstrap", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    [line] = result.output.splitlines()
    assert line.startswith("kvledger: error: ")
    assert "faust-streaming 0.15.4 is not the tested 0.15.3" in line


def test_the_tested_versions_are_the_pins_of_the_installed_package():
    """Stated once, in pyproject.toml: the guard reads the exact pins from kvledger's installed metadata."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    exact = [r.split("==") for r in project["optional-dependencies"]["stream"] if "==" in r]
    pins = {name.split("[")[0]: pinned for name, pinned in exact}  # aiokafka[lz4,...]: aiokafka
    assert {package: pins[package] for package in faust_fixes.PINNED} == faust_fixes.TESTED_WITH


def test_metadata_without_the_pins_fails_loudly():
    with pytest.raises(RuntimeError, match="metadata is missing"):
        faust_fixes.pinned_versions(None)
    loose = ["faust-streaming>=0.15", 'mode_streaming==0.7.1; extra == "stream"', "aiokafka[lz4] == 0.14.0"]
    with pytest.raises(RuntimeError, match=r"pins no exact version of faust-streaming:"):
        faust_fixes.pinned_versions(loose)
    exact = ['Faust-Streaming==0.15.3; extra == "stream"', *loose[1:]]
    assert faust_fixes.pinned_versions(exact) == {
        "faust-streaming": "0.15.3", "mode-streaming": "0.7.1", "aiokafka": "0.14.0",
    }  # fmt: skip
