"""`kvledger` command line: replay and query file ledgers.

Exit status: 0 clean, 1 violations found, 2 unusable input (one-line error).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from kvledger.stream_app.core import Violation
from kvledger.stream_app.replay import Replay, UnusableLedger, query, replay

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_UNUSABLE = 0, 1, 2


def _fail(message: str) -> None:
    click.echo(f"kvledger: error: {message}", err=True)
    sys.exit(EXIT_UNUSABLE)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvledger")
def main() -> None:
    """kvledger: an event-sourced monitor for the KV cache of vLLM engines."""


def _violation_json(v: Violation) -> str:
    return json.dumps({"type": "violation", **v.to_record()})


def _violation_text(v: Violation) -> str:
    where = f"{v.engine_id} dp{v.dp_rank}/tp{v.tp_rank}/pp{v.pp_rank}"
    at = " ".join(
        x
        for x in (
            f"step {v.step}" if v.step is not None else "",
            f"req {v.req_id}" if v.req_id is not None else "",
            f"group {v.group}" if v.group is not None else "",
        )
        if x
    )
    return f"[bold red]{v.kind}[/] [cyan]{where}[/]{' ' + at if at else ''}: {v.detail}"


def _print_text_summary(console: Console, result: Replay) -> None:
    s = result.summary()
    console.print()
    console.print(
        f"[bold]{s['events']}[/] events, [bold]{s['steps']}[/] step-events, [bold]{s['ranks']}[/] rank stream(s)"
    )
    checks = ", ".join(f"{k} {n}" for k, n in s["checks"].items()) or "none"
    console.print(f"checks run: {checks}")
    if s["unchecked"]:
        unchecked = ", ".join(f"{k} {n}" for k, n in s["unchecked"].items())
        console.print(f"[yellow]not checked:[/] {unchecked}")
    for p in s["problems"]:
        console.print(
            f"[yellow]unreadable:[/] {p['path']}: {p['reason']} after {p['events_read']} event(s) ({p['detail']})"
        )
    if s["violations"]:
        table = Table(title="violations", show_edge=False)
        table.add_column("kind", style="red")
        table.add_column("count", justify="right")
        for kind, n in s["violations"].items():
            table.add_row(kind, str(n))
        console.print(table)
    else:
        console.print("[bold green]no violations[/]")


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text: a readable report; json: one JSON object per line, a summary last.",
)
def check(path: str, fmt: str) -> None:
    """Replay the file ledger at PATH and report every violation."""
    err = Console(stderr=True)
    out = Console(highlight=False)
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
    if fmt == "json":
        click.echo(json.dumps(result.summary()))
    else:
        _print_text_summary(out, result)
    sys.exit(EXIT_VIOLATIONS if result.violations else EXIT_CLEAN)


@main.command(name="query")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--engine", "engine_id", required=True, help="Engine id.")
@click.option("--req", "req_id", required=True, help="Request id.")
@click.option("--step", type=int, default=None, help="Step to travel to (default: the end of the ledger).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def query_cmd(path: str, engine_id: str, req_id: str, step: int | None, fmt: str) -> None:
    """Time travel: the block table of a request at a step, per KV cache group and rank."""
    try:
        views = query(path, engine_id, req_id, step)
    except UnusableLedger as exc:
        _fail(str(exc))
    if fmt == "json":
        for view in views:
            click.echo(json.dumps({"type": "block_table", "req_id": req_id, **asdict(view)}))
    else:
        console = Console(highlight=False)
        for v in views:
            where = f"dp{v.dp_rank}/tp{v.tp_rank}/pp{v.pp_rank} at step {v.step}"
            if v.rows is None:
                seen = (
                    f"; live from step {v.first_seen} to {v.last_seen}"
                    if v.first_seen is not None
                    else "; never live on this rank"
                )
                console.print(f"[cyan]{where}[/]: {req_id} holds no blocks{seen}")
                continue
            console.print(f"[cyan]{where}[/]: {req_id}")
            for group, row in enumerate(v.rows):
                console.print(f"  group {group}: {len(row)} block(s) {row}")
    sys.exit(EXIT_CLEAN if any(v.rows is not None for v in views) else EXIT_VIOLATIONS)
