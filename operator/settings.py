"""The operator's settings: one place that turns environment variables into a typed object.

The Helm chart sets these variables; every field names its variable so an error can say which one
is wrong.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from sdcguard.contract import names

DEEP_HEALTH_CHECKS = ("InstanceStress", "InstanceConnectivity")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Settings:
    cluster_name: str | None = None
    """SDCGUARD_CLUSTER_NAME: HyperPod cluster, used when a node lacks the cluster-name label."""
    region: str | None = None
    """SDCGUARD_REGION (else AWS_REGION / AWS_DEFAULT_REGION): region of the SageMaker API."""
    namespaces: tuple[str, ...] = ()
    """SDCGUARD_NAMESPACES: comma-separated namespaces whose alarms are accepted; empty = all."""
    max_concurrent_suspect_nodes: int = 2
    """SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES: storm guard, nodes cordoned by sdcguard at once."""
    max_suspect_nodes_per_job: int = 2
    """SDCGUARD_MAX_SUSPECT_NODES_PER_JOB: storm guard, nodes one job's incidents may hold at once
    (unset: the cluster-wide limit)."""
    max_suspect_nodes_per_namespace: int = 2
    """SDCGUARD_MAX_SUSPECT_NODES_PER_NAMESPACE: storm guard, nodes one namespace's incidents may hold
    at once, so that one tenant cannot take every cluster-wide slot (unset: the cluster-wide limit;
    set it below that limit on a shared cluster)."""
    allow_shared_nodes: bool = False
    """SDCGUARD_ALLOW_SHARED_NODES: cordon a suspect node that also runs pods of other namespaces
    (DaemonSet pods and kube-system aside). false (the default): such a node is not cordoned; the
    incident records it (condition ``SharedNode``) for a person to decide, so that a tenant's
    alarm cannot take another team's node out of service."""
    suspend_jobs: bool = True
    """SDCGUARD_SUSPEND_JOBS: set spec.runPolicy.suspend on the PyTorchJob of an incident."""
    nvsentinel_external_fault: bool = False
    """SDCGUARD_NVSENTINEL_EXTERNAL_FAULT: on cordon, also create an NVIDIA NVSentinel
    ``ExternalFault`` naming the suspect GPUs (operator/nvsentinel.py; needs NVSentinel's CRD)."""
    deep_health_checks: tuple[str, ...] = DEEP_HEALTH_CHECKS
    """SDCGUARD_DEEP_HEALTH_CHECKS: comma-separated subset of InstanceStress,InstanceConnectivity;
    empty = no health check (the replacement waits for approval straight away)."""
    poll_seconds: float = 30.0
    """SDCGUARD_POLL_SECONDS: how often open NodeReplacements are reconciled (AWS progress, decisions)."""
    retry_seconds: float = 5.0
    """SDCGUARD_RETRY_SECONDS: first delay after a throttled AWS call or a transient API error."""
    retry_max_seconds: float = 300.0
    """SDCGUARD_RETRY_MAX_SECONDS: cap of the exponential backoff."""
    max_throttle_retries: int = 8
    """SDCGUARD_MAX_THROTTLE_RETRIES: throttled attempts of one AWS action before giving up."""
    max_unavailable_retries: int = 8
    """SDCGUARD_MAX_UNAVAILABLE_RETRIES: attempts of one AWS action that found SageMaker
    unavailable (5xx, internal errors, timeouts) before giving up."""
    storm_guard_recheck_seconds: float = 60.0
    """SDCGUARD_STORM_GUARD_RECHECK_SECONDS: how often an incident held by the storm guard retries."""
    resync_seconds: float = 600.0
    """SDCGUARD_RESYNC_SECONDS: how often an incident awaiting approval re-reads its NodeReplacements'
    phases (a safety net for a watch event whose handling failed: kopf does not retry it)."""
    aws_connect_timeout: float = 5.0
    """SDCGUARD_AWS_CONNECT_TIMEOUT: seconds to connect to the SageMaker API."""
    aws_read_timeout: float = 20.0
    """SDCGUARD_AWS_READ_TIMEOUT: seconds to wait for a SageMaker answer; a call that times out
    counts as transient (it may have taken effect: DescribeClusterNode is asked before a retry)."""
    leader_election: bool = True
    """SDCGUARD_LEADER_ELECTION (``sdcguard operator`` only): act only while holding the Lease
    ``leader_lease`` in the operator's namespace; the webhooks are served either way."""
    leader_lease: str = "sdcguard-operator"
    """SDCGUARD_LEADER_LEASE: name of the coordination.k8s.io Lease."""
    lease_seconds: float = 15.0
    """SDCGUARD_LEASE_SECONDS: how long a Lease not renewed stays the holder's (followers wait this long)."""
    renew_seconds: float = 10.0
    """SDCGUARD_RENEW_SECONDS: the leader stops (exits) if it could not renew for this long; must
    be shorter than the lease, so that it has stopped before anyone else may take over."""
    key_recheck_seconds: float = 60.0
    """SDCGUARD_KEY_RECHECK_SECONDS: how often each enabled job's key Secret is checked (a deleted
    key is recreated)."""
    metrics_port: int = 8080
    """SDCGUARD_METRICS_PORT: Prometheus metrics port; 0 turns the endpoint off."""
    require_signed_alarms: bool = True
    """SDCGUARD_REQUIRE_SIGNED_ALARMS: reject alarm Events without a signature (UnsignedAlarm); false
    accepts them, counted and logged, while old sidecars are replaced. A wrong signature is always
    rejected."""
    require_alarm_uids: bool = True
    """SDCGUARD_REQUIRE_ALARM_UIDS: refuse a record without the signed ``job.uid`` and
    ``suspects[].pod_uid`` (``MissingUid``); false accepts records of older libraries (counted,
    logged; the live job's and pods' uids are then not compared, the pods' lifetimes still are)."""
    max_alarm_age_seconds: float = 21600.0
    """SDCGUARD_MAX_ALARM_AGE_SECONDS: an alarm whose ``time`` is older than this is refused
    (``StaleAlarm``); long enough for a sidecar to outlast an API server outage."""
    clock_skew_seconds: float = 30.0
    """SDCGUARD_CLOCK_SKEW_SECONDS: tolerance between a node's clock (the alarm's ``time``) and
    the API server's (pod creationTimestamp, now)."""
    require_admission_decisions: bool = True
    """SDCGUARD_REQUIRE_ADMISSION_DECISIONS: act on a NodeReplacement decision only when admission
    recorded its decider (``spec.decidedBy``); false only for a cluster without the webhook."""
    master_key_file: str | None = None
    """SDCGUARD_MASTER_KEY_FILE: the operator's master key (>= 32 bytes) every job's alarm key is
    derived from; empty: the Secret ``sdcguard-master-key`` in the operator's namespace (created
    on first start)."""
    operator_username: str | None = None
    """SDCGUARD_OPERATOR_USERNAME: the operator's own user as the API server authenticates it
    (``system:serviceaccount:<namespace>:<name>``); the NodeReplacement webhook lets only it write
    the operator's fields."""
    alarm_rate_per_minute: float = 120.0
    """SDCGUARD_ALARM_RATE_PER_MINUTE: alarm Events handled per namespace per minute (a token bucket
    in the operator, refilled at this rate); past it an Event is rejected ``RateLimited`` before it
    costs an API call. 0 = no limit."""
    alarm_burst: int = 300
    """SDCGUARD_ALARM_BURST: the bucket's size (every rank of a large job reports one fault at once:
    the duplicates join one incident)."""
    max_incidents_per_job: int = 50
    """SDCGUARD_MAX_INCIDENTS_PER_JOB: SDCIncidents one job instance (uid) may have; a new fault past
    it is rejected ``TooManyIncidents`` (its duplicates still join). 0 = no limit."""
    prometheus_url: str | None = None
    """SDCGUARD_PROMETHEUS_URL: the Prometheus API root holding the GPUs' DCGM metrics (an Amazon
    Managed Prometheus workspace: ``https://aps-workspaces.<region>.amazonaws.com/workspaces/<id>``);
    each incident's suspect GPUs are looked up there (docs/telemetry.md). Empty: no lookup."""
    prometheus_token: str | None = dataclasses.field(default=None, repr=False)
    """SDCGUARD_PROMETHEUS_TOKEN: a bearer token for a Prometheus that wants one (not for a workspace)."""
    prometheus_sigv4: str = "auto"
    """SDCGUARD_PROMETHEUS_SIGV4: auto (sign with SigV4, service ``aps``, when the URL is a workspace's),
    true (always: a VPC endpoint or proxy under another name), false (never)."""
    telemetry_lookback_seconds: float = 3600.0
    """SDCGUARD_TELEMETRY_LOOKBACK_SECONDS: how far before the alarm the DCGM query starts (the alarm
    carries the suspect window's steps, not their times: this stands for the window and its margin)."""
    telemetry_margin_seconds: float = 120.0
    """SDCGUARD_TELEMETRY_MARGIN_SECONDS: how far after the alarm it ends (scrape and remote-write delay)."""
    telemetry_timeout_seconds: float = 10.0
    """SDCGUARD_TELEMETRY_TIMEOUT_SECONDS: one Prometheus request's time limit."""
    telemetry_attempts: int = 5
    """SDCGUARD_TELEMETRY_ATTEMPTS: failed lookups of one incident before it says "telemetry unavailable"
    for good (one every SDCGUARD_POLL_SECONDS)."""
    telemetry_node_labels: tuple[str, ...] = ("Hostname", "node")
    """SDCGUARD_TELEMETRY_NODE_LABELS: comma-separated labels that may carry the node's name on DCGM
    series (dcgm-exporter's ``Hostname``; ``node`` where a scrape config adds the Kubernetes node)."""
    incident_retention_seconds: float = 90 * 86400.0
    """SDCGUARD_INCIDENT_RETENTION (chart ``incidents.retention``, e.g. ``90d``): how long an
    SDCIncident with nothing in flight (Contained, Resolved, or not the operator's) is kept after its
    last change; the operator then deletes it. Incidents are not owned by their job: they outlive it
    as evidence. 0 keeps them forever."""
    repeat_offender_window_seconds: float = 30 * 86400.0
    """SDCGUARD_REPEAT_OFFENDER_WINDOW (chart ``repeatOffender.window``, e.g. ``30d``): an instance
    or GPU with alarms in more than one incident within this period is a repeat offender."""
    intake_retries: int = 20
    """How often kopf tries an alarm Event whose handling fails transiently; the last failure is a
    rejection (``IntakeError``), counted and alerted, never a silent drop."""
    pod_name: str | None = None
    """POD_NAME / POD_NAMESPACE: the operator's own pod (downward API), for rejection Events."""
    pod_namespace: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        checks = _csv(env.get("SDCGUARD_DEEP_HEALTH_CHECKS", ",".join(DEEP_HEALTH_CHECKS)))
        unknown = [c for c in checks if c not in DEEP_HEALTH_CHECKS]
        if unknown:
            raise ValueError(f"SDCGUARD_DEEP_HEALTH_CHECKS: unknown checks {unknown}; allowed: {DEEP_HEALTH_CHECKS}")
        cluster_limit = _int(env, "SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES", 2)
        settings = cls(
            cluster_name=env.get("SDCGUARD_CLUSTER_NAME") or None,
            region=env.get("SDCGUARD_REGION") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
            namespaces=_csv(env.get("SDCGUARD_NAMESPACES", "")),
            max_concurrent_suspect_nodes=_int(env, "SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES", 2),
            max_suspect_nodes_per_job=_int(env, "SDCGUARD_MAX_SUSPECT_NODES_PER_JOB", cluster_limit),
            max_suspect_nodes_per_namespace=_int(env, "SDCGUARD_MAX_SUSPECT_NODES_PER_NAMESPACE", cluster_limit),
            allow_shared_nodes=_bool(env, "SDCGUARD_ALLOW_SHARED_NODES", False),
            suspend_jobs=_bool(env, "SDCGUARD_SUSPEND_JOBS", True),
            nvsentinel_external_fault=_bool(env, names.ENV_NVSENTINEL_EXTERNAL_FAULT, False),
            deep_health_checks=checks,
            poll_seconds=_float(env, "SDCGUARD_POLL_SECONDS", 30.0),
            retry_seconds=_float(env, "SDCGUARD_RETRY_SECONDS", 5.0),
            retry_max_seconds=_float(env, "SDCGUARD_RETRY_MAX_SECONDS", 300.0),
            max_throttle_retries=_int(env, "SDCGUARD_MAX_THROTTLE_RETRIES", 8),
            max_unavailable_retries=_int(env, "SDCGUARD_MAX_UNAVAILABLE_RETRIES", 8),
            storm_guard_recheck_seconds=_float(env, "SDCGUARD_STORM_GUARD_RECHECK_SECONDS", 60.0),
            resync_seconds=_float(env, "SDCGUARD_RESYNC_SECONDS", 600.0),
            aws_connect_timeout=_float(env, "SDCGUARD_AWS_CONNECT_TIMEOUT", 5.0),
            aws_read_timeout=_float(env, "SDCGUARD_AWS_READ_TIMEOUT", 20.0),
            leader_election=_bool(env, "SDCGUARD_LEADER_ELECTION", True),
            leader_lease=env.get("SDCGUARD_LEADER_LEASE") or "sdcguard-operator",
            lease_seconds=_float(env, "SDCGUARD_LEASE_SECONDS", 15.0),
            renew_seconds=_float(env, "SDCGUARD_RENEW_SECONDS", 10.0),
            key_recheck_seconds=_float(env, "SDCGUARD_KEY_RECHECK_SECONDS", 60.0),
            metrics_port=_int(env, "SDCGUARD_METRICS_PORT", 8080),
            require_signed_alarms=_bool(env, "SDCGUARD_REQUIRE_SIGNED_ALARMS", True),
            require_alarm_uids=_bool(env, "SDCGUARD_REQUIRE_ALARM_UIDS", True),
            max_alarm_age_seconds=_float(env, "SDCGUARD_MAX_ALARM_AGE_SECONDS", 21600.0),
            clock_skew_seconds=_float(env, "SDCGUARD_CLOCK_SKEW_SECONDS", 30.0),
            require_admission_decisions=_bool(env, "SDCGUARD_REQUIRE_ADMISSION_DECISIONS", True),
            master_key_file=env.get("SDCGUARD_MASTER_KEY_FILE") or None,
            operator_username=env.get("SDCGUARD_OPERATOR_USERNAME") or None,
            alarm_rate_per_minute=_float(env, "SDCGUARD_ALARM_RATE_PER_MINUTE", 120.0),
            alarm_burst=_int(env, "SDCGUARD_ALARM_BURST", 300),
            max_incidents_per_job=_int(env, "SDCGUARD_MAX_INCIDENTS_PER_JOB", 50),
            prometheus_url=env.get("SDCGUARD_PROMETHEUS_URL") or None,
            prometheus_token=env.get("SDCGUARD_PROMETHEUS_TOKEN") or None,
            prometheus_sigv4=(env.get("SDCGUARD_PROMETHEUS_SIGV4") or "auto").lower(),
            telemetry_lookback_seconds=_float(env, "SDCGUARD_TELEMETRY_LOOKBACK_SECONDS", 3600.0),
            telemetry_margin_seconds=_float(env, "SDCGUARD_TELEMETRY_MARGIN_SECONDS", 120.0),
            telemetry_timeout_seconds=_float(env, "SDCGUARD_TELEMETRY_TIMEOUT_SECONDS", 10.0),
            telemetry_attempts=_int(env, "SDCGUARD_TELEMETRY_ATTEMPTS", 5),
            telemetry_node_labels=_csv(env.get("SDCGUARD_TELEMETRY_NODE_LABELS", "Hostname,node")),
            incident_retention_seconds=_duration(env, "SDCGUARD_INCIDENT_RETENTION", 90 * 86400.0),
            repeat_offender_window_seconds=_duration(env, "SDCGUARD_REPEAT_OFFENDER_WINDOW", 30 * 86400.0),
            pod_name=env.get(names.ENV_POD_NAME) or None,
            pod_namespace=env.get(names.ENV_POD_NAMESPACE) or None,
        )
        if settings.incident_retention_seconds < 0 or settings.repeat_offender_window_seconds <= 0:
            raise ValueError("SDCGUARD_INCIDENT_RETENTION must be >= 0 (0: keep forever) and "
                             "SDCGUARD_REPEAT_OFFENDER_WINDOW > 0")
        for name, value in (("SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES", settings.max_concurrent_suspect_nodes),
                            ("SDCGUARD_MAX_SUSPECT_NODES_PER_JOB", settings.max_suspect_nodes_per_job),
                            ("SDCGUARD_MAX_SUSPECT_NODES_PER_NAMESPACE", settings.max_suspect_nodes_per_namespace)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0")
        if settings.alarm_rate_per_minute < 0 or settings.alarm_burst < 1 or settings.max_incidents_per_job < 0:
            raise ValueError("SDCGUARD_ALARM_RATE_PER_MINUTE and SDCGUARD_MAX_INCIDENTS_PER_JOB must be >= 0, "
                             "SDCGUARD_ALARM_BURST >= 1")
        if settings.max_alarm_age_seconds <= 0 or settings.clock_skew_seconds < 0:
            raise ValueError("SDCGUARD_MAX_ALARM_AGE_SECONDS must be > 0 and SDCGUARD_CLOCK_SKEW_SECONDS >= 0")
        if settings.poll_seconds <= 0 or settings.retry_seconds <= 0 or settings.resync_seconds <= 0:
            raise ValueError("SDCGUARD_POLL_SECONDS, SDCGUARD_RETRY_SECONDS and SDCGUARD_RESYNC_SECONDS must be > 0")
        if settings.prometheus_url and not settings.prometheus_url.startswith(("http://", "https://")):
            raise ValueError("SDCGUARD_PROMETHEUS_URL must be an http:// or https:// URL, "
                             f"got {settings.prometheus_url!r}")
        if settings.prometheus_sigv4 not in ("auto", "true", "false"):
            raise ValueError("SDCGUARD_PROMETHEUS_SIGV4 must be auto, true or false, "
                             f"got {settings.prometheus_sigv4!r}")
        if settings.telemetry_lookback_seconds <= 0 or settings.telemetry_margin_seconds < 0 \
                or settings.telemetry_timeout_seconds <= 0 or settings.telemetry_attempts < 1:
            raise ValueError("SDCGUARD_TELEMETRY_LOOKBACK_SECONDS and SDCGUARD_TELEMETRY_TIMEOUT_SECONDS must be > 0, "
                             "SDCGUARD_TELEMETRY_MARGIN_SECONDS >= 0, SDCGUARD_TELEMETRY_ATTEMPTS >= 1")
        if settings.prometheus_url and not settings.telemetry_node_labels or not all(
                re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", label) for label in settings.telemetry_node_labels):
            raise ValueError("SDCGUARD_TELEMETRY_NODE_LABELS must name at least one label, each a Prometheus "
                             f"label name, got {settings.telemetry_node_labels!r}")
        if not 0 < settings.renew_seconds < settings.lease_seconds:
            raise ValueError("SDCGUARD_RENEW_SECONDS must be > 0 and shorter than SDCGUARD_LEASE_SECONDS")
        return settings

    @property
    def aws_call_seconds(self) -> float:
        """The longest one SageMaker call can be in flight (connect + read timeout, plus a margin)."""
        return self.aws_connect_timeout + self.aws_read_timeout + 5.0

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based): exponential, capped."""
        return min(self.retry_max_seconds, self.retry_seconds * 2 ** max(0, attempt - 1))


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name) or default)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env.get(name)!r}") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(env.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a number, got {env.get(name)!r}") from None


def _duration(env: Mapping[str, str], name: str, default: float) -> float:
    """``30d``, ``12h``, ``90m``, ``45s`` or plain seconds."""
    from .history import parse_duration
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return parse_duration(value)
    except ValueError:
        raise ValueError(f"{name} must be a duration such as 30d, 12h, 90m or 45s, got {value!r}") from None


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")
