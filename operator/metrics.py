"""Prometheus metrics of the operator (docs/design.md §7), prefix ``sdcguard_``."""
from __future__ import annotations

import prometheus_client as prom

ALARMS_ACCEPTED = prom.Counter("sdcguard_alarms_accepted_total",
                               "Alarm Events accepted, by outcome (new incident or joined a duplicate)", ["outcome"])
ALARMS_REJECTED = prom.Counter("sdcguard_alarms_rejected_total", "Alarm Events rejected, by reason", ["reason"])
ALARMS_UNSIGNED = prom.Counter("sdcguard_alarms_unsigned_accepted_total",
                               "Unsigned alarm Events let through because SDCGUARD_REQUIRE_SIGNED_ALARMS=false")
ALARMS_WITHOUT_UIDS = prom.Counter("sdcguard_alarms_without_uids_accepted_total",
                                   "Alarm records without job.uid / pod_uid let through because "
                                   "SDCGUARD_REQUIRE_ALARM_UIDS=false")
ALARM_KEYS = prom.Counter("sdcguard_alarm_keys_created_total", "Per-job alarm-key Secrets created")
ADMISSION = prom.Counter("sdcguard_nodereplacement_admission_total",
                         "NodeReplacement admission reviews, by outcome (allowed, decided, denied reason)", ["outcome"])
INCIDENTS = prom.Counter("sdcguard_incidents_total", "SDCIncidents opened", ["check"])
INCIDENTS_REFUSED = prom.Counter("sdcguard_incidents_refused_total",
                                 "SDCIncidents not acted on (not sealed by the operator, alarm does not verify, "
                                 "spec edited), by reason", ["reason"])
REPLACEMENTS_REFUSED = prom.Counter("sdcguard_replacements_refused_total",
                                    "NodeReplacements or decisions not acted on (not created by the operator, "
                                    "decision not recorded by admission), by reason", ["reason"])
NODES_CORDONED = prom.Counter("sdcguard_nodes_cordoned_total", "Nodes cordoned and labelled suspect")
STORM_GUARD_HOLDS = prom.Counter("sdcguard_storm_guard_holds_total",
                                 "Cordons held back because maxConcurrentSuspectNodes was reached")
SUSPECT_NODES = prom.Gauge("sdcguard_suspect_nodes", "Nodes labelled sdcguard.dev/suspect=true (last count)")
RELEASES = prom.Counter("sdcguard_storm_guard_releases_total",
                        "Storm-guard slots of failed replacements released by a person (kubectl sdcguard release)")
LEADER = prom.Gauge("sdcguard_leader", "1 while this replica holds the leader Lease and acts, else 0")
PENDING_APPROVAL = prom.Gauge(
    "sdcguard_replacement_pending_approval_timestamp_seconds",
    "Unix time each NodeReplacement now waiting for a decision entered PendingApproval (from its status "
    "timeline, so a restarted or new leader reports the same time); the series goes when it leaves",
    ["nodereplacement", "node"])
REPLACEMENTS = prom.Counter("sdcguard_replacements_total", "NodeReplacement phase transitions, by phase", ["phase"])
ROLLBACK_GPU_SECONDS = prom.Counter(
    "sdcguard_rollback_gpu_seconds_total",
    "GPU-seconds that resuming from each opened incident's last good checkpoint redoes (steps at risk x the "
    "checked step time the library measured x the job's ranks; an alarm without these figures adds nothing), "
    "by check", ["check"])
FALSE_POSITIVES = prom.Counter(
    "sdcguard_false_positive_investigations_total",
    "Incidents whose every node replacement was denied after the node's deep health check passed")
TELEMETRY = prom.Counter("sdcguard_incident_telemetry_total",
                         "Incidents whose DCGM telemetry lookup finished, by verdict (Corroborates, Clean, NoData, "
                         "Unavailable)", ["verdict"])
TELEMETRY_CORROBORATED = prom.Gauge("sdcguard_incident_telemetry_corroborated",
                                    "1 when the suspect GPU's DCGM telemetry corroborates the incident's alarm, 0 when "
                                    "it does not (clean telemetry clears nothing); per incident (namespace/name)",
                                    ["incident"])
AWS_CALLS = prom.Counter("sdcguard_aws_calls_total", "SageMaker calls made, by operation", ["operation"])
AWS_ERRORS = prom.Counter("sdcguard_aws_call_errors_total", "SageMaker call errors, by operation and code",
                          ["operation", "code"])


def forget_incident(ref: str) -> None:
    """Drop an incident's own series (``<namespace>/<name>``) once it is deleted: the gauge would
    otherwise keep one per incident ever opened."""
    try:
        TELEMETRY_CORROBORATED.remove(ref)
    except KeyError:
        pass  # never had one


_started = False


def serve(port: int) -> None:
    """Expose /metrics once per process (kopf may call startup handlers again after a restart)."""
    global _started
    if port and not _started:
        prom.start_http_server(port)
        _started = True
