"""The docker-compose dev stack, validated by the Compose CLI and kept in step with the project.

`docker compose config` parses, validates and normalises the file without a
Docker engine; `infra/install-compose-cli` installs the CLI where it is
missing. The checks below compare the normalised stack with what the rest of
the repository runs: the Kafka version and broker settings of
`infra/local-kafka`, the topic names, the worker command and image, and the
metrics the stream workers export.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from kvledger.producer.config import DEFAULT_TOPIC
from kvledger.stream_app.cli import stream
from kvledger.stream_app.worker.metrics import WorkerMetrics
from kvledger.stream_app.worker.topics import Topics

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE_FILE = INFRA / "docker-compose.yml"
DASHBOARD = INFRA / "compose" / "grafana" / "dashboards" / "kvledger.json"
PROMETHEUS_CONFIG = INFRA / "compose" / "prometheus" / "prometheus.yml"
PROMETHEUS_RULES = INFRA / "compose" / "prometheus" / "alerts.yml"
GRAFANA_PROVISIONING = INFRA / "compose" / "grafana" / "provisioning"
# The one description both the compose file and infra/dev-stack follow.
DESCRIPTION = tomllib.loads((INFRA / "stack.toml").read_text())

TOPICS = {"kvledger.events", "kvledger.violations", "kvledger.deadletter"}
WORKER_COMMAND = ["kvledger", "stream", "--bootstrap", "kafka:9092", "--web-port", "6066"]
# What the stream workers export on /metrics: name -> labels.
EXPORTED_METRICS = {
    "kvledger_events_total": {"engine"},
    "kvledger_violations_total": {"engine", "kind"},
    "kvledger_unchecked_total": {"reason"},
    "kvledger_consumer_lag": {"topic", "partition"},
    "kvledger_producer_dropped_events": {"engine", "rank"},
    "kvledger_ranks_out_of_sync": {"engine"},
    "kvledger_deadletter_total": {"reason"},
    "kvledger_engines": set(),
    "kvledger_engines_retired_total": {"reason"},
}
# Broker settings that differ by design between a loopback process and a container.
LOCAL_ONLY_SETTINGS = {
    "listeners",
    "advertised.listeners",
    "controller.quorum.bootstrap.servers",  # the image formats a static quorum: controller.quorum.voters
    "listener.security.protocol.map",  # checked as a subset below
    "log.dirs",
}


def _compose_cli() -> list[str]:
    for cli in (["docker", "compose"], ["docker-compose"]):
        if not shutil.which(cli[0]):
            continue
        out = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True, timeout=60)
        major = re.match(r"v?(\d+)\.", out.stdout.strip())
        if out.returncode == 0 and major and int(major[1]) >= 2:
            return cli
    pytest.fail("no Docker Compose CLI (v2 or later) found: run infra/install-compose-cli")


def _stack_variables() -> set[str]:
    return set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))


def _compose_config(**env: str) -> dict:
    """The stack as the Compose CLI normalises it, with defaults unless `env` sets a variable."""
    clean = {k: v for k, v in os.environ.items() if k not in _stack_variables() and not k.startswith("COMPOSE_")}
    result = subprocess.run(
        [*_compose_cli(), "-f", str(COMPOSE_FILE), "--env-file", os.devnull, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )
    assert result.returncode == 0, f"docker compose config rejected {COMPOSE_FILE.name}:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def stack() -> dict:
    return _compose_config()


def _workers(stack: dict) -> dict[str, dict]:
    return {name: svc for name, svc in stack["services"].items() if svc.get("command") == WORKER_COMMAND}


def _local_kafka_source() -> str:
    return (INFRA / "local-kafka").read_text()


def _local_kafka_settings() -> dict[str, str]:
    block = re.search(r'SERVER_PROPERTIES = """\\\n(.*?)"""', _local_kafka_source(), re.S)
    assert block, "SERVER_PROPERTIES not found in infra/local-kafka"
    lines = [ln for ln in block[1].splitlines() if ln.strip() and not ln.startswith("#")]
    return dict(ln.split("=", 1) for ln in lines)


def _kafka_env_name(setting: str) -> str:
    # The apache/kafka image maps KAFKA_FOO_BAR to foo.bar.
    return "KAFKA_" + setting.upper().replace(".", "_")


def _listeners(value: str) -> dict[str, str]:
    return dict(item.split("://", 1) for item in value.split(","))


def _published(service: dict, target: int) -> int:
    ports = [int(p["published"]) for p in service.get("ports", []) if p["target"] == target]
    assert len(ports) == 1, f"expected one published port for {target}: {service.get('ports')}"
    return ports[0]


def _mount(service: dict, source: Path) -> str:
    targets = [v["target"] for v in service.get("volumes", []) if v["type"] == "bind" and Path(v["source"]) == source]
    assert targets, f"{source.relative_to(ROOT)} is not mounted"
    return targets[0]


def _yaml_values(path: Path, key: str) -> list[str]:
    """Values of `key: value` lines in a small YAML file (no YAML parser in the dev extras)."""
    return [m.strip().strip("'\"") for m in re.findall(rf"^\s*-?\s*{key}:\s*(.+?)\s*$", path.read_text(), re.M)]


def test_the_compose_cli_accepts_the_stack(stack):
    assert stack["name"] == "kvledger"
    assert set(stack["services"]) == {
        "kafka",
        "schema-registry",
        "worker-1",
        "worker-2",
        "prometheus",
        "grafana",
    }


def test_published_ports_listen_on_loopback_only(stack):
    ports = [(name, p) for name, svc in stack["services"].items() for p in svc.get("ports", [])]
    assert ports
    for name, port in ports:
        assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond 127.0.0.1"


def test_kafka_is_the_version_local_kafka_runs_in_kraft_mode(stack):
    version = re.search(r'^KAFKA_VERSION = "([^"]+)"', _local_kafka_source(), re.M)[1]
    pom = re.search(r"<kafka.version>([^<]+)</kafka.version>", (INFRA / "kafka" / "pom.xml").read_text())[1]
    assert version == pom
    kafka = stack["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{version}"

    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert not any("ZOOKEEPER" in k for k in env)
    voters = env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
    assert voters == f"{env['KAFKA_NODE_ID']}@kafka:{_listeners(env['KAFKA_LISTENERS'])['CONTROLLER'].split(':')[-1]}"
    # The cluster id is the base64 form of a UUID, as `kafka-storage format` wants it.
    cluster_id = env["CLUSTER_ID"]
    try:
        raw = base64.urlsafe_b64decode(cluster_id + "==")
    except binascii.Error:
        raw = b""
    assert len(cluster_id) == 22 and len(raw) == 16 and not cluster_id.startswith("-"), cluster_id


def test_kafka_settings_match_local_kafka(stack):
    env = stack["services"]["kafka"]["environment"]
    local = _local_kafka_settings()
    assert "process.roles" in local
    for setting, value in local.items():
        if setting in LOCAL_ONLY_SETTINGS:
            continue
        found = env.get(_kafka_env_name(setting))
        assert found == value, f"{setting}: infra/local-kafka has {value!r}, the stack {found!r}"
    local_map = set(local["listener.security.protocol.map"].split(","))
    assert local_map <= set(env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))


def test_kafka_listeners_serve_the_workers_and_the_host():
    for port in (None, "19094"):
        stack = _compose_config(**({"KVLEDGER_KAFKA_PORT": port} if port else {}))
        kafka = stack["services"]["kafka"]
        advertised = _listeners(kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"])
        # Containers of the stack: the workers' --bootstrap.
        bootstrap = WORKER_COMMAND[WORKER_COMMAND.index("--bootstrap") + 1]
        assert advertised["PLAINTEXT"] == bootstrap
        assert kafka["hostname"] == bootstrap.split(":")[0]
        # Engines on the host: the advertised address is the published one.
        host, host_port = advertised["HOST"].rsplit(":", 1)
        container_port = int(_listeners(kafka["environment"]["KAFKA_LISTENERS"])["HOST"].rsplit(":", 1)[1])
        assert host == "127.0.0.1"
        assert int(host_port) == _published(kafka, container_port) == int(port or 9094)


def test_the_readme_points_engines_at_the_published_listener(stack):
    readme = (INFRA / "compose" / "README.md").read_text()
    advertised = _listeners(stack["services"]["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"])
    port = int(advertised["HOST"].rsplit(":", 1)[1])
    sinks = re.findall(r"kafka://([\w.-]+):(\d+)", readme)
    assert ("127.0.0.1", str(port)) in sinks
    assert all(int(p) == port for h, p in sinks if h == "127.0.0.1"), sinks
    assert '"kv_role": "kv_producer"' in readme and '"kv_role": "kv_consumer"' in readme


def test_the_workers_make_the_project_topics(stack):
    # The workers create their topics (`ensure_topics`) under the default prefix.
    topics = Topics()
    assert {topics.events, topics.violations, topics.deadletter} == TOPICS
    assert topics.events == DEFAULT_TOPIC  # where engines' Kafka sinks write by default
    assert "--topic-prefix" not in WORKER_COMMAND
    # Every kvledger topic the stack or its README names is one of the workers'.
    names = {topics.events, topics.violations, topics.deadletter, topics.transfers}
    readme = (INFRA / "compose" / "README.md").read_text()
    for text in (COMPOSE_FILE.read_text(), readme):
        assert set(re.findall(r"\bkvledger\.(?!json\b|ya?ml\b)[a-z]+", text)) <= names
    assert all(f"`{t}`" in readme for t in TOPICS)


def test_the_workers_serve_metrics_beyond_the_container(stack):
    """The app binds its web server to loopback; Faust lets WEB_BIND override that, so
    Prometheus and the published port reach it. Checked on the worker's real app object."""
    env = _workers(stack)["worker-1"]["environment"]
    web_port = int(WORKER_COMMAND[WORKER_COMMAND.index("--web-port") + 1])
    code = textwrap.dedent(f"""
        from kvledger.stream_app.worker.app import StreamWorker, WorkerSettings
        conf = StreamWorker(WorkerSettings(bootstrap="kafka:9092", web_port={web_port}, store="memory")).app.conf
        print(conf.web_bind, conf.web_port)
    """)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WEB_")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**clean, **env}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0.0.0.0", str(web_port)]


def test_each_worker_advertises_a_url_the_other_worker_reaches(stack):
    """Workers find each other's status views through the URL each one's group membership carries
    (Faust's canonical_url, which NODE_CANONICAL_URL sets): its own service name and its container's
    web port, one per worker. Checked on the worker's real app object."""
    web_port = int(WORKER_COMMAND[WORKER_COMMAND.index("--web-port") + 1])
    code = textwrap.dedent(f"""
        from kvledger.stream_app.worker.app import StreamWorker, WorkerSettings
        worker = StreamWorker(WorkerSettings(bootstrap="kafka:9092", web_port={web_port}, store="memory"))
        print(worker.app.conf.canonical_url)
    """)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WEB_", "NODE_"))}
    urls = {}
    for name, worker in _workers(stack).items():
        env = {**clean, **worker["environment"]}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        urls[name] = result.stdout.strip()
        assert urls[name] == f"http://{worker['hostname']}:{web_port}", name
    assert len(set(urls.values())) == len(urls) == 2


def test_two_workers_run_kvledger_stream_from_the_project_image(stack):
    workers = _workers(stack)
    assert set(workers) == {"worker-1", "worker-2"}
    for name, worker in workers.items():
        assert Path(worker["build"]["context"]) == ROOT, name
        assert worker["build"]["dockerfile"] == "infra/Dockerfile", name
        assert worker["depends_on"]["kafka"]["condition"] == "service_healthy"

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["kvledger"] == "kvledger.stream_app.cli:main"
    dockerfile = (INFRA / "Dockerfile").read_text()
    cmd = re.findall(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd and json.loads(cmd[-1]) == WORKER_COMMAND
    # The image is built from every source folder the package maps, with the stream extra.
    copied = set(re.findall(r"^COPY (\w+)/ ", dockerfile, re.M))
    assert copied == set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert "pip install '.[stream]'" in dockerfile and "stream" in pyproject["project"]["optional-dependencies"]
    # Worker state survives restarts: the default --state-dir is relative, in the image's
    # working directory, where each worker has a volume.
    (state_dir,) = [p.default for p in stream.params if p.name == "state_dir"]
    assert not Path(state_dir).is_absolute()
    workdir = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.M)[-1]
    for worker in workers.values():
        assert [v["target"] for v in worker["volumes"] if v["type"] == "volume"] == [workdir]


def test_prometheus_scrapes_every_workers_metrics(stack):
    prometheus = stack["services"]["prometheus"]
    assert _mount(prometheus, PROMETHEUS_CONFIG) == "/etc/prometheus/prometheus.yml"
    # The rules are loaded from beside the configuration, as promtool tests them.
    assert _mount(prometheus, PROMETHEUS_RULES) == f"/etc/prometheus/{PROMETHEUS_RULES.name}"
    assert re.findall(r"^rule_files:\n((?:\s+- .+\n)+)", PROMETHEUS_CONFIG.read_text(), re.M) == [
        f"  - {PROMETHEUS_RULES.name}\n"
    ]
    assert _yaml_values(PROMETHEUS_CONFIG, "metrics_path") == ["/metrics"]
    targets = [t for v in _yaml_values(PROMETHEUS_CONFIG, "targets") for t in json.loads(v)]
    web_port = WORKER_COMMAND[WORKER_COMMAND.index("--web-port") + 1]
    assert sorted(targets) == sorted(f"{name}:{web_port}" for name in _workers(stack))


def test_the_compose_file_follows_the_dev_stack_description(stack):
    """infra/dev-stack runs infra/stack.toml as processes; the compose file must be that same stack."""
    services = stack["services"]
    kafka, registry, prometheus = (DESCRIPTION[k] for k in ("kafka", "schema_registry", "prometheus"))
    assert _published(services[kafka["service"]], 9094) == kafka["port"]
    assert _published(services[registry["service"]], 8081) == registry["port"]
    assert _published(services[prometheus["service"]], 9090) == prometheus["port"]
    workers = DESCRIPTION["workers"]
    assert set(_workers(stack)) == set(workers["ports"])
    assert [*workers["command"], "--bootstrap", "kafka:9092", "--web-port", "6066"] == WORKER_COMMAND
    for name, port in workers["ports"].items():
        assert _published(services[name], 6066) == port
    assert _yaml_values(PROMETHEUS_CONFIG, "job_name") == [prometheus["job"]]
    assert _yaml_values(PROMETHEUS_CONFIG, "scrape_interval") == [prometheus["scrape_interval"]]
    assert _yaml_values(PROMETHEUS_CONFIG, "evaluation_interval") == [prometheus["evaluation_interval"]]
    assert INFRA / prometheus["rules"] == PROMETHEUS_RULES


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(stack):
    grafana = stack["services"]["grafana"]
    assert _mount(grafana, GRAFANA_PROVISIONING) == "/etc/grafana/provisioning"
    dashboards_dir = _mount(grafana, DASHBOARD.parent)

    datasource = GRAFANA_PROVISIONING / "datasources" / "prometheus.yml"
    prometheus_port = stack["services"]["prometheus"]["ports"][0]["target"]
    assert _yaml_values(datasource, "url") == [f"http://prometheus:{prometheus_port}"]
    assert _yaml_values(datasource, "type") == ["prometheus"]
    (uid,) = _yaml_values(datasource, "uid")

    provider = GRAFANA_PROVISIONING / "dashboards" / "kvledger.yml"
    assert _yaml_values(provider, "path") == [dashboards_dir]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"

    dashboard = json.loads(DASHBOARD.read_text())
    sources = [p["datasource"] for p in dashboard["panels"]]
    sources += [t["datasource"] for p in dashboard["panels"] for t in p["targets"]]
    sources += [v["datasource"] for v in dashboard["templating"]["list"]]
    assert sources and all(s == {"type": "prometheus", "uid": uid} for s in sources)


# PromQL words that are not metric names.
_PROMQL_GROUPING = ("by", "without", "on", "ignoring", "group_left", "group_right")
_PROMQL_WORDS = {*_PROMQL_GROUPING, "bool", "and", "or", "unless", "offset"}


def _promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) that a PromQL expression refers to."""
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    grouping = rf"\b(?:{'|'.join(_PROMQL_GROUPING)})\s*\(([^)]*)\)"
    for names in re.findall(grouping, expr):
        labels |= {x.strip() for x in names.split(",") if x.strip()}
    expr = re.sub(grouping, " ", expr)
    idents = re.findall(r"(?<![\w$.])([a-zA-Z_:][\w:]*)\b(?!\s*\()", expr)
    return {i for i in idents if i not in _PROMQL_WORDS}, labels


def _dashboard_queries() -> list[tuple[str, set[str], set[str]]]:
    """(query, metrics, labels) for every panel target and template variable of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            metrics, labels = _promql_names(target["expr"])
            labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            queries.append((target["expr"], metrics, labels))
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]["query"]
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert m, f"unexpected variable query {query!r}"
        queries.append((query, {m[1]}, {m[2]}))
    return queries


def test_the_promql_reader_finds_names():
    metrics, labels = _promql_names('sum by (engine, rank) (rate(kvledger_events_total{engine=~"$engine"}[$__range]))')
    assert (metrics, labels) == ({"kvledger_events_total"}, {"engine", "rank"})
    metrics, _ = _promql_names("max(up) + on(job) kvledger_consumer_lag > 0")
    assert metrics == {"up", "kvledger_consumer_lag"}


def test_the_workers_export_these_metrics():
    metrics = WorkerMetrics()
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*("x" for _ in metric._labelnames))  # one sample per metric, to see its labels
    exported = {}
    for line in metrics.exposition().decode().splitlines():
        if (m := re.match(r"(kvledger_\w+)(?:\{([^}]*)\})? ", line)) and not m[1].endswith("_created"):
            exported[m[1]] = set(re.findall(r"(\w+)=", m[2] or ""))
    assert exported == EXPORTED_METRICS


def test_the_dashboard_queries_only_metrics_the_workers_export():
    queries = _dashboard_queries()
    assert queries
    for query, metrics, labels in queries:
        assert metrics, f"no metric in {query!r}"
        unknown = metrics - set(EXPORTED_METRICS)
        assert not unknown, f"{query!r} queries {unknown}, which the workers do not export"
        known_labels = set().union(*(EXPORTED_METRICS[m] for m in metrics))
        assert labels <= known_labels, f"{query!r} uses labels {labels - known_labels} its metrics do not have"


def test_the_dashboard_shows_violations_throughput_lag_and_drops():
    dashboard = json.loads(DASHBOARD.read_text())
    shown = {(m, frozenset(re.findall(r"\bby \(([^)]*)\)", q))) for q, ms, _ in _dashboard_queries() for m in ms}
    for metric, grouping in [
        ("kvledger_violations_total", "kind"),
        ("kvledger_violations_total", "engine"),
        ("kvledger_events_total", "engine"),
        ("kvledger_consumer_lag", "topic, partition"),
        ("kvledger_producer_dropped_events", "engine, rank"),
    ]:
        assert (metric, frozenset({grouping})) in shown, f"no panel shows {metric} by ({grouping})"
    assert any("rate(kvledger_events_total" in t["expr"] for p in dashboard["panels"] for t in p["targets"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
