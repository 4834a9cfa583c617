#!/usr/bin/env bash
# The GPU checks, as one run on the device machine (PyTorch and Triton preinstalled there):
#   1. the ordinary step's host synchronisations on CUDA (bench/gpu_step_account.py): plain DDP,
#      the synchronous update gate and the device gate (Config(device_gate=True), fused AdamW),
#      counted by torch.cuda.set_sync_debug_mode("warn"), then the device gate under "error";
#   2. check 4's fused Triton fold (the comm hook's local pass in one read) compiled, bit for bit
#      against its torch formula (same cases as the CPU interpreter test), its self-test, and its
#      time on a 25 MB bucket against the torch path and a copy_;
#   3. the fused Triton fingerprint, compiled, against the SPEC §3 reference (same cases as the
#      CPU interpreter test), and the automatic choice's self-test;
#   4. fingerprint throughput vs copy bandwidth for both backends (bench/fingerprint.py checks
#      each size bit for bit against the CPU before timing it);
#   5. bench/gpu_single.py: check 4's cost per bucket against copy_ and its bound on the device
#      (no false alarm, a corruption caught), the replay bit for bit with deterministic
#      algorithms (float32 and bf16 autocast), and one rank's per-step account.
# What one GPU cannot show: NCCL collectives between ranks and the overhead ratios against DDP
# (each NCCL rank needs its own GPU); those need a multi-GPU node (part 1 stands in for the
# peers with torch's fake process group).
# Expected time: about 5 minutes, most of it Triton compiling kernels; each part has a time limit
# (7 minutes in all at most); the first parts answer the newest questions.
# Everything it prints also lands in $OUT (or /tmp/gpu-check). Usage, from the repository root:
#   bash bench/gpu_check.sh
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
# No install on the device: import the package straight from agent/ under its real name.
pkg=$(mktemp -d)
ln -s "$PWD/agent" "$pkg/sdcguard"
export PYTHONPATH=$pkg PYTHONSAFEPATH=1
py=${PYTHON:-$(command -v python3 || command -v python)}
status=0
{
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv
    "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/machine.txt"
timeout 120 "$py" bench/gpu_step_account.py --device cuda --steps 6 2>&1 | tee "$out/step-account.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
SDCGUARD_TEST_DEVICE=cuda timeout 60 "$py" tests/checksum_triton_worker.py 2>&1 | tee "$out/checksum-kernel.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
SDCGUARD_TEST_DEVICE=cuda timeout 60 "$py" tests/fingerprint_triton_worker.py 2>&1 | tee "$out/kernel-cases.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
for backend in triton torch; do
    timeout 40 "$py" bench/fingerprint.py --device cuda --backend "$backend" --sizes 16,256,1024 --reps 10 2>&1 \
        | tee "$out/fingerprint-$backend.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
timeout 120 "$py" bench/gpu_single.py --device cuda 2>&1 | tee "$out/single-gpu.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
