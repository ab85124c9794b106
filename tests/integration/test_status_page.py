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
import subprocess
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
