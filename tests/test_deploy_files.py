"""The deployment files that name metrics: the alert rules and the Grafana dashboard.

Every expression is checked against what the code exposes, collected from real edge and replica
registries (every labelled child exists from the start, so the samples name every metric and
every label value). A renamed metric, a mistyped label value or a label the code never sets fails
here instead of becoming an alert that can never fire or a panel that stays empty.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from edge.metrics import EdgeMetrics
from replica.metrics import ReplicaMetrics

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "fleet-dashboard.json"

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
