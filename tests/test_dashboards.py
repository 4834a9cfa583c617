"""The chart's Grafana dashboard and PrometheusRule, against the metrics the code really exports.

Metric names come from the code twice: imported (the sidecar's registry and collector, the
operator's module-level metrics, as prometheus_client exports them) and parsed (the label names,
which a labelled counter shows only after its first increment); the two must agree. Every query
of the dashboard and every rule's expression may name only those metrics and their labels. PromQL
syntax and the rules' behaviour are checked by the real promtool (`make tools` unpacks it from
Debian's prometheus package): `promtool check rules`, and `promtool test rules` on series that
open incidents, wait for approval, fill a spool, hold the storm guard.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import prometheus_client
import pytest
import yaml
from prometheus_client import CollectorRegistry

import sdcguard_operator.metrics as operator_metrics
from sdcguard.sidecar import metrics as sidecar_metrics

from test_chart import CHART, EVERYWHERE, K8S_VERSION, by_kind, helm, render

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = CHART / "dashboards" / "sdcguard.json"
PROMTOOL = shutil.which("promtool") or str(ROOT / ".venv" / "bin" / "promtool")
METRICS_SOURCES = [ROOT / "agent" / "sidecar" / "metrics.py", ROOT / "operator" / "metrics.py"]
ON = [*EVERYWHERE, "--set", "dashboards.enabled=true,alerts.enabled=true"]

# Labels Prometheus adds when it scrapes (PodMonitor / ServiceMonitor target labels).
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "instance", "job", "service"}
# Rule metrics the code does not export yet (the alert is written against the proposed name).
PROPOSED: dict[str, set[str]] = {}  # metrics a rule may name before the code exports them (none now)

pytestmark = pytest.mark.timeout(120)


# --- what the code exports -------------------------------------------------------------------

def _registered_families() -> Iterator[Any]:
    registry = CollectorRegistry()
    sidecar_metrics.PublisherMetrics(registry)
    registry.register(sidecar_metrics.RankStatsCollector(Path("/nonexistent-spool")))
    yield from registry.collect()
    for metric in vars(operator_metrics).values():
        if isinstance(metric, prometheus_client.metrics.MetricWrapperBase):
            yield from metric.collect()


def exported_names() -> set[str]:
    """Sample names as scraped: a counter family ``x`` is exported as ``x_total``."""
    names = set()
    for family in _registered_families():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
        names.update(s.name for s in family.samples)
    return names


def parsed_labels() -> dict[str, set[str]]:
    """Label names of each metric, read from the calls that define them in the metrics modules."""
    kinds = {"Counter", "Gauge", "CounterMetricFamily", "GaugeMetricFamily", "Histogram", "Summary"}
    found: dict[str, set[str]] = {}
    for source in METRICS_SOURCES:
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func not in kinds or not node.args or not isinstance(node.args[0], ast.Constant):
                continue
            labels_node = node.args[2] if len(node.args) > 2 else next(
                (k.value for k in node.keywords if k.arg in ("labels", "labelnames")), None)
            labels = set(ast.literal_eval(labels_node)) if labels_node is not None else set()
            name = node.args[0].value
            if func.startswith("Counter"):
                name = name.removesuffix("_total") + "_total"
            found[name] = labels
    return found


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    labels = parsed_labels()
    names = exported_names()
    assert set(labels) == {n for n in names if not n.endswith("_created")}, "parser and registries disagree"
    return labels


def rejection_reasons() -> set[str]:
    text = "".join(p.read_text() for p in (ROOT / "operator").glob("*.py"))
    return set(re.findall(r'Rejected\(\s*"(\w+)"', text))


def replacement_phases() -> set[str]:
    return set(re.findall(r'_phase\(body, "(\w+)"', (ROOT / "operator" / "replacement.py").read_text()))


# --- PromQL: the metric names, label matchers and grouping labels of an expression ----------

_TOKEN = re.compile(r'''(?P<str>"(?:[^"\\]|\\.)*")|(?P<range>\[[^\]]*\])|(?P<dur>\d+(?:ms|[smhdwy])\b)'''
                    r'''|(?P<num>\d+(?:\.\d+)?)|(?P<id>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<sel>\{[^}]*\})|(?P<other>\S)''')
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "offset", "bool", *_GROUPING,  # and the aggregations, before by / without:
             "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
             "count_values"}


def selectors(expr: str) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], set[str]]:
    """([(metric, [(label, op, value)])], grouping labels) of a PromQL expression."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    found, grouping = [], set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else (None, "")
        if kind == "id" and text in _GROUPING and following[1] == "(":
            close = next(j for j in range(i + 2, len(tokens)) if tokens[j][1] == ")")
            grouping.update(t for k, t in tokens[i + 2:close] if k == "id")
            i = close + 1
            continue
        if kind == "id" and text not in _KEYWORDS and following[1] != "(":
            matchers = []
            if following[0] == "sel":
                body = following[1][1:-1]
                matchers = _MATCHER.findall(body)
                assert _MATCHER.sub("", body).strip() == "", f"unparsed matchers {body!r} in {expr!r}"
            found.append((text, matchers))
        assert kind != "sel" or tokens[i - 1][0] == "id", f"a selector without a metric name in {expr!r}"
        i += 1
    return found, grouping


def test_the_promql_reader_finds_metrics_matchers_and_grouping_labels() -> None:
    found, grouping = selectors('sum by (reason) (increase(a_total{reason=~"X|Y", ns="$namespace"}[5m])) > 0 '
                                'or sum without (pod) (b unless b offset 15m) / on (job) group_left c')
    assert found == [("a_total", [("reason", "=~", "X|Y"), ("ns", "=", "$namespace")]), ("b", []), ("b", []),
                     ("c", [])]
    assert grouping == {"reason", "pod", "job"}


def check_expression(expr: str, known: dict[str, set[str]], where: str) -> set[str]:
    """Assert that ``expr`` names only known metrics, labels they carry and real reason / phase values."""
    found, grouping = selectors(expr)
    assert found, f"{where}: no metric in {expr!r}"
    reasons, phases = rejection_reasons(), replacement_phases()
    for metric, matchers in found:
        assert metric in known, f"{where}: {metric} is not exported by the sidecar or the operator"
        for label, op, value in matchers:
            assert label in known[metric] | TARGET_LABELS, f"{where}: {metric} has no label {label!r}"
            if label in ("reason", "phase") and metric in ("sdcguard_alarms_rejected_total",
                                                           "sdcguard_replacements_total"):
                values = set(value.split("|")) if "~" in op else {value}
                assert values <= (reasons if label == "reason" else phases), f"{where}: unknown {label} {value!r}"
    carried = set().union(*(known[m] for m, _ in found)) | TARGET_LABELS
    assert grouping <= carried, f"{where}: grouping by {grouping - carried} that no metric of {expr!r} carries"
    return {m for m, _ in found}


# --- the dashboard ---------------------------------------------------------------------------

def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert inner, f"variable {variable['name']}: {query!r}"
            yield f"variable {variable['name']}", inner.group(1)


def as_promql(expr: str) -> str:
    """Grafana's variables replaced by what Grafana would send."""
    for var, value in (("$__rate_interval", "2m"), ("$__range", "6h"), ("$__interval", "1m")):
        expr = expr.replace(var, value)
    return expr.replace('"$namespace"', '".*"')


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_dashboard_query_names_only_exported_metrics_and_their_labels(dashboard: dict[str, Any],
                                                                              exported: dict[str, set[str]]) -> None:
    used = set()
    for where, expr in dashboard_queries(dashboard):
        used |= check_expression(as_promql(expr), exported, where)
    # The views the dashboard promises: checks and their time, alarms by check, suspects, replacements,
    # spool backlog, AWS errors, rejections (signatures among them), storm guard holds.
    assert {"sdcguard_checks_total", "sdcguard_check_seconds_total", "sdcguard_steps_total",
            "sdcguard_sidecar_alarms_published_total", "sdcguard_incidents_total", "sdcguard_suspect_nodes",
            "sdcguard_replacements_total", "sdcguard_sidecar_spool_backlog", "sdcguard_aws_call_errors_total",
            "sdcguard_alarms_rejected_total", "sdcguard_storm_guard_holds_total"} <= used
    # The cost of a checked run (issue 34): the measured premium by kind, step times, the audit
    # interval, the rollback waste and the false-positive investigations.
    assert {"sdcguard_check_premium_ratio", "sdcguard_check_premium_seconds", "sdcguard_step_time_seconds",
            "sdcguard_checked_step_seconds", "sdcguard_audit_interval", "sdcguard_rollback_gpu_seconds_total",
            "sdcguard_false_positive_investigations_total"} <= used
    # The one metric left off: a Unix time where 0 means "never" makes a misleading panel.
    unused = set(exported) - used - {"sdcguard_sidecar_last_publish_timestamp_seconds"}
    assert not unused, f"exported but on no panel: {sorted(unused)}"


def test_dashboard_queries_are_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    rules = [{"record": f"sdcguard:dashboard_query_{i}", "expr": as_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_queries(dashboard))]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_counts_include_the_first_increment_of_a_new_series(dashboard: dict[str, Any],
                                                                     tmp_path: Path) -> None:
    """A phase's counter born in the range counts from 0, an older one by its increase (promtool)."""
    [query] = [t["expr"] for p in dashboard["panels"] if p["title"] == "Replacements, by phase" for t in p["targets"]]
    expr = query.replace("$__range", "30m")
    (tmp_path / "empty-rules.yaml").write_text("groups: []\n")
    tests = {"rule_files": ["empty-rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": 'sdcguard_replacements_total{phase="HealthCheck"}', "values": "1x20 3x30"},
                         {"series": 'sdcguard_replacements_total{phase="Replaced"}', "values": "_x15 1x5 2x30"}],
        "promql_expr_test": [{"expr": expr, "eval_time": "40m", "exp_samples": [
            {"labels": '{phase="HealthCheck"}', "value": 2}, {"labels": '{phase="Replaced"}', "value": 2}]}]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cost_of_checking_adds_the_premium_and_the_rollbacks_in_gpu_hours(dashboard: dict[str, Any],
                                                                              tmp_path: Path) -> None:
    """Two ranks' premium (gauges, seconds so far) plus an incident's rollback counted in the range
    (a counter born in it counts from 0), in GPU-hours; and with no incident the premium alone (promtool)."""
    [query] = [t["expr"] for p in dashboard["panels"] if p["title"] == "Cost of checking, GPU-hours"
               for t in p["targets"]]
    expr = as_promql(query).replace("6h", "30m")
    (tmp_path / "empty-rules.yaml").write_text("groups: []\n")
    premium = [{"series": f'sdcguard_check_premium_seconds{{namespace="ml",pod="w-{r}",rank="{r}",kind="audit"}}',
                "values": "0+45x40"} for r in (0, 1)]  # 45 s a minute each: 1800 s each at 40m
    waste = [{"series": 'sdcguard_rollback_gpu_seconds_total{check="replay"}', "values": "_x20 9000x20"}]
    tests = {"rule_files": ["empty-rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": premium + waste,
         "promql_expr_test": [{"expr": expr, "eval_time": "40m", "exp_samples": [{"labels": "{}", "value": 3.5}]}]},
        {"interval": "1m", "input_series": premium,
         "promql_expr_test": [{"expr": expr, "eval_time": "40m", "exp_samples": [{"labels": "{}", "value": 1.0}]}]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_layout_and_data_source(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "sdcguard" and dashboard["templating"]["list"][0]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        if panel["type"] != "row":
            # No fixed data source: the dashboard works in any Grafana, on the one picked in $datasource.
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
            assert panel["description"], panel["title"]


# --- the alerting rules ----------------------------------------------------------------------

def rendered_rules(*args: str) -> dict[str, Any]:
    [rule] = by_kind(render([*ON, *args]), "PrometheusRule")
    return rule


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "sdcguard-rules.yaml"
    path.write_text(yaml.safe_dump(rendered_rules("--set", "alerts.ruleLabels.team=ml")["spec"], sort_keys=False))
    return path


def alerts(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_rules_pass_promtool_check(rules_file: Path) -> None:
    done = subprocess.run([PROMTOOL, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 9 rules found" in done.stdout


def test_rule_expressions_name_exported_metrics(exported: dict[str, set[str]]) -> None:
    known = {**exported, **PROPOSED}
    used = set()
    for name, rule in alerts(rendered_rules()).items():
        used |= check_expression(rule["expr"], known, name)
        assert rule["labels"]["severity"] in ("critical", "warning") and rule["annotations"]["summary"], name
    assert used - set(exported) <= set(PROPOSED)


def test_rule_settings_reach_the_rules() -> None:
    rule = rendered_rules("--set", "alerts.pendingApprovalMinutes=5,alerts.spoolBacklogMinutes=3",
                          "--set", "alerts.labels.release=kube-prometheus-stack,alerts.ruleLabels.team=ml")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    by_name = alerts(rule)
    assert set(by_name) == {"SdcguardAlarmRaised", "SdcguardIncidentOpened", "SdcguardReplacementPendingApproval",
                            "SdcguardSpoolBacklogGrowing", "SdcguardAwsCallErrors", "SdcguardStormGuardHolding",
                            "SdcguardAlarmSignatureRejected", "SdcguardAlarmsRejected", "SdcguardAlarmEventNameTaken"}
    assert by_name["SdcguardReplacementPendingApproval"]["expr"].endswith("> 300")
    assert by_name["SdcguardSpoolBacklogGrowing"]["for"] == "3m"
    assert all(r["labels"]["team"] == "ml" for r in by_name.values())


SEVERITY = {"SdcguardAlarmRaised": "critical", "SdcguardIncidentOpened": "critical",
            "SdcguardReplacementPendingApproval": "warning", "SdcguardSpoolBacklogGrowing": "warning",
            "SdcguardAwsCallErrors": "warning", "SdcguardStormGuardHolding": "critical",
            "SdcguardAlarmSignatureRejected": "critical", "SdcguardAlarmsRejected": "warning",
            "SdcguardAlarmEventNameTaken": "critical"}
POD = {"namespace": "ml", "pod": "gpt-worker-1"}


def unit_tests(descriptions: dict[str, str]) -> list[dict[str, Any]]:
    """promtool unit tests: (input series, [(minute, alert, expected alerts)]) at a 1-minute scrape.
    ``descriptions``: each alert's description as rendered (only one of them names series labels)."""

    def _expect(alert: str, labels: dict[str, str], summary: str, description: str | None = None) -> dict[str, Any]:
        return {"exp_labels": {"severity": SEVERITY[alert], "team": "ml", **labels},
                "exp_annotations": {"summary": summary, "description": description or descriptions[alert]}}

    cases = [
        # A labelled counter appears at its first increment: increase() alone would never fire.
        ([('sdcguard_incidents_total{check="weights"}', "_x5 1x40")],
         [(4, "SdcguardIncidentOpened", []),
          (10, "SdcguardIncidentOpened", [_expect("SdcguardIncidentOpened", {"check": "weights"},
                                                  "The sdcguard operator opened an SDCIncident (check weights)")]),
          (25, "SdcguardIncidentOpened", [])]),
        ([('sdcguard_alarms_total{namespace="ml",pod="gpt-worker-1",rank="3"}', "0x10 1x20"),
          ('sdcguard_alarms_total{namespace="ml",pod="gpt-worker-1",rank="2"}', "0x30")],
         [(9, "SdcguardAlarmRaised", []),
          (12, "SdcguardAlarmRaised", [_expect("SdcguardAlarmRaised", POD, "Training ranks of pod ml/gpt-worker-1 "
                                               "raised a silent-data-corruption alarm")])]),
        ([('sdcguard_replacement_pending_approval_timestamp_seconds{nodereplacement="hyperpod-i-0abc",'
           'node="hyperpod-i-0abc"}', "120x60")],
         [(31, "SdcguardReplacementPendingApproval", []),
          (33, "SdcguardReplacementPendingApproval", [_expect(
              "SdcguardReplacementPendingApproval", {"nodereplacement": "hyperpod-i-0abc", "node": "hyperpod-i-0abc"},
              "NodeReplacement hyperpod-i-0abc has waited for a decision for 31m 0s",
              "Node hyperpod-i-0abc stays cordoned until a person decides: kubectl sdcguard approve (or deny) "
              "hyperpod-i-0abc.")])]),
        # A stuck record fires after spoolBacklogMinutes; a draining spool never does.
        ([('sdcguard_sidecar_spool_backlog{namespace="ml",pod="gpt-worker-1"}', "0x5 1x30"),
          ('sdcguard_sidecar_spool_backlog{namespace="ml",pod="gpt-worker-0"}', "0x5 4 3 2 1 1 1 0x30")],
         [(14, "SdcguardSpoolBacklogGrowing", []),
          (17, "SdcguardSpoolBacklogGrowing", [_expect("SdcguardSpoolBacklogGrowing", POD,
                                                       "1 alarm records wait in the spool of ml/gpt-worker-1 and the "
                                                       "backlog is not draining")])]),
        ([("sdcguard_storm_guard_holds_total", "0x10 1+1x10 11x30")],
         [(12, "SdcguardStormGuardHolding", [_expect(
             "SdcguardStormGuardHolding", {}, "The storm guard holds back cordons: operator.maxConcurrentSuspectNodes "
             "nodes are already suspect")]),
          (40, "SdcguardStormGuardHolding", [])]),
        ([('sdcguard_aws_call_errors_total{operation="BatchReplaceClusterNodes",code="InstanceIdInUse"}', "_x3 1x30")],
         [(5, "SdcguardAwsCallErrors", [_expect(
             "SdcguardAwsCallErrors", {"operation": "BatchReplaceClusterNodes", "code": "InstanceIdInUse"},
             "SageMaker BatchReplaceClusterNodes calls failed (InstanceIdInUse)")])]),
        # An alarm's Event name taken in advance (issue 20, 3): fires on the first one.
        ([('sdcguard_sidecar_event_name_taken_total{namespace="ml",pod="gpt-worker-1"}', "_x4 1x30")],
         [(3, "SdcguardAlarmEventNameTaken", []),
          (6, "SdcguardAlarmEventNameTaken", [_expect("SdcguardAlarmEventNameTaken", POD,
                                                      "An alarm Event name of pod ml/gpt-worker-1 was taken by "
                                                      "another Event")])]),
        # Signature rejections and the other rejections are two alerts.
        ([('sdcguard_alarms_rejected_total{reason="BadSignature"}', "_x3 1x30"),
          ('sdcguard_alarms_rejected_total{reason="PodNotFound"}', "_x8 1x30")],
         [(5, "SdcguardAlarmSignatureRejected", [_expect("SdcguardAlarmSignatureRejected", {"reason": "BadSignature"},
                                                         "Alarm Events rejected for their signature (BadSignature)")]),
          (5, "SdcguardAlarmsRejected", []),
          (12, "SdcguardAlarmsRejected", [_expect("SdcguardAlarmsRejected", {"reason": "PodNotFound"},
                                                  "Alarm Events rejected (PodNotFound)")])]),
    ]
    return [{"interval": "1m",
             "input_series": [{"series": s, "values": v} for s, v in series],
             "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": expected}
                                 for minute, alert, expected in checks]}
            for series, checks in cases]


def test_rules_fire_when_they_should_under_promtool(rules_file: Path) -> None:
    spec = yaml.safe_load(rules_file.read_text())
    cases = unit_tests({r["alert"]: r["annotations"]["description"] for r in spec["groups"][0]["rules"]})
    tests = rules_file.parent / "sdcguard-rules-test.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": cases},
                                    sort_keys=False))
    done = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    alerts_tested = {c["alertname"] for t in cases for c in t["alert_rule_test"]}
    assert alerts_tested == set(SEVERITY)


# --- the chart -------------------------------------------------------------------------------

def test_chart_renders_neither_by_default_and_both_when_enabled(tmp_path: Path) -> None:
    default = render(EVERYWHERE)
    assert not by_kind(default, "PrometheusRule")
    assert not [d for d in by_kind(default, "ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]]
    docs = render(ON)
    [rule] = by_kind(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"] == "sdcguard"
    [configmap] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["sdcguard.json"]) == json.loads(DASHBOARD.read_text())
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    lint = helm("lint", "--strict", str(CHART), *ON)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_dashboard_label_namespace_and_annotations_are_configurable() -> None:
    docs = render([*ON, "--set", "dashboards.label=grafana.com/dashboard,dashboards.labelValue=sdc",
                   "--set", "dashboards.namespace=monitoring,dashboards.annotations.grafana_folder=sdcguard"])
    [configmap] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert configmap["metadata"]["labels"]["grafana.com/dashboard"] == "sdc"
    assert "grafana_dashboard" not in configmap["metadata"]["labels"]
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "sdcguard"}


def test_values_schema_rejects_bad_observability_settings() -> None:
    for bad in ("alerts.pendingApprovalMinutes=0", "alerts.spoolBacklogMinutes=-1", "alerts.bogus=1",
                "dashboards.label=bad label", "dashboards.namespace=Not_A_Namespace", "dashboards.enabled=maybe"):
        done = helm("template", "x", str(CHART), *ON, "--set", bad)
        assert done.returncode != 0, f"{bad} was accepted"


def test_chart_readme_lists_every_alert_with_its_severity() -> None:
    text = (CHART / "README.md").read_text().split("## Dashboard and alerts", 1)[1]
    table = dict(re.findall(r"^\| `(Sdcguard\w+)` \| (\w+) \|", text, re.MULTILINE))
    assert table == {name: rule["labels"]["severity"] for name, rule in alerts(rendered_rules()).items()}
