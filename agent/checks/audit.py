"""Check 2, the ring replay audit, and the GradScaler overflow confirmation that reuses it.

Every rank ``r`` replays the local batch of ``t = r + R (mod W)`` (same local index, next node)
and compares with what ``t`` computed. The digest of ``t``'s own pass travels to ``r`` with the
batch, so ``r`` compares locally and the ring agrees in one 16-byte all-reduce (see
``exchange.agree``); only then, on a mismatch, are every rank's two digests — own pass, replay —
gathered, and details only from the ranks involved. Nothing grows with the model. Who is named
on a mismatch is decided by the pure rules in ``attribution``; this module runs the replays and
the tie-breaks they ask for.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..contract.alarm import CHECK_NONFINITE_LOCAL, CHECK_REPLAY
from .attribution import NEITHER, Attribution, attribute, mismatching_pairs, settle, suspects_after
from .exchange import DIGEST_BYTES, Incoming, broadcast_digest, gather_objects, gather_tensor, ring_post, serialize
from .replay import PassResult, Payload, replay
from .replay_failures import CONFIRMATION, raise_replay_failures
from .topology import Topology
from .verdict import Verdict, parameter_summary

log = logging.getLogger("sdcguard")

_FAILED = -2.0
"""A confirmation row's second value when this rank's replay failed (-1: finite, k >= 0: the
first non-finite micro-batch)."""


@dataclass(slots=True)
class Replayer:
    """Everything a replay needs, shared by the audit, its tie-breaks and overflow checks."""

    module: torch.nn.Module
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    params: list[tuple[int, torch.nn.Parameter]]
    names: dict[int, str]
    topology: Topology
    group: dist.ProcessGroup | None
    device: torch.device
    seed: int

    def run(self, payload: Payload, scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
            with_norm: bool = False) -> PassResult:
        return replay(self.module, self.loss_fn, self.params, Payload.from_wire(payload), seed=self.seed,
                      device=self.device, scale=scale, with_norm=with_norm)

    # -- check 2 -------------------------------------------------------------------------------

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        """Send this rank's serialized batch, and the digest of its own pass, to its replayer, and
        start receiving the batch of the rank it audits (left in flight: the caller works on)."""
        topo, me = self.topology, self.topology.rank
        return ring_post(blob, own_digest, send_to=topo.replayer_of(me), recv_from=topo.replay_target(me),
                         device=self.device, group=self.group)

    def verdict(self, own: PassResult, mine: PassResult, digests: list[list[bytes]], payload: Payload,
                scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Verdict | None:
        """The ring's verdict from every rank's ``[own pass, replay]`` digests; None when every
        replay matched its original bit for bit. Every rank calls it (the exchanges below are
        collective) and reaches the same one; the judgement itself is :func:`judge_replays`."""
        topo = self.topology
        pairs = mismatching_pairs(digests, topo.replay_target)
        if not pairs:
            return None
        details = self._exchange_details(own, mine, {x for pair in pairs for x in pair})
        found = attribute(pairs, topo.units)
        thirds = {(replayer, owner): (topo.replay_target(owner),
                                      self._tiebreak(owner, topo.replay_target(owner), payload, scale))
                  for replayer, owner in found.tiebreaks}
        return judge_replays(pairs, found, digests, thirds, details, self.names)

    def _exchange_details(self, own: PassResult, mine: PassResult, involved: set[int]) -> list[Any]:
        """Per rank ``[own pass, replay]`` (None from the ranks no mismatching pair involves)."""
        me = self.topology.rank
        said = gather_objects([own.to_json(), mine.to_json()] if me in involved else None, self.group, self.device)
        return [None if d is None else [PassResult.from_json(d[0]), PassResult.from_json(d[1])] for d in said]

    def _tiebreak(self, owner: int, third: int, payload: Payload,
                  scale: Callable[[torch.Tensor], torch.Tensor] | None) -> bytes:
        """``third`` replays ``owner``'s batch; everyone learns the digest it got. A third replay
        that fails tells no digest (zeros, which settle for neither: both stay suspect), rather
        than leaving everyone in the broadcast."""
        me = self.topology.rank
        incoming = ring_post(serialize(payload) if me == owner else None, bytes(DIGEST_BYTES),
                             send_to=third if me == owner else None, recv_from=owner if me == third else None,
                             device=self.device, group=self.group)
        digest = None
        if me != third:
            incoming.receive()  # this rank's own send, if any, completes
        else:
            try:
                digest = self.run(incoming.receive(), scale).digest()
            except Exception:  # noqa: BLE001 - the others wait for this rank's answer
                log.exception("sdcguard: the tie-break replay of rank %d's batch failed; both ranks stay suspect", owner)
        return broadcast_digest(digest, third, self.device, self.group)

    # -- non-finite confirmation -----------------------------------------------------------------

    def confirm_nonfinite(self, step: int, bad: list[int], payload: Payload,
                          scale: Callable[[torch.Tensor], torch.Tensor] | None) -> Confirmation:
        """Replay each rank's batch whose local gradient was not finite on another node (all at
        once): a NaN/Inf that reproduces comes from the data, the model or an honest GradScaler
        overflow; one that does not is silent data corruption. Every rank gets the same answer,
        or the same ReplayError when a replay failed somewhere (its row in the gather says so)."""
        topo, me = self.topology, self.topology.rank
        target = topo.replay_target(me)
        incoming = ring_post(serialize(payload) if me in bad else None, bytes(DIGEST_BYTES),
                             send_to=topo.replayer_of(me) if me in bad else None,
                             recv_from=target if target in bad else None, device=self.device, group=self.group)
        result, failure = None, None
        try:
            theirs = incoming.receive()
            result = self.run(theirs, scale, with_norm=True) if theirs is not None else None
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            failure = exc
        row = [0.0, _FAILED if failure is not None else -1.0] if result is None else [
            result.grad_sq_norm, -1.0 if result.nonfinite_micro is None else float(result.nonfinite_micro)]
        rows = gather_tensor(torch.tensor(row, dtype=torch.float64, device=self.device), self.group, "norms").tolist()
        if any(r[1] == _FAILED for r in rows):
            raise_replay_failures(step, failure, self.group, self.device, CONFIRMATION)
        replayed = {b: rows[topo.replayer_of(b)] for b in bad}
        return judge_confirmation(bad, {b: (v[0], None if v[1] < 0 else int(v[1])) for b, v in replayed.items()},
                                  {b: topo.replayer_of(b) for b in bad})


def judge_replays(pairs: list[tuple[int, int]], found: Attribution, digests: list[list[bytes]],
                  thirds: dict[tuple[int, int], tuple[int, bytes]], details: list[Any],
                  names: dict[int, str]) -> Verdict:
    """Pure: who is named for the mismatching ``(replayer, owner)`` pairs, from the ring's
    attribution, each tie-break's third opinion (``(replayer, owner) -> (third, its digest)``),
    and the ``[own pass, replay]`` details of the ranks involved."""
    suspects, ambiguous, tiebreaks = set(found.suspects), found.ambiguous, []
    for (replayer, owner), (third, opinion) in thirds.items():
        agrees = settle(digests[owner][0], digests[replayer][1], opinion)
        suspects |= suspects_after(agrees, replayer, owner)
        ambiguous |= agrees == NEITHER
        tiebreaks.append({"replayer": replayer, "owner": owner, "third": third, "agrees_with": agrees})
    evidence = {"pairs": [_describe_pair(r, t, details, names) for r, t in pairs], "tiebreaks": tiebreaks}
    return Verdict(CHECK_REPLAY, suspects=sorted(suspects), ambiguous=ambiguous, evidence=evidence)


def _describe_pair(replayer: int, owner: int, details: list[Any], names: dict[int, str]) -> dict[str, Any]:
    original, replayed = details[owner][0], details[replayer][1]
    differing = [names[i] for i in sorted(original.grad_fps) if original.grad_fps[i] != replayed.grad_fps.get(i)]
    return {
        "replayer": replayer, "owner": owner,
        "loss_bits_owner": [f"{fp.s0:016x}" for fp in original.loss_fps],
        "loss_bits_replay": [f"{fp.s0:016x}" for fp in replayed.loss_fps],
        "differing_parameters": parameter_summary(differing),
    }


@dataclass(frozen=True, slots=True)
class Confirmation:
    """What replaying the non-finite ranks' batches elsewhere showed."""

    reproduced: dict[int, int | None]
    """rank -> the micro-batch that went non-finite in the replay too (the data or model's doing)."""
    verdict: Verdict | None
    """``nonfinite-local`` naming the ranks whose NaN/Inf did not reproduce, else None."""


def judge_confirmation(bad: list[int], replayed: dict[int, tuple[float, int | None]],
                       replayed_on: dict[int, int]) -> Confirmation:
    """Pure: ``replayed[rank] = (replay's squared gradient norm, first non-finite micro-batch)``."""
    unexplained = [b for b in bad if math.isfinite(replayed[b][0])]
    reproduced = {b: replayed[b][1] for b in bad if b not in unexplained}
    verdict = None if not unexplained else Verdict(CHECK_NONFINITE_LOCAL, suspects=unexplained, evidence={
        "non_finite_ranks": bad,
        "confirmation": {b: {"replayed_on": replayed_on[b], "replay_grad_sq_norm": replayed[b][0],
                             "reproduced": b not in unexplained} for b in bad},
    })
    return Confirmation(reproduced, verdict)
