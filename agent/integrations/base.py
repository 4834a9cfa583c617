"""What every framework adapter needs from sdcguard, each once: the integration contract.

A framework that owns the loop calls the adapter from several places (a step begun in one
callback ends in another; its checkpointer saves and loads on its own schedule). The adapter
then needs the same five things whatever the framework, and takes them from here:

- :class:`HeldStep`: one ``guard.step`` held open across the framework's callbacks (opened at the
  first micro-batch, closed once the optimizer stepped, or with the error that cut it short);
- the save gate is :meth:`Guard.save_gate` itself (no save after an alarm, the step rule, check 3),
  called before the framework writes any file;
- :func:`rank0_outcome`: rank 0 did something alone (wrote or checked a manifest) and every rank
  learns how it went, so all raise the same ``CheckpointError`` or none does;
- :func:`agree`: each rank checked something of its own (its loaded weights); the same
  ``CheckpointError`` on every rank when any rank's check failed;
- :func:`adopt`: a verified checkpoint the framework loaded becomes the run's starting point.

Which checkpoints a framework's rotation must spare is the recovery rule
(``recovery.nameable``, ``recovery.worth_keeping``), not the adapter's.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..checkpoint import CheckpointError
from ..checks.exchange import broadcast_json, gather_objects
from ..guard import Guard
from ..manifest import resumed_history
from ..step import Step

__all__ = ["HeldStep", "adopt", "agree", "rank0_outcome"]


class HeldStep:
    """One ``guard.step`` held open across framework callbacks: what ``with guard.step(...)`` is in
    a loop of your own, for a framework that begins a step in one method and ends it in another."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: Step | None = None
        """The open step, or None between steps."""

    def open(self, guard: Guard, step: int, micro_batches: int) -> Step:
        """Begin ``step`` (``micro_batches`` backward passes before ``s.check()``)."""
        if self.current is not None:
            raise RuntimeError(f"sdcguard: step {step} begun while step {self.current.step} is still open")
        s = guard.step(step, micro_batches=micro_batches)
        s.__enter__()
        self.current = s
        return s

    def close(self, failed: BaseException | None) -> None:
        """End the open step, if any: ``failed`` None once the update ran (check 3 on weight-check
        steps), else the error that cut it short (the step then counts as not applied)."""
        s, self.current = self.current, None
        if s is not None:
            s.__exit__(None if failed is None else type(failed), failed, None)


def adopt(guard: Guard, path: str, manifest: Mapping[str, Any], weights_digest: str | None) -> int:
    """The run resumed from the verified checkpoint at ``path``: it inherits what its ``manifest``
    recorded, check 3's next comparison starts from ``weights_digest``, and the update count from
    the manifest's step (returned)."""
    step = int(manifest["step"])
    guard.resumed(step, resumed_history(path, manifest), weights_digest)
    return step


def rank0_outcome(guard: Guard, work: Callable[[], Mapping[str, Any]], refusal: str) -> dict[str, Any]:
    """Rank 0 runs ``work`` (e.g. writes a manifest) and every rank gets what it returned; when it
    raised (``CheckpointError``, ``OSError``, a full disk's ``RuntimeError``, anything), every rank
    raises ``CheckpointError("{refusal}: ...")``. Collective: every rank calls it."""
    outcome: dict[str, Any] = {"failure": None}
    failed: Exception | None = None
    if guard.topology.rank == 0:
        try:
            outcome.update(work())
        except Exception as exc:  # noqa: BLE001 - every rank learns it below, none is left waiting
            failed, outcome["failure"] = exc, f"{type(exc).__name__}: {exc}"
    if not guard.solo:
        outcome = broadcast_json(outcome if guard.topology.rank == 0 else None, 0, guard.device, guard.group)
    if outcome["failure"] is not None:
        raise CheckpointError(f"{refusal}: {outcome['failure']}") from failed
    return outcome


def agree(guard: Guard, failure: str | None) -> None:
    """Raise the same ``CheckpointError`` on every rank when any rank's own check failed
    (``failure``: what this rank found, None when its check passed), so no rank goes on to wait for
    the others in the framework's next collective. Collective: every rank calls it."""
    failures: list[str | None] = [failure]
    if not guard.solo:
        failures = gather_objects(failure, guard.group, guard.device)  # JSON, never a pickle
    found = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if found:
        raise CheckpointError("; ".join(f"rank {rank}: {f}" for rank, f in found))
