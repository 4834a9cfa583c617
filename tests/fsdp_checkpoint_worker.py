"""One rank of the sharded-checkpoint test, launched by tests/test_fsdp_checkpoint.py under torchrun
(4 ranks, gloo, CPU). Each scenario writes OUT/<scenario>-rank<r>.json; the checkpoint directories
stay in OUT for the test to inspect and to verify offline.

  hsdp   HSDP 2 x 2, audited every other step (check 2). Run A trains steps 0..5, saving one
         directory, ``ckpt``, after step 1 and again after step 3 (an LR scheduler and a plain
         value as extra state): the second save keeps step 1's directory, the resume point of a
         compute fault the audit of step 4 would catch (its window starts after the audit of 2).
         Run B, fresh model, optimizer, scheduler and Guard, loads what that alarm names (after
         ``ckpt`` itself is refused: it now holds step 3) and trains steps 2..5. Then a file with
         one byte changed, a shard changed before its file was hashed, and a directory sdcguard
         did not write are refused on every rank; a flipped bit in one replica's shard stops the
         save at its check 3.
  fsdp   pure FSDP over 4 ranks: saved after step 1 (its manifest: not cross-checked; no alarm
         names it), resumed by a fresh run, which ends where the uninterrupted one does.
"""
import io
import json
import logging
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import sdcguard
from sdcguard.child_process import exit_without_finalizing
from sdcguard import recovery
from sdcguard.config import Config
from sdcguard.fingerprint import digest, fingerprint
from sdcguard.sharding import dcp_manifest

STEPS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hid = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 3)                    # 3 rows: uneven shards (one empty on 4)

    def forward(self, x):
        return self.out(self.drop(F.relu(self.hid(F.relu(self.inp(x))))))


def loss_fn(module, batch):
    x, y = batch
    return F.cross_entropy(module(x), y)


def batch(step, rank, n=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(dim=1)


def build(mesh):
    torch.manual_seed(0)
    model = Net()
    for layer in (model.inp, model.hid, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=2, weight_check_every=1))
    return model, opt, sched, guard


def shards_digest(model):
    return digest(fingerprint(p.to_local()) for p in model.parameters()).hex()


def train(model, opt, sched, guard, steps, rank, at=None):
    """Train ``steps``; ``at[step]()`` runs after that step (a save). Returns each loss's bits."""
    losses = {}
    for step in steps:
        with guard.step(step) as s:
            loss = s.backward(batch(step, rank))
            s.check()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        losses[step] = loss.view(torch.int32).item()
        if at and step in at:
            at[step]()
    return losses


def refused(fn):
    """The CheckpointError's message, or None when ``fn`` did not raise one."""
    try:
        fn()
    except sdcguard.CheckpointError as exc:
        return str(exc)
    return None


def hsdp(mesh, rank, out):
    ckpt = os.path.join(out, "ckpt")
    model, opt, sched, guard = build(mesh)
    found = {}

    def save():
        guard.save_checkpoint(ckpt, state={"scheduler": sched, "seen": 17})
        found["checkpoints"] = guard.checkpoints
        if guard.updates_through == 3:  # what an alarm at step 4 would say
            found["replay"] = recovery.recovery_fields("replay", 4, guard.history)
            found["weights"] = recovery.recovery_fields("weights", 4, guard.history)

    losses = train(model, opt, sched, guard, range(STEPS), rank, at={1: save, 3: save})
    replay = found["replay"]
    result = {"losses": losses, "final": shards_digest(model), "replay": replay, "weights": found["weights"],
              "checkpoints": found["checkpoints"], "audited": guard.history.last_audited_step,
              "lr": sched.get_last_lr()}
    a_guard, a_sched = guard, sched

    # Run B: fresh model, optimizer, scheduler and Guard; resume where the alarm says.
    model, opt, sched, guard = build(mesh)
    state = {"scheduler": sched, "seen": 0}
    result["overwritten"] = refused(lambda: guard.load_checkpoint(ckpt, expect_step=1, state=state))
    step = guard.load_checkpoint(replay["last_good_checkpoint"], expect_step=replay["last_good_checkpoint_step"],
                                 expect_sha256=replay["last_good_checkpoint_sha256"], state=state)
    # Run A saves once more (step 5, its audit at 4 passed): step 3 is kept now, step 1 is pruned.
    a_guard.save_checkpoint(ckpt, state={"scheduler": a_sched, "seen": 17})
    result["checkpoints_after"] = a_guard.checkpoints
    result["resumed"] = {"step": step, "seen": state["seen"], "updates_through": guard.updates_through,
                         "checkpoints": guard.checkpoints,
                         "losses": train(model, opt, sched, guard, range(step + 1, STEPS), rank),
                         "final": shards_digest(model), "lr": sched.get_last_lr()}

    # Corrupted copies of the step-5 directory (rank 0 makes them; every rank tries to load them).
    if rank == 0:
        corrupt_byte(ckpt, os.path.join(out, "bad-byte"))
        corrupt_shard(ckpt, os.path.join(out, "bad-shard"), "model.hid.weight", shard_rows=8)
        os.makedirs(os.path.join(out, "foreign"))
        with open(os.path.join(out, "foreign", "notes.txt"), "w") as fh:
            fh.write("mine")
    dist.barrier()
    before = shards_digest(model)  # run B's, at step 5
    result["bad_byte"] = refused(lambda: guard.load_checkpoint(os.path.join(out, "bad-byte")))
    result["bad_byte_untouched"] = shards_digest(model) == before
    result["bad_shard"] = refused(lambda: guard.load_checkpoint(os.path.join(out, "bad-shard")))
    result["foreign"] = refused(lambda: guard.save_checkpoint(os.path.join(out, "foreign")))
    # A flipped bit in one replica's shard: the save's check 3 raises on every rank, nothing is written.
    if rank == 3:
        with torch.no_grad():
            dict(model.named_parameters())["hid.weight"].to_local().view(torch.int32)[0, 0] ^= 1
    try:
        guard.save_checkpoint(os.path.join(out, "after-flip"))
        result["flip"] = None
    except sdcguard.SDCDetected as exc:
        result["flip"] = {"check": exc.alarm["check"], "suspects": exc.alarm["suspect_ranks"]}
    result["after_alarm"] = refused(lambda: guard.save_checkpoint(os.path.join(out, "after-alarm")))
    return result


def fsdp(mesh, rank, out):
    flat = os.path.join(out, "flat")
    again = os.path.join(out, "flat-again")
    model, opt, sched, guard = build(mesh)
    losses = train(model, opt, sched, guard, range(4), rank, at={
        1: lambda: guard.save_checkpoint(flat, state={"scheduler": sched}),
        2: lambda: guard.save_checkpoint(again, state={"scheduler": sched}),
        3: lambda: guard.save_checkpoint(again, state={"scheduler": sched})})
    result = {"losses": losses, "final": shards_digest(model), "checkpoints": guard.checkpoints,
              "reduction": recovery.recovery_fields("reduce-checksum", 4, guard.history),
              "weights_verified": guard.last_weights_verified_step}
    model, opt, sched, guard = build(mesh)
    step = guard.load_checkpoint(flat, expect_step=1, state={"scheduler": sched})
    result["resumed"] = {"step": step, "losses": train(model, opt, sched, guard, range(step + 1, 4), rank),
                         "final": shards_digest(model), "weights_verified": guard.last_weights_verified_step}
    return result


def corrupt_byte(src, dst):
    """One byte changed in the middle of one rank's file (after it was hashed: the manifest is kept)."""
    shutil.copytree(src, dst)
    victim = os.path.join(dst, "__1_0.distcp")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(victim, "wb").write(bytes(data))


def corrupt_shard(src, dst, fqn, shard_rows):
    """One bit of shard 1 of ``fqn`` flipped in its file, and that file's SHA-256 (and so the
    checkpoint's identity) written into the manifest: a shard changed before its file was hashed,
    which only the fingerprints can tell."""
    shutil.copytree(src, dst)
    info = FileSystemReader(dst).read_metadata().storage_data[MetadataIndex(fqn, torch.Size([shard_rows, 0]))]
    victim = os.path.join(dst, info.relative_path)
    data = bytearray(open(victim, "rb").read())
    blob = bytes(data[info.offset:info.offset + info.length])
    raw = torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes()
    data[info.offset + blob.find(raw) + 1] ^= 0x01  # the second byte of the shard's first element
    open(victim, "wb").write(bytes(data))
    manifest = json.loads(open(os.path.join(dst, dcp_manifest.MANIFEST_NAME)).read())
    manifest["files"][info.relative_path] = dcp_manifest.sha256_file(victim)
    manifest["sha256"] = dcp_manifest.identity(manifest["files"])
    open(os.path.join(dst, dcp_manifest.MANIFEST_NAME), "w").write(json.dumps(manifest))


def main(out):
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for name, shape, run in (("hsdp", (2, 2), hsdp), ("fsdp", (4,), fsdp)):
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        result = run(init_device_mesh("cpu", shape, mesh_dim_names=names), rank, out)
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
            json.dump(result, fh, default=str)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)  # FSDP2's gloo ops at finalization (see its docstring)
