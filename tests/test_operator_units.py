"""The operator's parts one by one: settings, localization (all three paths, the last against the
local SageMaker endpoint), incident naming, CRDs, the CLI.  No operator process: fast.
"""
from __future__ import annotations

import os
import pathlib

import kubernetes
import pytest
import yaml
from sdcguard.sandbox.sagemaker import start_aws
from conftest import new_instance

from sdcguard_operator import cli, hyperpod, incident, localize
from sdcguard_operator.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_settings_defaults_and_errors_name_the_variable():
    s = Settings.from_env({})
    assert s.max_concurrent_suspect_nodes == 2 and s.suspend_jobs is True
    assert s.deep_health_checks == ("InstanceStress", "InstanceConnectivity") and s.namespaces == ()
    s = Settings.from_env({"SDCGUARD_NAMESPACES": "ml, research", "SDCGUARD_SUSPEND_JOBS": "false",
                           "SDCGUARD_DEEP_HEALTH_CHECKS": "InstanceStress", "AWS_REGION": "us-east-2"})
    assert s.namespaces == ("ml", "research") and not s.suspend_jobs and s.region == "us-east-2"
    assert s.deep_health_checks == ("InstanceStress",)
    for env, name in [({"SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES": "two"}, "SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES"),
                      ({"SDCGUARD_SUSPEND_JOBS": "maybe"}, "SDCGUARD_SUSPEND_JOBS"),
                      ({"SDCGUARD_DEEP_HEALTH_CHECKS": "Burn"}, "SDCGUARD_DEEP_HEALTH_CHECKS")]:
        with pytest.raises(ValueError, match=name):
            Settings.from_env(env)
    assert [Settings.from_env({}).backoff(n) for n in (1, 2, 3, 10)] == [5.0, 10.0, 20.0, 300.0]


@pytest.mark.parametrize("command", [["-m", "sdcguard.cli", "operator"], ["-m", "kopf", "run", "-m", "sdcguard_operator",
                                                                          "--standalone"]], ids=["sdcguard", "kopf"])
def test_the_real_command_refuses_bad_settings_in_one_line(command):
    """Before: the package read its settings while being imported, so a bad value died in a
    traceback and the CLI's clean exit path was never reached."""
    import subprocess
    import sys

    env = {**os.environ, "SDCGUARD_POLL_SECONDS": "abc", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "SDCGUARD_POLL_SECONDS must be a number, got 'abc'" in lines[0], proc.stderr


def test_instance_id_from_node_name_then_provider_id():
    assert localize.instance_from_names("hyperpod-i-0123456789abcdef0", None) == ("i-0123456789abcdef0", "node-name")
    assert localize.instance_from_names("ip-10-0-0-1.ec2.internal", "aws:///us-west-2a/i-0abcdef0123456789") == \
        ("i-0abcdef0123456789", "provider-id")
    assert localize.instance_from_names("hyperpod-i-XYZ", "gce://p/z/n") is None


def _node(name: str, labels: dict, provider_id: str | None = None, addresses: tuple = ()) -> kubernetes.client.V1Node:
    return kubernetes.client.V1Node(
        metadata=kubernetes.client.V1ObjectMeta(name=name, labels=labels),
        spec=kubernetes.client.V1NodeSpec(provider_id=provider_id),
        status=kubernetes.client.V1NodeStatus(addresses=[kubernetes.client.V1NodeAddress(address=a, type="InternalIP")
                                                         for a in addresses]))


@pytest.fixture
def aws(monkeypatch):
    endpoint = start_aws()
    for key, value in endpoint.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(hyperpod, "_client", None)
    yield endpoint
    endpoint.stop()


def test_localize_every_path(aws):
    settings = Settings.from_env({"SDCGUARD_CLUSTER_NAME": "c1", "AWS_REGION": aws.region})
    first, second = new_instance(), new_instance()
    aws.add_cluster("c1", {first: "gpu-a", second: "gpu-b"})
    # 1. the HyperPod node name, labels give cluster and group: no AWS call
    where = localize.localize(_node(f"hyperpod-{first}", {"sagemaker.amazonaws.com/cluster-name": "c1",
                                                          "sagemaker.amazonaws.com/instance-group-name": "gpu-a"}),
                              settings)
    assert (where.instance_id, where.cluster, where.instance_group, where.source) == (first, "c1", "gpu-a", "node-name")
    assert aws.calls() == []
    # 2. providerID; no group label: DescribeClusterNode tells the group; cluster from the setting
    where = localize.localize(_node("ip-10-9-9-9.ec2.internal", {}, f"aws:///us-west-2a/{second}"), settings)
    assert (where.instance_id, where.instance_group, where.source) == (second, "gpu-b", "provider-id")
    # 3. neither: ListClusterNodes + DescribeClusterNode, matched on the private DNS name
    hostname = hyperpod.describe_node(settings, "c1", first)["PrivateDnsHostname"]
    where = localize.localize(_node(hostname, {"sagemaker.amazonaws.com/cluster-name": "c1"}), settings)
    assert (where.instance_id, where.instance_group, where.source) == (first, "gpu-a", "list-cluster-nodes")
    assert {c["action"] for c in aws.calls()} == {"DescribeClusterNode", "ListClusterNodes"}
    with pytest.raises(localize.NotLocalized, match="matches no instance"):
        localize.localize(_node("ip-1-2-3-4.ec2.internal", {}), settings)
    with pytest.raises(localize.NotLocalized, match="SDCGUARD_CLUSTER_NAME"):
        localize.localize(_node(f"hyperpod-{first}", {}), Settings.from_env({}))


def test_incident_names_are_dns_safe_and_distinct():
    record = {"job": {"name": "LLM_pretrain"}, "check": "nonfinite-local", "step": 12}
    assert incident.incident_name(record) == "llm-pretrain-nonfinite-local-12"
    long_a = incident.incident_name({"job": {"name": "x" * 80 + "a"}, "check": "replay", "step": 1})
    long_b = incident.incident_name({"job": {"name": "x" * 80 + "b"}, "check": "replay", "step": 1})
    assert len(long_a) <= 63 and long_a != long_b


def test_recovery_plan_comes_from_the_alarm_and_is_null_where_an_older_record_is_silent():
    spec = {"step": 40, "lastGoodCheckpoint": "s3://ckpt/step-19.pt", "suspectWindow": {"firstStep": 31, "lastStep": 40},
            "alarm": {"last_good_checkpoint_step": 19, "steps_at_risk": 21, "last_audited_step": 30,
                      "last_weights_verified_step": 38}}
    assert incident.recovery(spec) == {
        "resumeFrom": "s3://ckpt/step-19.pt", "resumeFromStep": 19, "resumeFromSha256": None, "stepsAtRisk": 21,
        "suspectWindow": {"firstStep": 31, "lastStep": 40, "range": "31-40"},
        "lastAuditedStep": 30, "lastWeightsVerifiedStep": 38}
    assert incident.resume_text(incident.recovery(spec)) == "s3://ckpt/step-19.pt (step 19)"
    # steps at risk follow from the checkpoint's step when the record does not say
    spec["alarm"] = {"last_good_checkpoint_step": 25}
    assert incident.recovery(spec)["stepsAtRisk"] == 15
    # an older record: nothing is guessed; values of the wrong type are dropped (the CRD wants integers)
    old = incident.recovery({"step": 7, "lastGoodCheckpoint": None, "suspectWindow": {"firstStep": 7},
                             "alarm": {"steps_at_risk": "many", "last_audited_step": True}})
    assert old == {"resumeFrom": None, "resumeFromStep": None, "resumeFromSha256": None, "stepsAtRisk": None, "lastAuditedStep": None,
                   "lastWeightsVerifiedStep": None, "suspectWindow": {"firstStep": 7, "lastStep": None, "range": "7-?"}}
    assert incident.resume_text(old) == "no verified checkpoint"


@pytest.mark.parametrize("path", ["deploy/crds/sdcincident.yaml", "deploy/crds/nodereplacement.yaml"])
def test_crds_have_schema_status_and_printer_columns(path):
    crd = yaml.safe_load((ROOT / path).read_text())
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["group"] == "sdcguard.dev" and version["name"] == "v1"
    assert version["subresources"] == {"status": {}}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    props = version["schema"]["openAPIV3Schema"]["properties"]
    assert {"spec", "status"} <= set(props)
    if crd["spec"]["names"]["kind"] == "SDCIncident":
        assert crd["spec"]["scope"] == "Namespaced"
        assert {"Job", "Check", "Step", "Suspects", "Window", "Resume-From", "At-Risk", "Phase", "Age"} <= columns
        status = props["status"]["properties"]
        assert {"resumeFrom", "resumeFromStep", "suspectWindow", "stepsAtRisk"} <= set(status)
    else:
        assert crd["spec"]["scope"] == "Cluster"
        assert {"Node", "Instance", "Phase", "Decision", "Age"} <= columns
        assert props["spec"]["properties"]["decision"]["enum"] == ["", "Approved", "Denied"]


def test_injected_pods_get_a_grace_period_the_sidecar_knows_and_never_a_shorter_one() -> None:
    from sdcguard_operator import pod_mutation

    def injected(grace: int | None, settings: pod_mutation.SidecarSettings) -> dict:
        pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "train", "image": "t"}]}}
        if grace is not None:
            pod["spec"]["terminationGracePeriodSeconds"] = grace
        how, _ = pod_mutation.plan("llm", {"sdcguard.dev/enabled": "true"})
        pod_mutation.inject(pod, how=how, sidecar=settings)
        return pod

    default = pod_mutation.SidecarSettings()
    pod = injected(None, default)
    [sidecar] = [c for c in pod["spec"]["initContainers"] if c["name"] == "sdcguard-sidecar"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 90
    assert sidecar["args"][sidecar["args"].index("--grace-period") + 1] == "90"
    longer = injected(600, default)
    assert longer["spec"]["terminationGracePeriodSeconds"] == 600
    [sidecar] = [c for c in longer["spec"]["initContainers"] if c["name"] == "sdcguard-sidecar"]
    assert sidecar["args"][sidecar["args"].index("--grace-period") + 1] == "600"
    env = pod_mutation.SidecarSettings.from_env({"SDCGUARD_SIDECAR_GRACE_SECONDS": "120"})
    assert injected(30, env)["spec"]["terminationGracePeriodSeconds"] == 120


def test_settings_refuse_a_renew_deadline_not_shorter_than_the_lease() -> None:
    import pytest as _pytest
    from sdcguard_operator.settings import Settings

    with _pytest.raises(ValueError, match="SDCGUARD_RENEW_SECONDS"):
        Settings.from_env({"SDCGUARD_LEASE_SECONDS": "5", "SDCGUARD_RENEW_SECONDS": "5"})
    assert Settings.from_env({}).aws_call_seconds == 30.0


def test_an_explicit_flag_beats_the_environment_which_beats_the_default(monkeypatch):
    """Issue 19: every sdcguard command, flag > environment > default; the operator's --namespace
    also reaches the handlers' settings (intake accepts exactly the namespaces kopf watches)."""
    from sdcguard.sidecar import publisher
    from sdcguard_operator import handlers

    env = {"SDCGUARD_NAMESPACES": "from-env"}
    assert cli.settings_for([], dict(env)).namespaces == ("from-env",)
    assert cli.settings_for(["a", "b"], dict(env)).namespaces == ("a", "b")
    assert handlers.SETTINGS.namespaces == ("a", "b")
    assert cli.settings_for([], {}).namespaces == ()
    monkeypatch.delenv("SDCGUARD_SPOOL", raising=False)
    assert publisher.build_parser().parse_args([]).spool == "/var/run/sdcguard"
    monkeypatch.setenv("SDCGUARD_SPOOL", "/from-env")
    assert publisher.build_parser().parse_args([]).spool == "/from-env"
    assert publisher.build_parser().parse_args(["--spool", "/from-flag"]).spool == "/from-flag"
    monkeypatch.setenv("SDCGUARD_ALARM_KEY_FILE", "/env/key")
    assert publisher.build_parser().parse_args(["--key-file", "/flag/key"]).key_file == "/flag/key"


def test_storm_guard_limits_per_job_and_per_namespace_beside_the_cluster_wide_one():
    from sdcguard_operator import contain

    s = Settings.from_env({"SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES": "4", "SDCGUARD_MAX_SUSPECT_NODES_PER_JOB": "1",
                           "SDCGUARD_MAX_SUSPECT_NODES_PER_NAMESPACE": "2"})
    taken = {"n1": contain.slot_value("a/x-replay-1", "x")}
    assert contain.full(taken, "a", "x", s) == "MaxSuspectNodesPerJob"
    assert contain.full(taken, "a", "y", s) is None
    taken["n2"] = contain.slot_value("a/y-replay-1", "y")
    assert contain.full(taken, "a", "z", s) == "MaxSuspectNodesPerNamespace"
    assert contain.full(taken, "b", "x", s) is None  # the same job name elsewhere is another job
    taken.update({"n3": "", "n4": "c/old-ref"})  # a labelled node without a slot; an older operator's value
    assert contain.full(taken, "b", "x", s) == "MaxConcurrentSuspectNodes"
    defaults = Settings.from_env({"SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES": "7"})
    assert (defaults.max_suspect_nodes_per_job, defaults.max_suspect_nodes_per_namespace) == (7, 7)


def test_alarm_freshness_and_derived_keys():
    import time as _time

    from sdcguard_operator import master_key, validate

    s = Settings.from_env({"SDCGUARD_MAX_ALARM_AGE_SECONDS": "60", "SDCGUARD_CLOCK_SKEW_SECONDS": "5"})
    now = 2_000_000_000.0
    stamp = lambda t: _time.strftime("%Y-%m-%dT%H:%M:%S.000Z", _time.gmtime(t))  # noqa: E731
    assert validate.check_fresh({"time": stamp(now - 30)}, s, now) == now - 30
    for t in (now - 61, now + 6):
        with pytest.raises(validate.Rejected) as refused:
            validate.check_fresh({"time": stamp(t)}, s, now)
        assert refused.value.reason == "StaleAlarm"
    master_key._cached["key"] = b"m" * 32  # (the key a real operator reads from its Secret)
    try:
        one = master_key.job_key(s, "ml", "llm", "uid-1")
        assert len(one) == 32 and one == master_key.job_key(s, "ml", "llm", "uid-1")
        assert len({one, master_key.job_key(s, "ml", "llm", "uid-2"), master_key.job_key(s, "ml2", "llm", "uid-1"),
                    master_key.job_key(s, "ml", "llm2", "uid-1")}) == 4
        seal = master_key.seal(s, "NodeReplacement", "n", "i-1")
        assert master_key.sealed(s, seal, "NodeReplacement", "n", "i-1")
        assert not master_key.sealed(s, seal, "NodeReplacement", "n", "i-2") and not master_key.sealed(
            s, None, "NodeReplacement", "n", "i-1")
    finally:
        master_key._cached.clear()


def test_an_alarm_counts_only_within_its_pods_lifetime():
    """Issue 20, 1/2: the alarm's time must fall within the life of the pod it names: not before
    its creation, not after its deletion time (the end of its grace period)."""
    import datetime as _dt

    from sdcguard_operator import validate

    s = Settings.from_env({"SDCGUARD_CLOCK_SKEW_SECONDS": "5"})
    born = _dt.datetime(2026, 1, 1, 12, 0, tzinfo=_dt.timezone.utc)
    pod = kubernetes.client.V1Pod(
        metadata=kubernetes.client.V1ObjectMeta(
            name="llm-worker-0", uid="p1", labels={"training.kubeflow.org/job-name": "llm"}, creation_timestamp=born,
            owner_references=[kubernetes.client.V1OwnerReference(api_version="kubeflow.org/v1", kind="PyTorchJob",
                                                                 name="llm", uid="j1", controller=True)]),
        spec=kubernetes.client.V1PodSpec(node_name="n1", containers=[]))
    who, job = {"rank": 0, "pod": "llm-worker-0", "node": "n1", "pod_uid": "p1"}, {"name": "llm", "namespace": "ml"}
    at = born.timestamp()
    validate.check_pod(pod, who, job, "j1", at + 60, s)
    for moment, why in ((at - 60, "older than pod"), (at + 3600, "newer than the end")):
        pod.metadata.deletion_timestamp = born + _dt.timedelta(minutes=30)
        with pytest.raises(validate.Rejected) as refused:
            validate.check_pod(pod, who, job, "j1", moment, s)
        assert refused.value.reason == "StaleAlarm" and why in refused.value.message
    for changed, reason in (({"pod_uid": "p2"}, "PodUidMismatch"), ({"node": "n2"}, "NodeMismatch")):
        with pytest.raises(validate.Rejected) as refused:
            validate.check_pod(pod, {**who, **changed}, job, "j1", at + 60, s)
        assert refused.value.reason == reason
    with pytest.raises(validate.Rejected) as refused:
        validate.check_pod(pod, who, job, "j-other", at + 60, s)
    assert refused.value.reason == "PodNotInJob"
