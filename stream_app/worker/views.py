"""The worker's web views (Faust's web server, bound to 127.0.0.1).

/metrics       Prometheus exposition
/engines       engines and ranks seen: last step, lag, events dropped by producers; then the engines
               retired (state "retired", and why: every rank shut down, or silent too long)
/violations    the most recent violations, newest last
/block-table   ?engine=E&req=R[&step=S]: a request's block table per rank, at each rank's current
               step, or at step S (time travel: rebuilt from a kept checkpoint and the events topic)
/transfers     the transfer joins of this worker's partitions: offsets covered, transfers open
/history       the last 30 minutes of events/s, lag, producer drops and violations (history.py)
/fleet         every worker of the group, the engines each holds and the violations each found: this
               worker's own views merged with the /engines and /violations of the others (below)
/              the status page: plots of /history, the tables, each violation's block table drawn

The fleet. Workers of one group find each other through the group itself: every worker's
subscription carries its web URL (Faust's canonical_url) and the group's leader hands every member
the map of which URL holds which partitions (the assignor's distribution, renewed at each
rebalance). /fleet asks each other member for its /engines and /violations at once, each answer
within FLEET_TIMEOUT_S, and merges them (merge_fleet): a worker that does not answer is listed as
unreachable with the partitions it holds, one that left the group since this worker saw it as
left; neither holds the page up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from typing import TYPE_CHECKING

import aiohttp
import faust
from prometheus_client import CONTENT_TYPE_LATEST

from kvledger.schemas.ranks import rank_label
from kvledger.stream_app.worker.history import History, read_registry
from kvledger.stream_app.worker.travel import travel

if TYPE_CHECKING:
    from kvledger.stream_app.worker.app import StreamWorker

log = logging.getLogger("kvledger.worker")


def engines_view(worker: StreamWorker) -> list[dict]:
    out = []
    for engine_id, projection in sorted(worker.engines.items()):
        anchor = worker.anchors.get(engine_id)
        tp = anchor.message.tp if anchor is not None else None
        lag = worker.lag(tp) if tp is not None else None
        ledger = projection.ledger
        ranks = [
            {
                "rank": key.label,
                "incarnation": slot.incarnation,
                "last_step": slot.last_step,
                "events_dropped": slot.events_dropped,
                "in_sync": slot.in_sync,
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
        views.append({"rank": key.label, "step": slot.last_step, "rows": rows})
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
    ranks = [{"rank": rank_label(v.dp_rank, v.tp_rank, v.pp_rank), **asdict(v)} for v in journey.views]
    return {"start_offset": journey.start_offset, "from_waypoint": journey.from_waypoint, "ranks": ranks}


# -- the fleet ------------------------------------------------------------------------------------
FLEET_TIMEOUT_S = 1.5  # a worker that has not answered /engines and /violations by then is unreachable
FLEET_FRESH_S = 1.0  # a /fleet this recent is served again (pages refresh every 2 s, several may be open)
LEFT_KEPT = 16  # workers that left the group, listed as such


@dataclass(frozen=True)
class Answer:
    """What one worker's /engines and /violations said, or why it said nothing."""

    engines: list[dict] | None = None
    violations: list[dict] | None = None
    error: str | None = None


def members_of(distribution: Mapping[str, Mapping[str, list[int]]], topic: str) -> dict[str, list[int]]:
    """Every member of the group (its URL) and the partitions of `topic` it holds, from the
    assignor's distribution ({url: {topic: [partition, ...]}}, every member listed). Only http(s)
    URLs: each is asked for its views, and the page links to it."""
    return {
        url: sorted(topics.get(topic, ()))
        for url, topics in distribution.items()
        if url.startswith(("http://", "https://"))
    }


def merge_fleet(
    self_url: str, members: Mapping[str, list[int]], answers: Mapping[str, Answer], left: Mapping[str, float]
) -> dict:
    """One view of the fleet from each worker's own views.

    `members`: URL -> events partitions, as the group assigned them (this worker among them);
    `answers`: URL -> its /engines and /violations, or the error that stood for them; `left`: URL ->
    when a worker seen before was no longer a member. Workers are listed this one first, then by
    URL; engines by id; violations by worker URL, each worker's newest last. An engine listed live
    by two workers (a rebalance in between) is the one of the worker its partition is assigned to,
    else the first reported (this worker's first); a retired engine is listed only when no worker
    holds it live. A violation is listed once by its id (ids name the fact: a worker taking over
    re-sends under the same id) and points at the worker holding its engine, else the one that
    reported it. Each entry names its worker (`worker`), whose page has its details and block tables.
    """
    order = [self_url, *sorted(u for u in {*members, *answers} if u != self_url)]
    owner = {p: url for url, parts in members.items() for p in parts}
    live: dict[str, dict] = {}
    retired: dict[str, dict] = {}
    for url in order:
        answer = answers.get(url)
        for e in (answer.engines if answer is not None else None) or ():
            entry = {**e, "worker": url}
            if e.get("state") == "retired":
                retired.setdefault(e["engine_id"], entry)
            else:
                held = live.get(e["engine_id"])
                theirs = owner.get(e.get("partition")) == url
                if held is None or (theirs and owner.get(held.get("partition")) != held["worker"]):
                    live[e["engine_id"]] = entry
    engines = [live[k] for k in sorted(live)] + [retired[k] for k in sorted(retired) if k not in live]
    violations: dict[str, dict] = {}
    for url in sorted(order):  # the same order on every page: by worker, each worker's newest last
        answer = answers.get(url)
        for v in (answer.violations if answer is not None else None) or ():
            if v["id"] not in violations:
                held = live.get(v["engine_id"])
                violations[v["id"]] = {**v, "worker": held["worker"] if held is not None else url}
    workers = []
    for url in order:
        answer = answers.get(url) or Answer(error="not asked")
        workers.append(
            {
                "url": url,
                "self": url == self_url,
                "state": "unreachable" if answer.error is not None else "up",
                "error": answer.error,
                "partitions": list(members.get(url, [])),
                "engines": sum(e["worker"] == url for e in live.values()),
            }
        )
    for url, since in sorted(left.items(), key=lambda kv: -kv[1]):
        if url not in members and url not in answers:
            workers.append({"url": url, "self": False, "state": "left", "left_at": since, "partitions": []})
    return {"self": self_url, "workers": workers, "engines": engines, "violations": list(violations.values())}


class Fleet:
    """The members of the group as this worker last saw them, and /fleet served from them."""

    def __init__(self, app: faust.App, worker: StreamWorker):
        self.app, self.worker = app, worker
        self.url = str(app.conf.canonical_url)
        self.seen: set[str] = set()  # every URL seen a member since this worker started
        self.left: dict[str, float] = {}  # URL -> wall time it was first seen missing
        self.lock = asyncio.Lock()
        self.cached: tuple[float, dict] | None = None

    def members(self) -> dict[str, list[int]]:
        """The group's members and their events partitions; this worker's own from its consumer."""
        members = members_of(self.app.assignor.external_topics_metadata(), self.worker.topics.events)
        members[self.url] = _own_partitions(self.app, self.worker)
        self.note(members)
        return members

    def note(self, members: Mapping[str, list[int]]) -> None:
        """A worker seen a member before and not now has left the group (until it is back)."""
        now = time.time()
        for url in self.seen - set(members):
            self.left.setdefault(url, now)
        for url in members:
            self.left.pop(url, None)
        self.seen |= set(members)
        for url in sorted(self.left, key=self.left.__getitem__)[: max(len(self.left) - LEFT_KEPT, 0)]:
            del self.left[url]
            self.seen.discard(url)

    async def view(self) -> dict:
        async with self.lock:  # pages open at once share one round of requests
            if self.cached is not None and time.monotonic() - self.cached[0] < FLEET_FRESH_S:
                return self.cached[1]
            members = self.members()
            answers = {self.url: Answer(engines_view(self.worker), violations_view(self.worker))}
            peers = [url for url in members if url != self.url]
            timeout = aiohttp.ClientTimeout(total=FLEET_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for url, answer in zip(peers, await asyncio.gather(*(_ask(session, u) for u in peers)), strict=True):
                    answers[url] = answer
            merged = merge_fleet(self.url, members, answers, self.left)
            self.cached = (time.monotonic(), merged)
            return merged


def _own_partitions(app: faust.App, worker: StreamWorker) -> list[int]:
    return sorted(tp.partition for tp in app.consumer.assignment() if tp.topic == worker.topics.events)


async def _ask(session: aiohttp.ClientSession, url: str) -> Answer:
    """A worker's /engines and /violations, or why not (refused, no answer in time, not JSON)."""

    async def get(path: str, key: str) -> list[dict]:
        async with session.get(url.rstrip("/") + path) as response:
            response.raise_for_status()
            body = await response.json()
            if not isinstance(body, list) or not all(isinstance(x, dict) and key in x for x in body):
                raise ValueError(f"{path} answered something else than a list of entries with {key!r}")
            return body

    try:
        engines, violations = await asyncio.wait_for(
            asyncio.gather(get("/engines", "engine_id"), get("/violations", "id")), timeout=FLEET_TIMEOUT_S
        )
    except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
        return Answer(error=f"no answer in {FLEET_TIMEOUT_S} s")
    except Exception as exc:  # refused, reset, an HTTP error, not JSON: the page says so and goes on
        return Answer(error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    return Answer(engines, violations)


def register_views(app: faust.App, worker: StreamWorker) -> None:
    status_page = resources.files("kvledger.stream_app.worker").joinpath("status.html").read_text()
    history = History()
    fleet = Fleet(app, worker)

    @app.on_partitions_assigned.connect
    async def note_members(app: faust.App, assigned, **kwargs) -> None:
        # At each rebalance (the assignor has the new distribution by then): a worker gone is noted
        # as left even if no page was open meanwhile. Never in the rebalance's way.
        try:
            fleet.members()
        except Exception:
            log.exception("the group's members not noted for the status page")

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
        return web.json(_own_partitions(app, worker))

    @app.page("/fleet")
    async def fleet_view(web, request):
        return web.json(await fleet.view())

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
