"""`kvledger` command line: replay and query file ledgers; run and read the stream worker.

Exit status: 0 clean, 1 violations found, 2 unusable input or unreachable
broker (one-line error).
"""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict
from pathlib import Path

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
        # A truncated tail lost only its end (every whole block before it was replayed).
        label = "tail lost" if p["reason"] == "truncated" else "unreadable"
        console.print(
            f"[yellow]{label}:[/] {p['path']}: {p['reason']} after {p['events_read']} event(s) ({p['detail']})"
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

    Several ledgers (e.g. the prefill and the decode engine of a pair, traced to
    different directories) are replayed together, so transfers join across them.
    """
    path = paths[0] if len(paths) == 1 else list(paths)
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


@main.command()
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
    )
    click.echo(
        f"kvledger: worker of group {group} on {bootstrap} ({partitions} partitions), http://127.0.0.1:{web_port}/",
        err=True,
    )
    try:
        run_worker(settings, loglevel=loglevel)
    except RegistryError as exc:  # raised before the app starts: registering the Violation schema
        _fail(str(exc))


@main.command()
@kafka_options
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--from-beginning", is_flag=True, help="Read the whole topic, not only what comes next.")
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
) -> None:
    """Print the violations topic (each violation once), then a summary, and exit when idle."""
    from kvledger.stream_app.worker.reader import ViolationsRead, read_violations
    from kvledger.stream_app.worker.topics import BrokerUnavailable, Topics

    security, bootstrap = _kafka(kafka_config, bootstrap)
    registry = _registry(schema_registry)
    out = Console(highlight=False)
    stats = ViolationsRead()
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
            if fmt == "json":
                click.echo(_violation_json(v))
            else:
                out.print(_violation_text(v), soft_wrap=True)
    except BrokerUnavailable as exc:
        _fail(str(exc))
    summary = stats.summary()
    if fmt == "json":
        click.echo(json.dumps(summary))
    else:
        kinds = ", ".join(f"{k} {n}" for k, n in summary["violations"].items())
        out.print()
        out.print(f"[bold]{sum(stats.kinds.values())}[/] violation(s) from {summary['engines']} engine(s)")
        out.print(f"[bold red]{kinds}[/]" if kinds else "[bold green]no violations[/]")
        if stats.duplicates:
            out.print(f"{stats.duplicates} re-sent record(s) dropped (same violation id)")
    sys.exit(EXIT_VIOLATIONS if stats.kinds else EXIT_CLEAN)
