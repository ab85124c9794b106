"""The worker's status page, as headless Chromium renders it (infra/install-chromium), over a real
worker on the real broker.

A synthetic engine (TP=2) with one slot shifted on rank 0 and a clean one are produced to the
events topic; once the worker applied them and sampled its history, the page must render without
an error of its own (the page keeps every error, console.error included, in #page-errors, which the
DOM dump shows; a broken copy of the page proves that check fails), draw the plots (SVG paths with
data points for the faulty engine), filter by engine (the clean one: no violation rows), and link
each violation to its drawn block table, where the wrong slot is marked with the slots the
violation names ("expected slot X, actual slot Y").

Screenshots of the overview and of the drawn block table are kept in the test's tmp dir
(`artifacts/`), and copied to the directory the environment variable KVLEDGER_TEST_ARTIFACTS names,
if set (e.g. `test-artifacts/` at the repository root).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.stream_harness import events_done, produce, start_worker, wait_for
from tests.synthetic.engine import FaultSpec, SimConfig, simulate

pytestmark = pytest.mark.integration

FAULT_STEP = 50
PAGE = Path(__file__).parents[2] / "stream_app" / "worker" / "status.html"
SLOTS = re.compile(r"expected slot (\d+), actual slot (\d+)")


def browser(*args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on `args`; console messages go to its stderr."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("no chromium on PATH (run infra/install-chromium)", pytrace=False)
    out = subprocess.run(
        [found, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=8000", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def page_errors(dom: str, stderr: str) -> list[str]:
    """What the page recorded as its errors, and what Chromium logged of its console."""
    box = re.search(r'<pre id="page-errors" data-errors="(\d+)"[^>]*>(.*?)</pre>', dom, re.S)
    assert box is not None, "the page's error box is missing"
    errors = [line for line in html.unescape(box[2]).splitlines() if line] if box[1] != "0" else []
    # The page logs nothing itself: any console line Chromium logged (an uncaught error, a failed
    # request) is an error.
    return errors + [line for line in stderr.splitlines() if ":CONSOLE" in line]


def rendered(url: str) -> str:
    """The DOM of `url` after its scripts ran; fails on any error of the page."""
    out = browser("--dump-dom", url)
    errors = page_errors(out.stdout, out.stderr)
    assert errors == [], f"{url}: {errors}"
    return out.stdout


def screenshot(url: str, path: Path) -> None:
    browser(f"--screenshot={path}", "--window-size=1280,1000", url)
    assert path.stat().st_size > 10_000, path  # a page, not a blank
    if target := os.environ.get("KVLEDGER_TEST_ARTIFACTS"):
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


def tbody(dom: str, table: str) -> str:
    return re.search(rf'<table id="{table}">.*?<tbody>(.*?)</tbody>', dom, re.S)[1]


def attrs(tag: str) -> dict[str, str]:
    return {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', tag)}


def test_a_broken_page_is_caught(tmp_path):
    """The error check itself: the page with one failing script must be reported."""
    broken = tmp_path / "broken.html"
    broken.write_text(PAGE.read_text().replace("</body>", "<script>notDefinedAnywhere();</script></body>"))
    out = browser("--dump-dom", broken.as_uri())
    assert any("notDefinedAnywhere" in e for e in page_errors(out.stdout, out.stderr)), out.stdout[-2000:]


@pytest.fixture
def served(kafka_bootstrap, tmp_path):
    """A worker holding a faulty engine and a clean one, its history sampled: (url, faulty, clean)."""
    prefix = f"page{uuid.uuid4().hex[:8]}"
    faulty, clean = f"faulty-{prefix}", f"clean-{prefix}"
    worker = start_worker(
        kafka_bootstrap, prefix, tmp_path / "state", tmp_path / "worker.log",
        "--partitions", "2", "--store", "memory", "--settle-after", "1",
    )  # fmt: skip
    try:
        engines = {
            faulty: simulate(SimConfig(seed=7, engine_id=faulty, steps=160, tp_size=2,
                                       faults=(FaultSpec("slot_shift", FAULT_STEP),))).events,
            clean: simulate(SimConfig(seed=8, engine_id=clean, steps=160)).events,
        }  # fmt: skip
        produce(kafka_bootstrap, f"{prefix}.events", [e for events in engines.values() for e in events])
        wait_for("every event applied", events_done([worker], {k: len(v) for k, v in engines.items()}), [worker])

        def plotted() -> bool:  # two samples of the faulty engine's rate and of its violations
            h = json.loads(worker.get("/history"))
            rates = [s for s in h["events_per_s"] if s["engine"] == faulty]
            found = [s for s in h["violations"] if s["engine"] == faulty]
            return all(len([v for v in s["values"] if v is not None]) >= 2 for s in rates + found) and rates and found

        wait_for("the history sampled", plotted, [worker], timeout=30)
        yield f"http://127.0.0.1:{worker.port}/", faulty, clean, worker
    finally:
        worker.stop()


def test_status_page(served, tmp_path):
    base, faulty, clean, worker = served
    [violation] = [
        v for v in json.loads(worker.get("/violations"))
        if v["engine_id"] == faulty and v["kind"] == "write_target_mismatch" and SLOTS.search(v["detail"])
    ]  # fmt: skip
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()

    # The overview: both engines, the violation in red with its link, the plots drawn.
    page = rendered(base)
    assert 'data-loaded="overview"' in page
    engines = tbody(page, "engines")
    assert faulty in engines and clean in engines
    rows = tbody(page, "violations")
    assert '<td class="bad">write_target_mismatch</td>' in rows and violation["req_id"] in rows
    assert "recent violation(s)" in page
    links = [attrs(a)["href"] for a in re.findall(r'<a class="travel"[^>]*>', rows)]
    want = f"#/block?engine={faulty}&req={violation['req_id']}&step={violation['step']}&rank=dp0-tp0-pp0"
    assert want in links, links
    fault_plot = re.search(
        rf'<svg [^>]*data-engine="{faulty}" data-kind="write_target_mismatch"[^>]*>(.*?)</svg>', page, re.S
    )
    assert fault_plot is not None, page[-3000:]
    [points] = re.findall(r'<path class="series"[^>]*data-points="(\d+)"', fault_plot[1])
    assert int(points) >= 2
    rate_paths = [attrs(p) for p in re.findall(r'<path class="series"[^>]*>', page)]
    assert any(p["data-series"] == faulty and int(p["data-points"]) >= 2 for p in rate_paths), rate_paths
    screenshot(base, artifacts / "status-page.png")

    # Filtered to the clean engine: its rows only, no violation, no plot of the faulty engine.
    only_clean = rendered(f"{base}#/?engine={clean}")
    assert clean in tbody(only_clean, "engines") and faulty not in tbody(only_clean, "engines")
    assert "<tr" not in tbody(only_clean, "violations")
    assert f'data-engine="{faulty}"' not in only_clean
    filtered_kind = rendered(f"{base}#/?kind=write_target_mismatch&rank=dp0-tp0-pp0")
    kinds = re.findall(r'<td class="bad">([a-z_]+)</td>', tbody(filtered_kind, "violations"))
    assert kinds and set(kinds) == {"write_target_mismatch"}

    # The violation's link: its block table drawn, the wrong slot marked as the violation says.
    drawn = rendered(base + want)
    assert 'data-loaded="block"' in drawn
    expected_slot, actual_slot = SLOTS.search(violation["detail"]).groups()
    marked = [attrs(tr) for tr in re.findall(r'<tr class="wrong-slot"[^>]*>', drawn)]
    assert {(m["data-expected-slot"], m["data-written-slot"]) for m in marked} >= {(expected_slot, actual_slot)}, marked
    marks = [attrs(r) for r in re.findall(r'<rect class="mark-wrong"[^>]*data-slot[^>]*>', drawn)]
    assert any(m["data-slot"] == actual_slot and m["data-expected-slot"] == expected_slot for m in marks), marks
    assert re.search(rf'<rect class="mark-expected"[^>]*data-slot="{expected_slot}"', drawn)
    assert re.search(r'<rect class="block wrong"', drawn)
    assert violation["detail"] in drawn  # the finding, above its drawing
    # The other TP rank's plan wrote where its row says: nothing marked there.
    other = rendered(base + want.replace("rank=dp0-tp0-pp0", "rank=dp0-tp1-pp0"))
    assert 'aria-pressed="true">dp0-tp1-pp0' in other and 'class="wrong-slot"' not in other
    screenshot(base + want, artifacts / "block-table.png")


# -- the fleet: every worker's page shows every worker's engines and violations ---------------------
FLEET = ("fleet-0", "fleet-1", "fleet-2", "fleet-3")  # keyed to partitions 0, 1, 1, 0 of two (murmur2)
FLEET_FAULTY = ("fleet-0", "fleet-1")  # one on each partition


def own(worker) -> tuple[set[str], set[str]]:
    """What a worker holds itself: its live engines, the ids of its recent violations."""
    engines = {e["engine_id"] for e in json.loads(worker.get("/engines")) if e["state"] == "live"}
    return engines, {v["id"] for v in json.loads(worker.get("/violations"))}


def page_rows(dom: str, table: str, key: str) -> dict[str, dict[str, str]]:
    """A table's rows by their data-`key`: the row's attributes, and the href of its worker link."""
    rows = {}
    for tr, body in re.findall(r"(<tr [^>]*>)(.*?)</tr>", tbody(dom, table), re.S):
        row = attrs(tr)
        link = re.search(r'<a class="worker"[^>]*>', body)
        rows[row[f"data-{key}"]] = {**row, "href": attrs(link[0])["href"] if link else ""}
    return rows


@pytest.fixture
def fleet(kafka_bootstrap, tmp_path):
    """Two workers of one group, each holding one of two partitions, engines and findings on both."""
    prefix = f"fleet{uuid.uuid4().hex[:8]}"
    options = ("--partitions", "2", "--store", "memory", "--settle-after", "1", "--session-timeout", "6")
    workers = []
    try:
        for name in ("a", "b"):
            workers.append(
                start_worker(kafka_bootstrap, prefix, tmp_path / f"state-{name}", tmp_path / f"{name}.log", *options)
            )

        def shared() -> bool:
            held = [json.loads(w.get("/partitions")) for w in workers]
            return all(held) and sorted(held[0] + held[1]) == [0, 1]

        wait_for("the two workers to share the partitions", shared, workers)
        engines = {
            name: simulate(
                SimConfig(seed=30 + i, engine_id=name, steps=120,
                          faults=(FaultSpec("slot_shift", FAULT_STEP),) if name in FLEET_FAULTY else ())
            ).events
            for i, name in enumerate(FLEET)
        }  # fmt: skip
        produce(kafka_bootstrap, f"{prefix}.events", [e for events in engines.values() for e in events])
        wait_for("every event applied", events_done(workers, {k: len(v) for k, v in engines.items()}), workers)
        yield workers
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)  # a stopped one ends too
            w.stop()


def test_every_workers_page_shows_the_fleet_with_each_engines_worker(fleet):
    urls = [f"http://127.0.0.1:{w.port}" for w in fleet]
    holds = [own(w) for w in fleet]
    assert all(engines for engines, _ in holds), f"the engines landed on one worker: {holds}"
    holder = {e: url for url, (engines, _) in zip(urls, holds, strict=True) for e in engines}
    assert set(holder) == set(FLEET)
    found = {vid: url for url, (_, ids) in zip(urls, holds, strict=True) for vid in ids}
    assert {vid.split("/")[0] for vid in found} == set(FLEET_FAULTY)  # a finding on each worker

    for w, url in zip(fleet, urls, strict=True):
        [other] = [u for u in urls if u != url]
        view = json.loads(w.get("/fleet"))
        assert view["self"] == url
        assert {e["engine_id"]: e["worker"] for e in view["engines"]} == holder
        assert {v["id"]: v["worker"] for v in view["violations"]} == found
        assert [(x["url"], x["state"]) for x in view["workers"]] == [(url, "up"), (other, "up")]

        page = rendered(url + "/")
        assert 'data-loaded="overview"' in page
        assert f"{len(FLEET)} engine(s) live on 2 worker(s)" in page and f"{len(found)} recent violation(s)" in page
        engines = page_rows(page, "engines", "engine")
        assert {e: row["data-worker"] for e, row in engines.items()} == holder
        for e, row in engines.items():  # the owner link: this page's own filter, or the other worker's page
            assert row["href"] == (f"#/?engine={e}" if holder[e] == url else f"{holder[e]}/#/?engine={e}"), row
        violations = page_rows(page, "violations", "id")
        assert {vid: row["data-worker"] for vid, row in violations.items()} == found
        workers = page_rows(page, "workers", "worker")
        assert {u: row["data-state"] for u, row in workers.items()} == {u: "up" for u in urls}

    # A violation held by the other worker links to its block table, drawn there.
    page = rendered(urls[0] + "/")
    links = [attrs(x)["href"] for x in re.findall(r'<a class="travel"[^>]*>', tbody(page, "violations"))]
    remote = [h for h in links if h.startswith(urls[1] + "/#/block?")]
    assert remote, links
    drawn = rendered(remote[0])
    assert 'data-loaded="block"' in drawn and 'class="group"' in drawn


def test_a_worker_not_answering_shows_as_such_and_then_as_gone(fleet):
    a, b = fleet
    ua, ub = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"
    on_b, _ = own(b)
    b.proc.send_signal(signal.SIGSTOP)  # it still accepts connections, and answers nothing
    started = time.monotonic()
    view = json.loads(a.get("/fleet", timeout=10))
    assert time.monotonic() - started < 4  # bounded by the fleet's timeout, not by the silent worker
    [unreachable] = [x for x in view["workers"] if x["url"] == ub]
    assert unreachable["state"] == "unreachable" and unreachable["error"].startswith("no answer in")
    assert not on_b & {e["engine_id"] for e in view["engines"]}
    page = rendered(ua + "/")
    assert page_rows(page, "workers", "worker")[ub]["data-state"] == "unreachable"
    assert "1 worker(s) not answering" in page

    # The group drops it after its session timeout: listed as having left, its engines on the survivor.
    def taken_over() -> bool:
        view = json.loads(a.get("/fleet", timeout=10))
        states = {x["url"]: x["state"] for x in view["workers"]}
        return states == {ua: "up", ub: "left"} and {e["engine_id"]: e["worker"] for e in view["engines"]} == {
            e: ua for e in FLEET
        }

    wait_for("the survivor to hold every engine, the stopped worker listed as gone", taken_over, [a], timeout=60)
    page = rendered(ua + "/")
    assert page_rows(page, "workers", "worker")[ub]["data-state"] == "left"
    assert set(page_rows(page, "engines", "engine")) == set(FLEET)
