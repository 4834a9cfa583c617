"""Every name the in-pod agent, the sidecar and the operator must spell alike, defined once.

Annotations, labels, environment variables, paths, ports and API coordinates. Standard library
only; ``sdcguard_operator`` imports this module, never the other way round.
"""
from __future__ import annotations

# -- API coordinates -------------------------------------------------------------------------------
GROUP = "sdcguard.dev"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
INCIDENTS = "sdcincidents"
REPLACEMENTS = "nodereplacements"

JOB_GROUP, JOB_VERSION, JOB_PLURAL, JOB_KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
JOB_API_VERSION = f"{JOB_GROUP}/{JOB_VERSION}"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
"""Set by the Kubeflow training operator on every pod of a PyTorchJob."""

# -- the alarm Event (docs/design.md §4) -------------------------------------------------------------------
EVENT_REASON = "SilentDataCorruption"
EVENT_COMPONENT = "sdcguard-agent"
ALARM_ANNOTATION = f"{GROUP}/alarm"
ALARM_SIGNATURE_ANNOTATION = f"{GROUP}/alarm-signature"
CHECK_LABEL = f"{GROUP}/check"

# -- enabling a job, and what the webhook adds (docs/design.md §5) -----------------------------------------
ENABLED_ANNOTATION = f"{GROUP}/enabled"
AUDIT_EVERY_ANNOTATION = f"{GROUP}/audit-every"
WEIGHT_CHECK_EVERY_ANNOTATION = f"{GROUP}/weight-check-every"
INJECTED_LABEL = f"{GROUP}/injected"
SIDECAR_CONTAINER = "sdcguard-sidecar"
SPOOL_VOLUME = "sdcguard-spool"
SPOOL_PATH = "/var/run/sdcguard"
SIDECAR_METRICS_PORT = 9464
SIDECAR_METRICS_PORT_NAME = "sdc-metrics"
"""The sidecar's container port name; the chart's PodMonitor scrapes it by this name."""
ALARM_KEY_SECRET_PREFIX = "sdcguard-alarm-key-"
"""Per job: the Secret ``sdcguard-alarm-key-<job name>`` (docs/design.md §4), created by the operator."""
ALARM_KEY_DATA_KEY = "key"
ALARM_KEY_MIN_BYTES = 32
ALARM_KEY_VOLUME = "sdcguard-alarm-key"
ALARM_KEY_MOUNT = "/var/run/sdcguard-key"
"""Where the webhook mounts the job's key Secret, in the sidecar container only."""
ALARM_KEY_FILE = f"{ALARM_KEY_MOUNT}/{ALARM_KEY_DATA_KEY}"
ALARM_MAX_BYTES = 64 * 1024
"""The operator refuses (``MalformedAlarm``) an alarm annotation longer than this before parsing it
(a record is a few KiB; the API server allows 256 KiB of annotations per object)."""
ALARM_MAX_DEPTH = 16
"""...and one whose JSON nests deeper than this (a record nests at most 5 levels)."""
ALARM_SIGNATURE_SCHEME = "v1"
"""``sdcguard.dev/alarm-signature: v1=<hex HMAC-SHA256(key, UTF-8 alarm annotation)>``."""

# -- HyperPod's own labels on the EKS nodes of a cluster (read by the operator, set by the sandbox) --
HYPERPOD_CLUSTER_LABEL = "sagemaker.amazonaws.com/cluster-name"
HYPERPOD_GROUP_LABEL = "sagemaker.amazonaws.com/instance-group-name"
HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
HYPERPOD_PENDING_HEALTH = ("UnschedulablePendingReplacement", "UnschedulablePendingReboot")
"""Values of ``HYPERPOD_HEALTH_LABEL`` saying HyperPod's own resiliency already acts on the node:
sdcguard records it and asks for no replacement of its own."""

# -- what the rest of the cluster sees (docs/operator.md) ------------------------------------------
NODE_CONDITION = "SilentDataCorruptionSuspected"
"""The condition type on a suspect node's status, ``True`` from the cordon until the replacement or
a person's denial resolves it (NodeHealthCheck, node-problem consumers, dashboards read it)."""
NVSENTINEL_GROUP, NVSENTINEL_VERSION, NVSENTINEL_PLURAL, NVSENTINEL_KIND = (
    "nvsentinel.dgxc.nvidia.com", "v1", "externalfaults", "ExternalFault")
"""NVIDIA NVSentinel's ``ExternalFault`` (its ADR-049): an external system's fault on a node."""
ENV_NVSENTINEL_EXTERNAL_FAULT = "SDCGUARD_NVSENTINEL_EXTERNAL_FAULT"
"""Operator setting (chart ``nvsentinel.externalFault.enabled``): create an ExternalFault per suspect GPU."""

# -- the operator's webhooks: kopf serves each at POST /<handler id> (the chart and sandbox call them)
POD_WEBHOOK_ID = "sdcguard-pod-inject"
REPLACEMENT_WEBHOOK_ID = "sdcguard-nodereplacement-admission"
EPHEMERAL_WEBHOOK_ID = "sdcguard-pod-ephemeral-containers"
"""Validating, fail closed: ``pods/ephemeralcontainers`` UPDATE (``kubectl debug``) may not reach an alarm key."""

# -- the operator's marks on nodes and objects ----------------------------------------------------
SUSPECT_LABEL = f"{GROUP}/suspect"
INCIDENT_ANNOTATION = f"{GROUP}/incident"
INTAKE_ANNOTATION = f"{GROUP}/intake"
WAS_UNSCHEDULABLE_ANNOTATION = f"{GROUP}/was-unschedulable"
INCIDENT_JOB_LABEL = f"{GROUP}/job"
"""On each SDCIncident: the name of its job (``kubectl get sdcincidents -l sdcguard.dev/job=NAME``)."""
REPEAT_OFFENDER_LABEL = f"{GROUP}/repeat-offender"
"""On a node whose instance or GPU had alarms in more than one incident within the repeat-offender
window: ``"true"`` (``kubectl get nodes -l sdcguard.dev/repeat-offender``); set by the operator, kept
until the node leaves the cluster or a person removes it."""
REPEAT_OFFENDER_ANNOTATION = f"{GROUP}/repeat-offender"
"""Beside the label: which instance or GPU, and the incidents behind it (one line)."""
HARDWARE_HISTORY_CONFIGMAP = "sdcguard-hardware-history"
"""The operator's own record of which instances and GPUs had alarms (its namespace): it outlives
jobs, incidents, namespaces and the nodes themselves (docs/operator.md, Repeat offenders)."""

# -- the resumed run (docs/operator.md, Evidence report) -------------------------------------------
RESUME_ANNOTATION = f"{GROUP}/resume"
"""On a ``SilentDataCorruption`` Event of type Normal: the resume record (schema
``sdcguard.dev/resume/v1``), signed like an alarm (``ALARM_SIGNATURE_ANNOTATION``) with the job's key."""

# -- environment of the training container (set by the webhook, read by sdcguard.Config) ---------
ENV_AUDIT_EVERY = "SDCGUARD_AUDIT_EVERY"
ENV_WEIGHT_CHECK_EVERY = "SDCGUARD_WEIGHT_CHECK_EVERY"
ENV_SPOOL = "SDCGUARD_SPOOL"
ENV_RANKS_PER_NODE = "SDCGUARD_RANKS_PER_NODE"
ENV_SEED = "SDCGUARD_SEED"
ENV_MAX_OVERHEAD = "SDCGUARD_MAX_OVERHEAD"
"""``sdcguard.Config.max_overhead``: the integrity budget (a fraction, e.g. ``0.03``)."""
ENV_MAX_AUDIT_INTERVAL = "SDCGUARD_MAX_AUDIT_INTERVAL"
"""``sdcguard.Config.max_audit_interval``: the budget's detection-latency cap, in steps."""
ENV_JOB_NAME = "SDCGUARD_JOB_NAME"
ENV_JOB_KIND = "SDCGUARD_JOB_KIND"
ENV_POD_NAME = "POD_NAME"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_NODE_NAME = "NODE_NAME"
ENV_POD_UID = "POD_UID"
"""The pod's own uid (downward API ``metadata.uid``): signed into the alarm as ``suspects[].pod_uid``."""
ENV_JOB_UID = "SDCGUARD_JOB_UID"
"""The enabled PyTorchJob's uid (the pod's controlling ownerReference): signed as ``job.uid``."""
ENV_ALARM_KEY_FILE = "SDCGUARD_ALARM_KEY_FILE"
"""The sidecar's signing key file (default ``ALARM_KEY_FILE``)."""
DEFAULT_AUDIT_EVERY = 100
"""``sdcguard.Config.audit_every`` when neither the script nor the job sets it."""
DEFAULT_WEIGHT_CHECK_EVERY = 10
"""``sdcguard.Config.weight_check_every`` when neither the script nor the job sets it."""
ANNOTATION_SETTINGS = {
    AUDIT_EVERY_ANNOTATION: (ENV_AUDIT_EVERY, DEFAULT_AUDIT_EVERY),
    WEIGHT_CHECK_EVERY_ANNOTATION: (ENV_WEIGHT_CHECK_EVERY, DEFAULT_WEIGHT_CHECK_EVERY),
}
"""A job's check-setting annotation -> (the training container's environment variable, the
library's default): the webhook writes the variable from the annotation (and names the default
when the value is bad), ``sdcguard.Config.from_env`` reads it."""
DOWNWARD_API = {ENV_POD_NAME: "metadata.name", ENV_POD_NAMESPACE: "metadata.namespace", ENV_NODE_NAME: "spec.nodeName"}
"""Environment variable -> downward-API field path, as the webhook adds them."""
POD_UID_FIELD = "metadata.uid"
"""The downward-API field the webhook maps to ``POD_UID`` (beside ``DOWNWARD_API``)."""

# -- the tenant boundary (docs/design.md §9) ------------------------------------------------------------------
MASTER_KEY_SECRET = "sdcguard-master-key"
"""The operator's master key (operator namespace); each job's alarm key is derived from it."""
ALARM_LEDGER_PREFIX = "sdcguard-alarms-"
"""Per job: the ConfigMap ``sdcguard-alarms-<job>`` (owned by the job) of alarm ids already handled."""
SEAL_ANNOTATION = f"{GROUP}/operator-seal"
"""On every SDCIncident and NodeReplacement the operator creates: an HMAC under its master key."""
