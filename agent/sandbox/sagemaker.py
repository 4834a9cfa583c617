"""The sandbox's SageMaker endpoint: moto's server plus the HyperPod calls moto lacks.

A SANDBOX, never a production path: dummy credentials, state in memory, health checks that pass
or fail as scripted. ``sdcguard sandbox`` / ``make demo`` point the real operator (boto3) at it, and
the test suite uses the same one.

Usage::

    from sdcguard.sandbox.sagemaker import start_aws

    aws = start_aws()                                    # http://127.0.0.1:<port>, in a thread
    aws.env()                                            # AWS_* variables for boto3 / the operator
    aws.add_cluster("ml-cluster", {"i-0123456789abcdef0": "workers"})     # id -> instance group
    aws.script("i-0123456789abcdef0", health="fail", replace=["throttle", "ok"])
    aws.calls()                                          # every HyperPod call so far, read over HTTP
    aws.stop()

Real botocore serialisation runs over HTTP; nothing in boto3 is patched.  The sagemaker app of
moto's ``DomainDispatcherApplication`` is served with a subclass of moto's ``SageMakerResponse``
that adds, server-side:

* ``StartClusterHealthCheck``: the instance shows ``DeepHealthCheckInProgress`` in
  ``DescribeClusterNode`` for ``health_polls`` describes and at least ``health_seconds`` (per
  instance, or ``chaos(health_seconds=...)`` for all), then ``Running`` (pass) or ``Failure``.
* ``BatchReplaceClusterNodes``: per-instance scripted outcomes, in order: ``ok``, ``throttle``
  (a ``ThrottlingException``), ``in-use`` / ``not-found`` / ``bad-status`` / ``internal`` (``Failed``
  entries ``InstanceIdInUse`` / ``InstanceIdNotFound`` / ``InvalidInstanceStatus`` /
  ``InternalServerError``, none of which takes effect), ``ok-then-500`` (takes effect, then
  answers ``InternalServerError``: the caller cannot tell from the answer).  A successful replace
  shows ``ShuttingDown`` for ``replace_polls`` describes, then the instance is gone from the cluster
  and a fresh instance joins its group.
* The health check can be scripted to throttle too (``health_errors=["throttle"]``).
* ``health_delay`` / ``replace_delay``: seconds to hold the answer after the call took effect, so
  a test can kill the caller while the call is in flight.

* Random faults (``aws.chaos(rate, seed=...)``): a share of the HyperPod calls is answered with a
  ``ThrottlingException`` (no effect), an ``InternalServerError`` (HTTP 500) before or *after* the
  call took effect, or slowly (after the effect, ``slow`` seconds: longer than the caller's read
  timeout, it times out).  ``DescribeClusterNode`` only throttles or answers slowly.  Every call
  record says whether the call took effect (``effective``), which is what "exactly once" counts.

Control and call records live under ``/_hyperpod/`` on the same port (JSON over HTTP).  moto's
state is process-wide: endpoints started in one process share clusters, so use fresh instance ids
(and ``calls()`` keeps only the calls made to its own endpoint).
"""
from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.request
from typing import Any

from moto.core.exceptions import JsonRESTError
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, convert_to_flask_response, \
    create_backend_app
from moto.sagemaker.models import ClusterNode, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse
from werkzeug.serving import WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

ACCOUNT = "123456789012"
_LOCK = threading.RLock()


class _ServerError(JsonRESTError):
    code = 500


class _State:
    """Scripted behaviour and call records, shared by the request threads of one server."""

    def __init__(self) -> None:
        import random
        self.chaos: dict[str, Any] = {"rate": 0.0, "slow": 3.0}
        self.rng = random.Random()
        self.calls: list[dict[str, Any]] = []
        self.scripts: dict[str, dict[str, Any]] = {}
        self.progress: dict[str, dict[str, Any]] = {}  # instance id -> {"kind", "polls_left", "result"}

    def script(self, instance_id: str) -> dict[str, Any]:
        return self.scripts.setdefault(instance_id, {
            "health": "pass", "health_errors": [], "replace": [], "health_polls": 1, "replace_polls": 1,
            "health_delay": 0.0, "replace_delay": 0.0, "health_message": "", "health_seconds": 0.0,
        })


STATE = _State()


def _fault(action: str) -> str | None:
    """A random fault for this call (None, "throttle", "error-before", "error-after", "slow")."""
    if STATE.chaos["rate"] <= 0 or STATE.rng.random() >= STATE.chaos["rate"]:
        return None
    kinds = ("throttle", "slow") if action == "DescribeClusterNode" else \
        ("throttle", "error-before", "error-after", "slow")
    return STATE.rng.choice(kinds)


class HyperPodResponse(SageMakerResponse):
    """moto's SageMaker responses with the HyperPod node operations added."""

    def _before(self, action: str, ids: list[str]) -> str | None:
        """Apply a fault that strikes before the call takes effect; return the one that strikes after."""
        fault = _fault(action)
        if fault == "throttle":
            self._record(action, ids, "ThrottlingException", effective=False)
            raise JsonRESTError("ThrottlingException", "Rate exceeded")
        if fault == "error-before":
            self._record(action, ids, "InternalServerError", effective=False)
            raise _ServerError("InternalServerError", "We encountered an internal error. Please try again.")
        return fault

    def _after(self, fault: str | None) -> None:
        if fault == "error-after":
            raise _ServerError("InternalServerError", "We encountered an internal error. Please try again.")
        if fault == "slow":
            time.sleep(STATE.chaos["slow"])

    def start_cluster_health_check(self) -> str:
        cluster = self._cluster(self._get_param("ClusterName"))
        configs = self._get_param("DeepHealthCheckConfigurations") or []
        ids = [i for c in configs for i in c.get("InstanceIds", [])]
        with _LOCK:
            fault = self._before("StartClusterHealthCheck", ids)
            for instance_id in ids:
                errors = STATE.script(instance_id)["health_errors"]
                if errors:
                    errors.pop(0)
                    self._record("StartClusterHealthCheck", ids, "ThrottlingException", configs)
                    raise JsonRESTError("ThrottlingException", "Rate exceeded")
            for config in configs:
                for instance_id in config.get("InstanceIds", []):
                    node = cluster.nodes.get(instance_id)
                    if node is None or node.instance_group_name != config.get("InstanceGroupName"):
                        self._record("StartClusterHealthCheck", ids, "ValidationException", configs)
                        raise JsonRESTError("ValidationException",
                                            f"Instance {instance_id} not found in group {config.get('InstanceGroupName')}")
            for instance_id in ids:
                script = STATE.script(instance_id)
                cluster.nodes[instance_id].status = "DeepHealthCheckInProgress"
                seconds = script["health_seconds"] or STATE.chaos.get("health_seconds", 0.0)
                STATE.progress[instance_id] = {"kind": "health", "polls_left": script["health_polls"],
                                               "result": script["health"], "until": time.time() + seconds}
            self._record("StartClusterHealthCheck", ids, "ok", configs, fault=fault)
            delay = max(STATE.script(i)["health_delay"] for i in ids) if ids else 0
        time.sleep(delay)  # the call took effect; the answer is slow (a crash window for the caller)
        self._after(fault)
        return json.dumps({"ClusterArn": cluster.arn})

    def batch_replace_cluster_nodes(self) -> str:
        cluster = self._cluster(self._get_param("ClusterName"))
        ids = self._get_param("NodeIds") or []
        successful, failed = [], []
        with _LOCK:
            fault = self._before("BatchReplaceClusterNodes", ids)
            outcomes = {i: (STATE.script(i)["replace"].pop(0) if STATE.script(i)["replace"] else "ok") for i in ids}
            if "throttle" in outcomes.values():
                self._record("BatchReplaceClusterNodes", ids, "ThrottlingException")
                raise JsonRESTError("ThrottlingException", "Rate exceeded")
            if "ok-then-500" in outcomes.values():
                fault = "error-after"
            for instance_id, outcome in outcomes.items():
                outcome = "ok" if outcome == "ok-then-500" else outcome
                if instance_id not in cluster.nodes and outcome == "ok":
                    outcome = "not-found"
                if outcome == "ok":
                    cluster.nodes[instance_id].status = "ShuttingDown"
                    STATE.progress[instance_id] = {"kind": "replace",
                                                   "polls_left": STATE.script(instance_id)["replace_polls"]}
                    successful.append(instance_id)
                else:
                    code, message = _REPLACE_ERRORS[outcome]
                    failed.append({"NodeId": instance_id, "ErrorCode": code, "Message": message.format(instance_id)})
            self._record("BatchReplaceClusterNodes", ids, "ok" if not failed else "failed",
                         {"Successful": successful, "Failed": failed}, effective=bool(successful), fault=fault)
            delay = max(STATE.script(i)["replace_delay"] for i in ids) if ids else 0
        time.sleep(delay)
        self._after(fault)
        return json.dumps({"Successful": successful, "Failed": failed})

    def describe_cluster_node(self) -> Any:
        cluster_name, instance_id = self._get_param("ClusterName"), self._get_param("NodeId")
        with _LOCK:
            fault = self._before("DescribeClusterNode", [instance_id])
            self._record("DescribeClusterNode", [instance_id], "ok", fault=fault)
            cluster = self._cluster(cluster_name)
            progress = STATE.progress.get(instance_id)
            node = cluster.nodes.get(instance_id)
            # An answer the caller times out on (slow) is a read it never saw: progress, which the
            # emulator counts in describes seen, does not move (real checks take minutes).
            if progress is not None and node is not None and fault != "slow":
                if progress["polls_left"] > 0:
                    progress["polls_left"] -= 1
                elif progress["kind"] == "health" and time.time() < progress["until"]:
                    pass  # still running: a real check takes many minutes
                elif progress["kind"] == "health":
                    node.status = "Running" if progress["result"] == "pass" else "Failure"
                    del STATE.progress[instance_id]
                else:  # replaced: the old instance is gone, a fresh one joins the group
                    del cluster.nodes[instance_id]
                    del STATE.progress[instance_id]
                    fresh = "i-" + secrets.token_hex(9)[:17]
                    cluster.nodes[fresh] = _node(cluster, fresh, node.instance_group_name)
        answer = super().describe_cluster_node()
        self._after(fault)
        return answer

    def list_cluster_nodes(self) -> Any:
        with _LOCK:
            self._record("ListClusterNodes", [], "ok")
        return super().list_cluster_nodes()

    def _cluster(self, name: str) -> Any:
        cluster = sagemaker_backends[self.current_account][self.region].clusters.get(name)
        if cluster is None:
            raise JsonRESTError("ValidationException", f"Could not find cluster '{name}'.")
        return cluster

    def _record(self, action: str, ids: list[str], outcome: str, detail: Any = None, *,
                effective: bool | None = None, fault: str | None = None) -> None:
        STATE.calls.append({"action": action, "ids": list(ids), "outcome": outcome, "detail": detail,
                            "effective": outcome == "ok" if effective is None else effective, "fault": fault,
                            "time": time.time(),
                            "endpoint": self.headers.get("Host", "")})


_REPLACE_ERRORS = {
    "in-use": ("InstanceIdInUse", "Another operation is already in progress for node {}"),
    "not-found": ("InstanceIdNotFound", "Instance {} does not exist in the cluster"),
    "bad-status": ("InvalidInstanceStatus", "Instance {} is in a state that does not allow replacement"),
    "internal": ("InternalServerError", "An internal error occurred replacing {}"),
}


class _HyperPodNode(ClusterNode):
    """moto's node plus the private address fields real HyperPod reports (used to match EKS nodes)."""

    __module__ = "moto.sagemaker.models"  # moto's model metaclass derives the service from the module

    def describe(self) -> dict[str, Any]:
        octets = int(self.instance_id[-6:], 16)
        ip = f"10.{(octets >> 16) & 255}.{(octets >> 8) & 255}.{octets & 255}"
        answer = {**super().describe(), "PrivatePrimaryIp": ip,
                  "PrivateDnsHostname": f"ip-{ip.replace('.', '-')}.{self.region_name}.compute.internal"}
        message = {"Failure": (STATE.scripts.get(self.instance_id) or {}).get("health_message")
                   or "deep health check failed", "Running": "", "ShuttingDown": "replacement in progress",
                   "DeepHealthCheckInProgress": "deep health check in progress"}.get(self.status)
        if message is not None:
            answer["InstanceStatus"] = {"Status": self.status, "Message": message}
        return answer


def _node(cluster: Any, instance_id: str, group: str) -> ClusterNode:
    return _HyperPodNode(
        region_name=cluster.region_name, account_id=cluster.account_id, cluster_name=cluster.cluster_name,
        instance_group_name=group, instance_type="ml.p5.48xlarge",
        life_cycle_config={"SourceS3Uri": "s3://sagemaker-lifecycle/", "OnCreate": "on_create.sh"},
        execution_role=f"arn:aws:iam::{ACCOUNT}:role/hyperpod", node_id=instance_id,
    )


def _create_app(service: Any) -> Any:
    app = create_backend_app(service)
    if service == "sagemaker":
        app.view_functions["SageMakerResponse.dispatch"] = convert_to_flask_response(HyperPodResponse.dispatch)
    return app


class _Control:
    """WSGI front: ``/_hyperpod/...`` is ours, everything else goes to moto."""

    def __init__(self) -> None:
        self.moto = DomainDispatcherApplication(_create_app)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/_hyperpod/"):
            return self.moto(environ, start_response)
        request = Request(environ)
        body = json.loads(request.get_data() or b"{}")
        with _LOCK:
            if path == "/_hyperpod/calls":
                answer: Any = STATE.calls
            elif path == "/_hyperpod/cluster":
                answer = _add_cluster(body["name"], body["region"], body["nodes"])
            elif path == "/_hyperpod/script":
                STATE.script(body.pop("instance_id")).update(body)
                answer = {"ok": True}
            elif path == "/_hyperpod/chaos":
                STATE.chaos.update({k: v for k, v in body.items() if k != "seed"})
                if "seed" in body:
                    STATE.rng.seed(body["seed"])
                answer = dict(STATE.chaos)
            elif path == "/_hyperpod/nodes":
                cluster = sagemaker_backends[ACCOUNT][body["region"]].clusters[body["name"]]
                answer = {i: n.status for i, n in cluster.nodes.items()}
            else:
                return Response("not found", status=404)(environ, start_response)
        return Response(json.dumps(answer, default=str), mimetype="application/json")(environ, start_response)


def _add_cluster(name: str, region: str, nodes: dict[str, str]) -> dict[str, Any]:
    backend = sagemaker_backends[ACCOUNT][region]
    if name not in backend.clusters:
        backend.create_cluster(
            cluster_name=name,
            instance_groups=[{"InstanceGroupName": g, "InstanceType": "ml.p5.48xlarge", "InstanceCount": 0,
                              "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-lifecycle/", "OnCreate": "on_create.sh"},
                              "ExecutionRole": f"arn:aws:iam::{ACCOUNT}:role/hyperpod"}
                             for g in sorted(set(nodes.values()))],
            vpc_config={"SecurityGroupIds": ["sg-1"], "Subnets": ["subnet-1"]},
            tags=[],
        )
    cluster = backend.clusters[name]
    for instance_id, group in nodes.items():
        cluster.nodes[instance_id] = _node(cluster, instance_id, group)
    return {"arn": cluster.arn}


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class RunningAWS:
    """The endpoint, served by werkzeug from a daemon thread."""

    def __init__(self, region: str = "us-west-2") -> None:
        self.region = region
        self._server = make_server("127.0.0.1", 0, _Control(), threaded=True,
                                   request_handler=_QuietHandler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="aws-emulator", daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """Environment for boto3 (and the operator) to use this endpoint with dummy credentials."""
        return {"AWS_ENDPOINT_URL_SAGEMAKER": self.url, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": self.region,
                "AWS_REGION": self.region, "AWS_EC2_METADATA_DISABLED": "true"}

    def _post(self, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def add_cluster(self, name: str, nodes: dict[str, str]) -> dict[str, Any]:
        """Create (or extend) a cluster; ``nodes`` maps instance id -> instance group name."""
        return self._post("/_hyperpod/cluster", {"name": name, "region": self.region, "nodes": nodes})

    def script(self, instance_id: str, **behaviour: Any) -> None:
        """Set ``health`` ("pass"/"fail"), ``health_message`` (what a failed check reports),
        ``health_errors``, ``replace`` (list of outcomes), ``*_polls``, ``*_delay``."""
        self._post("/_hyperpod/script", {"instance_id": instance_id, **behaviour})

    def chaos(self, rate: float, seed: int | None = None, slow: float | None = None,
              health_seconds: float | None = None) -> None:
        """Random faults in a share ``rate`` of the HyperPod calls from now on (0 stops them);
        ``health_seconds``: how long every deep health check lasts at least."""
        self._post("/_hyperpod/chaos", {"rate": rate, **({"seed": seed} if seed is not None else {}),
                                        **({"slow": slow} if slow is not None else {}),
                                        **({"health_seconds": health_seconds} if health_seconds is not None else {})})

    def calls(self, action: str | None = None, instance_id: str | None = None) -> list[dict[str, Any]]:
        """HyperPod calls received so far (read over HTTP), optionally filtered."""
        calls = [c for c in self._post("/_hyperpod/calls") if c["endpoint"] == self.url.split("//", 1)[1]]
        return [c for c in calls if (action is None or c["action"] == action)
                and (instance_id is None or instance_id in c["ids"])]

    def node_statuses(self, cluster: str) -> dict[str, str]:
        return self._post("/_hyperpod/nodes", {"name": cluster, "region": self.region})

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(10)


def start_aws(region: str = "us-west-2") -> RunningAWS:
    return RunningAWS(region)
