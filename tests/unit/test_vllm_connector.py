"""The KV connector probe on stand-ins shaped like vLLM 0.32's connectors (no vLLM needed).

The real thing, on a real Mooncake pair, is tested in tests/e2e/test_pd_pair.py;
here the paths a clean pair never takes: failed receives, invalid blocks,
expired sends, connectors no adapter knows, and missing attach targets.
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.producer.vllm_connector import ConnectorProbe, MooncakeAdapter, adapter_for
from kvledger.schemas import LEDGER_EVENT, SingleObjectCodec, unpack_i32
from tests.e2e.conftest import vllm_python
from tests.unit.connector_standins import (
    Metadata,
    MooncakeConnector,
    OtherConnector,
    PullReqMeta,
    Results,
    step,
)


class Recording:
    def __init__(self):
        self.events: list[dict] = []
        self.codec = SingleObjectCodec(LEDGER_EVENT)

    def __call__(self, body, ready=None):  # the digest of a completion: none drawn here
        body = body() if callable(body) else body
        event = records.envelope(RankIdentity("eng"), len(self.events), 0, body)
        self.codec.decode(self.codec.encode(event))  # every event is valid Avro
        self.events.append(event["body"][1])  # as written

    def kinds(self) -> list[tuple[str, str | None, str | None]]:
        return [(e["kind"], e["req_id"], e["transfer_id"]) for e in self.events]


def probe_on(connector) -> tuple[ConnectorProbe, Recording, list]:
    recording = Recording()
    probe = ConnectorProbe(connector, adapter_for(connector), recording, lambda: 7)
    return probe, recording, probe.attach()


def test_a_send_is_recorded_from_intent_to_completion():
    connector = MooncakeConnector()
    _, recording, capabilities = probe_on(connector)
    assert ("connector", True, None) in capabilities and ("connector_expiry", True, None) in capabilities
    # Registered before its prefill finished (no blocks yet): not an intent.
    step(connector, Metadata(reqs_to_send={"p1": ("t1", [])}))
    step(connector, Metadata(reqs_to_send={"p1": ("t1", [[4, 5]])}))
    connector.connector_worker.finished_sending_reqs.add("p1")
    step(connector)
    assert recording.kinds() == [("SEND_INTENT", "p1", "t1"), ("SEND_DONE", "p1", "t1")]
    assert [unpack_i32(b).tolist() for b in recording.events[1]["block_ids"]] == [[4, 5]]
    assert recording.events[0]["step"] == 7 and recording.events[0]["connector"] == "MooncakeConnector"
    assert connector.bound is not None  # the connector itself still got its metadata


def test_an_expired_send_is_not_a_completed_one():
    connector = MooncakeConnector()
    _, recording, _ = probe_on(connector)
    step(connector, Metadata(reqs_to_send={"p1": ("t1", [[4]]), "p2": ("t2", [[6]])}))
    connector.connector_worker.finished_sending_reqs.add("p1")
    connector.connector_worker.expiring.add("p2")
    step(connector)
    assert recording.kinds()[2:] == [("SEND_DONE", "p1", "t1"), ("EXPIRED", "p2", "t2")]


def test_receives_done_failed_and_with_invalid_blocks():
    connector = MooncakeConnector()
    _, recording, _ = probe_on(connector)
    pulls = {f"d{i}": PullReqMeta(f"d{i}", f"t{i}", [[10 * i, 10 * i + 1]], "prefill-0") for i in (1, 2, 3)}
    pulls["d4"] = PullReqMeta("d4", "t4", [[]], "prefill-0")
    step(connector, Metadata(reqs_to_recv={"prefill-0": pulls}))
    # d1 arrived; d2 reported failed (HMA path); d3 "finished" but its blocks failed to load.
    connector.next_results = Results(finished_recving={"d1", "d2", "d3"}, failed_recving={"d2"})
    connector.next_invalid = {31}
    step(connector)
    assert recording.kinds() == [
        ("RECV_INTENT", "d1", "t1"),
        ("RECV_INTENT", "d2", "t2"),
        ("RECV_INTENT", "d3", "t3"),
        ("OTHER", "d4", "t4"),  # a pull without blocks only releases the prefill side's
        ("INVALID_BLOCKS", None, None),
        ("RECV_DONE", "d1", "t1"),
        ("RECV_FAILED", "d2", "t2"),
        ("RECV_FAILED", "d3", "t3"),
    ]
    assert recording.events[0]["remote_engine_id"] == "prefill-0"
    assert recording.events[3]["detail"] == "release_only"
    assert [unpack_i32(b).tolist() for b in recording.events[4]["block_ids"]] == [[31]]
    assert recording.events[7]["detail"] == "1 block(s) failed to load"


def test_invalid_blocks_reported_before_their_receive_completes_fail_it():
    """Seen on the real pair: the worker reports the blocks that failed to load one step before
    it reports the receive finished."""
    connector = MooncakeConnector()
    _, recording, _ = probe_on(connector)
    pulls = {f"d{i}": PullReqMeta(f"d{i}", f"t{i}", [[10 * i, 10 * i + 1]], "prefill-0") for i in (1, 2)}
    step(connector, Metadata(reqs_to_recv={"prefill-0": pulls}))
    connector.next_invalid = {20, 99}  # 99: no receive holds it
    step(connector)
    connector.next_results = Results(finished_recving={"d1", "d2"})
    step(connector)
    assert recording.kinds()[2:] == [
        ("INVALID_BLOCKS", None, None),
        ("RECV_DONE", "d1", "t1"),
        ("RECV_FAILED", "d2", "t2"),
    ]
    assert recording.events[-1]["detail"] == "1 block(s) failed to load"
    # Claimed once: a later receive of the same block is not failed by the old report.
    step(connector, Metadata(reqs_to_recv={"prefill-0": {"d5": PullReqMeta("d5", "t5", [[20]], "prefill-0")}}))
    connector.next_results = Results(finished_recving={"d5"})
    step(connector)
    assert recording.kinds()[-1] == ("RECV_DONE", "d5", "t5")


def test_a_cancelled_send_is_recorded():
    connector = MooncakeConnector()
    _, recording, _ = probe_on(connector)
    step(connector, Metadata(reqs_not_processed={"t9"}))
    assert recording.kinds() == [("OTHER", None, "t9")] and recording.events[0]["detail"] == "send_cancelled"


def test_completions_are_kept_when_load_errors_are_never_asked_for():
    connector = MooncakeConnector()
    _, recording, _ = probe_on(connector)
    connector.bind_connector_metadata(Metadata(reqs_to_send={"p1": ("t1", [[4]])}))
    connector.connector_worker.finished_sending_reqs.add("p1")
    connector.get_transfer_results(set())
    connector.bind_connector_metadata(Metadata())  # next step, no load-error call in between
    assert recording.kinds() == [("SEND_INTENT", "p1", "t1"), ("SEND_DONE", "p1", "t1")]


def test_an_unknown_connector_gets_completions_and_says_what_it_lacks():
    other = OtherConnector()
    assert adapter_for(other).name == "generic"
    _, recording, capabilities = probe_on(other)
    assert ("connector_intents", False, "no adapter reads OtherConnector's metadata") in capabilities
    step(other, Metadata(reqs_to_send={"p1": ("t1", [[4]])}))
    other.next_results = Results(finished_recving={"d1"})
    step(other)
    assert recording.kinds() == [("RECV_DONE", "d1", None)]


def test_missing_targets_are_reported_not_raised():
    bare = SimpleNamespace(bind_connector_metadata=lambda m: None)
    _, _, capabilities = probe_on(bare)
    assert capabilities == [
        ("connector", False, "SimpleNamespace has no get_transfer_results, get_block_ids_with_load_errors")
    ]
    no_worker = MooncakeConnector()
    no_worker.connector_worker = None
    _, _, capabilities = probe_on(no_worker)
    assert capabilities[0] == ("connector", True, None)
    assert capabilities[1][:2] == ("connector_expiry", False)


def test_a_failing_probe_goes_quiet_and_the_connector_goes_on():
    connector = MooncakeConnector()
    probe, recording, _ = probe_on(connector)
    probe.adapter = MooncakeAdapter()
    bad = Metadata(reqs_to_recv={"prefill-0": {"d1": object()}})  # not a PullReqMeta
    step(connector, bad)
    assert connector.bound is bad and probe._broken
    step(connector, Metadata(reqs_to_send={"p1": ("t1", [[4]])}))
    assert recording.events == []


def test_prompt_length_from_either_runner():
    """Send intents carry the prompt length on V1 (request states) and on MRV2 (`req_states` columns)."""
    import numpy as np

    from kvledger.producer.vllm_connector import _prompt_tokens

    v1 = SimpleNamespace(requests={"a": SimpleNamespace(prompt_token_ids=[1, 2, 3])})
    mrv2 = SimpleNamespace(
        req_states=SimpleNamespace(req_id_to_index={"a": 2}, prompt_len=SimpleNamespace(np=np.array([0, 0, 7])))
    )
    assert _prompt_tokens(v1)("a") == 3 and _prompt_tokens(v1)("b") is None
    assert _prompt_tokens(mrv2)("a") == 7 and _prompt_tokens(mrv2)("b") is None


DIGEST_SCRIPT = """
import hashlib, threading
import torch
from kvledger.producer import records
from kvledger.producer.vllm_connector import ConnectorProbe, adapter_for
from tests.unit.connector_standins import Metadata, MooncakeConnector, step

# Two layers' KV caches as Mooncake registers them: per region a base, a block stride and the
# bytes a block moves, all of group 0; every byte tells its layer, block and offset.
caches = [torch.arange(16 * 256, dtype=torch.int64).to(torch.uint8).view(16, 256) + layer for layer in (0, 7)]
connector = MooncakeConnector()
worker = connector.connector_worker
worker.device_kv_caches = {f"layer{i}": c for i, c in enumerate(caches)}
worker.kv_caches_base_addr = [c.data_ptr() for c in caches]
worker.block_len_per_layer = worker.kv_block_len_per_layer = [256, 256]
worker.registered_group_indices = [0, 0]

recorded = []  # (build, ready) as the rank's capture path takes them
probe = ConnectorProbe(connector, adapter_for(connector), lambda body, ready=None: recorded.append((body, ready)),
                       lambda: 3, digest_fraction=1.0)
assert ("transfer_digests", True, None) in probe.attach()
hashing, go_on = threading.Event(), threading.Event()
hash_blocks = probe.digester.hash
def held_hash(copied):  # the digest thread, held until the test lets it go
    hashing.set()
    go_on.wait(30)
    return hash_blocks(copied)
probe.digester.hash = held_hash

step(connector, Metadata(reqs_to_send={"p1": ("t1", [[4, 0, 9]])}))
worker.finished_sending_reqs.add("p1")
engine = threading.current_thread()
step(connector)  # SEND_DONE: the blocks' bytes copied on this thread, hashed on the digest thread
body, ready = recorded[-1]
assert hashing.wait(30) and ready is not None and not ready()  # held while the thread hashes
want = []
for block in (4, 0, 9):
    h = hashlib.blake2b(digest_size=8)
    for c in caches:
        h.update(c[block].numpy().tobytes())
    want.append(int.from_bytes(h.digest(), "little") if block else 0)  # the null block: no digest
for c in caches:  # the scheduler frees the blocks and another request overwrites them
    c[4] = 255
    c[9] = 255
go_on.set()
for _ in range(3000):
    if ready():
        break
    threading.Event().wait(0.01)
event = body()
assert event.kind == "SEND_DONE" and event.digest == records.transfer_digest(probe.digester.layout, want)
assert [t.name for t in threading.enumerate() if t.name.startswith("kvledger-digest")]  # hashed off this thread
print("ok")
"""


@pytest.mark.vllm
def test_a_transfer_is_copied_at_its_completion_and_hashed_off_the_engine_thread():
    proc = subprocess.run([vllm_python(), "-c", DIGEST_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.stdout + proc.stderr)[-2000:]
