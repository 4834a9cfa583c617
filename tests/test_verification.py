"""The audit step's sequence (sdcguard.verification) on a layout of its own, in one gloo process.

On an audit step check 1's vote travels while the audit runs and is read with the agreement; its
sums are judged first. These tests hold the layout's answers fixed (a NaN vote, a replay that
raises on every rank, a replay that matches) and check what the Verifier makes of them: the
sums' outcome wins, a set-aside audit counts no run and verifies nothing, and an error of the
audit is raised only when the sums let the step through.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from sdcguard.checks.audit import Confirmation
from sdcguard.checks.exchange import Incoming
from sdcguard.checks.replay import PassResult, Payload
from sdcguard.checks.weights import WeightCheck
from sdcguard.contract.stats import CheckStats
from sdcguard.errors import ReplayError
from sdcguard.fingerprint import Fingerprint
from sdcguard.layouts.base import StepRecord, Vote
from sdcguard.verification import PASSED, Verifier

CPU = torch.device("cpu")


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FixedLayout:
    """A layout whose vote and replay say what the test sets; it records what was asked of it.
    Its topology claims two ranks (so the Verifier is not solo) over a one-rank gloo group."""

    def __init__(self, *, vote: list[float], replay_raises: type[Exception] | None = None) -> None:
        self.topology = SimpleNamespace(world_size=2, rank=0, replay_target=lambda r: 1 - r)
        self.device, self.group = CPU, None
        self.vote_value = torch.tensor(vote, dtype=torch.float64)
        self.replay_raises = replay_raises
        self.calls: list[str] = []
        self.grad = PassResult([Fingerprint(1, 2)], {0: Fingerprint(3, 4)})

    def vote(self, s):
        self.calls.append("vote")
        return Vote(self.vote_value, lambda: self.vote_value, None)

    def reduced_gradients_finite(self):
        self.calls.append("reduced_gradients_finite")
        return False

    def confirm_nonfinite(self, step, bad, payload, scale):
        self.calls.append("confirm_nonfinite")
        return Confirmation(reproduced={0: 0}, verdict=None)

    def annotate(self, verdict):
        return verdict

    def own_pass(self, s):
        self.calls.append("own_pass")
        return self.grad

    def post_batch(self, blob, own_digest):
        self.calls.append("post_batch")
        return Incoming(own_digest, None, [], CPU, None)

    def fingerprint_weights(self):
        return WeightCheck(["w"], [Fingerprint(5, 6)])

    def weights_token(self, weights):
        return lambda: (weights.digest, True)

    def replay(self, step, incoming, scale):
        self.calls.append("replay")
        if self.replay_raises is ReplayError:  # the sharded layouts, when a rank could not load its batch
            raise ReplayError(step, {1: "could not load the batch it replays"})
        if self.replay_raises is not None:  # e.g. out of memory on this rank alone
            raise self.replay_raises("this rank's replay ran out of memory")
        return self.grad, None


def audit_step(layout: FixedLayout) -> tuple[Verifier, object]:
    stats = CheckStats(identity={}, job=None)
    verifier = Verifier(layout, stats)
    record = StepRecord(7, True, Payload(7, 0, [torch.zeros(2)], [], []),
                        torch.zeros((0, 2), dtype=torch.int64), [torch.tensor(0.5)])
    return verifier, verifier.before_update(record, None)


def test_a_clean_audit_step_passes_and_is_recorded(group):
    layout = FixedLayout(vote=[0.0, 1.0])
    verifier, outcome = audit_step(layout)
    assert outcome is PASSED
    assert verifier.history.last_audited_step == 7
    assert verifier.history.last_weights_verified_step == 6  # the weights before this step's update
    assert verifier.stats.runs == {"nonfinite": 1, "weights": 1, "replay": 1}
    assert layout.calls == ["vote", "own_pass", "post_batch", "replay"]


def test_a_nan_vote_decides_an_audit_step_and_the_audit_is_set_aside(group):
    layout = FixedLayout(vote=[float("nan"), 1.0])
    verifier, outcome = audit_step(layout)
    assert outcome.nonfinite == {0: 0} and outcome.verdict is None  # reproduced: the data's NaN
    # the audit ran (its replay travelled with the vote) but nothing of it is counted or verified
    assert layout.calls[:4] == ["vote", "own_pass", "post_batch", "replay"]
    assert layout.calls[4:] == ["reduced_gradients_finite", "confirm_nonfinite"]
    assert verifier.history.last_audited_step is None
    assert verifier.history.last_weights_verified_step is None
    assert "weights" not in verifier.stats.runs
    assert verifier.stats.runs["replay"] == 1  # the confirmation's replay only


def test_an_audit_that_raises_everywhere_does_not_hide_a_nan_vote(group):
    layout = FixedLayout(vote=[float("nan"), 1.0], replay_raises=ReplayError)
    verifier, outcome = audit_step(layout)
    assert outcome.nonfinite == {0: 0}
    assert layout.calls[-2:] == ["reduced_gradients_finite", "confirm_nonfinite"]


def test_an_audit_that_raises_everywhere_is_raised_when_the_vote_passes(group):
    layout = FixedLayout(vote=[0.0, 1.0], replay_raises=ReplayError)
    with pytest.raises(ReplayError, match="could not load"):
        audit_step(layout)


def test_an_error_of_this_rank_alone_propagates_untouched_whatever_the_vote(group):
    """Another rank may be inside the replay's collectives: judging the sums here (collectives of
    their own) could pair with the wrong ones. The error propagates, as before the vote travelled."""
    layout = FixedLayout(vote=[float("nan"), 1.0], replay_raises=MemoryError)
    with pytest.raises(MemoryError, match="out of memory"):
        audit_step(layout)
    assert "confirm_nonfinite" not in layout.calls


def test_a_single_replica_checks_its_gradients_with_one_host_read(group, monkeypatch):
    """A job of one replica runs only the local non-finite check, every step: its gradients once
    read one flag per parameter to the host (hundreds of stalls a step on a GPU); now one."""
    named = [(f"p{i}", torch.nn.Parameter(torch.ones(3))) for i in range(5)]
    for _, p in named:
        p.grad = torch.ones(3)
    layout = SimpleNamespace(topology=SimpleNamespace(world_size=1, rank=0), device=CPU, group=None,
                             named_parameters=named)
    verifier = Verifier(layout, CheckStats(identity={}, job=None))
    record = StepRecord(3, False, Payload(3, 0, [torch.zeros(2)], [], []),
                        torch.zeros((0, 2), dtype=torch.int64), [torch.tensor(0.5), torch.tensor(float("nan"))])
    reads = []
    real_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real_bool(t))
    assert verifier.before_update(record, None) is PASSED
    assert len(reads) == 1
    named[3][1].grad[1] = float("inf")
    outcome = verifier.before_update(record, None)
    assert (outcome.nonfinite, outcome.confirmed) == ({0: 1}, False)  # the first micro-batch whose loss is not finite
