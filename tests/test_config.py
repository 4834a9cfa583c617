"""Settings come from arguments or from the environment the webhook sets up."""
import pytest

from sdcguard.config import Config


def test_from_env_reads_every_setting():
    env = {
        "SDCGUARD_AUDIT_EVERY": "50", "SDCGUARD_WEIGHT_CHECK_EVERY": "5", "SDCGUARD_SPOOL": "/spool",
        "LOCAL_WORLD_SIZE": "8", "POD_NAME": "llm-worker-3", "NODE_NAME": "hyperpod-i-0123456789abcdef0",
        "POD_NAMESPACE": "ml", "SDCGUARD_JOB_NAME": "llm", "SDCGUARD_SEED": "9",
    }
    cfg = Config.from_env(env)
    assert (cfg.audit_every, cfg.weight_check_every, cfg.spool, cfg.ranks_per_node, cfg.seed) == (50, 5, "/spool", 8, 9)
    assert (cfg.pod, cfg.node) == ("llm-worker-3", "hyperpod-i-0123456789abcdef0")
    assert cfg.job == {"kind": "PyTorchJob", "name": "llm", "namespace": "ml"}


def test_the_environment_wins_over_the_scripts_defaults():
    # the job's annotations reach the pod as SDCGUARD_* variables: they beat what the script passes
    cfg = Config.from_env({"SDCGUARD_AUDIT_EVERY": "50", "SDCGUARD_RANKS_PER_NODE": "4", "LOCAL_WORLD_SIZE": "8"},
                          audit_every=7, weight_check_every=3)
    assert cfg.audit_every == 50 and cfg.ranks_per_node == 4
    assert cfg.weight_check_every == 3  # not set by the platform: the script's default holds


def test_a_scripts_default_beats_local_world_size_only():
    cfg = Config.from_env({"LOCAL_WORLD_SIZE": "8"}, ranks_per_node=2)
    assert cfg.ranks_per_node == 2


def test_an_explicit_config_is_explicit(monkeypatch):
    monkeypatch.setenv("SDCGUARD_AUDIT_EVERY", "50")
    assert Config(audit_every=7).audit_every == 7


def test_on_nonfinite_is_checked():
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        Config(on_nonfinite="ignore")


def test_outside_kubernetes_identity_is_null():
    cfg = Config.from_env({})
    assert (cfg.job, cfg.pod, cfg.node, cfg.spool) == (None, None, None, None)


@pytest.mark.parametrize("env, message", [
    ({"SDCGUARD_AUDIT_EVERY": "often"}, "SDCGUARD_AUDIT_EVERY must be an integer"),
    ({"SDCGUARD_WEIGHT_CHECK_EVERY": "-1"}, "weight_check_every must be an integer >= 0"),
    ({"LOCAL_WORLD_SIZE": "0"}, "ranks_per_node must be an integer >= 1"),
])
def test_bad_settings_name_the_option(env, message):
    with pytest.raises(ValueError, match=message):
        Config.from_env(env)
