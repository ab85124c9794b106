"""The worker's web views (Faust's web server, bound to 127.0.0.1).

/metrics       Prometheus exposition
/engines       engines and ranks seen: last step, lag, events dropped by producers; then the engines
               retired (state "retired", and why: every rank shut down, or silent too long)
/violations    the most recent violations, newest last
/block-table   ?engine=E&req=R[&step=S]: a request's block table per rank, at each rank's current
               step, or at step S (time travel: rebuilt from a kept checkpoint and the events topic)
/transfers     the transfer joins of this worker's partitions: offsets covered, transfers open
/history       the last 30 minutes of events/s, lag, producer drops and violations (history.py)
/              the status page: plots of /history, the tables, each violation's block table drawn
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from importlib import resources
from typing import TYPE_CHECKING

import faust
from prometheus_client import CONTENT_TYPE_LATEST

from kvledger.stream_app.worker.history import History, read_registry
from kvledger.stream_app.worker.travel import travel

if TYPE_CHECKING:
    from kvledger.stream_app.worker.app import StreamWorker


def engines_view(worker: StreamWorker) -> list[dict]:
    out = []
    for engine_id, projection in sorted(worker.engines.items()):
        anchor = worker.anchors.get(engine_id)
        tp = anchor.message.tp if anchor is not None else None
        lag = worker.lag(tp) if tp is not None else None
        ledger = projection.ledger
        ranks = [
            {
                "rank": f"dp{key.dp}-tp{key.tp}-pp{key.pp}",
                "incarnation": slot.incarnation,
                "last_step": slot.last_step,
                "events_dropped": slot.events_dropped,
                "in_sync": not slot.desynced,
            }
            for key, slot in sorted(ledger.ranks.items(), key=lambda kv: (kv[0].dp, kv[0].pp, kv[0].tp))
        ]
        out.append(
            {
                "engine_id": engine_id,
                "state": "live",
                "partition": tp.partition if tp is not None else None,
                "lag": lag,
                "events": ledger.events,
                "next_offset": projection.next_offset,
                "steps": ledger.steps,
                "held_steps": sum(len(g.pending) for g in ledger.step_groups.values()),
                "ranks": ranks,
                "closed": ledger.closed,
            }
        )
    live = {e["engine_id"] for e in out}
    for retired in worker.retired:
        if retired["engine_id"] not in live:  # an engine id that came back is listed live
            out.append({**retired, "state": "retired", "held_steps": 0, "ranks": []})
    return out


def transfers_view(worker: StreamWorker) -> list[dict]:
    return [
        {
            "partition": partition,
            "next_offset": projection.next_offset,
            "open_transfers": projection.open_transfers,
            "ranks": len(projection.join.clock),
        }
        for partition, projection in sorted(worker.joins.items())
    ]


def violations_view(worker: StreamWorker) -> list[dict]:
    return [{"id": issued.id, **issued.violation.to_record()} for issued in worker.recent]


def block_table_view(worker: StreamWorker, engine_id: str, req_id: str) -> list[dict] | None:
    projection = worker.engines.get(engine_id)
    if projection is None:
        return None
    views = []
    for key, slot in sorted(projection.ledger.ranks.items(), key=lambda kv: (kv[0].dp, kv[0].pp, kv[0].tp)):
        state = projection.ledger.tables_of(key)
        rows = state.request_rows(req_id) if state is not None else None
        views.append({"rank": f"dp{key.dp}-tp{key.tp}-pp{key.pp}", "step": slot.last_step, "rows": rows})
    return views


async def travel_view(worker: StreamWorker, engine_id: str, req_id: str, step: int) -> dict | None:
    projection = worker.engines.get(engine_id)
    anchor = worker.anchors.get(engine_id)
    if projection is not None and anchor is not None:
        tp = anchor.message.tp
        partition, waypoints, end = tp.partition, projection.waypoints, worker.positions.get(tp, projection.next_offset)
    elif engine_id in worker.retired_travel:  # retired (closed, crashed, silent): from what it left
        partition, end, waypoints = worker.retired_travel[engine_id]
    else:
        return None
    journey = await asyncio.to_thread(
        travel,
        worker.settings.bootstrap,
        worker.topics.events,
        partition,
        engine_id,
        req_id,
        step,
        # Strictly before the step: a waypoint at it holds its tables, not the plan checked against them.
        [w for w in waypoints if w.step < step],
        end,
        worker.settings.kafka,
        worker.decoder.codec,  # the worker's own framings: registry ids too
    )
    ranks = [{"rank": f"dp{v.dp_rank}-tp{v.tp_rank}-pp{v.pp_rank}", **asdict(v)} for v in journey.views]
    return {"start_offset": journey.start_offset, "from_waypoint": journey.from_waypoint, "ranks": ranks}


def register_views(app: faust.App, worker: StreamWorker) -> None:
    status_page = resources.files("kvledger.stream_app.worker").joinpath("status.html").read_text()
    history = History()

    @app.timer(interval=history.interval_s)
    async def sample_history() -> None:
        history.record(read_registry(worker.metrics.registry))

    @app.page("/history")
    async def history_view(web, request):
        return web.json(history.view())

    @app.page("/metrics")
    async def metrics(web, request):
        return web.bytes(worker.metrics.exposition(), content_type=CONTENT_TYPE_LATEST.split(";")[0])

    @app.page("/engines")
    async def engines(web, request):
        return web.json(engines_view(worker))

    @app.page("/partitions")
    async def partitions(web, request):
        assigned = worker.app.consumer.assignment()
        return web.json(sorted(tp.partition for tp in assigned if tp.topic == worker.topics.events))

    @app.page("/transfers")
    async def transfers(web, request):
        return web.json(transfers_view(worker))

    @app.page("/violations")
    async def violations(web, request):
        return web.json(violations_view(worker))

    @app.page("/block-table")
    async def block_table(web, request):
        engine_id, req_id, step = (request.query.get(k) for k in ("engine", "req", "step"))
        if not engine_id or not req_id or (step is not None and not step.isdigit()):
            return web.json({"error": "give ?engine=ENGINE&req=REQUEST[&step=STEP]"}, status=400)
        not_here = web.json({"error": f"engine {engine_id!r} is not projected by this worker"}, status=404)
        if step is None:
            found = block_table_view(worker, engine_id, req_id)
            if found is None:
                return not_here
            return web.json({"engine_id": engine_id, "req_id": req_id, "ranks": found})
        try:
            journey = await travel_view(worker, engine_id, req_id, int(step))
        except Exception as exc:  # the broker went away mid-replay: say so, keep serving
            return web.json({"error": f"time travel failed: {type(exc).__name__}: {exc}"}, status=503)
        if journey is None:
            return not_here
        return web.json({"engine_id": engine_id, "req_id": req_id, "step": int(step), **journey})

    @app.page("/")
    async def status(web, request):
        return web.html(status_page)
