"""``kubectl sdcguard``: approve or deny a NodeReplacement, list incidents, rank repeat offenders.

Installed as the console script ``kubectl-sdcguard`` (kubectl finds plugins on PATH).  It drives
the real ``kubectl`` (``$KUBECTL``, else ``kubectl`` on PATH), so the user's kubeconfig, context
and credentials apply unchanged:

    kubectl sdcguard approve NAME [--reason TEXT]   # spec.decision=Approved, and why
    kubectl sdcguard deny NAME [--reason TEXT]      # spec.decision=Denied: the node is uncordoned
    kubectl sdcguard release NODE [--reason TEXT]   # a Failed replacement gives its storm-guard
                                                    # slot back (spec.release; the node stays cordoned)
    kubectl sdcguard replacements                   # the approval queue: each NodeReplacement with its
                                                    # health check, decision and repeat offenders
    kubectl sdcguard incidents                      # every SDCIncident, newest last, with where to
                                                    # resume from and how many steps are at risk
    kubectl sdcguard history [--window 30d]         # instances and GPUs by incidents: repeat offenders
    kubectl sdcguard report INCIDENT [-n NS] [-o json]  # the incident as evidence (docs/operator.md)

It sends no identity: who decided is what the API server authenticated, recorded by sdcguard's
admission webhook in ``spec.decidedBy`` (deciding needs the RBAC verb ``approve``, ClusterRole
``sdcguard-approver``); the plugin prints that record from the API server's answer.

It needs the standard library and ``sdcguard.contract`` only: neither kopf, boto3, the Kubernetes
client nor torch (tests/test_contract.py), so ``pip install sdcguard`` is enough.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from typing import Any

from sdcguard.contract import names
from sdcguard.contract.phases import Decision, ReplacementPhase
from sdcguard.contract.text import strip_format_characters, telemetry_line

from . import history, report


class PluginError(Exception):
    pass


_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[ -/]*[0-~])|\x9b[0-?]*[ -/]*[@-~]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: Any) -> str:
    """``text`` without terminal escape sequences (ANSI CSI/OSC, C1), control characters (tabs
    and newlines kept) and Unicode format characters (U+202E and the like: they reorder what is
    shown): what an alarm or an object carries can never rewrite the screen a person approves
    from. Everything the plugin prints passes through here."""
    return strip_format_characters(_CONTROLS.sub("", _ESCAPES.sub("", str(text))))


def _one_line(text: Any) -> str:
    return clean(text).replace("\n", " ").replace("\t", " ")


def kubectl(*args: str) -> str:
    command = [os.environ.get("KUBECTL", "kubectl"), *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        raise PluginError(f"cannot run {command[0]} ({exc.strerror or exc}): put kubectl on PATH or set "
                          "$KUBECTL") from None
    if result.returncode != 0:
        raise PluginError(result.stderr.strip() or f"{' '.join(command)} failed")
    return result.stdout


UNSEALED = "unsealed status"
"""What the plugin shows instead of a NodeReplacement's phase or health check when the status is not
the operator's record: no ``status.seal`` (written by someone else), or the operator found its seal
broken (condition ``StatusSealed=False``). The plugin holds no key and cannot check a seal itself."""


def sealed(body: dict[str, Any]) -> bool:
    """Whether the NodeReplacement's status may be shown as the operator's record."""
    status = body.get("status") or {}
    if any(c.get("type") == "StatusSealed" and c.get("status") == "False" for c in status.get("conditions") or []):
        return False
    return bool(status.get("seal")) or not any(k not in ("conditions", "seal") for k in status)


def shown_phase(body: dict[str, Any]) -> str | None:
    """The phase as the operator recorded it, or :data:`UNSEALED`."""
    return (body.get("status") or {}).get("phase") if sealed(body) else UNSEALED


def health_check(body: dict[str, Any]) -> str:
    """``Failed: <message>`` as the operator recorded the deep health check, or :data:`UNSEALED`."""
    if not sealed(body):
        return UNSEALED
    check = (body.get("status") or {}).get("healthCheck") or {}
    if not check.get("result"):
        return "-"
    return f"{check['result']}" + (f": {check['message']}" if check.get("message") else "")


def decide(name: str, decision: str, reason: str) -> str:
    body = json.loads(kubectl("get", names.REPLACEMENTS, name, "-o", "json"))
    if decision == Decision.APPROVED and not sealed(body):
        raise PluginError(f"nodereplacement {name}: {UNSEALED}: its phase and health check were not written by the "
                          "sdcguard operator (a /status write?); not approving what it shows. Deny it, or look "
                          "at the incident's evidence and the operator's logs")
    already = ((body.get("status") or {}).get("decision") or {}).get("decision") or (body.get("spec") or {}).get("decision")
    if already:
        raise PluginError(f"nodereplacement {name} is already {already}: decisions are final")
    patch = {"spec": {"decision": decision, "decisionReason": reason}}
    stored = json.loads(kubectl("patch", names.REPLACEMENTS, name, "--type=merge", "-p", json.dumps(patch),
                                "-o", "json"))
    spec = stored.get("spec") or {}
    return f"nodereplacement {name} ({spec.get('nodeName')}) {decision.lower()} {decider(spec)}"


def release(node: str, reason: str) -> str:
    """Give the storm-guard slot of NODE's Failed NodeReplacement back (recorded: who, when, why)."""
    items = json.loads(kubectl("get", names.REPLACEMENTS, "-o", "json")).get("items") or []
    mine = [i for i in items if (i.get("spec") or {}).get("nodeName") == node]
    failed = [i for i in mine if shown_phase(i) == ReplacementPhase.FAILED]
    if not failed:
        phases = ", ".join(f"{i['metadata']['name']}: {shown_phase(i)}" for i in mine)
        raise PluginError(f"node {node} has no Failed NodeReplacement ({phases or 'none at all'}); only a failed "
                          "replacement holds its slot until released (denied and replaced ones give it back)")
    done = []
    for item in failed:
        if (item.get("spec") or {}).get("release"):
            done.append(f"nodereplacement {item['metadata']['name']} was already released")
            continue
        stored = json.loads(kubectl("patch", names.REPLACEMENTS, item["metadata"]["name"], "--type=merge", "-p",
                                    json.dumps({"spec": {"release": True, "releaseReason": reason}}), "-o", "json"))
        by = (stored.get("spec") or {}).get("releasedBy") or "(not recorded: is the admission webhook installed?)"
        done.append(f"nodereplacement {item['metadata']['name']} ({node}): storm-guard slot released by {by}; "
                    "the node stays cordoned (kubectl uncordon it once you trust it)")
    return "\n".join(done)


def decider(spec: dict[str, Any]) -> str:
    """Who the API server says decided, from the stored object."""
    if not spec.get("decidedBy"):
        return "(the API server recorded no decider: is the sdcguard NodeReplacement webhook installed?)"
    groups = [g for g in spec.get("decidedByGroups") or [] if g != "system:authenticated"]
    return f"by {spec['decidedBy']}" + (f" (groups: {', '.join(groups)})" if groups else "")


def incidents() -> list[dict[str, Any]]:
    items = json.loads(kubectl("get", names.INCIDENTS, "--all-namespaces", "-o", "json")).get("items", [])
    return sorted(items, key=lambda i: i["metadata"].get("creationTimestamp") or "")


def table(rows: list[list[str]]) -> str:
    rows = [[_one_line(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


INCIDENT_COLUMNS = ["NAMESPACE", "NAME", "JOB", "CHECK", "STEP", "SUSPECTS", "WINDOW", "RESUME-FROM", "SHA256",
                    "AT-RISK", "DRILL", "REPEAT", "TELEMETRY", "PHASE", "AGE"]


def incidents_table(now: datetime.datetime | None = None) -> str:
    """One row per incident: what fired where, the suspect nodes and window, where to resume (the
    checkpoint, its manifest step and the first 12 hex digits of its sha256, as the alarm named
    them: verify with ``sdcguard verify-checkpoint PATH --step N --sha256 H``), how many steps
    resuming redoes, and whether the alarm came from ``sdcguard drill`` (a release test). Incidents
    opened before the operator recorded the recovery plan show what their spec says, and ``-`` for
    the rest."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    rows = [INCIDENT_COLUMNS]
    for item in incidents():
        spec, status, meta = item.get("spec") or {}, item.get("status") or {}, item["metadata"]
        suspects = ",".join((s.get("node") or "?") + (f"/gpu{s['gpu']['index']}" if s.get("gpu") else "")
                            + (f"({s['gpu']['uuid']})" if (s.get("gpu") or {}).get("uuid") else "")
                            for s in spec.get("suspects") or []) or "-"
        rows.append([meta.get("namespace", ""), meta["name"], (spec.get("job") or {}).get("name", ""),
                     spec.get("check", ""), _text(spec.get("step")), suspects, _window(spec, status),
                     _resume(spec, status), _sha(spec, status), _text(status.get("stepsAtRisk")),
                     "yes" if spec.get("drill") else "-", _repeat(status), telemetry_line(status.get("telemetry")),
                     status.get("phase") or "-",
                     age(meta.get("creationTimestamp"), now)])
    return table(rows)


def _repeat(status: dict[str, Any]) -> str:
    """The REPEAT column: the hardware of this incident that other incidents named within the window
    (``gpu:GPU-1234(2)``), ``-`` for none, ``?`` when not judged (an older operator)."""
    offenders = status.get("repeatOffenders")
    if offenders is None:
        return "?"
    return ",".join(f"{o.get('kind')}:{o.get('id')}({len(o.get('incidents') or [])})" for o in offenders) or "-"


def _text(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _window(spec: dict[str, Any], status: dict[str, Any]) -> str:
    """``first-last`` (``?`` for an unknown end), as the Window column of ``kubectl get`` shows it."""
    window = status.get("suspectWindow") or spec.get("suspectWindow") or {}
    first, last = window.get("firstStep"), window.get("lastStep")
    if first is None and last is None:
        return "-"
    return f"{'?' if first is None else first}-{'?' if last is None else last}"


def _resume(spec: dict[str, Any], status: dict[str, Any]) -> str:
    path = status.get("resumeFrom") if "resumeFrom" in status else spec.get("lastGoodCheckpoint")
    if not path:
        return "none"
    step = status.get("resumeFromStep")
    if step is None:
        step = spec.get("lastGoodCheckpointStep")
    return f"{path} (step {step})" if step is not None else str(path)


def _sha(spec: dict[str, Any], status: dict[str, Any]) -> str:
    digest = status.get("resumeFromSha256") or spec.get("lastGoodCheckpointSha256")
    return str(digest)[:12] if digest else "-"


def age(stamp: str | None, now: datetime.datetime) -> str:
    """kubectl's short age: 42s, 7m, 5h, 3d."""
    if not stamp:
        return "-"
    try:
        then = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


HISTORY_COLUMNS = ["KIND", "ID", "NODE", "RECENT", "TOTAL", "JOBS", "REPEAT-OFFENDER", "LAST-ALARM", "INCIDENTS"]


def hardware_record(namespace: str) -> tuple[dict[str, list[dict[str, Any]]], float | None, str]:
    """The operator's hardware record (its ConfigMap in ``namespace``), its window, and where it came
    from. Without the right to read it (or before the operator wrote one), the record the incidents
    themselves hold, said on stderr: it lacks what was deleted."""
    try:
        body = json.loads(kubectl("get", "configmap", names.HARDWARE_HISTORY_CONFIGMAP, "-n", namespace, "-o", "json"))
    except PluginError as exc:
        print(clean(f"kubectl sdcguard: cannot read configmap {namespace}/{names.HARDWARE_HISTORY_CONFIGMAP} "
                    f"({_one_line(exc)[:200]}); ranking the incidents that still exist instead (pass "
                    "--operator-namespace if the operator runs elsewhere)"), file=sys.stderr)
        return history.of_incidents(incidents()), None, "incidents"
    window = ((body.get("metadata") or {}).get("annotations") or {}).get(history.WINDOW_ANNOTATION)
    try:
        seconds = float(window) if window else None
    except ValueError:
        seconds = None
    return history.parse(body.get("data")), seconds, "record"


def history_table(namespace: str = "sdcguard", window: float | None = None,
                  now: datetime.datetime | None = None) -> str:
    """Repeat offenders first: every instance and GPU that alarms named, by incidents within the
    window (RECENT; the operator's window unless ``window`` is given), then in all (TOTAL), with
    the incidents behind each."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    record, operator_window, _ = hardware_record(namespace)
    window = window or operator_window or DEFAULT_WINDOW
    rows = [HISTORY_COLUMNS]
    for r in history.ranking(record, window, now.timestamp()):
        rows.append([r["kind"], r["id"], r["node"], str(r["recent"]), str(r["total"]), str(r["jobs"]),
                     "yes" if r["repeat"] else "-", r["last"] or "-",
                     ",".join(r["incidents"])])
    return table(rows)


DEFAULT_WINDOW = 30 * 86400.0
REPLACEMENT_COLUMNS = ["NAME", "NODE", "INSTANCE", "PHASE", "HEALTH-CHECK", "DECISION", "REPEAT", "INCIDENTS", "AGE"]


def replacements_table(now: datetime.datetime | None = None) -> str:
    """The approval queue: one row per NodeReplacement (phase and health check as the operator sealed
    them), who decided, and the repeat offenders its incidents found on its node (REPEAT)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    by_ref = {f"{i['metadata'].get('namespace')}/{i['metadata']['name']}": i for i in incidents()}
    rows = [REPLACEMENT_COLUMNS]
    items = json.loads(kubectl("get", names.REPLACEMENTS, "-o", "json")).get("items") or []
    for item in sorted(items, key=lambda i: i["metadata"].get("creationTimestamp") or ""):
        spec, meta = item.get("spec") or {}, item["metadata"]
        refs = [r for r in spec.get("incidents") or [] if isinstance(r, str)]
        found = [o for r in refs for o in ((by_ref.get(r) or {}).get("status") or {}).get("repeatOffenders") or []
                 if o.get("node") == spec.get("nodeName")]
        decision = ((item.get("status") or {}).get("decision") or {}).get("decision") if sealed(item) else UNSEALED
        rows.append([meta["name"], spec.get("nodeName") or "-", spec.get("instanceId") or "-",
                     shown_phase(item) or "-", health_check(item), decision or "-",
                     _repeat({"repeatOffenders": list({(o.get("kind"), o.get("id")): o for o in found}.values())}),
                     ",".join(refs) or "-", age(meta.get("creationTimestamp"), now)])
    return table(rows)


def report_of(name: str, namespace: str | None) -> dict[str, Any]:
    """The evidence report of incident ``name`` (in ``namespace``, else wherever it is unique)."""
    if namespace:
        body = json.loads(kubectl("get", names.INCIDENTS, name, "-n", namespace, "-o", "json"))
    else:
        found = [i for i in incidents() if i["metadata"]["name"] == name]
        if len(found) != 1:
            where = ", ".join(i["metadata"].get("namespace", "") for i in found)
            raise PluginError(f"sdcincident {name}: {'not found' if not found else 'in several namespaces: ' + where}"
                              f"{'' if not found else '; pass -n NAMESPACE'}")
        body = found[0]
    replacements = []
    for replacement in (body.get("status") or {}).get("replacements") or {}:
        try:
            replacements.append(json.loads(kubectl("get", names.REPLACEMENTS, replacement, "-o", "json")))
        except PluginError:
            continue  # gone (or not readable): the report lists it as not found
    return report.build(body, replacements, trusted=sealed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl sdcguard", description="sdcguard incidents and node replacements")
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in ("approve", "deny"):
        p = sub.add_parser(verb, help=f"{verb} a NodeReplacement (final)")
        p.add_argument("name")
        p.add_argument("--reason", default="", help="why (recorded in the status)")
    p = sub.add_parser("release", help="give a Failed replacement's storm-guard slot back (recorded)")
    p.add_argument("node")
    p.add_argument("--reason", default="", help="why (recorded in the status)")
    sub.add_parser("incidents", help="list SDCIncidents")
    sub.add_parser("replacements", help="list NodeReplacements: the approval queue, with repeat offenders")
    p = sub.add_parser("history", help="instances and GPUs by number of incidents (repeat offenders first)")
    p.add_argument("--operator-namespace", default=os.environ.get("SDCGUARD_OPERATOR_NAMESPACE", "sdcguard"),
                   help="where the operator keeps its hardware record (default: $SDCGUARD_OPERATOR_NAMESPACE "
                   "or %(default)s)")
    p.add_argument("--window", type=history.parse_duration, default=None,
                   help="repeat-offender window, e.g. 30d (default: the operator's)")
    p = sub.add_parser("report", help="an incident as evidence: signature, hardware, inventory, checkpoints, decisions")
    p.add_argument("incident")
    p.add_argument("-n", "--namespace", default=None)
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command in ("approve", "deny"):
            decision = Decision.APPROVED if args.command == "approve" else Decision.DENIED
            print(clean(decide(args.name, decision, args.reason)))
        elif args.command == "release":
            print(clean(release(args.node, args.reason)))
        elif args.command == "incidents":
            print(incidents_table())
        elif args.command == "replacements":
            print(replacements_table())
        elif args.command == "report":
            built = report_of(args.incident, args.namespace)
            print(clean(json.dumps(built, indent=2, sort_keys=True) if args.output == "json" else report.render(built)))
        else:
            print(history_table(args.operator_namespace, args.window))
    except PluginError as exc:
        print(clean(f"kubectl sdcguard: error: {exc}"), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
