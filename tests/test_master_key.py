"""The operator's master key and what is derived from it (operator/master_key.py): job keys and seals.

In-process, with a known master key in place of the Secret a real operator reads once per process.
That a deleted key Secret is written again is tests/test_alarm_keys.py.
"""
from __future__ import annotations

import pytest

from sdcguard_operator import master_key
from sdcguard_operator.settings import Settings


@pytest.fixture
def known_master():
    """The master key, read once per process by design (no API here): a known one for this test."""
    saved = dict(master_key._cached)
    master_key._cached.clear()
    master_key._cached["key"] = b"m" * 32
    yield
    master_key._cached.clear()
    master_key._cached.update(saved)


def test_job_keys_and_seals_are_derived_from_the_master_key(known_master):
    s = Settings.from_env({})
    one = master_key.job_key(s, "ml", "llm", "uid-1")
    assert len(one) == 32 and one == master_key.job_key(s, "ml", "llm", "uid-1")
    assert len({one, master_key.job_key(s, "ml", "llm", "uid-2"), master_key.job_key(s, "ml2", "llm", "uid-1"),
                master_key.job_key(s, "ml", "llm2", "uid-1")}) == 4
    seal = master_key.seal(s, "NodeReplacement", "n", "i-1")
    assert master_key.sealed(s, seal, "NodeReplacement", "n", "i-1")
    assert not master_key.sealed(s, seal, "NodeReplacement", "n", "i-2") and not master_key.sealed(
        s, None, "NodeReplacement", "n", "i-1")
