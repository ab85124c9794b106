"""Every command the README and the docs show is run, or held to what runs it, so none can rot.

Each shell command of a fenced `bash` block in README.md and docs/*.md (and each `kvledger ...`
the README's `make demo` sample suggests, or a page shows as inline code) must be one of:

* a `kvledger` invocation the CLI accepts: parsed by the real click commands (an unknown or
  renamed option, a choice the option lacks, a missing required option fail; a synopsis's
  `[--x]`, `a|b` and placeholders such as `PATH` or `N` are read as such);
* run by a named test or by the demo scripts (RUN_BY): each entry names the test (file::function)
  or script, and the strings its source must hold (every `--option` of the command among them for
  a test's Python source), checked by reading that source; a `make` target must also be the
  Makefile's, with the recipe that runs what the test runs;
* run here (RUN_HERE), by the test below that executes it;
* not runnable here (NOT_RUN, by exact command) or a benchmark (BENCHMARKS, by script), each with
  why; a benchmark's options are still held to the options its script declares (argparse, read
  from its source), and an engine's `--additional-config` to the `kv_trace` option's model.

A command in none of these fails the test, so does a listed one no page shows any more.
`test_the_checks_catch_what_they_are_for` shows each rule failing on a broken command.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from kvledger.producer.config import TraceOptions
from kvledger.stream_app.cli import main as kvledger_cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}

# A test or script that runs the command: "path::function" (a function's source, nested ones
# included), "Makefile::target" (the target's recipe) or a bare path (the whole file), and what
# that source must hold.
Evidence = tuple[str, tuple[str, ...]]

_DEMO_TEST = "tests/e2e/test_demo.py::test_make_demo_prints_the_readmes_sample"
_DEV_STACK_TEST = "tests/e2e/test_dev_stack.py::test_demo_cluster_finds_the_fault_through_the_dev_stack"
_SERVER_TEST = "tests/e2e/test_server.py::test_sigterm_right_after_the_last_response_leaves_a_complete_clean_ledger"
_SERVER_KAFKA_TEST = (
    "tests/e2e/test_server.py::test_sigterm_with_a_kafka_sink_delivers_the_closing_health_of_every_rank"
)
_SERVE = "tests/e2e/server_run.py::serve"  # how test_server.py starts its servers
_SERVER_OPTIONS = ("vllm.entrypoints.openai.api_server", '"--model"', '"--additional-config"')

RUN_BY: dict[str, tuple[Evidence, ...]] = {
    "make demo": (
        ("Makefile::demo", ("infra/demo $(abspath $(VLLM_VENV))/bin/python $(abspath $(BIN))/kvledger",)),
        (_DEMO_TEST, ('"infra" / "demo"', "vllm_python()", "KVLEDGER")),
    ),
    "make demo-cluster": (
        ("Makefile::demo-cluster", ("infra/demo-cluster $(abspath $(VLLM_VENV))/bin/python",)),
        (_DEV_STACK_TEST, ('"infra" / "demo-cluster"', "vllm_python()", "KVLEDGER")),
    ),
    "infra/dev-stack up": (("infra/demo-cluster", ("$(infra/dev-stack up)",)),),
    "infra/dev-stack down": (
        (_DEV_STACK_TEST, ('dev_stack("down", env)',)),
        ("tests/e2e/test_dev_stack.py::dev_stack", ('ROOT / "infra" / "dev-stack"',)),
    ),
    "infra/local-kafka up": (
        ("tests/conftest.py::kafka_bootstrap", ("_started(local_kafka,",)),
        ("tests/conftest.py::_started", ('run("up"',)),
        ("tests/conftest.py", ('LOCAL_KAFKA = Path(__file__).resolve().parents[1] / "infra" / "local-kafka"',)),
    ),
    "infra/local-kafka status": (
        ("tests/integration/test_local_kafka.py::test_status_reports_the_running_broker", ('local_kafka("status")',)),
    ),
    "infra/local-kafka down": (("tests/conftest.py::kafka_bootstrap", ('local_kafka("down")',)),),
    # The server forms: test_server.py runs the same module with the tiny model, the same options.
    "VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model /tmp/tiny "
    "--load-format dummy --skip-tokenizer-init --enforce-eager --block-size 32 --dtype float32 --max-model-len 512 "
    "--host 127.0.0.1 --port 8000 --additional-config "
    '\'{"kv_trace": {"enabled": true, "sink": "file:///tmp/kvledger"}}\'': (
        (_SERVER_TEST, ("serve(",)),
        (_SERVE, (*_SERVER_OPTIONS, '"VLLM_CPU_KVCACHE_SPACE": "1"', "json.dumps(TINY_LLAMA)")),
    ),
    ".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model MODEL --additional-config "
    '\'{"kv_trace": {"enabled": true, "sink": "file:///var/lib/kvledger"}}\'': (
        (_SERVER_TEST, ("serve(",)),
        (_SERVE, _SERVER_OPTIONS),
    ),
    ".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model MODEL --additional-config "
    '\'{"kv_trace": {"enabled": true, "sink": "kafka://127.0.0.1:9094"}}\'': (
        (_SERVER_KAFKA_TEST, ("serve(", "kafka://")),
        (_SERVE, _SERVER_OPTIONS),
    ),
}

# Run by test_the_commands_run_here_run below, in a temporary directory for /tmp/tiny.
RUN_HERE = {
    "mkdir -p /tmp/tiny && .venv/bin/python -c 'import json; from tests.e2e.engine_run import TINY_LLAMA; "
    "print(json.dumps(TINY_LLAMA))' > /tmp/tiny/config.json",
}

NOT_RUN = {
    "make test": "the whole suite, this test among it",
    "vllm serve MODEL --additional-config "
    '\'{"kv_trace": {"enabled": true, "sink": "file:///var/lib/kvledger"}}\'': "CUDA vLLM's `vllm` script: this "
    "project has no GPU engine, and vllm-cpu's script fails at start (the README says so); its --additional-config "
    "is checked",
}

# Benchmarks: minutes each, several need a broker or a GPU; docs/performance.md holds their results.
BENCHMARKS = {
    "bench/engine_overhead.py": "real engines with tracing on and off, in pairs: ~10-40 minutes",
    "bench/recorder_policy.py": "real engines under each recorder policy: minutes each",
    "bench/probe_hot_path.py": "thousands of probe steps, side by side with another checkout",
    "bench/content_state.py": "a million-block content ledger",
    "bench/device_staging.py": "a device engine's staging (torch; a GPU for the figures)",
    "bench/gpu_check.py": "the device check, for a GPU host (its --dry-run runs its stages on CPU: ~35 s)",
    "bench/replay_throughput.py": "replay throughput over thousands of synthetic steps, repeated",
    "bench/fleet_scale.py": "a production-sized engine's tables (262,144 blocks)",
    "bench/stream_throughput.py": "a worker against a broker, 20,000 step-events (tests/integration: its short form)",
    "bench/stream_recovery.py": "a worker killed and restarted over a million events",
    "bench/soak.py": "the soak: 200 engines, 10^7 step-events (tests/integration/test_soak.py: its short form)",
}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # continuation lines joined, the trailing comment cut, blanks collapsed
    inline: bool = False  # a code span in the prose, naming a command rather than giving it whole

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line of the first line inside, body) of each fenced block."""
    return [
        (m[1], text[: m.start()].count("\n") + 2, m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    ]


def _without_comment(line: str) -> str:
    """The line less a trailing `# comment` (a `#` outside quotes, after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _logical_lines(body: str, first: int) -> list[tuple[int, str]]:
    out, pending, start = [], "", first
    for n, raw in enumerate(body.splitlines(), first):
        if not pending:
            start = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = " ".join(_without_comment(pending + raw).split())
        pending = ""
        if line:
            out.append((start, line))
    return out


def shell_commands(pages: list[Path] = PAGES) -> list[Command]:
    found = []
    for page in pages:
        name = str(page.relative_to(ROOT))
        for lang, first, body in _fenced_blocks(page.read_text()):
            if lang in SHELL_BLOCKS:
                found += [Command(name, n, line) for n, line in _logical_lines(body, first)]
    return found


_LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ )?(\S*/)?(kvledger|make|pip|vllm|python3?|infra/\S+|bench/\S+)( |$)")


def commands_outside_shell_blocks(pages: list[Path] = PAGES) -> list[Command]:
    """Lines of other fenced blocks that look like commands (a sample's suggested commands)."""
    found = []
    for page in pages:
        name = str(page.relative_to(ROOT))
        for lang, first, body in _fenced_blocks(page.read_text()):
            if lang not in SHELL_BLOCKS and lang != "json":
                found += [
                    Command(name, n, line)
                    for n, line in _logical_lines(body, first)
                    if _LOOKS_LIKE_A_COMMAND.match(line)
                ]
    return found


def inline_kvledger_commands(pages: list[Path] = PAGES) -> list[Command]:
    found = []
    for page in pages:
        text = re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), page.read_text(), flags=re.M | re.S)
        for m in re.finditer(r"`(kvledger (?:check|ls|query|stream|violations)\b[^`]*)`", text):
            line = text[: m.start()].count("\n") + 1
            found.append(Command(str(page.relative_to(ROOT)), line, " ".join(m[1].split()), inline=True))
    return found


# -- kvledger, against the real click commands --------------------------------------------------

_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(:[A-Z][A-Z0-9_]*)?$")  # PATH, N, HOST:PORT


def _simple_commands(text: str) -> list[list[str]]:
    """The argv of each simple command of a line, `VAR=value` prefixes and redirections left out."""
    # A synopsis's alternatives (`text|json`, no blanks around the bar) are one word, not a pipe.
    protected = re.sub(r"(?<=[\w\]])\|(?=[\w\[])", "\0", text)
    lexer = shlex.shlex(protected, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    argvs: list[list[str]] = [[]]
    redirect = False
    for token in (t.replace("\0", "|") for t in lexer):
        if token in (";", "&&", "||", "|", "&"):
            argvs.append([])
        elif token in (">", ">>", "<", "2>"):
            redirect = True
        elif redirect:
            redirect = False
        elif not argvs[-1] and re.match(r"^[A-Z_][A-Z0-9_]*=", token):
            continue
        else:
            argvs[-1].append(token)
    return [argv for argv in argvs if argv]


def _is_kvledger(argv: list[str]) -> bool:
    return Path(argv[0]).name == "kvledger"


def kvledger_problem(argv: list[str], complete: bool = True) -> str | None:
    """Why the real CLI would not accept `argv` (a synopsis's notation read as such), or None.
    Not `complete` (prose naming a command and some of its options): the options only."""
    tokens = [t.replace("[", "").replace("]", "").removesuffix("...") for t in argv[1:]]
    tokens = [t for t in tokens if t]
    if not tokens or tokens[0] not in kvledger_cli.commands:
        return f"no such kvledger command: {tokens[:1]}"
    command = kvledger_cli.commands[tokens[0]]
    options = {opt: p for p in command.params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}
    args, rest = [], tokens[1:]
    while rest:
        token = rest.pop(0)
        name = token.split("=", 1)[0]
        param = options.get(name)
        if param is None or param.is_flag or param.count or "=" in token or not rest:
            args.append(token)
            continue
        value = rest.pop(0)
        choices = getattr(param.type, "choices", None)
        if "|" in value:
            wrong = [v for v in value.split("|") if choices is None or v not in choices]
            if wrong:
                return f"{name} takes {choices}, not {wrong}"
            value = value.split("|")[0]
        elif _PLACEHOLDER.match(value):
            if choices:
                value = choices[0]
            elif isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType)):
                value = str(getattr(param.type, "min", None) or 1)
        args += [name, value]
    if not complete:
        unknown = [a for a in args if a.startswith("-") and a.split("=", 1)[0] not in options]
        return f"kvledger {tokens[0]} has no {unknown}" if unknown else None
    try:
        with click.Context(kvledger_cli, info_name="kvledger") as parent:
            command.make_context(tokens[0], args, parent=parent)
    except click.exceptions.Exit:
        return None  # --help, --version
    except click.ClickException as exc:
        return exc.format_message()
    return None


# -- the rest: run by a test or a demo script, by what its source holds ------------------------------


def _source(ref: str) -> str:
    path, _, scope = ref.partition("::")
    text = (ROOT / path).read_text()
    if not scope:
        return text
    if path == "Makefile":
        m = re.search(rf"^{re.escape(scope)}:.*\n((?:\t.*\n)+)", text, re.M)
        assert m, f"no target {scope} in the Makefile"
        return m[1]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == scope:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"{ref}: no function {scope} in {path}")


def _options(text: str) -> list[str]:
    return [t.split("=", 1)[0] for argv in _simple_commands(text) for t in argv if t.startswith("--")]


def run_by_problems(text: str, evidence: tuple[Evidence, ...]) -> list[str]:
    problems, python_sources = [], []
    for ref, needles in evidence:
        try:
            source = _source(ref)
        except (AssertionError, OSError) as exc:
            problems.append(f"{ref}: {exc}")
            continue
        problems += [f"{ref} does not hold {needle!r}" for needle in needles if needle not in source]
        if ref.split("::")[0].endswith(".py"):
            python_sources.append(source)
    if python_sources:  # the command's options, each passed by one of the tests' sources
        held = "".join(python_sources)
        problems += [f"no test passes {opt}" for opt in _options(text) if f'"{opt}"' not in held]
    return problems


def _additional_config_problems(text: str) -> list[str]:
    problems = []
    for argv in _simple_commands(text):
        for i, token in enumerate(argv[:-1]):
            if token == "--additional-config":
                try:
                    TraceOptions.model_validate(json.loads(argv[i + 1])["kv_trace"])
                except Exception as exc:
                    problems.append(f"--additional-config: {exc}")
    return problems


def _literal(node: ast.expr, names: dict[str, object]) -> object:
    """A literal's value, a module-level name's (a mapping: its keys), or None."""
    if isinstance(node, ast.Call) and node.args:  # tuple(LAYOUTS)
        node = node.args[0]
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys if isinstance(k, ast.Constant)]
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _declared_arguments(script: Path) -> tuple[set[str], dict[str, set[str]]]:
    """The options an argparse script declares, and the choices of each argument, as far as its
    source states them as literals (or module-level names bound to literals)."""
    tree = ast.parse(script.read_text())
    names = {
        node.targets[0].id: _literal(node.value, {})
        for node in tree.body
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }
    options, choices = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            declared = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            options |= {n for n in declared if n.startswith("-")}
            for kw in node.keywords:
                if kw.arg == "choices" and declared and (values := _literal(kw.value, names)) is not None:
                    choices[declared[0]] = {str(c) for c in values}
    return options, choices


def benchmark_problems(argv: list[str]) -> list[str]:
    script = ROOT / argv[0]
    if not script.exists():
        return [f"no script {argv[0]}"]
    options, choices = _declared_arguments(script)
    problems = []
    tokens = [t.strip("[]") for t in argv[1:]]
    for token, following in zip(tokens, [*tokens[1:], ""][: len(tokens)], strict=True):
        if token.startswith("--") and token.split("=")[0] not in options:
            problems.append(f"{argv[0]} declares no {token}")
        if token in choices and following and not following.startswith("-") and following not in choices[token]:
            problems.append(f"{argv[0]}: {token} has no choice {following!r}")
        if token.startswith("{"):  # one of the positional argument's choices, e.g. {batch,idle}
            named = set(token.strip("{}").split(","))
            known = set().union(*[c for n, c in choices.items() if not n.startswith("-")])
            problems += [f"{argv[0]}: no choice {c!r}" for c in sorted(named - known)]
    return problems


def _benchmark_argv(text: str) -> list[str] | None:
    for argv in _simple_commands(text):
        scripts = [t for t in argv if t.startswith("bench/") and t.endswith(".py")]
        if scripts and Path(argv[0]).name.startswith("python"):
            return argv[argv.index(scripts[0]) :]
    return None


def problems_of(command: str, complete: bool = True) -> list[str]:
    """What is wrong with a documented command; [] when it is held to what runs it."""
    problems = _additional_config_problems(command)
    argvs = _simple_commands(command)
    if argvs and all(_is_kvledger(argv) for argv in argvs):
        return problems + [p for argv in argvs if (p := kvledger_problem(argv, complete))]
    if command in RUN_BY:
        return problems + run_by_problems(command, RUN_BY[command])
    if command in RUN_HERE or command in NOT_RUN:
        return problems
    if (bench := _benchmark_argv(command)) is not None:
        if bench[0] not in BENCHMARKS:
            return [*problems, f"{bench[0]} is not among the benchmarks this test lists"]
        return problems + benchmark_problems(bench)
    return [*problems, "neither a kvledger command, nor run by a test or a demo, nor listed as not runnable here"]


def _all_commands() -> list[Command]:
    return shell_commands() + commands_outside_shell_blocks() + inline_kvledger_commands()


@pytest.mark.parametrize("command", _all_commands(), ids=lambda c: f"{c.page}:{c.line} {c.text}"[:72])
def test_each_documented_command_is_run_or_held_to_what_runs_it(command: Command) -> None:
    problems = problems_of(command.text, complete=not command.inline)
    assert not problems, f"{command}\n  " + "\n  ".join(problems)


def test_the_pages_show_commands_in_shell_blocks() -> None:
    """A command outside a `bash` block is one the demo's sample suggests, all `kvledger ...`."""
    outside = commands_outside_shell_blocks()
    assert outside, "the README's demo sample suggests its next commands"
    for command in outside:
        assert all(_is_kvledger(argv) for argv in _simple_commands(command.text)), command


def test_every_listed_command_is_still_shown() -> None:
    """The lists hold no command that no page shows any more (and every benchmark listed is shown)."""
    shown = {c.text for c in _all_commands()}
    stale = (set(RUN_BY) | RUN_HERE | set(NOT_RUN)) - shown
    assert not stale, sorted(stale)
    benchmarks = {bench[0] for c in shown if (bench := _benchmark_argv(c))}
    assert set(BENCHMARKS) == benchmarks, set(BENCHMARKS) ^ benchmarks


def test_the_commands_run_here_run(tmp_path: Path) -> None:
    for command in RUN_HERE:
        here = command.replace("/tmp/tiny", str(tmp_path / "tiny")).replace(".venv/bin/python", sys.executable)
        done = subprocess.run(["bash", "-c", here], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{command}\n{done.stderr}"
    from tests.e2e.engine_run import TINY_LLAMA

    assert json.loads((tmp_path / "tiny" / "config.json").read_text()) == TINY_LLAMA


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("kvledger check PATH... [--format text|json]", None),
        ("kvledger query PATH --req R [--step N]", None),
        ("kvledger check PATH --format xml", "'xml' is not one of"),
        ("kvledger check PATH [--format text|xml]", "not ['xml']"),
        ("kvledger query PATH --step N", "Missing option '--req'"),
        ("kvledger query PATH --req R --at-step 6", "No such option: --at-step"),
        ("kvledger stream --web-port 0", "0 is not in the range"),
        ("kvledger frobnicate PATH", "no such kvledger command"),
        ("kvledger violations --from-beginning yes", "unexpected extra argument"),
        ("infra/dev-stack restart", "neither a kvledger command"),
        ("make demo", None),
        ("python bench/replay_throughput.py --steps 10 --no-such-flag", "declares no --no-such-flag"),
        ("python bench/recorder_policy.py {batch,sometimes}", "no choice 'sometimes'"),
        ("python bench/engine_overhead.py [--layout double]", "--layout has no choice 'double'"),
        ("python bench/new_bench.py", "not among the benchmarks"),
        ("""vllm serve M --additional-config '{"kv_trace": {"enabled": true, "sink_url": "x"}}'""", "sink_url"),
    ],
)
def test_the_checks_catch_what_they_are_for(command: str, problem: str | None) -> None:
    found = "\n".join(problems_of(command))
    if problem is None:
        assert not found, found
    else:
        assert problem in found, found


def test_run_by_evidence_must_be_in_the_named_source() -> None:
    text = "infra/dev-stack down"
    assert run_by_problems(text, RUN_BY[text]) == []
    assert run_by_problems(text, ((_DEV_STACK_TEST, ('dev_stack("restart", env)',)),))
    assert run_by_problems(text, (("tests/e2e/test_dev_stack.py::no_such_test", ()),))
    server = next(c for c in RUN_BY if "/tmp/tiny" in c)
    assert run_by_problems(server + " --no-such-vllm-option 1", RUN_BY[server]) == [
        "no test passes --no-such-vllm-option"
    ]
