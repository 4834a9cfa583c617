"""The typed errors the library raises; each is raised on every rank alike, after the ranks agree."""
from __future__ import annotations

from typing import Any

from .contract.alarm import gpu_text


class SDCDetected(RuntimeError):
    """A check found silent data corruption; the step was not applied (or, for check 3, the
    next checkpoint is blocked). Every rank raises it with the same alarm record, so the whole
    job stops cleanly instead of hanging in a collective that one rank skipped."""

    def __init__(self, *, alarm: dict[str, Any]) -> None:
        self.alarm = alarm
        self.check: str = alarm["check"]
        self.step: int = alarm["step"]
        self.suspect_ranks: list[int] = list(alarm["suspect_ranks"])
        self.ambiguous: bool = alarm["ambiguous"]
        who = ", ".join(_describe(s) for s in alarm["suspects"]) or "no rank can be named"
        super().__init__(f"silent data corruption: check {self.check} at step {self.step}: {who}")


class NonFiniteGradient(RuntimeError):
    """A NaN/Inf local gradient (or loss) that is *not* silent data corruption: replaying the batch
    on another node reproduced it, so the data or the model is at fault (or, with a single
    replica, there was nobody to replay it on: ``confirmed`` is False). No alarm is published and
    no rank is named; the step's update is refused. Raised on every rank with the same fields.
    ``Config(on_nonfinite="skip")`` skips such steps instead (counted and logged)."""

    def __init__(self, *, step: int, ranks: dict[int, int | None], confirmed: bool) -> None:
        self.step = step
        self.ranks = dict(ranks)
        """rank -> the micro-batch index that went non-finite (None when not known)."""
        self.confirmed = confirmed
        where = ", ".join(f"rank {r}" + (f" micro-batch {m}" if m is not None else "") for r, m in sorted(ranks.items()))
        how = "reproduced by a replay on another node" if confirmed else "not confirmable with a single replica"
        super().__init__(f"sdcguard: non-finite gradient at step {step} ({where}), {how}: the data or the "
                         "model is at fault, not the hardware; the update was not applied")


class UncheckedUpdate(RuntimeError):
    """An optimizer step was attempted before sdcguard's checks of that step ran (or after they
    failed): refused, so that no update is ever applied unchecked."""


class ReplayError(RuntimeError):
    """A rank could not replay its neighbour's batch (check 2): e.g. the batch would not unpickle
    or ``loss_fn`` raised during the replay. Raised on every rank — the failing rank joins the
    audit's agreement first and vetoes it — so the job stops cleanly instead of hanging. Not in
    itself evidence of silent data corruption: no alarm is published; the step is not applied."""

    def __init__(self, step: int, failures: dict[int, str], what: str = "the audit's replay") -> None:
        self.step = step
        self.failures = failures
        """rank -> what went wrong there."""
        where = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        super().__init__(f"sdcguard: {what} failed at step {step} ({where}); the step was not applied")


class ConfigurationError(ValueError):
    """The training set-up cannot support a check (e.g. ranks that cannot replay bit for bit)."""


def _describe(suspect: dict[str, Any]) -> str:
    where = [f"rank {suspect['rank']}"]
    if suspect.get("node"):
        where.append(f"node {suspect['node']}")
    if suspect.get("pod"):
        where.append(f"pod {suspect['pod']}")
    if suspect.get("gpu"):
        where.append(gpu_text(suspect["gpu"]))
    return " ".join(where)
