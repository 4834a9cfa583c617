"""Check 2, the ring replay audit, and the GradScaler overflow confirmation that reuses it.

Every rank ``r`` replays the local batch of ``t = r + R (mod W)`` (same local index, next node)
and compares with what ``t`` computed. The digest of ``t``'s own pass travels to ``r`` with the
batch, so ``r`` compares locally and the ring agrees in one 16-byte all-reduce (see
``exchange.agree``); only then, on a mismatch, are every rank's two digests — own pass, replay —
gathered, and details only from the ranks involved. Nothing grows with the model. On a mismatch:
  - a rank in two mismatching pairs (its own batch replayed differently, and its replay of
    another's batch different) is the suspect: a persistent fault;
  - a single mismatching pair is settled by a tie-break replay on a third node: the side that
    disagrees with the third opinion is the suspect: a transient fault;
  - with fewer than three nodes there is no third opinion: both sides, ``ambiguous``.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..contract.alarm import CHECK_NONFINITE_LOCAL, CHECK_REPLAY
from .exchange import Incoming, broadcast_digest, gather_objects, gather_tensor, ring_exchange, ring_post
from .replay import PassResult, Payload, replay
from .topology import Topology
from .verdict import Verdict, parameter_summary


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
        return replay(self.module, self.loss_fn, self.params, payload, seed=self.seed,
                      device=self.device, scale=scale, with_norm=with_norm)

    # -- check 2 -------------------------------------------------------------------------------

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        """Send this rank's serialized batch, and the digest of its own pass, to its replayer, and
        start receiving the batch of the rank it audits (left in flight: the caller works on)."""
        topo, me = self.topology, self.topology.rank
        return ring_post(blob, own_digest, send_to=topo.replayer_of(me), recv_from=topo.replay_target(me),
                         device=self.device, group=self.group)

    def judge(self, own: PassResult, mine: PassResult, digests: list[list[bytes]], payload: Payload,
              scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Verdict | None:
        """The ring's verdict from every rank's ``[own pass, replay]`` digests; None when every
        replay matched its original bit for bit. Every rank calls it and reaches the same one."""
        topo, me = self.topology, self.topology.rank
        pairs = [(r, topo.replay_target(r)) for r in range(topo.world_size)
                 if digests[r][1] != digests[topo.replay_target(r)][0]]
        if not pairs:
            return None
        involved = {x for pair in pairs for x in pair}
        details = gather_objects((own, mine) if me in involved else None, self.group)
        suspects, ambiguous, tiebreaks = self._attribute(pairs, digests, payload, scale)
        evidence = {"pairs": [self._describe_pair(r, t, details) for r, t in pairs], "tiebreaks": tiebreaks}
        return Verdict(CHECK_REPLAY, suspects=sorted(suspects), ambiguous=ambiguous, evidence=evidence)

    def _attribute(self, pairs: list[tuple[int, int]], digests: list[list[bytes]], payload: Payload,
                   scale: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[set[int], bool, list[dict[str, Any]]]:
        """Name suspects from the mismatching (replayer, owner) pairs; identical on every rank."""
        topo = self.topology
        if topo.units < 3:
            return {x for pair in pairs for x in pair}, True, []
        counts = Counter(x for pair in pairs for x in pair)
        suspects = {x for x, c in counts.items() if c >= 2}
        ambiguous = False
        tiebreaks = []
        for replayer, owner in pairs:
            if replayer in suspects or owner in suspects:
                continue
            third = topo.replay_target(owner)
            opinion = self._tiebreak(owner, third, payload, scale)
            if opinion == digests[owner][0]:
                suspects.add(replayer)
                agrees = "owner"
            elif opinion == digests[replayer][1]:
                suspects.add(owner)
                agrees = "replayer"
            else:
                suspects.update((replayer, owner))
                ambiguous, agrees = True, "neither"
            tiebreaks.append({"replayer": replayer, "owner": owner, "third": third, "agrees_with": agrees})
        return suspects, ambiguous, tiebreaks

    def _tiebreak(self, owner: int, third: int, payload: Payload,
                  scale: Callable[[torch.Tensor], torch.Tensor] | None) -> bytes:
        """``third`` replays ``owner``'s batch; everyone learns the digest it got."""
        me = self.topology.rank
        theirs = ring_exchange(payload if me == owner else None, send_to=third if me == owner else None,
                               recv_from=owner if me == third else None, device=self.device, group=self.group)
        digest = self.run(theirs, scale).digest() if me == third else None
        return broadcast_digest(digest, third, self.device, self.group)

    def _describe_pair(self, replayer: int, owner: int, details: list[Any]) -> dict[str, Any]:
        original, replayed = details[owner][0], details[replayer][1]
        differing = [self.names[i] for i in sorted(original.grad_fps)
                     if original.grad_fps[i] != replayed.grad_fps.get(i)]
        return {
            "replayer": replayer, "owner": owner,
            "loss_bits_owner": [f"{fp.s0:016x}" for fp in original.loss_fps],
            "loss_bits_replay": [f"{fp.s0:016x}" for fp in replayed.loss_fps],
            "differing_parameters": parameter_summary(differing),
        }

    # -- mixed precision -----------------------------------------------------------------------

    def confirm_nonfinite(self, bad: list[int], payload: Payload,
                          scale: Callable[[torch.Tensor], torch.Tensor] | None) -> Verdict | None:
        """With a GradScaler a non-finite local gradient may be an honest overflow: replay each
        such rank's batch on another node (all at once). An overflow reproduces; SDC does not."""
        topo, me = self.topology, self.topology.rank
        target = topo.replay_target(me)
        theirs = ring_exchange(payload if me in bad else None,
                               send_to=topo.replayer_of(me) if me in bad else None,
                               recv_from=target if target in bad else None,
                               device=self.device, group=self.group)
        norm = self.run(theirs, scale, with_norm=True).grad_sq_norm if theirs is not None else 0.0
        norms = torch.tensor([norm], dtype=torch.float64, device=self.device)
        parts = gather_tensor(norms, self.group, "norms")
        replayed = {b: float(parts[topo.replayer_of(b)]) for b in bad}
        unexplained = [b for b in bad if math.isfinite(replayed[b])]
        if not unexplained:
            return None
        return Verdict(CHECK_NONFINITE_LOCAL, suspects=unexplained, evidence={
            "non_finite_ranks": bad,
            "confirmation": {b: {"replayed_on": topo.replayer_of(b), "replay_grad_sq_norm": replayed[b],
                                 "reproduced": b not in unexplained} for b in bad},
        })
