"""Pipeline parallelism (``torch.distributed.pipelining``): the grid, what crosses a stage
boundary, and who is named when a replica's replay of another's pipeline differs.

A pipeline replica is one pipeline-parallel group: its ranks hold consecutive stages and compute
one batch together (activations flow forward through the stages, gradients backward). The
replicas of one stage form a data-parallel group. Check 2 replays a whole replica's batch on
another replica, the schedule included; each rank then compares its stage's gradients with its
counterpart's. A fault in stage ``k``'s forward reaches every later stage's forward and every
stage's backward, so the gradients of the whole replica differ: what names the stage is what
crossed each boundary — each stage's output per micro-batch going forward, and the gradient of
each stage's input per micro-batch going backward. The first stage (in forward order) whose output
differs from its counterpart's, though its input did not, computed differently; if every forward
agrees, the first stage in backward order whose gradients differ. Within that stage, the ring's
usual rule (``attribution``) names the rank; a pipeline has no third replay, so a single
mismatching pair names both ranks, ambiguous.

Everything here but :class:`BoundaryLog` is pure, unit-tested without processes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..contract.alarm import CHECK_REPLAY
from ..fingerprint import Fingerprint, fingerprint_sums, to_fingerprints_together
from .attribution import attribute, mismatching_pairs
from .verdict import Verdict


# -- the grid ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Grid:
    """Every rank's place: ``replica`` (its pipeline group) and ``position`` (its place in it)."""

    replicas: int
    positions: int
    at: dict[int, tuple[int, int]]
    """rank -> (replica, position)."""
    stages: dict[int, tuple[int, ...]]
    """rank -> the stage indices it holds (one, or several under an interleaved schedule)."""
    num_stages: int

    def rank_at(self, replica: int, position: int) -> int:
        return self._ranks[(replica, position)]

    @property
    def _ranks(self) -> dict[tuple[int, int], int]:
        return {where: rank for rank, where in self.at.items()}

    def position_of_stage(self, stage: int) -> int:
        rank = next(r for r, held in self.stages.items() if stage in held)
        return self.at[rank][1]

    def describe(self) -> str:
        per = self.num_stages // self.positions
        held = f"{per} stages per rank (interleaved)" if per > 1 else "one stage per rank"
        return (f"pipeline: {self.num_stages} stages on {self.positions} ranks per replica ({held}), "
                f"{self.replicas} data-parallel replicas of each stage")


def read_grid(everyone: list[dict[str, Any]]) -> Grid | str:
    """Pure: the grid from every rank's ``{"pp": its pipeline group's ranks, "dp": its
    data-parallel group's ranks, "stages": its stage indices, "num_stages": n}``, or why the
    ranks do not form one (a refusal the user must read)."""
    world = len(everyone)
    at: dict[int, tuple[int, int]] = {}
    for rank, mine in enumerate(everyone):
        pp, dp = list(mine["pp"]), list(mine["dp"])
        if rank not in pp or rank not in dp:
            return f"rank {rank} is not in its own pipeline or data-parallel group"
        at[rank] = (dp.index(rank), pp.index(rank))
    positions = len(everyone[0]["pp"])
    replicas = len(everyone[0]["dp"])
    if positions * replicas != world:
        return (f"{replicas} data-parallel replicas of {positions} pipeline ranks make {positions * replicas} "
                f"ranks, the job has {world}: every rank must hold a stage of one replica")
    for rank, mine in enumerate(everyone):
        replica, position = at[rank]
        if len(mine["pp"]) != positions or len(mine["dp"]) != replicas:
            return "the pipeline groups (or the data-parallel groups) differ in size"
        if any(at[r][0] != replica for r in mine["pp"]):
            return (f"rank {rank}'s pipeline group {mine['pp']} does not hold one replica: its data-parallel "
                    "groups must hold the same stage of every replica, in the same order")
        if any(at[r][1] != position for r in mine["dp"]):
            return f"rank {rank}'s data-parallel group {mine['dp']} holds different pipeline positions"
        if any(everyone[r]["stages"] != mine["stages"] for r in mine["dp"]):
            return f"rank {rank}'s data-parallel group {mine['dp']} holds different stages"
    if len(set(at.values())) != world:
        return "two ranks claim the same place in the grid"
    if replicas < 2:
        return ("a pipeline with one data-parallel replica: no other replica holds a stage to compare or "
                "replay with (sdcguard needs two replicas of each stage or more)")
    stages = {rank: tuple(mine["stages"]) for rank, mine in enumerate(everyone)}
    return Grid(replicas, positions, at, stages, int(everyone[0]["num_stages"]))


def ring_shift(grid: Grid, ranks_per_node: int) -> tuple[int, bool]:
    """Pure: how many replicas ahead each replica replays (``(shift, crosses_nodes)``): the
    smallest shift that puts every rank's replay target on another node, else 1 (a replay on
    another GPU of the same node: a fault of one GPU is still caught, one of a whole node not)."""
    def node(rank: int) -> int:
        return rank // ranks_per_node
    for shift in range(1, grid.replicas):
        if all(node(ring_target(grid, rank, shift)) != node(rank) for rank in grid.at):
            return shift, True
    return 1, False


def ring_target(grid: Grid, rank: int, shift: int) -> int:
    replica, position = grid.at[rank]
    return grid.rank_at((replica + shift) % grid.replicas, position)


# -- what one pass recorded ----------------------------------------------------------------------

@dataclass(slots=True)
class StagePass:
    """One rank's pass of a pipeline batch (its own, or a replay of its counterpart's), as the
    checks compare it: per stage it holds, the output per micro-batch, the gradient of its input
    per micro-batch, its parameters' gradients; and on the last stage the micro-batch losses."""

    losses: list[Fingerprint] = field(default_factory=list)
    outputs: dict[int, list[list[Fingerprint]]] = field(default_factory=dict)
    input_grads: dict[int, list[list[Fingerprint]]] = field(default_factory=dict)
    grads: dict[int, dict[int, Fingerprint]] = field(default_factory=dict)

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for fp in self.losses:
            h.update(b"L" + _bytes(fp))
        for tag, part in ((b"O", self.outputs), (b"I", self.input_grads)):
            for stage in sorted(part):
                for micro, fps in enumerate(part[stage]):
                    h.update(tag + stage.to_bytes(4, "little") + micro.to_bytes(4, "little"))
                    for fp in fps:
                        h.update(_bytes(fp))
        for stage in sorted(self.grads):
            for index in sorted(self.grads[stage]):
                h.update(b"G" + stage.to_bytes(4, "little") + index.to_bytes(4, "little") + _bytes(self.grads[stage][index]))
        return h.digest()

    def to_json(self) -> dict[str, Any]:
        def fps(x: list[Fingerprint]) -> list[list[int]]:
            return [list(fp) for fp in x]
        return {"losses": fps(self.losses),
                "outputs": {str(s): [fps(m) for m in v] for s, v in self.outputs.items()},
                "input_grads": {str(s): [fps(m) for m in v] for s, v in self.input_grads.items()},
                "grads": {str(s): {str(i): list(fp) for i, fp in v.items()} for s, v in self.grads.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StagePass:
        def fps(x: list[list[int]]) -> list[Fingerprint]:
            return [Fingerprint(int(a), int(b)) for a, b in x]
        return cls(fps(data["losses"]),
                   {int(s): [fps(m) for m in v] for s, v in data["outputs"].items()},
                   {int(s): [fps(m) for m in v] for s, v in data["input_grads"].items()},
                   {int(s): {int(i): Fingerprint(int(a), int(b)) for i, (a, b) in v.items()}
                    for s, v in data["grads"].items()})


def _bytes(fp: Fingerprint) -> bytes:
    return fp.s0.to_bytes(8, "little") + fp.s1.to_bytes(8, "little")


GradSums = list[tuple[int, list[int], torch.Tensor]]
"""A pass's parameter-gradient fingerprint sums, still on the device: ``(stage, keys, sums)``, row
``j`` of ``sums`` the fingerprint of the gradient keyed ``keys[j]`` (:attr:`StagePass.grads`)."""


class BoundaryLog:
    """Records what crosses a stage's boundaries while on: wraps the stage's ``forward_one_chunk``
    and ``backward_one_chunk`` (the schedule's per-micro-batch calls) on the stage object itself.
    The fingerprints are taken only on audit steps (other steps pay one attribute check), and their
    sums stay on the device until :meth:`into` reads them with the pass's other fingerprints: one
    host read per pass, not one per micro-batch and boundary. A last stage's outputs are not
    recorded (they are its losses, fingerprinted as such)."""

    __slots__ = ("on", "outputs", "input_grads")

    def __init__(self) -> None:
        self.on = False
        self.outputs: dict[int, dict[int, torch.Tensor]] = {}
        self.input_grads: dict[int, dict[int, torch.Tensor]] = {}

    def start(self, on: bool) -> None:
        """Forget what was recorded; record from now on when ``on``."""
        self.on = on
        self.outputs, self.input_grads = {}, {}

    def stop(self) -> None:
        """Record nothing more (what was recorded stays, for :meth:`into`)."""
        self.on = False

    def install(self, stage: Any) -> None:
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        index, log = stage.stage_index, self

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            out = forward(fwd_chunk_id, *args, **kwargs)
            if log.on and not stage.is_last:
                outputs, _ = stage.fwd_cache[fwd_chunk_id]
                log.outputs.setdefault(index, {})[fwd_chunk_id] = _tensor_sums(outputs)
            return out

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            out = backward(bwd_chunk_id, *args, **kwargs)
            if log.on and not stage.is_first:
                log.input_grads.setdefault(index, {})[bwd_chunk_id] = _tensor_sums(stage.bwd_cache.get(bwd_chunk_id, ()))
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk

    def into(self, losses: torch.Tensor, grads: GradSums) -> StagePass:
        """The pass: its losses' fingerprint sums (``(n, 2)``), its gradients' and this log's
        boundaries', read to the host in one transfer."""
        boundaries = [(part, stage, sums) for part, book in (("outputs", self.outputs), ("input_grads", self.input_grads))
                      for stage, by_micro in book.items() for _, sums in sorted(by_micro.items())]
        loss_fps, *read = to_fingerprints_together([losses, *(sums for _, _, sums in grads),
                                                    *(sums for _, _, sums in boundaries)])
        result = StagePass(losses=loss_fps)
        for (stage, keys, _), fps in zip(grads, read):
            result.grads.setdefault(stage, {}).update(zip(keys, fps))
        for (part, stage, _), fps in zip(boundaries, read[len(grads):]):
            getattr(result, part).setdefault(stage, []).append(fps)  # in micro-batch order
        return result


def _tensor_sums(values: Any) -> torch.Tensor:
    tensors = [t.detach() for t in _flatten(values) if isinstance(t, torch.Tensor)]
    if len({t.device for t in tensors}) > 1:  # unusual (a stage's tensors live on its device): one device
        return torch.cat([fingerprint_sums([t]).to(tensors[0].device) for t in tensors])
    return fingerprint_sums(tensors)


def _flatten(values: Any) -> list[Any]:
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _flatten(v)]
    return [values]


# -- the verdict ---------------------------------------------------------------------------------

def culprit_stage(own: StagePass, replay: StagePass, stages: list[int], last_stage: int) -> tuple[int, str] | None:
    """Pure: for one replica pair, the owner's own passes and the replayer's replays merged over
    the replica's ranks: ``(stage, "forward" | "backward")`` where the two first part, or None."""
    for stage in sorted(stages):
        if stage == last_stage:
            if own.losses != replay.losses:
                return stage, "forward"
        elif own.outputs.get(stage) != replay.outputs.get(stage):
            return stage, "forward"
    for stage in sorted(stages, reverse=True):
        if own.grads.get(stage) != replay.grads.get(stage) or own.input_grads.get(stage) != replay.input_grads.get(stage):
            return stage, "backward"
    return None


def merge(passes: list[StagePass]) -> StagePass:
    """The passes of one replica's ranks as one (each holds different stages)."""
    out = StagePass()
    for p in passes:
        out.losses.extend(p.losses)
        out.outputs.update(p.outputs)
        out.input_grads.update(p.input_grads)
        out.grads.update(p.grads)
    return out


def judge_pipeline_replays(digests: list[list[bytes]], target: Callable[[int], int], grid: Grid,
                           details: list[Any]) -> Verdict | None:
    """Pure: check 2's verdict for a pipeline from every rank's ``[own pass, replay]`` digests
    and the ``[own, replay]`` StagePasses of every rank of the replicas involved."""
    pairs = mismatching_pairs(digests, target)
    if not pairs:
        return None
    replica_pairs = sorted({(grid.at[r][0], grid.at[o][0]) for r, o in pairs})
    last = grid.num_stages - 1
    stage_pairs: list[tuple[int, int]] = []
    found: list[dict[str, Any]] = []
    for replayer_replica, owner_replica in replica_pairs:
        replayers = [grid.rank_at(replayer_replica, p) for p in range(grid.positions)]
        owners = [grid.rank_at(owner_replica, p) for p in range(grid.positions)]
        own = merge([details[o][0] for o in owners])
        replay = merge([details[r][1] for r in replayers])
        where = culprit_stage(own, replay, sorted({s for r in owners for s in grid.stages[r]}), last)
        if where is None:  # the digests differ but no part does: cannot happen with honest details
            stage_pairs.extend((r, o) for r, o in pairs if grid.at[r][0] == replayer_replica)
            found.append({"replayer_replica": replayer_replica, "owner_replica": owner_replica, "stage": None})
            continue
        stage, direction = where
        position = grid.position_of_stage(stage)
        pair = (grid.rank_at(replayer_replica, position), grid.rank_at(owner_replica, position))
        stage_pairs.append(pair)
        found.append({"replayer_replica": replayer_replica, "owner_replica": owner_replica, "stage": stage,
                      "direction": direction, "replayer": pair[0], "owner": pair[1]})
    attribution = attribute(stage_pairs, grid.replicas)
    suspects = set(attribution.suspects)
    ambiguous = attribution.ambiguous
    for replayer, owner in attribution.tiebreaks:  # no third replay of a whole pipeline: both, ambiguous
        suspects |= {replayer, owner}
        ambiguous = True
    stages = sorted({f["stage"] for f in found if f["stage"] is not None})
    return Verdict(CHECK_REPLAY, suspects=sorted(suspects), ambiguous=ambiguous,
                   evidence={"pipeline_pairs": found, "first_differing_stages": stages,
                             "pairs": [{"replayer": r, "owner": o} for r, o in pairs]})
