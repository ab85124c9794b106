"""`kvledger` command line: replay, list and query file ledgers; run and read the stream worker.

Every command ends with an `ExitCode`, and says in its --help which ones and when. Any ledger
path may be a ledger root, any directory inside one (an engine's, a rank's), or a segment file.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import textwrap
from collections import Counter
from dataclasses import asdict
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from kvledger.schemas.files import RankStream, ReadProblem, unread_peers
from kvledger.schemas.kinds import Check, ReadFailure
from kvledger.schemas.ranks import engine_rank_label, rank_label
from kvledger.stream_app.core import RankKey, Violation
from kvledger.stream_app.replay import PlanWrites, Replay, RequestView, UnusableLedger, renamed, replay


class ExitCode(IntEnum):
    """How every `kvledger` command ends (each command's --help says which apply, and when)."""

    CLEAN = 0  # nothing wrong found, everything asked for was checked or shown
    VIOLATIONS = 1  # violations found (query: the step's plan broke a rule for the request)
    INPUT_ERROR = 2  # unusable input, unknown id, unreachable broker; click's usage errors exit 2 too
    # Read, but not all of it checked: no check ran on the ledger or on one of its ranks, or input was
    # lost before any check (a cut tail, a torn block, an unreadable file, events the producer dropped).
    NOT_ALL_CHECKED = 3  # never "clean"


_INPUT_ERROR_HELP = "input error, one line on stderr: a path that is missing, unreadable or no ledger, "


def _exit_help(**meanings: str) -> str:
    """The epilog of a command's --help: its exit statuses (`ExitCode` member name -> meaning)."""
    rows = "\n".join(
        textwrap.fill(text, 78, initial_indent=f"  {ExitCode[name]:d}  ", subsequent_indent="     ")
        for name, text in meanings.items()
    )
    return f"\b\nExit status:\n{rows}"


def _fail(message: str) -> NoReturn:
    click.echo(f"kvledger: error: {message}", err=True)
    sys.exit(ExitCode.INPUT_ERROR)


def output_console(*, stderr: bool = False) -> Console:
    """Where a command prints: wrapped to a terminal's width; piped or redirected, never wrapped nor
    cut, so that a script or a CI log gets each line whole (a path, a list of checks)."""
    out = Console(stderr=stderr, highlight=False)
    out.soft_wrap = not out.is_terminal
    return out


def _listed(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvledger")
def main() -> None:
    """kvledger: an event-sourced monitor for the KV cache of vLLM engines.

    A ledger PATH may be a ledger root, an engine's or a rank's directory inside one, or a
    single segment file (*.avro). Exit statuses, the same for every command: 0 clean, 1
    violations, 2 input error (a usage error too), 3 not all checked (see each command's --help).
    """


def _violation_json(v: Violation) -> str:
    return json.dumps({"type": "violation", **v.to_record()})


def _violation_text(v: Violation) -> str:
    where = escape(v.rank)
    at = " ".join(
        x
        for x in (
            f"step {v.step}" if v.step is not None else "",
            f"req {escape(v.req_id)}" if v.req_id is not None else "",
            f"group {v.group}" if v.group is not None else "",
        )
        if x
    )
    return f"[bold red]{v.kind}[/] [cyan]{where}[/]{' ' + at if at else ''}: {escape(v.detail)}"


# What replaying a stream counts without checking the KV cache: its events' order, tables loaded.
_NO_KV_CHECK = {Check.SEQUENCE, Check.RESYNC}


def _kv_checks(result: Replay) -> int:
    return sum(n for check, n in result.ledger.coverage.checks.items() if check not in _NO_KV_CHECK)


def unchecked_ranks(result: Replay) -> list[dict]:
    """The ranks read on which no check could run, each with why: never clean, whatever else was found."""
    ledger = result.ledger
    out = []
    for key, slot in sorted(ledger.ranks.items()):
        why = None
        if slot.info is None:
            why = "no RankInfo read: its steps cannot be checked"
        elif slot.last_step < 0:
            why = "no step read after its RankInfo"
        elif ledger.follower(key):
            group = ledger.step_groups.get((key.engine_id, key.dp))
            lead = RankKey(key.engine_id, key.dp, *group.lead) if group is not None else None
            if lead is not None and (ledger.ranks.get(lead) is None or ledger.ranks[lead].info is None):
                why = (
                    f"its group's lead {lead.label} was not read "
                    "(a rank's steps are checked against its lead's tables: give the engine's directory)"
                )
        if why is not None:
            out.append(
                {"engine_id": key.engine_id, "dp_rank": key.dp, "tp_rank": key.tp, "pp_rank": key.pp, "reason": why}
            )
    seen = {(k.engine_id, k.dp, k.tp, k.pp) for k in ledger.ranks}
    for s in result.streams:
        if s.dp >= 0 and (s.engine_id, s.dp, s.tp, s.pp) not in seen:
            seen.add((s.engine_id, s.dp, s.tp, s.pp))
            reason = "no event of it could be read"
            out.append({"engine_id": s.engine_id, "dp_rank": s.dp, "tp_rank": s.tp, "pp_rank": s.pp, "reason": reason})
    return out


class CheckStatus(StrEnum):
    """What `check` concluded (its JSON summary's "status"), the first that holds in this order."""

    VIOLATIONS = "violations"
    NOTHING_CHECKED = "nothing_checked"  # no check ran on the ledger, or on one of its ranks
    INCOMPLETE = "incomplete"  # checked, but input was lost before any check (Replay.lost)
    CLEAN = "clean"

    @property
    def exit_code(self) -> ExitCode:
        return _STATUS_EXIT[self]


_STATUS_EXIT = {
    CheckStatus.VIOLATIONS: ExitCode.VIOLATIONS,
    CheckStatus.NOTHING_CHECKED: ExitCode.NOT_ALL_CHECKED,
    CheckStatus.INCOMPLETE: ExitCode.NOT_ALL_CHECKED,
    CheckStatus.CLEAN: ExitCode.CLEAN,
}


def check_status(result: Replay, unchecked: list[dict]) -> CheckStatus:
    if result.violations:
        return CheckStatus.VIOLATIONS
    if unchecked or not _kv_checks(result):
        return CheckStatus.NOTHING_CHECKED
    if result.lost:
        return CheckStatus.INCOMPLETE
    return CheckStatus.CLEAN


def _problem_line(p: ReadProblem) -> str:
    # A truncated tail lost only its end (every whole block before it was read).
    label = "tail lost" if p.reason is ReadFailure.TRUNCATED else "unreadable"
    return f"[yellow]{label}:[/] {escape(p.path)}: {p.reason} after {p.events_read} event(s) ({escape(p.detail)})"


def _renamed_lines(streams: list[RankStream], done: str) -> list[str]:
    """Each rank directory whose events name another engine or rank than its path (renamed, copied):
    what its events are, and that they were `done` ("checked", "listed") as such, once."""
    return [
        f"[yellow]renamed:[/] {escape(r['path'])} holds the events of engine [cyan]{escape(_rank_of(r))}[/] "
        f"(its path names {escape(_rank_of(r['path_names']))}): {done} as that engine's"
        for r in renamed(streams)
    ]


def _rank_of(r: dict) -> str:
    """The rank a JSON entry names (engine_id, dp_rank, tp_rank, pp_rank)."""
    return engine_rank_label(r["engine_id"], r["dp_rank"], r["tp_rank"], r["pp_rank"])


def _print_text_summary(console: Console, result: Replay, unchecked: list[dict], status: CheckStatus) -> None:
    s = result.summary()
    console.print()
    console.print(
        f"[bold]{s['events']}[/] events, [bold]{s['steps']}[/] step-events, [bold]{s['ranks']}[/] rank stream(s)"
    )
    checks = ", ".join(f"{k} {n}" for k, n in s["checks"].items()) or "none"
    console.print(f"checks run: {checks}")
    if s["unchecked"]:
        not_checked = ", ".join(f"{k} {n}" for k, n in s["unchecked"].items())
        console.print(f"[yellow]not checked:[/] {not_checked}")
    for line in [*map(_problem_line, result.problems), *_renamed_lines(result.streams, "checked")]:
        console.print(line, soft_wrap=True)  # a path whole
    for (engine_id, dp), peers in sorted(unread_peers(result.streams).items()):
        names = ", ".join(rank_label(dp, tp, pp) for tp, pp in peers)
        console.print(
            f"[yellow]not read:[/] {escape(engine_id)} {names}, beside the rank(s) given "
            "(their steps are not compared with them)",
            soft_wrap=True,
        )
    for r in unchecked:
        console.print(
            f"[bold yellow]nothing checked on[/] [cyan]{escape(_rank_of(r))}[/]: {escape(r['reason'])}", soft_wrap=True
        )
    if s["violations"]:
        table = Table(title="violations", show_edge=False)
        table.add_column("kind", style="red")
        table.add_column("count", justify="right")
        for kind, n in s["violations"].items():
            table.add_row(kind, str(n))
        console.print(table, soft_wrap=False)  # laid out to the width, its title centred over it
    elif status is CheckStatus.NOTHING_CHECKED:
        left_out = {(r["engine_id"], r["dp_rank"], r["tp_rank"], r["pp_rank"]) for r in unchecked}
        checked = sum(1 for key in result.ledger.ranks if key not in left_out)
        if not _kv_checks(result) or checked == 0:
            console.print("[bold yellow]nothing checked:[/] no check of the KV cache ran on what could be read")
        else:
            console.print(
                f"[bold yellow]not clean:[/] nothing checked on {len(unchecked)} rank(s); "
                f"no violations on the {checked} rank(s) checked"
            )
    elif status is CheckStatus.INCOMPLETE:
        lost = ", ".join(f"{k} {n}" for k, n in sorted(result.lost.items()))
        console.print(
            f"[bold yellow]incomplete:[/] no violations in what was read, but input was lost before "
            f"any check ({lost}): not clean"
        )
    else:
        console.print("[bold green]no violations[/]")


CHECK_EXIT = _exit_help(
    CLEAN="clean: every rank read was checked, no input was lost, and no violation found",
    VIOLATIONS="violations found",
    INPUT_ERROR=_INPUT_ERROR_HELP + "a foreign file in it, nothing readable",
    NOT_ALL_CHECKED="not clean, no violation found in what was checked: status nothing_checked, no check ran "
    "on the ledger or on one of its ranks (a stream that ends after its first event, a rank read without its "
    "group's lead); status incomplete, input was lost before any check (a cut tail, a torn block, an "
    "unreadable or empty file, events the engine's probes dropped)",
)


@main.command(epilog=CHECK_EXIT)
@click.argument("paths", metavar="PATH...", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text: a readable report; json: one JSON object per line, a summary last.",
)
def check(paths: tuple[str, ...], fmt: str) -> None:
    """Replay the file ledger(s) at PATH... and report every violation.

    PATH is a ledger root, an engine's or a rank's directory in it, or a segment file. Several
    ledgers (e.g. the prefill and the decode engine of a pair, traced to different directories)
    are replayed together, so transfers join across them.
    """
    path = paths[0] if len(paths) == 1 else list(paths)
    err = output_console(stderr=True)
    out = output_console()
    if fmt == "json":

        def emit(v: Violation) -> None:
            click.echo(_violation_json(v))
    else:

        def emit(v: Violation) -> None:
            out.print(_violation_text(v), soft_wrap=True)

    try:
        if err.is_terminal and fmt == "text":
            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                console=out if out.is_terminal else err,  # one tty: prints go above the bar
                transient=True,
            ) as bar:
                task = bar.add_task("replaying", total=None)
                result = replay(
                    path,
                    on_violation=emit,
                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                )
        else:
            result = replay(path, on_violation=emit)
    except UnusableLedger as exc:
        _fail(str(exc))
    except OSError as exc:  # what the readers do not account for themselves
        _fail(_os_error(exc))
    unchecked = unchecked_ranks(result)
    status = check_status(result, unchecked)
    if fmt == "json":
        summary = result.summary() | {"unchecked_ranks": unchecked, "status": status}
        click.echo(json.dumps(summary))
    else:
        _print_text_summary(out, result, unchecked, status)
    sys.exit(status.exit_code)


def _os_error(exc: OSError) -> str:
    what = exc.strerror or str(exc)
    return f"cannot read {exc.filename}: {what.lower()}" if exc.filename else what


# -- query ----------------------------------------------------------------------------------------

_RANK = re.compile(r"^dp(\d+)-tp(\d+)-pp(\d+)$")
# Tokens to wrong slots shown per group; the rest are counted.
_WRONG_SHOWN = 8


def _slot(slot: int, block_size: int) -> str:
    return f"slot {slot} (block {slot // block_size}, offset {slot % block_size})"


def _plan_lines(plan: PlanWrites, rows: list[list[int]] | None) -> tuple[list[str], bool]:
    """What the step's plan did for the request, beside what the ledger expected (rich markup), and
    whether it broke a rule."""
    wrong = "[bold red]WRONG[/]"
    lines = [f"  plan of step {plan.step}: {plan.num_tokens} token(s) from position {plan.first_position}"]
    broke = plan.position_wrong
    if plan.position_wrong:
        lines.append(
            f"    {wrong} position: the plan writes from position {plan.first_position}; the scheduler handed "
            f"{plan.scheduled} token(s) from computed position {plan.computed}"
        )
    for g in plan.groups:
        bad = [i for i, w in enumerate(g.wrong) if w]
        for i in bad[:_WRONG_SHOWN]:
            if g.in_row[i]:
                expected = f"the ledger's row gives {_slot(g.expected[i], g.block_size)}"
            else:
                expected = f"the ledger's row ({g.ledger_len} block(s) of {g.block_size}) has no slot for it"
            lines.append(
                f"    group {g.group_id}: {wrong} slot: position {g.positions[i]} written to "
                f"{_slot(g.written[i], g.block_size)}; {expected}"
            )
        if len(bad) > _WRONG_SHOWN:
            lines.append(f"    group {g.group_id}: and {len(bad) - _WRONG_SHOWN} more token(s) to wrong slots")
        if g.read_wrong:
            ledger_row = rows[g.group_id] if rows is not None and g.group_id < len(rows) else None
            if g.read_row is not None and ledger_row is not None:
                at = next(
                    (i for i, (a, b) in enumerate(zip(g.read_row, ledger_row, strict=False)) if a != b),
                    min(len(g.read_row), len(ledger_row)),
                )
                got = g.read_row[at] if at < len(g.read_row) else "nothing"
                want = ledger_row[at] if at < len(ledger_row) else "nothing"
                lines.append(
                    f"    group {g.group_id}: {wrong} read: attention read {g.read_len} block(s) {g.read_row}; "
                    f"the ledger's row is {g.ledger_len} block(s) {ledger_row}; first difference at index {at}: "
                    f"block {got} where the row has {want}"
                )
            else:
                read = f"{g.read_len} block(s)" if g.read_len is not None else "a row"
                digest = f" (digest {g.read_digest:#010x})" if g.read_digest is not None else ""
                lines.append(
                    f"    group {g.group_id}: {wrong} read: attention read {read}{digest}; the ledger's row is "
                    f"{g.ledger_len} block(s) (digest {g.ledger_digest:#010x}), other blocks"
                )
        if not bad and not g.read_wrong:
            read = f", read its {g.read_len} block(s)" if g.read_len is not None else ""
            lines.append(f"    group {g.group_id}: {len(g.positions)} slot(s) as the ledger's row gives{read}")
        broke = broke or bool(bad) or g.read_wrong
    return lines, broke


def _view_lines(v: RequestView, req_id: str, step: int | None, first_step: int | None) -> tuple[list[str], bool]:
    where = f"{rank_label(v.dp_rank, v.tp_rank, v.pp_rank)} at step {v.step}"
    req = escape(req_id)
    if v.rows is None:
        if v.first_seen is not None:
            seen = f"; live from step {v.first_seen} to {v.last_seen}"
        elif step is not None and first_step is not None and first_step > step:
            seen = f"; it first appears at step {first_step}"
        else:
            seen = "; never live on this rank" + (f" up to step {step}" if step is not None else "")
        return [f"[cyan]{where}[/]: {req} holds no blocks{seen}"], False
    lines = [f"[cyan]{where}[/]: {req}"]
    for group, row in enumerate(v.rows):
        lines.append(f"  group {group}: {len(row)} block(s) {row}")
    if v.plan is None:
        return lines, False
    plan, broke = _plan_lines(v.plan, v.rows)
    return lines + plan, broke


QUERY_EXIT = _exit_help(
    CLEAN="the block table shown (with the step's plan for the request, where the rank has one)",
    VIOLATIONS="the step's plan broke a rule for the request: shown beside what the ledger expected",
    INPUT_ERROR=_INPUT_ERROR_HELP
    + "an engine, rank or request the ledger does not hold, a step outside the engine's steps "
    "(the line names what exists)",
)


@main.command(name="query", epilog=QUERY_EXIT)
@click.argument("path", type=click.Path(path_type=str))
@click.option("--engine", "engine_id", help="Engine id (default: the only engine at PATH).")
@click.option("--req", "req_id", required=True, help="Request id.")
@click.option("--step", type=int, default=None, help="Step to travel to (default: the end of the ledger).")
@click.option("--rank", "rank", metavar="dpD-tpT-ppP", help="Only this rank (default: every rank of the engine).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def query_cmd(path: str, engine_id: str | None, req_id: str, step: int | None, rank: str | None, fmt: str) -> None:
    """Time travel: the block table of a request at a step, per KV cache group and rank.

    At a step whose plan wrote or read for the request, the plan is shown beside the ledger's row:
    a wrong slot or block next to the one the row gives.
    """
    from kvledger.stream_app.inventory import discover_all, travel

    try:
        streams = discover_all([path])
        engines = sorted({s.engine_id for s in streams})
        if engine_id is None:
            if len(engines) > 1:
                _fail(f"{path} holds {len(engines)} engines: give --engine ({_listed(engines)})")
            engine_id = engines[0]
        elif engine_id not in engines:
            _fail(f"no engine {engine_id!r} at {path}; it holds: {_listed(engines)}")
        ranks = sorted({(s.dp, s.tp, s.pp) for s in streams if s.engine_id == engine_id})
        names = [rank_label(*r) for r in ranks]
        if rank is not None and rank not in names:
            _fail(f"no rank {rank!r} of engine {engine_id!r} at {path}; its ranks: {_listed(names)}")
        found = travel([path], engine_id, req_id, step)
    except UnusableLedger as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(_os_error(exc))
    engine = found.engine
    if step is not None and (engine.first_step is None or not engine.first_step <= step <= engine.last_step):
        _fail(f"step {step} is outside the steps of engine {engine_id!r}: it has {engine.steps}")
    if req_id not in engine.requests:
        ids = engine.request_ids()
        _fail(
            f"no request {req_id!r} in the ledger of engine {engine_id!r}; it holds {len(ids)}: {_listed(ids)} "
            f"(`kvledger ls {path} --all-requests` lists them)"
        )
    views = [v for v in found.views if rank is None or rank_label(v.dp_rank, v.tp_rank, v.pp_rank) == rank]
    broke = False
    if fmt == "json":
        for view in views:
            click.echo(json.dumps({"type": "block_table", "req_id": req_id, **asdict(view)}))
            if view.plan is not None:
                broke = broke or _plan_lines(view.plan, view.rows)[1]
    else:
        out = output_console()
        for view in views:
            lines, wrong = _view_lines(view, req_id, step, engine.requests[req_id])
            broke = broke or wrong
            for line in lines:
                out.print(line, soft_wrap=True)
    sys.exit(ExitCode.VIOLATIONS if broke else ExitCode.CLEAN)


# -- ls -------------------------------------------------------------------------------------------

# Request ids `ls` shows per engine, unless --all-requests.
REQUESTS_SHOWN = 10


def _size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _print_inventory(console: Console, inventory, all_requests: bool, source: str) -> None:
    if not inventory.engines:
        console.print(f"no ledger events in {escape(source)}")
    for engine_id in sorted(inventory.engines):
        engine = inventory.engines[engine_id]
        console.print(
            f"[bold]engine {escape(engine_id)}[/]: {len(engine.ranks)} rank(s), {engine.steps}, "
            f"{len(engine.requests)} request(s)"
        )
        for key in sorted(engine.ranks):
            rank = engine.ranks[key]
            files = f": {rank.segments} segment(s), {_size_text(rank.bytes or 0)}" if rank.segments is not None else ""
            console.print(f"  [cyan]{rank.name}[/]{files}")
            if not rank.incarnations:
                console.print("    no event read")
            for n in sorted(rank.incarnations):
                inc = rank.incarnations[n]
                steps = "no steps" if inc.first_step is None else f"steps {inc.first_step}..{inc.last_step}"
                closed = ", shut down" if inc.closed else ""
                console.print(
                    f"    incarnation {n}: {steps}, {inc.events} event(s) (seq {inc.first_seq}..{inc.last_seq}){closed}"
                )
        ids = engine.request_ids(None if all_requests else REQUESTS_SHOWN)
        if ids:
            more = len(engine.requests) - len(ids)
            tail = f" ... and {more} more (--all-requests lists them)" if more else ""
            console.print(f"  requests: {escape(', '.join(ids))}{tail}", soft_wrap=True)
    for line in [*map(_problem_line, inventory.problems), *_renamed_lines(inventory.streams, "listed")]:
        console.print(line, soft_wrap=True)
    if inventory.undecodable:
        console.print(f"[yellow]{inventory.undecodable} record(s) of the topic are no ledger events[/]")


LS_EXIT = _exit_help(
    CLEAN="listed",
    INPUT_ERROR=_INPUT_ERROR_HELP + "a foreign file in it; a broker that does not answer, a missing topic",
)


# -- cluster mode -------------------------------------------------------------------------------
# The worker's modules import Faust and the Kafka clients: loaded only by these commands.


def kafka_options(command):
    """--bootstrap and --kafka-config, for every command that talks to Kafka."""
    command = click.option(
        "--kafka-config",
        type=click.Path(dir_okay=False, path_type=Path),
        help="JSON object of client settings in librdkafka's names (security.protocol, sasl.*, ssl.*), "
        "as an engine's kv_trace.kafka.",
    )(command)
    return click.option("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap server(s) (else --kafka-config's).")(
        command
    )


def _registry_url(ctx, param, value: str | None) -> str | None:
    from kvledger.schemas.confluent import url_problem

    if value is not None and (problem := url_problem(value)):
        raise click.BadParameter(problem)
    return value


def registry_option(what: str):
    return click.option(
        "--schema-registry", metavar="URL", callback=_registry_url, help=f"Schema Registry (Confluent API URL): {what}"
    )


def _kafka(path: Path | None, bootstrap: str | None):
    """The clients' security settings (--kafka-config) and the bootstrap servers, or exit 2 saying why."""
    from kvledger.stream_app.kafka_security import KafkaConfigError, KafkaSecurity

    try:
        security = KafkaSecurity.load(path)
        security.faust_credentials()  # a CA or key that cannot be read fails here, not in the worker
        return security, security.bootstrap(bootstrap)
    except KafkaConfigError as exc:
        _fail(str(exc))


def _registry(url: str | None):
    """The Schema Registry client for --schema-registry, or exit 2 saying why."""
    if url is None:
        return None
    from kvledger.schemas.confluent import RegistryError, SchemaRegistry

    try:
        return SchemaRegistry(url)
    except RegistryError as exc:
        _fail(str(exc))


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@main.command(name="ls", epilog=LS_EXIT)
@click.argument("paths", metavar="[PATH]...", nargs=-1, type=click.Path(path_type=str))
@kafka_options
@click.option("--topic-prefix", default="kvledger", show_default=True, help="With a broker: read PREFIX.events.")
@registry_option("read Confluent-framed events too (with a broker).")
@click.option(
    "--all-requests", is_flag=True, help=f"List every request id (default: the first {REQUESTS_SHOWN} per engine)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one object, engines, ranks (with incarnations) and requests.",
)
def ls(
    paths: tuple[str, ...],
    bootstrap: str | None,
    kafka_config: Path | None,
    topic_prefix: str,
    schema_registry: str | None,
    all_requests: bool,
    fmt: str,
) -> None:
    """List what a ledger holds: its engines, their ranks (dp/tp/pp), incarnations, step ranges
    and request ids.

    From the file ledger(s) at PATH... (a ledger root, any directory inside one, or a segment),
    or, with --bootstrap or --kafka-config instead, from the cluster's events topic (read to its
    end as it stands, not followed).
    """
    from kvledger.stream_app.inventory import kafka_inventory, ledger_inventory

    if paths and (bootstrap or kafka_config):
        _fail("give ledger PATH... or a broker (--bootstrap, --kafka-config), not both")
    if paths:
        source = ", ".join(paths)
        try:
            inventory = ledger_inventory(paths)
        except UnusableLedger as exc:
            _fail(str(exc))
        except OSError as exc:
            _fail(_os_error(exc))
    elif bootstrap or kafka_config:
        from kvledger.stream_app.worker.topics import BrokerUnavailable, Topics

        security, bootstrap = _kafka(kafka_config, bootstrap)
        registry = _registry(schema_registry)
        source = Topics(topic_prefix).events
        try:
            inventory = kafka_inventory(bootstrap, source, security, registry)
        except BrokerUnavailable as exc:
            _fail(str(exc))
    else:
        _fail("give a ledger PATH, or a broker (--bootstrap HOST:PORT) to list the events topic")
    if fmt == "json":
        click.echo(json.dumps(inventory.to_json(None if all_requests else REQUESTS_SHOWN)))
    else:
        _print_inventory(output_console(), inventory, all_requests, source)
    sys.exit(ExitCode.CLEAN)


STREAM_EXIT = _exit_help(
    CLEAN="stopped (a signal)",
    INPUT_ERROR="input error, one line on stderr: a setting that is not usable, a broker that does not"
    " answer, a web port in use, client libraries other than the tested ones",
)


@main.command(epilog=STREAM_EXIT)
@kafka_options
@click.option("--partitions", type=click.IntRange(1), default=4, show_default=True, help="Of the events topic, if new.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("kvledger-state"),
    show_default=True,
    help="Local table state (RocksDB).",
)
@click.option("--web-port", type=click.IntRange(1, 65535), default=6066, show_default=True, help="/metrics, views.")
@click.option("--store", type=click.Choice(["rocksdb", "memory"]), default="rocksdb", show_default=True)
@click.option("--group", default="kvledger", show_default=True, help="Consumer group (workers of one group share).")
@click.option("--topic-prefix", default="kvledger", show_default=True, help="Topics are PREFIX.events, ...")
@click.option("--replication", type=click.IntRange(1), default=1, show_default=True, help="Of topics it creates.")
@click.option(
    "--settle-after",
    type=click.FloatRange(0.1),
    default=5.0,
    show_default=True,
    help="Seconds an engine may be silent before steps held for its missing ranks are settled.",
)
@click.option(
    "--retire-after",
    type=click.FloatRange(1.0),
    default=3600.0,
    show_default=True,
    help="Seconds an engine may be silent before it is retired (its state dropped); "
    "one whose ranks all shut down is retired at once.",
)
@click.option(
    "--session-timeout",
    type=click.FloatRange(6.0),
    default=10.0,
    show_default=True,
    help="Seconds before the group gives a silent worker's partitions to the others.",
)
@click.option(
    "--rocksdb-memory",
    type=click.IntRange(8),
    default=64,
    show_default=True,
    metavar="MB",
    help="RocksDB's cache and write buffers, per table and partition (--store rocksdb).",
)
@registry_option("read Confluent-framed events, publish violations so (subject PREFIX.violations-value).")
@click.option(
    "--untested-client-libraries",
    is_flag=True,
    envvar="KVLEDGER_UNTESTED_CLIENT_LIBRARIES",
    help="Start even where Faust, mode or aiokafka differ from the versions the worker's fixes to them were "
    "tested with (a warning names what differs; fixes whose targets are missing are not applied).",
)
@click.option(
    "--client-start-grace",
    type=click.FloatRange(0.0),
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="For this long after start, the Kafka client's known start-up errors (a broker still starting: "
    "no group coordinator yet) are logged as warnings; past it, as errors.",
)
@click.option("--loglevel", type=click.Choice(["debug", "info", "warning", "error"]), default="warning")
def stream(
    bootstrap: str | None,
    kafka_config: Path | None,
    partitions: int,
    state_dir: Path,
    web_port: int,
    store: str,
    group: str,
    topic_prefix: str,
    replication: int,
    settle_after: float,
    retire_after: float,
    session_timeout: float,
    rocksdb_memory: int,
    schema_registry: str | None,
    untested_client_libraries: bool,
    client_start_grace: float,
    loglevel: str,
) -> None:
    """Run a stream worker: project kvledger.events, publish violations (runs until stopped)."""
    from kvledger.schemas.confluent import RegistryError
    from kvledger.stream_app.worker.app import WorkerSettings, run_worker
    from kvledger.stream_app.worker.faust_fixes import UntestedClientLibraries, close_faust_holes
    from kvledger.stream_app.worker.topics import BrokerUnavailable, Topics, ensure_topics

    try:  # first: a worker that must not start says so before it reaches the broker
        close_faust_holes(untested_client_libraries)
    except UntestedClientLibraries as exc:
        _fail(str(exc))
    security, bootstrap = _kafka(kafka_config, bootstrap)
    if not _port_free(web_port):
        _fail(f"web port 127.0.0.1:{web_port} is in use (another worker?); pick one with --web-port")
    try:
        partitions = ensure_topics(bootstrap, Topics(topic_prefix), partitions, replication, security)
    except BrokerUnavailable as exc:
        _fail(str(exc))
    settings = WorkerSettings(
        bootstrap=bootstrap,
        partitions=partitions,
        state_dir=state_dir,
        web_port=web_port,
        store=store,
        group=group,
        topic_prefix=topic_prefix,
        replication=replication,
        settle_after=settle_after,
        retire_after=retire_after,
        session_timeout=session_timeout,
        rocksdb_memory_mb=rocksdb_memory,
        kafka=security,
        schema_registry=schema_registry,
        untested_client_libraries=untested_client_libraries,
        client_start_grace=client_start_grace,
    )
    click.echo(
        f"kvledger: worker of group {group} on {bootstrap} ({partitions} partitions), http://127.0.0.1:{web_port}/",
        err=True,
    )
    try:
        run_worker(settings, loglevel=loglevel)
    except RegistryError as exc:  # raised before the app starts: registering the Violation schema
        _fail(str(exc))


VIOLATIONS_EXIT = _exit_help(
    CLEAN="no violations read",
    VIOLATIONS="violations printed",
    INPUT_ERROR="input error, one line on stderr: a setting that is not usable, a broker that does not"
    " answer, a violations topic that does not exist",
)


@main.command(epilog=VIOLATIONS_EXIT)
@kafka_options
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--from-beginning", is_flag=True, help="Read the whole topic, not only what comes next.")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    metavar="ENGINE_ID",
    help="Only this engine's violations (repeat for several).",
)
@click.option(
    "--idle-timeout",
    type=click.FloatRange(0.1),
    default=10.0,
    show_default=True,
    help="Exit after this many seconds without a new record.",
)
@click.option("--topic-prefix", default="kvledger", show_default=True)
@registry_option("read Confluent-framed violations too (writer schemas by id).")
def violations(
    bootstrap: str | None,
    kafka_config: Path | None,
    fmt: str,
    from_beginning: bool,
    idle_timeout: float,
    topic_prefix: str,
    schema_registry: str | None,
    engines: tuple[str, ...],
) -> None:
    """Print the violations topic (each violation once), then a summary, and exit when idle."""
    from kvledger.stream_app.worker.reader import ViolationsRead, read_violations
    from kvledger.stream_app.worker.topics import BrokerUnavailable, Topics

    security, bootstrap = _kafka(kafka_config, bootstrap)
    registry = _registry(schema_registry)
    out = output_console()
    stats = ViolationsRead()
    shown: Counter = Counter()  # what was printed (with --engine, that engine's only)
    shown_engines: set[str] = set()
    try:
        for _, v in read_violations(
            bootstrap,
            Topics(topic_prefix).violations,
            from_beginning=from_beginning,
            idle_timeout=idle_timeout,
            stats=stats,
            security=security,
            registry=registry,
        ):
            if engines and v.engine_id not in engines:
                continue
            shown[v.kind] += 1
            shown_engines.add(v.engine_id)
            if fmt == "json":
                click.echo(_violation_json(v))
            else:
                out.print(_violation_text(v), soft_wrap=True)
    except BrokerUnavailable as exc:
        _fail(str(exc))
    summary = stats.summary() | {"violations": dict(sorted(shown.items())), "engines": len(shown_engines)}
    if fmt == "json":
        click.echo(json.dumps(summary))
    else:
        kinds = ", ".join(f"{k} {n}" for k, n in summary["violations"].items())
        out.print()
        out.print(f"[bold]{sum(shown.values())}[/] violation(s) from {summary['engines']} engine(s)")
        out.print(f"[bold red]{kinds}[/]" if kinds else "[bold green]no violations[/]")
        if stats.duplicates:
            out.print(f"{stats.duplicates} re-sent record(s) dropped (same violation id)")
    sys.exit(ExitCode.VIOLATIONS if shown else ExitCode.CLEAN)
