"""The sandbox's API emulator applies our CRDs' schemas as a real API server does for structural
schemas: unknown fields pruned (and recorded), nulls of non-nullable fields dropped, a wrong type
or a value outside an enum refused with 422 — through the real client over HTTP."""
from __future__ import annotations

import kubernetes
import pytest

from sdcguard.sandbox.apiserver import start_emulator

pytestmark = pytest.mark.emulator

GROUP, VERSION, PLURAL = "sdcguard.dev", "v1", "nodereplacements"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with start_emulator(tmp_path_factory.mktemp("kube")) as kube:
        yield kube, kubernetes.client.CustomObjectsApi(kube.api_client())


def _create(custom, name, **spec_extra):
    return custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeReplacement", "metadata": {"name": name},
        "spec": {"nodeName": "hyperpod-i-0", "instanceId": "i-0", "clusterName": "c", **spec_extra}})


def test_unknown_fields_are_pruned_and_recorded(api):
    kube, custom = api
    created = _create(custom, "prune", bogus="x", reason=None)
    assert "bogus" not in created["spec"] and "reason" not in created["spec"]
    assert "nodereplacements/prune: spec.bogus" in kube.emulator.pruned
    patched = custom.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, "prune", {"status": {
        "phase": "HealthCheck", "healthCheck": {"polls": 1, "wobble": True},
        "timeline": [{"time": "t", "event": "Opened", "message": "m", "extra": 1}]}})
    assert patched["status"]["healthCheck"] == {"polls": 1}
    assert patched["status"]["timeline"] == [{"time": "t", "event": "Opened", "message": "m"}]
    stored = custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, "prune")
    assert stored["status"]["healthCheck"] == {"polls": 1} and stored["status"]["phase"] == "HealthCheck"
    assert {"nodereplacements/prune: status.healthCheck.wobble",
            "nodereplacements/prune: status.timeline[0].extra"} <= set(kube.emulator.pruned)


@pytest.mark.parametrize("status, message", [
    ({"phase": "Exploded"}, "status.phase: Unsupported value: 'Exploded'"),
    ({"healthCheck": {"polls": "three"}}, "status.healthCheck.polls: Invalid value: 'three': must be of type integer"),
    ({"timeline": {"time": "t"}}, "status.timeline: Invalid value"),
])
def test_a_wrong_type_or_value_is_refused_and_nothing_changes(api, status, message):
    _, custom = api
    name = f"invalid-{abs(hash(message)) % 10_000}"
    _create(custom, name)
    before = custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        custom.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, name, {"status": status})
    assert refused.value.status == 422 and message in refused.value.body
    assert custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name) == before
