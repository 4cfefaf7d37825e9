"""The deployment files that name metrics (the alert rules and the Grafana dashboard), and the
JuiceFS mount script and units.

Every expression is checked against what the code exposes, collected from real edge and replica
registries (every labelled child exists from the start, so the samples name every metric and
every label value). A renamed metric, a mistyped label value or a label the code never sets fails
here instead of becoming an alert that can never fire or a panel that stays empty.

The JuiceFS mount script must give a replica host the flags the simulator gives every simulated
host (``fleet_sim.juicefs.mount.mount_argv``), so what the simulator measured is what a real
host runs; the two are compared here, and the script's refusals are exercised.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from edge.core.metrics import EdgeMetrics
from fleet_sim.juicefs.mount import ClientOptions, mount_argv
from replica.metrics import ReplicaMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "fleet-dashboard.json"
JUICEFS = ROOT / "deploy" / "juicefs"
MOUNT_SCRIPT = JUICEFS / "mount.sh"
MOUNT_UNIT = JUICEFS / "beyond-fleet-juicefs.service"
REPLICA_DROP_IN = JUICEFS / "beyond-fleet-replica.service.d" / "juicefs.conf"
ENV_EXAMPLE = JUICEFS / "juicefs.env.example"

# Labels the scraper adds; nothing else may appear in a grouping or a matcher unless the code
# sets it.
TARGET_LABELS = frozenset({"instance", "job"})
PROMQL_WORDS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "topk",
        "bottomk",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "rate",
        "irate",
        "increase",
        "delta",
        "deriv",
        "histogram_quantile",
        "clamp_min",
        "clamp_max",
        "abs",
        "label_values",
    }
)
SEVERITIES = frozenset({"critical", "warning", "info"})
DURATION = re.compile(r"^\d+[smhd]$")
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SELECTOR = re.compile(rf"({_NAME})\s*\{{([^}}]*)\}}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Grafana's variable query: label_values(METRIC, LABEL); the second argument is a label name.
_LABEL_VALUES = re.compile(rf"\blabel_values\(\s*({_NAME})\s*,\s*(\w+)\s*\)")
_IDENTIFIER = re.compile(rf"(?<![\w$.]){_NAME}")

Exposed = Mapping[str, Mapping[str, frozenset[str]]]


def exposed_metrics() -> dict[str, dict[str, frozenset[str]]]:
    """Sample name -> label -> every value the code exposes for it."""
    found: dict[str, dict[str, set[str]]] = {}
    for registry in (EdgeMetrics().registry, ReplicaMetrics().registry):
        for family in registry.collect():
            for sample in family.samples:
                labels = found.setdefault(sample.name, {})
                for name, value in sample.labels.items():
                    labels.setdefault(name, set()).add(value)
    return {
        name: {label: frozenset(values) for label, values in labels.items()}
        for name, labels in found.items()
    }


def problems(expr: str, exposed: Exposed) -> list[str]:
    """What in a PromQL expression does not match the exposed metrics (empty when all does)."""
    found: list[str] = []
    all_labels = {label for labels in exposed.values() for label in labels} | TARGET_LABELS
    for name, body in _SELECTOR.findall(expr):
        if name not in exposed:
            found.append(f"unknown metric {name}")
            continue
        for label, op, value in _MATCHER.findall(body):
            if label not in exposed[name] and label not in TARGET_LABELS:
                found.append(f"{name} has no label {label}")
            elif label in exposed[name] and "$" not in value and op in ("=", "=~"):
                wanted = value.split("|") if op == "=~" else [value]
                unknown = [v for v in wanted if v not in exposed[name][label]]
                if unknown:
                    found.append(f"{name}{{{label}}} never has {unknown}")
    for name, label in _LABEL_VALUES.findall(expr):
        if label not in exposed.get(name, {}) and label not in TARGET_LABELS:
            found.append(f"label_values of unknown label {name}{{{label}}}")
    for grouping in _GROUPING.findall(expr):
        for label in (part.strip() for part in grouping.split(",")):
            if label and label not in all_labels:
                found.append(f"grouping by unknown label {label}")
    # What is left once strings, matchers, ranges and groupings are gone must be a metric or a
    # PromQL word.
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)
    rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", rest)
    rest = _GROUPING.sub(" ", rest)
    rest = _LABEL_VALUES.sub(lambda m: f"label_values({m.group(1)})", rest)
    for word in _IDENTIFIER.findall(rest):
        if word not in exposed and word not in PROMQL_WORDS:
            found.append(f"unknown name {word}")
    return found


def base_names(exposed: Exposed) -> set[str]:
    """Metric names as a person writes them: histograms without their suffixes."""
    names = set()
    for name in exposed:
        if name.endswith("_created"):
            continue
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and f"{name.removesuffix(suffix)}_bucket" in exposed:
                name = name.removesuffix(suffix)
        names.add(name)
    return names


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_targets() -> Iterator[tuple[str, str]]:
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


@pytest.fixture(scope="module")
def exposed() -> dict[str, dict[str, frozenset[str]]]:
    return exposed_metrics()


def test_the_registries_expose_the_contract_names(exposed: Exposed) -> None:
    for name in (
        "agent_refusals_total",
        "agent_lock_wait_seconds_bucket",
        "agent_sessions_live",
        "agent_runs_in_flight",
        "agent_threads",
        "agent_ready_probe_seconds_bucket",
        "agent_sessions_superseded_total",
        "edge_requests_total",
        "edge_budget_exhaustions_total",
    ):
        assert name in exposed, name
    assert {"unavailable", "misdirected", "auth"} <= exposed["agent_refusals_total"]["reason"]


def test_the_checker_catches_each_kind_of_mistake(exposed: Exposed) -> None:
    good = 'sum by (instance) (rate(agent_refusals_total{reason="auth"}[5m])) > 0'
    assert problems(good, exposed) == []
    assert problems('agent_sessions_live{instance=~"$replica"}', exposed) == []
    assert problems("rate(agent_refusal_total[5m]) > 0", exposed) == [
        "unknown name agent_refusal_total"
    ]
    assert problems('agent_refusals_total{reason="unavaliable"}', exposed) == [
        "agent_refusals_total{reason} never has ['unavaliable']"
    ]
    assert problems('agent_sessions_live{tenant="acme"}', exposed) == [
        "agent_sessions_live has no label tenant"
    ]
    assert problems("sum by (shard) (agent_sessions_live)", exposed) == [
        "grouping by unknown label shard"
    ]
    assert problems('edge_requests_total{outcome=~"shed|dropped"}', exposed) == [
        "edge_requests_total{outcome} never has ['dropped']"
    ]
    assert problems("label_values(agent_sessions_live, instance)", exposed) == []
    assert problems("label_values(agent_sessions_live, tenant)", exposed) == [
        "label_values of unknown label agent_sessions_live{tenant}"
    ]


def test_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)) and len(names) >= 15
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert DURATION.match(str(rule.get("for", "0s"))), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]


def test_alert_expressions_use_only_what_the_code_exposes(exposed: Exposed) -> None:
    found = {rule["alert"]: problems(rule["expr"], exposed) for rule in alert_rules()}
    assert {name: p for name, p in found.items() if p} == {}


def test_every_signal_worth_alerting_on_has_an_alert() -> None:
    exprs = " ".join(rule["expr"] for rule in alert_rules())
    for name in (
        "agent_lock_wait_seconds_bucket",
        "agent_sessions_live",
        "agent_runs_in_flight",
        "agent_threads",
        "agent_ready_probe_seconds_bucket",
        "agent_sessions_superseded_total",
        "edge_budget_exhaustions_total",
        "edge_misdirected_total",
    ):
        assert re.search(rf"\b{name}\b", exprs), name
    for reason in ("unavailable", "misdirected", "auth", "capacity"):
        assert f'agent_refusals_total{{reason="{reason}"}}' in exprs, reason


def test_the_promtool_tests_load_these_rules() -> None:
    document = yaml.safe_load(ALERT_TESTS.read_text())
    assert document["rule_files"] == ["alerts.yml"]
    names = {rule["alert"] for rule in alert_rules()}
    tested = {case["alertname"] for test in document["tests"] for case in test["alert_rule_test"]}
    assert tested and tested <= names


def test_dashboard_is_a_grafana_dashboard() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    panels = board["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        covered = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] != "row":
            refs = [target["refId"] for target in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "replica", "edge"} <= variables


def test_dashboard_expressions_use_only_what_the_code_exposes(exposed: Exposed) -> None:
    found = [(title, problems(expr, exposed)) for title, expr in dashboard_targets()]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            found.append((variable["name"], problems(variable["definition"], exposed)))
    assert [(title, p) for title, p in found if p] == []


def test_dashboard_shows_every_metric_the_code_defines(exposed: Exposed) -> None:
    shown = " ".join(expr for _title, expr in dashboard_targets())
    missing = sorted(
        name for name in base_names(exposed) if not re.search(rf"\b{name}(_bucket)?\b", shown)
    )
    assert missing == []


def run_mount_script(
    tmp_path: Path,
    settings: str,
    *args: str,
    env_file: Path | None = None,
    environment: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``mount.sh ARGS`` with only these settings: a clean environment and its own env file."""
    if env_file is None:
        env_file = tmp_path / "juicefs.env"
        env_file.write_text(settings)
        env_file.chmod(0o600)
    env = {"PATH": os.environ["PATH"], "JFS_ENV_FILE": str(env_file), **(environment or {})}
    return subprocess.run(
        ["bash", str(MOUNT_SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


SIMULATOR_LIKE = """\
JFS_META_URL=redis://127.0.0.1:6379/1
JFS_MOUNTPOINT=/mnt/jfs
JFS_CACHE_DIR=/var/cache/jfs
JFS_CACHE_SIZE=256
JFS_HEARTBEAT=2s
JFS_METRICS=127.0.0.1:0
JFS_BIN=/opt/juicefs/bin/juicefs
"""
MINIMAL = "JFS_META_URL=redis://meta:6379/1\nJFS_BIN=/x/juicefs\n"


def test_the_mount_script_gives_a_host_the_simulators_flags(tmp_path: Path) -> None:
    done = run_mount_script(tmp_path, SIMULATOR_LIKE, "argv")
    assert done.returncode == 0, done.stderr
    expected = mount_argv(
        Path("/opt/juicefs/bin/juicefs"),
        "redis://127.0.0.1:6379/1",
        Path("/mnt/jfs"),
        Path("/var/cache/jfs"),
        ClientOptions(heartbeat_s=2.0, cache_size_mib=256),
    )
    assert done.stdout.splitlines() == expected


def test_the_mount_scripts_defaults_keep_the_design_flags(tmp_path: Path) -> None:
    done = run_mount_script(tmp_path, MINIMAL, "argv")
    assert done.returncode == 0, done.stderr
    argv = done.stdout.splitlines()

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    for cache in ("attr", "entry", "dir-entry", "negative-entry", "open"):
        assert value(f"--{cache}-cache") == "0", cache
    assert value("--heartbeat") == "2s"
    assert value("--metrics").startswith("127.0.0.1:")
    assert value("--backup-meta") == "0"
    assert {"--no-usage-report", "--no-agent", "--hide-internal"} <= set(argv)
    assert not [a for a in argv if a.startswith("--writeback") or a in ("-d", "--background")]
    assert argv[-2:] == ["redis://meta:6379/1", "/mnt/jfs"]


def test_the_sample_env_file_is_one_the_script_accepts(tmp_path: Path) -> None:
    done = run_mount_script(tmp_path, "", "argv", env_file=ENV_EXAMPLE)
    assert done.returncode == 0, done.stderr
    argv = done.stdout.splitlines()
    assert argv[-2:] == ["redis://jfs-meta.internal:6379/1?max-retry-backoff=500ms", "/mnt/jfs"]
    assert argv[argv.index("--heartbeat") + 1] == "2s"


def test_the_environment_wins_over_the_env_file_and_its_last_line_over_earlier_ones(
    tmp_path: Path,
) -> None:
    settings = f"{MINIMAL}JFS_HEARTBEAT=4s\nJFS_HEARTBEAT=5s\nJFS_MOUNTPOINT=/mnt/a\n"
    done = run_mount_script(tmp_path, settings, "argv", environment={"JFS_MOUNTPOINT": "/mnt/b"})
    assert done.returncode == 0, done.stderr
    argv = done.stdout.splitlines()
    assert argv[argv.index("--heartbeat") + 1] == "5s"
    assert argv[-1] == "/mnt/b"


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("JFS_META_URL=redis://:hunter2@meta:6379/1", "carries a password"),
        ("JFS_META_URL=postgres://jfs:hunter2@pg:5432/jfs", "carries a password"),
        ("JFS_EXTRA_ARGS=--writeback", "fsync must mean"),
        ("JFS_EXTRA_ARGS=--max-uploads 40 --upload-delay=10s", "fsync must mean"),
        ("JFS_EXTRA_ARGS=--no-bgjob", "frees a lost host's locks"),
        ("JFS_EXTRA_ARGS=-d", "foreground"),
        ("JFS_EXTRA_ARGS=--attr-cache=1", "set by this script"),
        ("JFS_METRICS=0.0.0.0:9567", "loopback"),
        ("JFS_HEARTBEAT=20s", "retry budget"),
        ("JFS_HEARTBEAT=0", "at least 1s"),
        ("JFS_HEARTBEAT=500ms", "at least 1s"),
        ("meta_password=hunter2", "upper-case KEY"),
        ("JFS_HEARTBEET=2s", "unknown setting JFS_HEARTBEET"),
    ],
)
def test_the_mount_script_refuses_what_the_design_rules_out(
    tmp_path: Path, setting: str, says: str
) -> None:
    done = run_mount_script(tmp_path, f"{MINIMAL}{setting}\n", "argv")
    assert done.returncode == 2, (setting, done.stdout)
    assert says in done.stderr, done.stderr
    assert "hunter2" not in done.stderr


def unit_settings(path: Path) -> dict[str, list[str]]:
    """Key -> every value it is given (systemd allows a key more than once)."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def test_the_mount_unit_runs_the_script_as_the_design_needs() -> None:
    unit = unit_settings(MOUNT_UNIT)
    assert unit["Type"] == ["simple"]
    assert unit["ExecStart"] == ["/usr/local/sbin/beyond-fleet-juicefs mount"]
    assert unit["ExecStartPost"] == ["/usr/local/sbin/beyond-fleet-juicefs wait"]
    assert unit["ExecStop"] == ["/usr/local/sbin/beyond-fleet-juicefs umount"]
    assert unit["EnvironmentFile"] == ["/etc/beyond-fleet/juicefs.env"]
    assert unit["KillMode"] == ["mixed"]
    assert unit["Restart"] == ["on-failure"]
    assert "network-online.target" in unit["After"] and "network-online.target" in unit["Wants"]
    assert unit["Before"] == ["beyond-fleet-replica.service"]
    # Any of these would hide the mount from the replica in a mount namespace of its own.
    for key in ("PrivateTmp", "PrivateMounts", "ProtectSystem", "ProtectHome", "MountFlags"):
        assert key not in unit, key
    drop_in = unit_settings(REPLICA_DROP_IN)
    assert drop_in["Requires"] == ["beyond-fleet-juicefs.service"]
    assert drop_in["After"] == ["beyond-fleet-juicefs.service"]
