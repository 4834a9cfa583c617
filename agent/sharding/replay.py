"""Check 2 for a sharded model: the whole mesh recomputes other ranks' batches together, and each
rank compares the local gradients it gets with the owner's (docs/design.md §3, "Sharded models").

In FSDP2 only parameters travel: every rank all-gathers a unit's full parameters, runs the forward
and backward of its *own* micro-batch, and hands its *local* unsharded gradient of the unit to the
reduce-scatter (``reduce_record.RecordingReduceScatter`` sees it, row by row, before any other
rank's is added). That local gradient depends on the batch and the full parameters only, not on
the rank's place in the mesh, so any rank can recompute any other rank's — but not alone: the
forward and backward of a sharded model all-gather its units, so every rank of the mesh must run
a replay at the same time. Each rank therefore replays the batch of the rank the DDP ring gives it
(``Topology.replay_target``: same local index, next node) and compares, per reduce-scatter, the
fingerprint of its replayed local input with the one the owner recorded in its own pass. A
difference names one rank (``checks/attribution.py``'s rules, unchanged), for pure FSDP as for
HSDP, without comparing any reduced shard.

What the replay must not disturb, and how (:func:`_isolated`):
  - the reduce-scatter is a no-op while ``recorder.replay`` is set: the replayed input is
    fingerprinted and nothing is sent, so no replayed gradient reaches another rank or a shard;
  - the sharded parameters' ``.grad`` (what the optimizer will read) are taken out before the
    replay and put back after, the same objects, untouched; FSDP2 writes the replay's (zero)
    output into fresh ``.grad`` tensors that are then dropped (one shard-sized gradient at most);
    post-accumulate-grad hooks (an optimizer in backward) are detached meanwhile;
  - HSDP's all-reduce is switched off (``all_reduce_grads``), so FSDP2 keeps the replay's output
    as a partial, which is replaced by the real step's own (None) afterwards; user all-reduce
    hooks are detached, the gradient-sync pattern of the real step is repeated per micro-batch
    and restored, and the backward is a last backward, so FSDP2's post-backward ends as it does
    after every step (parameters resharded, prefetch state cleared);
  - the buffers are the ones each of the owner's forwards saw (as for DDP), put back after; the
    forward runs under the owner's seed for (step, rank, micro-batch) (``checks/rng.py``).

The reduced shards are not compared: each rank's reduce-scatter output mixes the gradients of its
whole shard group, so a comparison needs the ring to map one shard group onto another position
for position (HSDP with ``S`` dividing the ranks per node only) and an identical reduction order
in two communicators (true on gloo, not promised by NCCL); it would also double an audit's
reduce-scatter traffic, for a fault that check 4 already bounds on every step while the local
comparison above covers every operand of the reduction exactly.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..checks.audit import Confirmation, Replayer, judge_confirmation
from ..checks.exchange import DIGEST_BYTES, _from_bytes, broadcast_digest, gather_tensor, ring_post, serialize, wait
from ..checks.replay import PassResult, Payload, _replay_mode, load_buffers, snapshot_buffers
from ..checks.replay_failures import CONFIRMATION, received_everywhere
from ..checks.rng import forward_seed, seeded
from ..fingerprint import fingerprint_sums, to_fingerprints, to_fingerprints_together
from .reduce_record import Reduction, ReplayTrace, ShardedRecorder

Scale = Callable[[torch.Tensor], torch.Tensor] | None


def pass_key(unit: int, micro: int, units: int) -> int:
    """The index of a reduce-scatter in a pass: one per unit and micro-batch."""
    return micro * units + unit


def own_pass(records: list[Reduction], loss_sums: torch.Tensor, units: int) -> PassResult:
    """What this rank's own pass recorded (an audited step): loss bits and each local input, from
    their fingerprint sums in one read to the host."""
    losses, *fps = to_fingerprints_together([loss_sums, *(rec.fp.unsqueeze(0) for rec in records)])
    return PassResult(losses, {pass_key(rec.unit, rec.micro, units): fp for rec, [fp] in zip(records, fps)})


def labels(recorder: ShardedRecorder, micro_batches: int) -> dict[int, str]:
    """pass key -> ``"<unit path> (micro-batch m)"`` (what an alarm's evidence names)."""
    units = len(recorder.units)
    return {pass_key(u, m, units): f"{path or '<root>'} (micro-batch {m})"
            for m in range(micro_batches) for u, (path, _) in enumerate(recorder.units)}


def replay_sharded(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                   recorder: ShardedRecorder, payload: Payload, *, seed: int, device: torch.device,
                   scale: Scale = None, with_norm: bool = False) -> PassResult:
    """Recompute ``payload``'s step on the sharded ``model`` (collective: every rank calls it at
    once, each with its own payload); the real step's gradients and FSDP2 state are left as they were."""
    pattern = recorder.sync_pattern()
    units = len(recorder.units)
    losses: list[torch.Tensor] = []
    trace = ReplayTrace(norms=with_norm)
    with _isolated(model, recorder, trace):
        for i, micro in enumerate(payload.micro_batches):
            trace.micro = i
            for unit, (_, group) in enumerate(recorder.units):
                group.reduce_grads = unit in pattern.get(i, set()) if pattern else i == len(payload.micro_batches) - 1
            if payload.buffers:
                load_buffers(model, payload.buffers[i])
            with seeded(forward_seed(seed, payload.step, payload.owner, i), device):
                loss = loss_fn(model, micro)
            weighting = payload.weighting[i] if payload.weighting else None
            scaled = weighting.apply(loss) if weighting is not None else loss
            (scale(scaled) if scale is not None else scaled).backward()
            losses.append(loss.detach())
    # Every local input's sums and the losses' in one read to the host for the whole pass.
    sums = [c[2] for c in trace.calls]
    if losses:
        sums += list(fingerprint_sums(losses))
    every = to_fingerprints(torch.stack(sums)) if sums else []
    fps, loss_fps = every[:len(trace.calls)], every[len(trace.calls):]
    result = PassResult(loss_fps, {pass_key(u, m, units): fp for (u, m, _, _), fp in zip(trace.calls, fps)})
    if with_norm:
        sq = torch.stack([c[3] for c in trace.calls]).sum() if trace.calls else torch.zeros((), dtype=torch.float64)
        result.grad_sq_norm = float(sq)
        result.nonfinite_micro = _first_nonfinite(trace, [bool(torch.isfinite(loss).all()) for loss in losses])
    return result


def _first_nonfinite(trace: ReplayTrace, loss_finite: list[bool]) -> int | None:
    """The first micro-batch whose loss or any local gradient was not finite."""
    bad = [i for i, ok in enumerate(loss_finite) if not ok]
    bad += [m for _, m, _, sq in trace.calls if not bool(torch.isfinite(sq))]
    return min(bad) if bad else None


@contextlib.contextmanager
def _isolated(model: torch.nn.Module, recorder: ShardedRecorder, trace: ReplayTrace) -> Iterator[None]:
    """Everything of the real step a replay's forward and backward could touch, set aside and put
    back (see the module docstring)."""
    groups = [g for _, g in recorder.units]
    params = [p for g in groups for p in g.fsdp_params]
    saved_groups = [(g.reduce_grads, g.all_reduce_grads, g._partial_reduce_output, g._all_reduce_hook) for g in groups]
    saved_params = [(p.sharded_param.grad, p.sharded_param._post_accumulate_grad_hooks, p.unsharded_accumulated_grad)
                    for p in params]
    state = model._get_fsdp_state()._state_ctx  # type: ignore[operator]
    last_backward = state.is_last_backward
    buffers = snapshot_buffers(model)
    try:
        for g in groups:
            g.all_reduce_grads = False  # HSDP: keep the replay's output as a partial, all-reduce nothing
            g._partial_reduce_output = None
            g._all_reduce_hook = None
        for p in params:
            p.sharded_param.grad = None
            p.unsharded_accumulated_grad = None
            p.sharded_param._post_accumulate_grad_hooks = None
        state.is_last_backward = True
        recorder.replay = trace
        with _replay_mode():
            yield
    finally:
        recorder.replay = None
        state.is_last_backward = last_backward
        for g, (reduce, all_reduce, partial, hook) in zip(groups, saved_groups):
            g.reduce_grads, g.all_reduce_grads, g._partial_reduce_output, g._all_reduce_hook = reduce, all_reduce, partial, hook
        for p, (grad, hooks, accumulated) in zip(params, saved_params):
            p.sharded_param.grad = grad
            p.sharded_param._post_accumulate_grad_hooks = hooks
            p.unsharded_accumulated_grad = accumulated
        load_buffers(model, buffers)


class ShardedReplayer(Replayer):
    """The DDP ring's replayer (``checks/audit.py``: batch transfer, attribution, tie-breaks,
    judgements) with every replay run collectively on the sharded model."""

    __slots__ = ("recorder",)

    def __init__(self, *, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 recorder: ShardedRecorder, topology: Any, device: torch.device, seed: int) -> None:
        super().__init__(module=model, loss_fn=loss_fn, params=[], names={}, topology=topology, group=None,
                         device=device, seed=seed)
        self.recorder = recorder

    def run(self, payload: Payload, scale: Scale = None, with_norm: bool = False) -> PassResult:
        return replay_sharded(self.module, self.loss_fn, self.recorder, Payload.from_wire(payload), seed=self.seed,
                              device=self.device, scale=scale, with_norm=with_norm)

    def _tiebreak(self, owner: int, third: int, payload: Payload, scale: Scale) -> bytes:
        """Every rank replays ``owner``'s batch (a replay is collective); ``third``'s digest is
        the third opinion everyone learns."""
        me = self.topology.rank
        theirs = broadcast_payload(payload if me == owner else None, owner, self.device)
        digest = self.run(theirs, scale).digest()
        return broadcast_digest(digest if me == third else None, third, self.device, None)

    def confirm_nonfinite(self, step: int, bad: list[int], payload: Payload, scale: Scale) -> Confirmation:
        """As DDP's (``Replayer.confirm_nonfinite``), but every rank replays its ring target's
        batch at once (a replay is collective, started once every rank holds its batch); only the
        non-finite ranks' replays are read."""
        topo, me = self.topology, self.topology.rank
        incoming = ring_post(serialize(payload), bytes(DIGEST_BYTES), send_to=topo.replayer_of(me),
                             recv_from=topo.replay_target(me), device=self.device, group=None)
        theirs = received_everywhere(step, lambda: Payload.from_wire(incoming.receive()), topo.replay_target(me),
                                     self.device, None, CONFIRMATION)
        result = self.run(theirs, scale, with_norm=True)
        row = [result.grad_sq_norm or 0.0, -1.0 if result.nonfinite_micro is None else float(result.nonfinite_micro)]
        parts = gather_tensor(torch.tensor(row, dtype=torch.float64, device=self.device), None, "norms")
        replayed = {b: parts[topo.replayer_of(b)].tolist() for b in bad}
        return judge_confirmation(bad, {b: (v[0], None if v[1] < 0 else int(v[1])) for b, v in replayed.items()},
                                  {b: topo.replayer_of(b) for b in bad})


def broadcast_payload(payload: Payload | None, src: int, device: torch.device) -> Any:
    """Rank ``src`` sends its payload to every rank (loaded with ``weights_only=True``)."""
    blob = serialize(payload) if payload is not None else None
    size = torch.tensor([blob.numel() if blob is not None else 0], dtype=torch.int64, device=device)
    wait(dist.broadcast(size, src=src, async_op=True))
    data = blob.to(device) if blob is not None else torch.empty(int(size), dtype=torch.uint8, device=device)
    wait(dist.broadcast(data, src=src, async_op=True))
    return _from_bytes(data, device)
