"""Per-job alarm keys (operator/alarm_keys.py): the key Secret of every enabled job, written and put back.

A world of its own (tests/conftest.py ``make_world``) that checks the keys every half second.
How the keys are derived is tests/test_master_key.py; how the sidecar signs with them,
tests/test_signing.py.
"""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


def test_a_deleted_key_secret_is_recreated_without_the_job_changing(make_world):
    world = make_world(SDCGUARD_KEY_RECHECK_SECONDS="0.5")
    world.job("keys", "llm")
    first = world.alarm_key("keys", "llm")
    world.core.delete_namespaced_secret("sdcguard-alarm-key-llm", "keys")
    second = world.wait(lambda: world.alarm_key("keys", "llm", timeout=1), timeout=30, what="the key recreated")
    assert second == first and len(second) >= 32  # the job's key, derived again (master key, job uid)
