"""A: the step's scheduler fields and the batch's repeated ids taken in Python, as the probe did
before; B: each in one compiled call (`frames.scheduler_fields`, `frames.RepeatedIds`, what the
probe does now). Same fields, same bytes: only the engine thread's cost differs.

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/compiled_fields.py
"""

from __future__ import annotations

import msgspec

from kvledger.producer import frames, vllm_v1
from kvledger.producer.vllm_v1 import V1RunnerProbe


def _python_fields(so, cached_ids=None) -> tuple:
    cached, new, counts = so.scheduled_cached_reqs, so.scheduled_new_reqs, so.num_scheduled_tokens
    copies = getattr(so, "kv_cache_block_copies", None) or ()
    return (
        [(r.req_id, r.block_ids, r.num_computed_tokens, len(r.prompt_token_ids or ())) for r in new],
        cached.req_ids if cached_ids is None else cached_ids(cached.req_ids),
        getattr(cached, "resumed_req_ids", None) or (),
        cached.new_block_ids,
        cached.num_computed_tokens,
        list(counts.values()) if not new and list(counts) == cached.req_ids else counts,
        so.finished_req_ids,
        getattr(so, "preempted_req_ids", None) or (),
        getattr(so, "new_block_ids_to_zero", None) or (),
        [(c.src, c.dst) if hasattr(c, "src") else tuple(c)[:2] for c in copies] if copies else (),
    )


class _PythonIds:
    __slots__ = ("_encoded", "_ids")

    def __init__(self) -> None:
        self._ids: list[str] | None = None
        self._encoded = msgspec.Raw(b"")

    def __call__(self, ids: list[str], n: int | None = None) -> msgspec.Raw:
        ids = ids if n is None else ids[:n]
        if ids != self._ids:
            self._ids = list(ids)
            self._encoded = msgspec.Raw(frames.pack(self._ids))
        return self._encoded


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    kept = probe.__dict__.setdefault("_kept_ids", {True: (probe._batch_ids, probe._scheduled_ids)})
    kept.setdefault(False, (_PythonIds(), _PythonIds()))
    probe._batch_ids, probe._scheduled_ids = kept[variant_b]
    vllm_v1.scheduler_fields = frames.scheduler_fields if variant_b else _python_fields
