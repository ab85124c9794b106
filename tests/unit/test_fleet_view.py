"""The fleet view (/fleet): every worker's engines and violations merged into one, each naming the
worker that holds it; a worker that does not answer, or left the group, listed as such."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from kvledger.stream_app.worker.views import (
    FLEET_TIMEOUT_S,
    LEFT_KEPT,
    Answer,
    Fleet,
    _ask,
    members_of,
    merge_fleet,
)

A, B, C = "http://127.0.0.1:6066", "http://127.0.0.1:6067", "http://127.0.0.1:6068"


def engine(engine_id: str, partition: int, state: str = "live", **more) -> dict:
    return {"engine_id": engine_id, "state": state, "partition": partition, "ranks": [], **more}


def violation(vid: str, engine_id: str, kind: str = "write_target_mismatch") -> dict:
    return {"id": vid, "engine_id": engine_id, "kind": kind, "step": 6}


def by_id(entries: list[dict], key: str = "engine_id") -> dict[str, str]:
    return {e[key]: e["worker"] for e in entries}


def test_each_workers_engines_and_violations_are_listed_once_with_the_worker_holding_them():
    members = {A: [0, 2], B: [1, 3]}
    answers = {
        A: Answer([engine("e0", 0), engine("e2", 2)], [violation("e2/x/0", "e2")]),
        B: Answer([engine("e1", 1), engine("e3", 3, lag=4)], [violation("e3/y/0", "e3"), violation("e3/z/0", "e3")]),
    }
    for self_url in (A, B):  # every worker's page says the same
        fleet = merge_fleet(self_url, members, answers, {})
        assert fleet["self"] == self_url
        assert by_id(fleet["engines"]) == {"e0": A, "e1": B, "e2": A, "e3": B}
        assert [e["engine_id"] for e in fleet["engines"]] == ["e0", "e1", "e2", "e3"]
        assert next(e for e in fleet["engines"] if e["engine_id"] == "e3")["lag"] == 4  # the entry as its worker has it
        assert by_id(fleet["violations"], "id") == {"e2/x/0": A, "e3/y/0": B, "e3/z/0": B}
        # The same order on every page: by worker, each worker's newest (its last) last.
        assert [v["id"] for v in fleet["violations"]] == ["e2/x/0", "e3/y/0", "e3/z/0"]
        workers = {w["url"]: w for w in fleet["workers"]}
        assert fleet["workers"][0]["url"] == self_url and workers[self_url]["self"]
        assert {u: (w["state"], w["partitions"], w["engines"]) for u, w in workers.items()} == {
            A: ("up", [0, 2], 2),
            B: ("up", [1, 3], 2),
        }


def test_an_engine_listed_by_two_workers_mid_rebalance_is_the_partition_owners():
    members = {A: [0], B: [1]}  # partition 1 just moved to B; A has not dropped e1 yet
    stale, fresh = engine("e1", 1, events=10), engine("e1", 1, events=12)
    for answers in ({A: Answer([stale], []), B: Answer([fresh], [])}, {B: Answer([fresh], []), A: Answer([stale], [])}):
        for self_url in (A, B):
            [e1] = merge_fleet(self_url, members, answers, {})["engines"]
            assert (e1["worker"], e1["events"]) == (B, 12)
    # Nobody owns it by the assignment (a partition between owners): the first report stands.
    [e1] = merge_fleet(A, {A: [], B: []}, {A: Answer([stale], []), B: Answer([fresh], [])}, {})["engines"]
    assert e1["worker"] == A


def test_a_retired_engine_is_listed_only_where_no_worker_holds_it_live():
    members = {A: [0], B: [1]}
    answers = {
        A: Answer([engine("back", 0, "retired", reason="closed"), engine("gone", 0, "retired", reason="silent")], []),
        B: Answer([engine("back", 1)], []),
    }
    fleet = merge_fleet(A, members, answers, {})
    assert [(e["engine_id"], e["state"], e["worker"]) for e in fleet["engines"]] == [
        ("back", "live", B),
        ("gone", "retired", A),
    ]


def test_a_violation_re_sent_by_a_new_owner_is_listed_once_at_its_engines_holder():
    # B took partition 0 over from A: it re-found what A had found since A's last checkpoint, under the same id.
    members = {A: [1], B: [0]}
    answers = {
        A: Answer([], [violation("e0/x/0", "e0"), violation("old/y/0", "old")]),
        B: Answer([engine("e0", 0)], [violation("e0/x/0", "e0")]),
    }
    fleet = merge_fleet(A, members, answers, {})
    assert by_id(fleet["violations"], "id") == {"e0/x/0": B, "old/y/0": A}  # an engine held nowhere: its finder
    assert len(fleet["violations"]) == 2


def test_a_worker_not_answering_is_listed_with_its_partitions_and_the_others_still_shown():
    members = {A: [0, 2], B: [1, 3]}
    answers = {A: Answer([engine("e0", 0)], [violation("e0/x/0", "e0")]), B: Answer(error="no answer in 1.5 s")}
    fleet = merge_fleet(A, members, answers, {})
    assert by_id(fleet["engines"]) == {"e0": A}
    [_, b] = fleet["workers"]
    assert (b["url"], b["state"], b["error"], b["partitions"], b["engines"]) == (
        B,
        "unreachable",
        "no answer in 1.5 s",
        [1, 3],
        0,
    )


def test_a_worker_that_left_the_group_is_listed_as_left():
    fleet = merge_fleet(A, {A: [0, 1]}, {A: Answer([engine("e0", 0), engine("e1", 1)], [])}, {B: 100.0, C: 50.0})
    assert [(w["url"], w["state"]) for w in fleet["workers"]] == [(A, "up"), (B, "left"), (C, "left")]
    assert fleet["workers"][1]["left_at"] == 100.0 and fleet["workers"][1]["partitions"] == []
    assert by_id(fleet["engines"]) == {"e0": A, "e1": A}


def test_members_and_their_events_partitions_from_the_assignors_distribution():
    distribution = {
        A: {"p.events": [2, 0], "p.transfers": [0, 2]},
        B: {"p.events": [1], "p.transfers": [1]},
        C: {},  # a member with nothing assigned (more workers than partitions)
        "javascript:alert(1)//": {"p.events": [3]},  # never asked, never a link
    }
    assert members_of(distribution, "p.events") == {A: [0, 2], B: [1], C: []}


def fleet_of(url: str) -> Fleet:
    return Fleet(SimpleNamespace(conf=SimpleNamespace(canonical_url=url)), SimpleNamespace())


def test_a_member_seen_before_and_missing_now_has_left_until_it_is_back():
    fleet = fleet_of(A)
    fleet.note({A: [0], B: [1]})
    assert fleet.left == {}
    fleet.note({A: [0, 1]})
    assert set(fleet.left) == {B}
    since = fleet.left[B]
    fleet.note({A: [0, 1]})
    assert fleet.left == {B: since}  # missing since the first time it was seen missing
    fleet.note({A: [0], B: [1]})  # restarted on the same URL
    assert fleet.left == {}
    # Bounded: the workers that left longest ago are forgotten first.
    for i in range(LEFT_KEPT + 4):
        fleet.note({A: [], f"http://w{i}": []})
    assert len(fleet.left) == LEFT_KEPT and f"http://w{LEFT_KEPT + 2}" in fleet.left and "http://w0" not in fleet.left


# -- asking a worker: answers, refusals and silence, over real sockets -------------------------------
@contextlib.asynccontextmanager
async def serving(routes: dict[str, web.Response]):
    app = web.Application()
    for path, response in routes.items():

        async def handler(request, response=response):
            return response

        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def ask(url: str) -> tuple[Answer, float]:
    async def run() -> Answer:
        async with aiohttp.ClientSession() as session:
            return await _ask(session, url)

    started = time.monotonic()
    return asyncio.run(run()), time.monotonic() - started


def test_asking_a_worker_that_answers():
    async def run() -> Answer:
        routes = {
            "/engines": web.json_response([engine("e1", 1)]),
            "/violations": web.json_response([violation("v", "e1")]),
        }
        async with serving(routes) as url, aiohttp.ClientSession() as session:
            return await _ask(session, url)

    assert asyncio.run(run()) == Answer([engine("e1", 1)], [violation("v", "e1")])


def test_asking_something_else_than_a_worker_is_an_error_not_a_failure():
    async def run() -> Answer:
        routes = {"/engines": web.json_response({"not": "a list"}), "/violations": web.json_response([])}
        async with serving(routes) as url, aiohttp.ClientSession() as session:
            return await _ask(session, url)

    answer = asyncio.run(run())
    assert answer.engines is None and "/engines answered something else" in answer.error


def test_a_worker_that_is_gone_or_hangs_is_an_error_within_the_bound():
    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    answer, took = ask(closed)
    assert answer.engines is None and answer.error and took < 1.0
    # A worker that accepts and never answers (a stopped process: the kernel still accepts).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        answer, took = ask(f"http://127.0.0.1:{s.getsockname()[1]}")
    assert answer.error == f"no answer in {FLEET_TIMEOUT_S} s"
    assert FLEET_TIMEOUT_S <= took < FLEET_TIMEOUT_S + 1.0
