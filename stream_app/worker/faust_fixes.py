"""Holes in Faust (faust-streaming 0.15, aiokafka 0.14) closed here, when the worker is imported:
three in its fetching around a rebalance, through which records were skipped for good, two
that crashed a worker, and one that spun a core while the broker was gone.

Found by the two-workers takeover test (tests/integration/test_stream_worker.py),
which lost records about one run in seven before:

1. Faust hands its *live* set of active partitions to the consumer thread, and
   aiokafka reads an empty set as "every partition". A fetch still pending when a
   rebalance pauses every partition (or recovery pauses the changelogs) returns the
   records of all assigned partitions, paused stream partitions included, and moves
   their positions past records Faust then drops (or yields only once the partition
   is resumed, mid-batch: the first records lost, the rest ahead of them). The
   thread gets a copy, and an empty set fetches nothing.
2. Faust undoes such drops by seeking to the committed offsets, and aiokafka's
   `seek_to_committed` leaves a partition without a committed offset where it is:
   the partition of a worker that died before its first commit stayed at its end,
   unread. Such partitions go back to their beginning, as
   `consumer_auto_offset_reset="earliest"` says (re-reading is harmless: the
   projections skip the offsets their checkpoints cover).
3. Recovery resumes the stream partitions and seeks them while the flow is already
   on (it was turned on to read the changelogs), then resumes the flow again, which
   empties the agents' queues: records of the new assignment already handed over
   were thrown away, and their re-fetch dropped as already read. Only a suspended
   flow is resumed now (suspending clears the queues anyway).
4. aiokafka's metadata snapshot lists a topic whose partitions it does not know yet
   (a changelog just created, its leader not elected) with 0 partitions, and Faust
   takes that 0 as a count where it means "unknown" (None): a table's first write
   compared it with its source topic's and refused the table for good
   (PartitionsMismatch). It reads as unknown now, as Faust's own check expects.
5. Faust's livelock detector reads each assigned partition's position, and aiokafka
   asserts on a position that is being reset (a partition just assigned, or sought to
   its beginning as in 2, that the fetcher has not reset yet): a tick in that window
   crashed the worker (AssertionError). Found by the dev stack's demo
   (tests/e2e/test_dev_stack.py: once in CI, once in six runs here). Such a partition
   has nothing to verify until it has a position again; the next tick checks it.
6. aiokafka's producer asks for new metadata as soon as the last request ended while a
   batch waits for a partition whose leader it does not know, and waits for nothing
   else: a broker that is gone refuses at once, so the worker spun a whole core (4,000
   failed requests and 8,000 log lines a second, 50 MB of log in a minute) for as long
   as the broker was away. A batch is left in that state by a broker that stops while
   a write is in flight (its last answer: not the leader), and the core was taken from
   the engine beside the worker (tests/e2e/test_broker_outage.py: its tokens/s fell to
   a third in CI). Metadata is now requested at most once per `retry_backoff_ms`
   (100 ms), as Kafka's own clients do (`retry.backoff.ms`).

The fixes reach into private names of these libraries, so they hold for the versions they were
tested with (`TESTED_WITH`: the exact pins of pyproject.toml, read from kvledger's installed metadata)
only. `close_faust_holes`, called as the worker starts, checks those
exact versions and every name the fixes read or replace (`FIXES`: methods with the parameters the
fixes call them with, properties, attributes an `__init__` assigns), and refuses to start on any
difference, in one line naming it and the versions tested and installed: a fix not applied, or one
that reads a renamed attribute, reopens its hole without a word. `--untested-client-libraries`
(KVLEDGER_UNTESTED_CLIENT_LIBRARIES=1) starts the worker anyway, with a warning naming what
failed, and applies the fixes whose every target is present.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import logging
import re
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, requires, version

log = logging.getLogger("kvledger.worker")
_PATCHED = False

# The libraries the fixes reach into. The exact versions they were tested with (the takeover, livelock
# and outage tests) are pinned once, in pyproject.toml's `stream` extra, and read here from kvledger's
# installed metadata. To move one: read every fix below against the new source, update `FIXES`, pass
# those tests, then change the pin there (and reinstall).
PINNED = ("faust-streaming", "mode-streaming", "aiokafka")
_EXACT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*===?\s*([^\s;,]+)\s*(?:;.*)?")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions(requirements: list[str] | None) -> dict[str, str]:
    """The exact version each of `PINNED` is pinned to among kvledger's requirements (`requires`);
    RuntimeError, naming what is missing, where the metadata is missing or pins one of them loosely."""
    if requirements is None:
        raise RuntimeError(
            "kvledger's installed metadata is missing: the versions of faust-streaming, mode-streaming and "
            "aiokafka the worker's fixes were tested with are read from it (reinstall: pip install -e '.[stream]')"
        )
    pins = {}
    for requirement in requirements:
        exact = _EXACT.fullmatch(requirement.strip())
        if exact is not None:
            pins[_canonical(exact[1])] = exact[2]
    missing = [package for package in PINNED if package not in pins]
    if missing:
        raise RuntimeError(
            f"kvledger's installed metadata pins no exact version of {', '.join(missing)}: the worker's fixes "
            "hold for the versions they were tested with only (pyproject.toml pins them with ==; reinstall)"
        )
    return {package: pins[package] for package in PINNED}


def _requirements() -> list[str] | None:
    try:
        return requires("kvledger")
    except PackageNotFoundError:
        return None


TESTED_WITH = pinned_versions(_requirements())
OVERRIDE = "--untested-client-libraries (or KVLEDGER_UNTESTED_CLIENT_LIBRARIES=1)"


class UntestedClientLibraries(RuntimeError):
    """Faust, mode or aiokafka differ from what the fixes were tested with; the message is one line."""


@dataclass(frozen=True)
class Target:
    """A name a fix reads or replaces. `owner`: `module` or `module:Class`. `kind`:
    "function": a function (a method) with `params` (as the fix calls it; `*` marks *args),
        a coroutine function if `coroutine` (the fix awaits it);
    "property": a property (the fix reads it as a value: a method there would read as true);
    "self": an attribute the `__init__` of the class (or of a base) assigns to `self`."""

    owner: str
    name: str
    kind: str = "function"
    params: tuple[str, ...] = ()
    coroutine: bool = False

    def __str__(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


@dataclass(frozen=True)
class Fix:
    hole: int  # as numbered in the docstring
    apply: Callable[[], None]
    targets: tuple[Target, ...]


def _close_hole_1() -> None:
    from faust.transport.drivers import aiokafka as faust_aiokafka

    thread_getmany = faust_aiokafka.AIOKafkaConsumerThread.getmany

    async def getmany(self, active_partitions, timeout):
        if active_partitions is not None:
            active_partitions = set(active_partitions)
            if not active_partitions:
                return {}
        return await thread_getmany(self, active_partitions, timeout)

    faust_aiokafka.AIOKafkaConsumerThread.getmany = getmany


def _close_hole_2() -> None:
    from faust.transport import consumer as faust_consumer
    from faust.transport.drivers import aiokafka as faust_aiokafka

    faust_perform_seek = faust_consumer.Consumer.perform_seek

    async def perform_seek(self) -> None:
        await faust_perform_seek(self)
        uncommitted = [
            faust_aiokafka.ensure_aiokafka_TP(tp)
            for tp in self.assignment()
            if not self._is_changelog_tp(tp) and self._committed_offset.get(tp) is None
        ]
        if uncommitted:
            await self._thread.seek_to_beginning(*uncommitted)

    faust_consumer.Consumer.perform_seek = perform_seek


def _close_hole_3() -> None:
    from mode.utils.queues import FlowControlEvent

    flow_resume = FlowControlEvent.resume

    def resume(self) -> None:
        if not self.is_active():
            flow_resume(self)

    FlowControlEvent.resume = resume


def _close_hole_4() -> None:
    from faust.transport.drivers import aiokafka as faust_aiokafka

    thread_topic_partitions = faust_aiokafka.AIOKafkaConsumerThread.topic_partitions

    def topic_partitions(self, topic: str) -> int | None:
        return thread_topic_partitions(self, topic) or None

    faust_aiokafka.AIOKafkaConsumerThread.topic_partitions = topic_partitions


def _close_hole_5() -> None:
    from faust.transport.drivers import aiokafka as faust_aiokafka

    thread_verify_event_path = faust_aiokafka.AIOKafkaConsumerThread.verify_event_path

    def verify_event_path(self, now: float, tp) -> None:
        # The state as Faust's own check reaches it (a private path of aiokafka's consumer).
        assignment = self._ensure_consumer()._fetcher._subscriptions.subscription.assignment
        state = assignment.state_value(faust_aiokafka.ensure_aiokafka_TP(tp)) if assignment else None
        if state is not None and not state.has_valid_position:
            return None
        return thread_verify_event_path(self, now, tp)

    faust_aiokafka.AIOKafkaConsumerThread.verify_event_path = verify_event_path


def _close_hole_6() -> None:
    from aiokafka.client import AIOKafkaClient

    client_metadata_update = AIOKafkaClient._metadata_update

    async def _metadata_update(self, cluster_metadata, topics) -> bool:
        # `_retry_backoff` is `retry_backoff_ms` in seconds (its default: Faust does not set it).
        wait = getattr(self, "_kvledger_metadata_at", -1e9) + self._retry_backoff - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        try:
            return await client_metadata_update(self, cluster_metadata, topics)
        finally:
            self._kvledger_metadata_at = time.monotonic()

    AIOKafkaClient._metadata_update = _metadata_update


_DRIVER = "faust.transport.drivers.aiokafka"
_THREAD = f"{_DRIVER}:AIOKafkaConsumerThread"  # Faust's consumer thread
_CONSUMER = f"{_DRIVER}:Consumer"  # Faust's consumer: what `self` is in perform_seek
_STATE = "aiokafka.consumer.subscription_state"
_TO_AIOKAFKA_TP = Target(_DRIVER, "ensure_aiokafka_TP", params=("tp",))

# Every name each fix reads or replaces, down the private paths its code follows.
FIXES = (
    Fix(
        1, _close_hole_1, (Target(_THREAD, "getmany", params=("self", "active_partitions", "timeout"), coroutine=True),)
    ),
    Fix(
        2,
        _close_hole_2,
        (
            Target("faust.transport.consumer:Consumer", "perform_seek", params=("self",), coroutine=True),
            Target(_CONSUMER, "assignment", params=("self",)),
            Target(_CONSUMER, "_is_changelog_tp", params=("self", "tp")),
            Target(_CONSUMER, "_committed_offset", "self"),
            Target(_CONSUMER, "_thread", "self"),
            Target(_THREAD, "seek_to_beginning", params=("self", "*partitions"), coroutine=True),
            _TO_AIOKAFKA_TP,
        ),
    ),
    Fix(
        3,
        _close_hole_3,
        (
            Target("mode.utils.queues:FlowControlEvent", "resume", params=("self",)),
            Target("mode.utils.queues:FlowControlEvent", "is_active", params=("self",)),
        ),
    ),
    Fix(4, _close_hole_4, (Target(_THREAD, "topic_partitions", params=("self", "topic")),)),
    Fix(
        5,
        _close_hole_5,
        (
            Target(_THREAD, "verify_event_path", params=("self", "now", "tp")),
            Target(_THREAD, "_ensure_consumer", params=("self",)),
            Target("aiokafka:AIOKafkaConsumer", "_fetcher", "self"),  # the consumer Faust's thread builds
            Target("aiokafka.consumer.fetcher:Fetcher", "_subscriptions", "self"),
            Target(f"{_STATE}:SubscriptionState", "subscription", "property"),
            Target(f"{_STATE}:Subscription", "assignment", "property"),
            Target(f"{_STATE}:Assignment", "state_value", params=("self", "tp")),
            Target(f"{_STATE}:TopicPartitionState", "has_valid_position", "property"),
            _TO_AIOKAFKA_TP,
        ),
    ),
    Fix(
        6,
        _close_hole_6,
        (
            Target(
                "aiokafka.client:AIOKafkaClient",
                "_metadata_update",
                params=("self", "cluster_metadata", "topics"),
                coroutine=True,
            ),
            Target("aiokafka.client:AIOKafkaClient", "_retry_backoff", "self"),
        ),
    ),
)


def _owner(target: Target):
    module, _, qualname = target.owner.partition(":")
    owner = importlib.import_module(module)
    for name in filter(None, qualname.split(".")):
        owner = getattr(owner, name)
    return owner


def _init_assigns(cls: type, name: str) -> bool:
    """Whether the `__init__` of `cls` or of one of its bases assigns `self.<name>`.

    Read from the source, not from an instance: building an aiokafka client or consumer, or a Faust
    consumer, takes a running loop, an app and a transport and may start tasks or connect, which a
    check before start-up must not; and some of these attributes hold None until the client starts
    (`_fetcher`), so an instance would show no more than the source does. An `__init__` whose source
    cannot be read counts as not assigning it (the check refuses rather than guesses)."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        this = init.__code__.co_varnames[0] if init.__code__.co_argcount else "self"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and node.attr == name
                and isinstance(node.value, ast.Name)
                and node.value.id == this
            ):
                return True
    return False


def _params(function) -> tuple[str, ...]:
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(stars.get(p.kind, "") + p.name for p in inspect.signature(function).parameters.values())


def target_problem(target: Target) -> str | None:
    """What is wrong with `target` in the installed libraries, or None."""
    try:
        owner = _owner(target)
    except (ImportError, AttributeError):
        return f"{target.owner.replace(':', '.')} is missing"
    if target.kind == "self":
        if _init_assigns(owner, target.name):
            return None
        return f"{target} is missing (no __init__ of {owner.__name__} or its bases assigns it)"
    try:
        value = inspect.getattr_static(owner, target.name)
    except AttributeError:
        return f"{target} is missing"
    if target.kind == "property":
        return None if isinstance(value, property) else f"{target} is no longer a property"
    if not inspect.isfunction(value):
        return f"{target} is no longer a function"
    params = _params(value)
    if params != target.params:
        return f"{target} takes ({', '.join(params)}), the fix calls ({', '.join(target.params)})"
    if inspect.iscoroutinefunction(value) != target.coroutine:
        return f"{target} is {'no longer' if target.coroutine else 'now'} a coroutine function"
    return None


def installed_versions() -> dict[str, str | None]:
    installed = {}
    for package in TESTED_WITH:
        try:
            installed[package] = version(package)
        except PackageNotFoundError:
            installed[package] = None
    return installed


def _listed(versions: dict[str, str | None]) -> str:
    return ", ".join(f"{package} {v or '(not installed)'}" for package, v in versions.items())


def client_library_problems() -> tuple[list[str], dict[Target, str]]:
    """The packages whose version differs from `TESTED_WITH`, and the targets that are not as the
    fixes expect them (each with what is wrong)."""
    installed = installed_versions()
    packages = [
        f"{package} {installed[package] or '(not installed)'} is not the tested {tested}"
        for package, tested in TESTED_WITH.items()
        if installed[package] != tested
    ]
    targets = {t: problem for fix in FIXES for t in fix.targets if (problem := target_problem(t)) is not None}
    return packages, targets


def close_faust_holes(untested_client_libraries: bool = False) -> list[int]:
    """Close the holes (once per process); returns the holes this call closed.

    Raises UntestedClientLibraries (one line) if a version or a target differs from what the fixes
    were tested with, unless `untested_client_libraries`: then it logs a warning naming what differs
    and closes the holes whose fix finds every one of its targets."""
    global _PATCHED
    if _PATCHED:
        return []
    packages, targets = client_library_problems()
    if packages or targets:
        found = "; ".join([*packages, *dict.fromkeys(targets.values())])
        versions = f"tested with {_listed(TESTED_WITH)}; installed {_listed(installed_versions())}"
        if not untested_client_libraries:
            raise UntestedClientLibraries(
                f"the worker's fixes to its Kafka client libraries are untested here: {found} ({versions}); "
                f"{OVERRIDE} starts it anyway"
            )
    closed = []
    for fix in FIXES:
        if not any(t in targets for t in fix.targets):
            fix.apply()
            closed.append(fix.hole)
    if packages or targets:
        left_open = [fix.hole for fix in FIXES if fix.hole not in closed]
        log.warning(
            "started on untested Kafka client libraries, as allowed: %s (%s); holes left open: %s",
            found,
            versions,
            ", ".join(map(str, left_open)) or "none",
        )
    _PATCHED = True
    return closed
