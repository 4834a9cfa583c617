"""Check 3 for pure FSDP (one replica): rank ``r + 1`` re-runs rank ``r``'s optimizer update.

On weight-check steps an optimizer step pre-hook copies what the update reads (this rank's local
shards, their gradients after the user's clipping, the optimizer state, the settings); after the
update, at the step's weight check, each rank sends that copy and the 16-byte digest of its shards
and state as they now are to its ring neighbour, re-runs its other neighbour's update
(``checks/update_replay.py``) and compares. One 16-byte agreement says whether every re-run
matched; only on a no are the digests gathered and a third opinion taken per mismatching pair, as
check 2 does: rank ``owner + 2`` re-runs the owner's update (with two ranks, the owner itself),
and the side it disagrees with is named. docs/sharded.md, "One replica: the update re-run".

Cost per weight-check step: the copy (about 4x the local shard for AdamW: shard, gradient, two
moments; 2x or 3x for SGD), sent to one rank; one optimizer step over it on the receiver; the
fingerprints of the shard and state on both. Nothing on other steps.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from ..checks.attribution import settle
from ..checks.exchange import (
    DIGEST_BYTES, Incoming, agree, broadcast_digest, gather_digests, gather_objects, ring_post, wait,
)
from ..checks.topology import Topology
from ..checks.update_replay import (
    UpdateSnapshot, differing, fingerprints, owner_result, refusal, rerun, result_digest, settle_alone, take_snapshot,
    tiebreaks, update_verdict,
)
from ..checks.verdict import Verdict
from ..errors import ReplayError
from ..fingerprint import Fingerprint

log = logging.getLogger("sdcguard")


class UpdateCheck:
    """This rank's part of the update re-run: the copy before the update, the ring after it."""

    def __init__(self, *, optimizer: torch.optim.Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]],
                 topology: Topology, device: torch.device, weight_check_every: int) -> None:
        # Settings.
        self.optimizer = optimizer
        self.names = {id(p): n for n, p in named_parameters}
        self.rank, self.world = topology.rank, topology.world_size
        self.device = device
        self.every = weight_check_every
        self.refused = refusal(optimizer) if self.world > 1 else "one rank: nobody to re-run its update"
        """Why the update cannot be re-run (the start-up plan says it), or None."""
        # State.
        self.armed: int | None = None
        """The weight-check step in progress, whose update is copied before it runs."""
        self.snapshot: UpdateSnapshot | None = None
        self.unreplayable: str | None = None
        self.reruns = 0
        """Updates of other ranks this rank re-ran."""
        self.bytes_sent = 0
        """Bytes this rank sent for its last re-run (the copy, framed): what a check costs on the wire."""
        self.last_nbytes = 0
        """Of which tensor data (shard, gradient, state)."""
        self.seconds: dict[str, float] = {}
        """Where the last check's time went: ``copy`` (before the update), ``send`` (this rank's
        fingerprints and serialization), ``exchange`` (the transfer), ``rerun`` (load, re-run, fingerprints)."""
        self._told: set[str] = set()
        if self.refused is None:
            self._handle = optimizer.register_step_pre_hook(self._before_update)

    @property
    def active(self) -> bool:
        return self.refused is None and self.every > 0

    def plan_line(self) -> str:
        if self.refused is not None:
            return f"does not run update re-run (check 3 with one replica): {self.refused}"
        if self.every <= 0:
            return "does not run update re-run (check 3 with one replica): weight_check_every is 0"
        third = "a third rank settles a lone mismatch" if self.world >= 3 else (
            "with 2 ranks a lone mismatch is settled by the owner's own re-run, or both are named")
        return (f"runs update re-run (check 3 with one replica) every {self.every} steps: rank r+1 re-runs rank r's "
                f"{type(self.optimizer).__name__} update from a copy of its shard, clipped gradient and state "
                f"(about {self._copies()}x the shard sent) and compares fingerprints, naming the rank; {third}")

    def _copies(self) -> int:
        kind = type(self.optimizer).__name__
        if kind == "SGD":
            return 3 if any(g.get("momentum") for g in self.optimizer.param_groups) else 2
        return 5 if any(g.get("amsgrad") for g in self.optimizer.param_groups) else 4

    # -- before the update -----------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.snapshot, self.unreplayable = None, None
        self.armed = step if self.active and step % self.every == 0 else None

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # After the update gate's pre-hook (registered first): only an update that goes ahead is copied.
        if self.armed is None:
            return None
        closure = kwargs.get("closure") if set(kwargs) == {"closure"} and not args[1:] else (
            args[1] if len(args) == 2 and not kwargs else None)
        if closure is not None:
            # A closure (Lightning's: the gradient clipping runs inside it) runs inside step() before
            # the update reads the gradients: copy them after it, not now.
            def closure_then_copy() -> Any:
                result = closure()
                self._copy(optimizer)
                return result
            return (args[0],), {"closure": closure_then_copy}
        if args[1:] or kwargs:  # args[0] is the optimizer; a GradScaler's grad_scale/found_inf (fused)
            self.snapshot, self.unreplayable = None, "optimizer.step() was given arguments (a GradScaler's grad_scale)"
            return None
        self._copy(optimizer)
        return None

    def _copy(self, optimizer: torch.optim.Optimizer) -> None:
        if any(optimizer.__dict__.get(key) is not None for key in ("grad_scale", "found_inf")):
            # torch's GradScaler hands a fused optimizer its scale and overflow flag as attributes the
            # kernel reads (and the device gate its mask): a re-run without them would differ.
            self.snapshot, self.unreplayable = None, "a GradScaler (or the device gate) set grad_scale/found_inf on the fused optimizer"
            return None
        started = time.perf_counter()
        try:
            self.snapshot = take_snapshot(optimizer, self.armed, self.names, _local)
        except Exception as exc:  # noqa: BLE001 - out of memory for the copy: this update goes unchecked
            # (every rank learns it at the check, as for an update nobody could copy), never a
            # failed optimizer.step() on this rank alone while the others go on into the check
            log.warning("sdcguard: copying step %s's update for its re-run failed: %s: %s", self.armed,
                        type(exc).__name__, exc)
            self.snapshot, self.unreplayable = None, f"copying its inputs failed on a rank ({type(exc).__name__})"
        self.seconds = {"copy": time.perf_counter() - started}
        return None

    # -- after it (collective) -------------------------------------------------------------------

    def check(self, step: int) -> Verdict | None:
        """Collective on weight-check steps (every rank arms the same steps): every rank's update of
        ``step`` re-run by its ring neighbour; the verdict, or None. Other steps: no collective."""
        if self.armed is None or self.armed != step:
            return None
        self.armed = None
        snap, self.snapshot = self.snapshot, None
        if snap is not None and snap.step != step:
            snap = None
        # A rank without a copy (no optimizer.step() in the step, a closure) still joins the ring with
        # an empty one: the agreement below is the only collective of a passing check.
        started = time.perf_counter()
        try:
            mine = owner_result(self.optimizer, snap.names, _local) if snap is not None else []
            my_digest = result_digest(mine) if snap is not None else bytes(DIGEST_BYTES)
            blob = _frame(snap)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the frame: joined without a copy
            log.warning("sdcguard: step %d: this rank's update could not be sent for its re-run: %s: %s", step,
                        type(exc).__name__, exc)
            self.unreplayable = f"sending it failed on a rank ({type(exc).__name__})"
            snap, mine, my_digest, blob = None, [], bytes(DIGEST_BYTES), _frame(None)
        self.bytes_sent, self.last_nbytes = blob.numel(), snap.nbytes if snap is not None else 0
        self.seconds["send"] = time.perf_counter() - started
        after, before = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        started = time.perf_counter()
        incoming = ring_post(blob, my_digest, after, before, self.device, None)
        failure, result, rerun_digest, missing = None, [], bytes(DIGEST_BYTES), snap is None
        try:
            owners = _unframe(incoming, self.device)
            self.seconds["exchange"] = time.perf_counter() - started
            started = time.perf_counter()
            if owners is None:
                missing = True
            else:
                if owners.step != step:
                    raise ValueError(f"rank {before} sent its update of step {owners.step}, not {step}")
                result = rerun(type(self.optimizer), owners)
                rerun_digest = result_digest(result)
                self.reruns += 1
        except Exception as exc:  # noqa: BLE001 - every rank learns of it below
            log.exception("sdcguard: re-running rank %d's update of step %d failed", before, step)
            failure = exc
        self.seconds["rerun"] = time.perf_counter() - started
        matched = failure is None and not missing and rerun_digest == incoming.note
        if agree(bytes(DIGEST_BYTES), self.device, None, veto=not matched):
            return None
        return self._judge(step, snap, blob, my_digest, rerun_digest, failure, missing, mine, result)

    def _judge(self, step: int, snap: UpdateSnapshot | None, blob: torch.Tensor, my_digest: bytes,
               rerun_digest: bytes, failure: Exception | None, missing: bool,
               mine: list[tuple[str, torch.Tensor]], result: list[tuple[str, torch.Tensor]]) -> Verdict | None:
        """After a veto: every rank's digests, the failures (a ReplayError on every rank), the
        tie-breaks, the verdict — the same on every rank. Per-tensor fingerprints are exchanged
        only here, by the two sides of each mismatching pair, to say what differs."""
        world = self.world
        digests = gather_digests([my_digest, rerun_digest], self.device, None)
        pairs = [(r, (r - 1) % world) for r in range(world) if digests[r][1] != digests[(r - 1) % world][0]]
        owners, rerunners = {o for _, o in pairs}, {r for r, _ in pairs}
        said = gather_objects({
            "failure": None if failure is None else f"{type(failure).__name__}: {failure}",
            "missing": missing,
            "own": [list(fp) for fp in fingerprints(mine)] if self.rank in owners and mine else None,
            "rerun": [list(fp) for fp in fingerprints(result)] if self.rank in rerunners and result else None,
            "labels": [n for n, _ in result] if self.rank in rerunners and result else None,
        }, None, self.device)
        failures = {r: s["failure"] for r, s in enumerate(said) if s["failure"] is not None}
        if failures:
            raise ReplayError(step, failures) from failure
        if any(s["missing"] for s in said):
            self._tell_once(f"step {step}: not every rank's update of this step was copied "
                            f"({self.unreplayable or 'no optimizer.step() in the step'}): the update re-run skipped it")
            return None
        assert snap is not None
        settled = {}
        for rerunner, owner in tiebreaks(pairs, world):
            third = (owner + 2) % world if world >= 3 else owner
            opinion = broadcast_digest(self._third_opinion(owner, third, snap, blob), third, self.device, None)
            owner_digest, rerun_of_owner = digests[owner][0], digests[rerunner][1]
            settled[(rerunner, owner)] = (settle(owner_digest, rerun_of_owner, opinion) if world >= 3
                                          else settle_alone(owner_digest, rerun_of_owner, opinion))
        what = {o: differing(said[r]["labels"] or [], _fps(said[o]["own"]), _fps(said[r]["rerun"])) for r, o in pairs}
        return update_verdict(step, pairs, world, settled, what)

    def _third_opinion(self, owner: int, third: int, snap: UpdateSnapshot, blob: torch.Tensor) -> bytes | None:
        """The digest of ``third``'s re-run of ``owner``'s update (on ``third``; None elsewhere, and
        from a re-run that failed: zeros are broadcast, which settle for neither side)."""
        if self.rank == owner and owner != third:
            _unframe(ring_post(blob, bytes(DIGEST_BYTES), third, None, self.device, None), self.device)
            return None
        if self.rank != third:
            return None
        try:
            if owner == third:
                return result_digest(rerun(type(self.optimizer), snap))
            owners = _unframe(ring_post(None, bytes(DIGEST_BYTES), None, owner, self.device, None), self.device)
            assert owners is not None  # the owner of a mismatching pair had its copy
            return result_digest(rerun(type(self.optimizer), owners))
        except Exception:  # noqa: BLE001 - the others wait for this rank's answer in the broadcast
            log.exception("sdcguard: the tie-break re-run of rank %d's update failed; both sides stay suspect",
                          owner)
            return None

    def _tell_once(self, message: str) -> None:
        key = message.split(":", 1)[-1]
        if key not in self._told:
            self._told.add(key)
            log.warning("sdcguard: %s", message)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _frame(snap: UpdateSnapshot | None) -> torch.Tensor:
    """What travels: 8 bytes giving the length of the small part (settings, names, shapes: JSON,
    never a pickle), the small part, then the shards, gradients and state end to end as raw bytes
    (``torch.save`` of megabytes, or of hundreds of small objects, costs more than the check)."""
    wire = snap.to_wire() if snap is not None else {"flat": torch.empty(0, dtype=torch.uint8)}
    flat = wire.pop("flat")
    head = torch.frombuffer(bytearray(json.dumps(wire if snap is not None else None).encode()), dtype=torch.uint8)
    size = torch.tensor([head.numel()], dtype=torch.int64).view(torch.uint8)
    return torch.cat([size.to(flat.device), head.to(flat.device), flat])


def _unframe(incoming: Incoming, device: torch.device) -> UpdateSnapshot | None:
    """The snapshot a peer framed (None: it had none); waits for this rank's own send too."""
    for work in incoming.works:
        wait(work)
    incoming.works, incoming.sending = [], None
    buffer = incoming.buffer
    if buffer is None:
        return None
    size = int(buffer[:8].cpu().view(torch.int64).item())
    head = json.loads(buffer[8:8 + size].cpu().numpy().tobytes().decode())
    if head is None:
        return None
    return UpdateSnapshot.from_wire({**head, "flat": buffer[8 + size:]})


def _fps(said: list[list[int]] | None) -> list[Fingerprint]:
    return [Fingerprint(int(a), int(b)) for a, b in said or []]
