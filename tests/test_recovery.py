"""Suspect windows and the last good checkpoint (sdcguard.recovery), without processes."""
import pytest

from sdcguard.recovery import Checkpoint, History, last_good_checkpoint, recovery_fields, suspect_window


def history(**kw):
    kw.setdefault("checkpoints", [Checkpoint(s, f"step-{s}.pt", None) for s in (2, 4, 6, 8)])
    return History(**kw)


def test_replay_window_reaches_back_to_the_last_passing_audit():
    # audits every 5, checkpoints every 2, grad-bitflip at 10: audit 5 passed, 10 fired
    h = history(last_audited_step=5, last_weights_verified_step=9)
    fields = recovery_fields("replay", 10, h)
    assert fields["suspect_window"] == {"first_step": 6, "last_step": 10}
    assert fields["last_good_checkpoint"] == "step-4.pt"  # never step-8.pt, inside the window
    assert fields["last_good_checkpoint_step"] == 4 and fields["steps_at_risk"] == 6
    assert fields["last_verified_step"] == 5 and fields["last_audited_step"] == 5


def test_persistent_fault_between_audits():
    # audits every 8, checkpoints every 3; the fault starts at 10 and is caught by the audit at 16
    h = History(last_audited_step=8, checkpoints=[Checkpoint(s, f"step-{s}.pt", None) for s in (3, 6, 9, 12, 15)])
    fields = recovery_fields("replay", 16, h)
    assert fields["suspect_window"] == {"first_step": 9, "last_step": 16}
    assert fields["last_good_checkpoint"] == "step-6.pt"


def test_weights_window_starts_after_the_last_weights_check():
    h = history(last_audited_step=0, last_weights_verified_step=4)
    assert suspect_window("weights", 6, h) == {"first_step": 5, "last_step": 6}
    assert last_good_checkpoint(suspect_window("weights", 6, h), h).path == "step-4.pt"


def test_nonfinite_local_is_treated_as_a_compute_fault():
    h = history(last_audited_step=3, last_weights_verified_step=7)
    assert suspect_window("nonfinite-local", 8, h) == {"first_step": 4, "last_step": 8}


def test_reduction_faults_reach_back_to_the_last_passing_check_4():
    h = history(last_audited_step=7, last_weights_verified_step=7, last_reduction_verified_step=7)
    assert suspect_window("reduce-checksum", 8, h) == {"first_step": 8, "last_step": 8}
    assert suspect_window("nonfinite-reduced", 8, h) == {"first_step": 8, "last_step": 8}
    without_check_4 = history(last_audited_step=7, last_weights_verified_step=7)
    assert suspect_window("nonfinite-reduced", 8, without_check_4) == {"first_step": 0, "last_step": 8}


@pytest.mark.parametrize("check", ["replay", "weights", "nonfinite-local", "nonfinite-reduced", "a-future-check"])
def test_without_any_verification_the_window_is_the_whole_run(check):
    h = History()
    fields = recovery_fields(check, 4, h)
    assert fields["suspect_window"] == {"first_step": 0, "last_step": 4}
    assert fields["last_good_checkpoint"] is None and fields["steps_at_risk"] == 5


def test_a_resumed_run_reaches_back_past_its_checkpoint_to_the_last_audit():
    # resumed from step-8.pt, which the audit at 5 covered: a compute fault caught at 12 may have
    # begun at 6, so step-8.pt is suspect; step-4.pt (inherited from the manifest) is not
    h = History(last_audited_step=5, last_weights_verified_step=8,
                checkpoints=[Checkpoint(4, "step-4.pt", 0), Checkpoint(8, "step-8.pt", 5)])
    fields = recovery_fields("replay", 12, h)
    assert fields["suspect_window"] == {"first_step": 6, "last_step": 12}
    assert fields["last_good_checkpoint"] == "step-4.pt"
    # a weights fault is cleared by the weights verified when step-8.pt was loaded
    assert recovery_fields("weights", 12, h)["last_good_checkpoint"] == "step-8.pt"


def test_an_alarm_on_the_step_after_an_audit_window_is_that_step():
    h = history(last_audited_step=10)
    assert suspect_window("replay", 11, h) == {"first_step": 11, "last_step": 11}


def test_last_verified_step_is_the_last_audit_else_the_last_weights_check():
    assert History(last_audited_step=5, last_weights_verified_step=9).last_verified_step == 5
    assert History(last_weights_verified_step=9).last_verified_step == 9
    assert History().last_verified_step is None


def test_nameable_is_each_checks_newest_checkpoint_at_or_before_the_step_it_cleared():
    """One rule for what a later alarm can still name (a rotation spares these; resume_floor is the
    oldest): audit cleared 5 -> step-4, check 3 cleared 8 -> step-8, check 4 cleared 3 -> step-2;
    a checkpoint never cross-checked is never one."""
    from sdcguard.recovery import nameable, resume_floor, worth_keeping
    h = history(last_audited_step=5, last_weights_verified_step=8, last_reduction_verified_step=3)
    assert [c.step for c in nameable(h)] == [2, 4, 8]
    assert resume_floor(h) == 2
    h = history(last_audited_step=5, last_weights_verified_step=5)  # both anchors are step-4: listed once
    assert [c.step for c in nameable(h)] == [4] and resume_floor(h) == 4
    assert nameable(history()) == [] and resume_floor(history()) is None  # nothing cleared yet
    h = history(last_audited_step=1, last_weights_verified_step=8)  # the audit cleared no checkpoint
    assert [c.step for c in nameable(h)] == [8] and resume_floor(h) is None  # so every one may be named
    unchecked = History(last_weights_verified_step=8, checkpoints=[Checkpoint(2, "a.pt", None),
                                                                   Checkpoint(6, "b.pt", None, cross_checked=False)])
    assert [c.path for c in nameable(unchecked)] == ["a.pt"]
    # a rotation removing a path keeps the entry only when an alarm may still name it
    h = history(last_audited_step=5, last_weights_verified_step=8)
    assert worth_keeping(h, "step-2.pt") is None  # below the floor (4)
    assert worth_keeping(h, "step-6.pt").step == 6
    assert worth_keeping(unchecked, "b.pt") is None
    twice = History(last_weights_verified_step=8, checkpoints=[Checkpoint(6, "b.pt", None),
                                                               Checkpoint(6, "b.sdcguard-step6.pt", None)])
    assert worth_keeping(twice, "b.pt") is None  # another copy of step 6 is kept already
