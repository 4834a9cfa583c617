"""The pending-approval gauge the PrometheusRule alerts on, computed from the object's status."""
import datetime

from sdcguard_operator import metrics, replacement


def value(name, node):
    return metrics.PENDING_APPROVAL.labels(name, node)._value.get()


def body(phase, decision=None):
    timeline = [{"time": "2026-12-01T10:00:00Z", "event": "Opened", "message": ""},
                {"time": "2026-12-01T10:05:00Z", "event": "HealthCheckPassed", "message": ""}]
    status = {"phase": phase, "target": {"nodeName": "hyperpod-i-0abc"}, "timeline": timeline}
    if decision:
        status["decision"] = {"decision": decision}
    return {"metadata": {"name": "hyperpod-i-0abc"}, "spec": {}, "status": status}


def test_pending_since_the_health_check_and_gone_once_it_moves_on():
    replacement._export_pending("hyperpod-i-0abc", body("PendingApproval"))
    expected = datetime.datetime(2026, 12, 1, 10, 5, tzinfo=datetime.timezone.utc).timestamp()
    assert value("hyperpod-i-0abc", "hyperpod-i-0abc") == expected
    replacement._export_pending("hyperpod-i-0abc", body("Replacing"))
    samples = [s for m in metrics.PENDING_APPROVAL.collect() for s in m.samples]
    assert not any(s.labels.get("nodereplacement") == "hyperpod-i-0abc" for s in samples)
    replacement._export_pending("hyperpod-i-0abc", body("Replacing"))  # removing twice is fine
