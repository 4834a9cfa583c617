"""The operator's settings (operator/settings.py): environment variables into one typed object.

In-process and fast. How the commands report a bad setting is tests/test_operator_cli.py.
"""
from __future__ import annotations

import pytest

from sdcguard_operator.settings import Settings


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


def test_settings_refuse_a_renew_deadline_not_shorter_than_the_lease() -> None:
    with pytest.raises(ValueError, match="SDCGUARD_RENEW_SECONDS"):
        Settings.from_env({"SDCGUARD_LEASE_SECONDS": "5", "SDCGUARD_RENEW_SECONDS": "5"})
    assert Settings.from_env({}).aws_call_seconds == 30.0
