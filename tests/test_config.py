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


def test_an_integrity_budget_from_arguments_and_from_the_environment():
    cfg = Config(max_overhead=0.03, max_audit_interval=500)
    assert (cfg.max_overhead, cfg.max_audit_interval, cfg.budgeted) == (0.03, 500, True)
    assert not Config().budgeted and Config().max_overhead is None
    cfg = Config.from_env({"SDCGUARD_MAX_OVERHEAD": "0.05", "SDCGUARD_MAX_AUDIT_INTERVAL": "200"},
                          max_overhead=0.01, max_audit_interval=50)
    assert (cfg.max_overhead, cfg.max_audit_interval) == (0.05, 200)  # the platform wins, as for every setting
    # audit_every is the interval a budgeted run starts with, not a conflict
    assert Config.from_env({"SDCGUARD_AUDIT_EVERY": "10", "SDCGUARD_MAX_OVERHEAD": "0.03",
                            "SDCGUARD_MAX_AUDIT_INTERVAL": "100"}).audit_every == 10


@pytest.mark.parametrize("kwargs, message", [
    ({"max_overhead": 0.03}, r"max_overhead needs max_audit_interval \(SDCGUARD_MAX_AUDIT_INTERVAL\)"),
    ({"max_audit_interval": 100}, "max_audit_interval applies only with max_overhead"),
    ({"max_overhead": 0.03, "max_audit_interval": 0}, "max_audit_interval must be an integer >= 1"),
    ({"max_overhead": 0.03, "max_audit_interval": 1.5}, "max_audit_interval must be an integer >= 1"),
    ({"max_overhead": 0.0, "max_audit_interval": 100}, "max_overhead must be a number > 0"),
    ({"max_overhead": -0.1, "max_audit_interval": 100}, "max_overhead must be a number > 0"),
    ({"max_overhead": float("nan"), "max_audit_interval": 100}, "max_overhead must be a number > 0"),
    ({"max_overhead": "3%", "max_audit_interval": 100}, "max_overhead must be a number > 0"),
    ({"max_overhead": True, "max_audit_interval": 100}, "max_overhead must be a number > 0"),
    ({"max_overhead": 0.03, "max_audit_interval": 100, "audit_every": 0}, "audit_every=0 turns audits off"),
])
def test_a_bad_budget_names_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


@pytest.mark.parametrize("env, message", [
    ({"SDCGUARD_MAX_OVERHEAD": "3%", "SDCGUARD_MAX_AUDIT_INTERVAL": "100"}, "SDCGUARD_MAX_OVERHEAD must be a number"),
    ({"SDCGUARD_MAX_OVERHEAD": "0.03"}, "max_overhead needs max_audit_interval"),
    ({"SDCGUARD_MAX_OVERHEAD": "0.03", "SDCGUARD_MAX_AUDIT_INTERVAL": "soon"},
     "SDCGUARD_MAX_AUDIT_INTERVAL must be an integer"),
])
def test_a_bad_budget_in_the_environment_names_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Config.from_env(env)
