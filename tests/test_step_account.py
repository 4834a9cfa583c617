"""The ordinary step's cost, counted (SPEC §10): a change that adds a host synchronisation, a
collective or a read of the gradient to sdcguard's ordinary step fails here, for DDP and for HSDP —
and with the device gate (``Config(device_gate=True)``, fused AdamW), any host synchronisation at
all. One short run of bench/step_account.py's counting per layout (2 gloo ranks, or a 2 x 2 HSDP
mesh; TinyGPT; 2 counted ordinary steps against the same loop without sdcguard);
the full account, with audit and weight-check steps and HSDP, is ``bench/step_account.py``."""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, ranks", [("ddp", 2), ("hsdp", 4)])
def test_ordinary_step_adds_one_host_sync_and_one_16_byte_collective(layout: str, ranks: int) -> None:
    import step_account

    results = step_account.account(layout, ranks=ranks, steps=2, kinds=("ordinary",), timeout=300)
    for result in results:
        added = step_account.added(result, "ordinary")
        plain_syncs, syncs = added["syncs"]
        assert syncs - plain_syncs <= 1, (
            f"rank {result['rank']}: the ordinary step adds {syncs - plain_syncs:g} host reads "
            f"({added['added_syncs']}; sdcguard's: {added['sync_sites']})")
        assert added["added_collectives"] == {"allreduce_ 16 B": 1}, (
            f"rank {result['rank']}: collectives added {added['added_collectives']} "
            f"(sdcguard's: {added['coll_sites']})")
        # Each gradient byte read at most four times more: TinyGPT's buckets (1 and 0.7 MiB) are in
        # cache, where the local pass reads them three times (fold, norm, DDP's scaling) and the
        # reduced one once; a bucket larger than a block is read once for the three
        # (test_reduce_checksum: reduce_checksum.BLOCKED_FROM_BYTES). HSDP's count moves by up to
        # ~0.3 with FSDP2's allocations the counter cannot see.
        assert added["gradient_passes"] <= (4.0 + 1e-6 if layout == "ddp" else 3.8), (
            f"rank {result['rank']}: gradient memory read {added['gradient_passes']:.2f} times more per step "
            f"(by phase: {added['gradient_reads_where']}, plain: {added['plain_gradient_reads_where']})")
        # The counting itself saw the step: DDP's bucket all-reduces, AdamW's step reads, no op it
        # could not count.
        assert added["collectives"][0] >= 1 and plain_syncs > 0 and added["ops"][1] > added["ops"][0]
        assert not [k for k in added["added_ops"] if k.startswith("uncounted")]


@pytest.mark.multiprocess
def test_the_device_gate_adds_no_host_sync_to_an_ordinary_ddp_step() -> None:
    import step_account

    results = step_account.account("ddp", ranks=2, steps=2, kinds=("ordinary",), timeout=300, device_gate=True)
    for result in results:
        added = step_account.added(result, "ordinary")
        assert added["syncs"] == (0, 0), (
            f"rank {result['rank']}: host reads plain -> sdcguard {added['syncs']} ({added['added_syncs']}; "
            f"sdcguard's: {added['sync_sites']})")
        assert added["added_collectives"] == {"allreduce_ 16 B": 1}, added["coll_sites"]
        # The previous step's verdict was read, from host memory, once per step: the counting saw it.
        assert added["deferred_reads"] == (0, 1)


@pytest.mark.multiprocess
def test_a_pipeline_audit_step_reads_each_pass_to_the_host_once() -> None:
    """A pipeline's audit step (2 stages x 2 replicas, 1F1B, 4 micro-batches) once read every
    boundary fingerprint on its own, per micro-batch, and every replayed loss: +16 host reads on
    the first stage, +33 on the last. Now each pass — the own one, the replay — is read in one
    transfer (``BoundaryLog.into``), besides the weights' and the exchanges' reads: +8 on every
    rank. The ordinary step adds the vote's one read and its one 16-byte collective, as DDP's."""
    import step_account

    results = step_account.account("pp", steps=1, kinds=("ordinary", "audit"), timeout=300)
    for result in results:
        ordinary, audit = step_account.added(result, "ordinary"), step_account.added(result, "audit")
        assert ordinary["syncs"][1] - ordinary["syncs"][0] <= 1, ordinary["sync_sites"]
        assert ordinary["added_collectives"] == {"allreduce_ 16 B": 1}, ordinary["coll_sites"]
        fingerprint_reads = sum(n for site, n in audit["sync_sites"].items() if "agent/fingerprint/" in site)
        assert fingerprint_reads <= 3, f"rank {result['rank']}: {audit['sync_sites']}"  # own pass, replay, weights
        assert audit["syncs"][1] - audit["syncs"][0] <= 8, f"rank {result['rank']}: {audit['sync_sites']}"
