"""The README and the docs against the code they describe, so that neither can drift.

* the README's table of `kv_trace` keys against the option's pydantic model (producer/config.py):
  the same keys, each with its type, bounds and default;
* the violation kinds the README and docs/checks.md list against the contract's enum;
* every relative link in README.md, docs/*.md and schemas/README.md resolves, anchors included;
* the facts the docs state about the dev stack and the worker's pinned client libraries
  against infra/ and pyproject.toml;
* docs/bugs.md's labels (how faithfully each entry re-creates its report) and their totals agree
  with its rows;
* the README stays a newcomer's page (at most ~400 lines);
* the README's sample of `make demo`'s output shows every line infra/demo prints itself, in its
  order (tests/e2e/test_demo.py holds the whole sample to a real run; `demo_sample` and
  `normalized_demo_output` are shared with it).
"""

from __future__ import annotations

import json
import re
import tomllib
import types
import typing
from enum import Enum
from pathlib import Path

import annotated_types
import pytest

from kvledger.producer.config import (
    DEFAULT_RING_BYTES,
    DEFAULT_SEGMENT_BYTES,
    TraceAction,
    TraceConfig,
    TraceOptions,
)
from kvledger.schemas.kinds import ViolationKind

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINKED_PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "schemas" / "README.md"]

# The JSON type a `kv_trace` value is written as, by the Python type the model declares.
JSON_TYPES = {bool: "bool", int: "int", float: "float", str: "string", dict: "object"}


def _section(text: str, heading: str) -> str:
    """The body of the section under `heading` (a whole heading line), up to the next heading."""
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    following = re.search(r"^#{1,6} ", rest, re.M)
    return rest[: following.start()] if following else rest


def _table(section: str) -> list[list[str]]:
    """The rows of the first Markdown table in `section`, header and separator left out."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert len(lines) > 2, "no table"
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines[2:]]


def _code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def _kv_trace_rows() -> dict[str, tuple[str, str, str]]:
    rows = _table(_section(README.read_text(), "### The `kv_trace` keys"))
    table = {}
    for row in rows:
        assert len(row) == 4, f"a row of the kv_trace table has {len(row)} cells: {row}"
        key, type_cell, default_cell, meaning = row
        (name,) = _code_spans(key)
        assert name not in table, f"{name} listed twice"
        table[name] = (type_cell, default_cell, meaning)
    return table


def _declared_type(annotation: object) -> type:
    """The one type a field holds besides None, Annotated metadata unwrapped."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _declared_type(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _declared_type(inner)
    return typing.get_origin(annotation) or annotation


def test_the_kv_trace_table_lists_every_key_of_the_option() -> None:
    assert set(_kv_trace_rows()) == set(TraceOptions.model_fields)


@pytest.mark.parametrize("key", sorted(TraceOptions.model_fields))
def test_each_kv_trace_row_states_the_models_type_bounds_and_default(key: str) -> None:
    type_cell, default_cell, _ = _kv_trace_rows()[key]
    field = TraceOptions.model_fields[key]

    declared = _declared_type(field.annotation)
    if issubclass(declared, Enum):
        assert _code_spans(type_cell)[0] == "string"
        assert set(_code_spans(type_cell)[1:]) == {member.value for member in declared}
    else:
        assert _code_spans(type_cell)[0] == JSON_TYPES[declared], f"{key}: {type_cell}"

    for bound in field.metadata:
        if isinstance(bound, annotated_types.Ge):
            assert f"≥ {bound.ge}" in type_cell, f"{key}: {type_cell} lacks ≥ {bound.ge}"
        elif isinstance(bound, annotated_types.Le):
            assert f"≤ {bound.le}" in type_cell, f"{key}: {type_cell} lacks ≤ {bound.le}"
        elif isinstance(bound, annotated_types.MultipleOf):
            assert f"multiple of {bound.multiple_of}" in type_cell, f"{key}: {type_cell}"

    written = json.loads(_code_spans(default_cell)[0])
    assert written == field.default, f"{key}: the README says {written!r}, the model {field.default!r}"
    if field.default is not None:
        assert type(written) is type(field.default), f"{key}: {written!r} is not a {type(field.default).__name__}"


def test_the_kv_trace_tables_effective_defaults_are_the_models() -> None:
    """Where the model's default is null, the cell says what the engine then uses."""
    rows = _kv_trace_rows()
    file_action = TraceOptions().config().action
    kafka_action = TraceOptions.model_validate({"sink": "kafka://127.0.0.1:9092"}).config().action
    assert f"`{kafka_action}` with a Kafka sink" in rows["action"][1]
    assert f"`{file_action}` with a file sink" in rows["action"][1]
    assert {file_action, kafka_action} == {TraceAction.LOG, TraceAction.RECORD}
    assert f"./{TraceConfig().sink.path.name}" in rows["sink"][1]
    assert f"{DEFAULT_SEGMENT_BYTES >> 20} MiB" in rows["segment_bytes"][1]
    assert f"{DEFAULT_RING_BYTES >> 20} MiB" in rows["ring_bytes"][1]
    assert f"`{DEFAULT_RING_BYTES}`" in rows["ring_bytes"][1]


def _kinds_in_tables(text: str) -> set[str]:
    """Every code span in the first cell of a table row."""
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            found |= set(_code_spans(line.split(" | ")[0]))
    return found


@pytest.mark.parametrize("page", ["README.md", "docs/checks.md"])
def test_every_violation_kind_is_in_the_tables(page: str) -> None:
    text = (ROOT / page).read_text()
    if page == "README.md":
        text = _section(text, "### What is checked")
    kinds = {kind.value for kind in ViolationKind if kind is not ViolationKind.OTHER}
    listed = _kinds_in_tables(text)
    assert kinds <= listed, f"{page} lacks {sorted(kinds - listed)}"
    assert listed <= kinds, f"{page} lists kinds the contract lacks: {sorted(listed - kinds)}"


def _without_code(text: str) -> str:
    """The text less its fenced code blocks and inline code spans (which hold no links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug, n = _slug(heading), 1
        while slug in anchors:
            slug = f"{_slug(heading)}-{n}"
            n += 1
        anchors.add(slug)
    return anchors


def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text()))


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading for #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_links_every_page_of_the_docs() -> None:
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _links(README)}
    assert set(DOCS.glob("*.md")) <= linked, sorted(str(p) for p in set(DOCS.glob("*.md")) - linked)


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 400


def test_the_dev_stacks_port_is_the_one_the_docs_name() -> None:
    stack = tomllib.loads((ROOT / "infra" / "stack.toml").read_text())
    port = stack["kafka"]["port"]
    for page in (README, DOCS / "operations.md"):
        assert f"kafka://127.0.0.1:{port}" in page.read_text(), page
    local_kafka = (ROOT / "infra" / "local-kafka").read_text()
    (default,) = re.findall(r'env_int\("KVLEDGER_KAFKA_PORT", (\d+)\)', local_kafka)
    assert f"`infra/local-kafka up` listens on **{default}**" in README.read_text()
    assert f"127.0.0.1:{default}" in (DOCS / "operations.md").read_text()


def test_the_compose_prometheus_version_is_the_one_the_docs_name() -> None:
    compose = (ROOT / "infra" / "docker-compose.yml").read_text()
    (image,) = re.findall(r"image: (prom/prometheus:\S+)", compose)
    assert f"`{image}`" in (DOCS / "operations.md").read_text()


def test_the_pinned_client_libraries_are_the_ones_the_docs_name() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [re.sub(r"\[.*?\]", "", dep) for dep in pyproject["project"]["optional-dependencies"]["stream"]]
    pinned = [pin for pin in pins if "==" in pin]
    assert {pin.split("==")[0] for pin in pinned} == {"faust-streaming", "mode-streaming", "aiokafka"}
    operations = (DOCS / "operations.md").read_text()
    for pin in pinned:
        assert f"`{pin}`" in operations, pin
    assert "--untested-client-libraries" in operations
    assert "KVLEDGER_UNTESTED_CLIENT_LIBRARIES=1" in operations


# -- the README's sample of `make demo` ---------------------------------------------------------------


def demo_sample() -> str:
    """The README's sample of what `make demo` prints: the fenced block that starts with its first line."""
    text = README.read_text()
    [sample] = [m[1] for m in re.finditer(r"^```\n(== 1/2 .*?)^```", text, re.M | re.S)]
    return sample


def normalized_demo_output(text: str) -> list[str]:
    """`make demo`'s lines less what differs from run to run: engine and request ids, the ledger's
    absolute path, every number (counts, slots, steps; tests/e2e/test_demo.py holds the step and
    request the fault was placed at), blanks at a line's end."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"file://(\S*?/)?demo-ledger/", "file://DIR/demo-ledger/", line.rstrip())
        line = re.sub(r"\bvllm-\d+\b", "vllm-ENGINE", line)
        line = re.sub(r"\b\d+-[0-9a-f]{8}\b", "REQ", line)
        lines.append(re.sub(r"\d+", "N", line))
    return lines


def _echoed(script: str) -> list[re.Pattern]:
    """What each `echo "..."` of infra/demo prints, as a pattern ($out: demo-ledger; $cli: the
    kvledger the Makefile passes, from the checkout's root; other variables: anything)."""
    patterns = []
    script = re.sub(r"^\w+\(\) \{.*?^\}$", "", script, flags=re.M | re.S)  # functions': said where called
    for literal in re.findall(r'^\s*echo "(.+)"(?:\s*>&2)?$', script, re.M):
        if literal.startswith("demo: expected") or literal.startswith("demo: the engine failed"):
            continue  # said only on failure
        pattern = re.escape(literal)
        pattern = pattern.replace(re.escape("$out"), "demo-ledger").replace(
            re.escape("$cli"), re.escape(".venv/bin/kvledger")
        )
        pattern = re.sub(r"\\\$(\\\{)?\w+(\\\})?", ".+", pattern)
        patterns.append(re.compile(f"^{pattern}$"))
    return patterns


def test_the_demo_sample_shows_each_line_the_demo_script_echoes_in_order() -> None:
    sample = demo_sample().splitlines()
    patterns = _echoed((ROOT / "infra" / "demo").read_text())
    assert len(patterns) >= 6, patterns
    at = 0
    for pattern in patterns:
        found = [i for i, line in enumerate(sample[at:], at) if pattern.match(line)]
        assert found, f"the README's demo sample lacks, after line {at + 1}, a line like {pattern.pattern}"
        at = found[0] + 1
    assert demo_sample().count("(engine log: demo-ledger/") == 2  # engine()'s, once per run


def test_the_demo_normalization_keeps_each_lines_shape() -> None:
    sample = normalized_demo_output(demo_sample())
    assert "kv_trace: write_target_mismatch at step N, req REQ, group N on vllm-ENGINE dpN-tpN-ppN: " in "\n".join(
        sample
    )
    assert any(
        line.endswith("recording to file://DIR/demo-ledger/clean (action log, ring N MiB, vN runner)")
        for line in sample
    )
    assert normalized_demo_output("45 events\nno violations  \n") != normalized_demo_output("45 events\nno violation\n")


def _markdown_rows(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with `header`, as cells."""
    lines = text[text.index(header) :].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_the_bug_zoos_labels_and_totals_agree_with_its_rows():
    """docs/bugs.md at a glance: every entry carries one label, and the totals table counts each
    label's entries and verdicts as the rows say (caught, documented miss, not re-created)."""
    text = (DOCS / "bugs.md").read_text()
    entries = {int(r[0]): (r[1].strip("*"), r[-1]) for r in _markdown_rows(text, "| # | label |")}
    assert sorted(entries) == list(range(1, len(entries) + 1))
    totals = {r[0].strip("*"): r for r in _markdown_rows(text, "| label | what runs |")}
    assert set(totals) == {label for label, _ in entries.values()} | {"all"}
    for label, row in totals.items():
        mine = {n: verdict for n, (lab, verdict) in entries.items() if label in (lab, "all")}
        assert row[2] == (str(len(mine)) if label == "all" else ", ".join(map(str, sorted(mine)))), label
        counts = [row[3], row[4], row[5]]
        caught = sum("**caught**" in v for v in mine.values())
        missed = sum(v.startswith("**documented miss**") for v in mine.values())
        pending = sum("to be re-created" in v for v in mine.values())
        assert [int(re.match(r"\d+|—", c)[0].replace("—", "0")) for c in counts] == [caught, missed, pending], label
