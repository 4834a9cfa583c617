"""Bad drill input: a one-line error and exit status 2, before any process starts."""
import subprocess
import sys

import pytest

CASES = [
    (["--inject", "cosmic-ray:rank=0:step=1"], "unknown fault kind 'cosmic-ray'"),
    (["--inject", "grad-inf:rank=6:step=1"], "rank 6 in 'grad-inf:rank=6:step=1' is out of range"),
    (["--world-size", "6", "--ranks-per-node", "4"], "world size 6 is not divisible by --ranks-per-node 4"),
    (["--world-size", "6", "--nodes", "2"], "--world-size 6 != --nodes 2 x --ranks-per-node 2"),
    (["--inject", "grad-inf:rank=1"], "lacks step=S"),
    (["--inject", "grad-inf:rank=1:step=two"], "step must be an integer"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--audit-every", "-3"], "--audit-every must be >= 0"),
    (["--placement", "/nonexistent/placement.json"], "--placement /nonexistent/placement.json:"),
    (["--placement", "/dev/null"], "--placement /dev/null: Expecting value"),
    (["--checkpoint-dir", "/tmp/x"], "--checkpoint-dir needs --checkpoint-every"),
    (["--checkpoint-every", "2", "--checkpoint-dir", "/dev/null"], "--checkpoint-dir /dev/null is not a directory"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[c[1][:30] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", *args, "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith("sdcguard drill: error:")
    assert proc.stdout == ""  # the drill prints its header before it launches anything
    assert not (tmp_path / "r.json").exists()


def test_unknown_option_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", "--nodez", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments: --nodez" in proc.stderr


def test_a_placement_must_name_a_pod_and_node_per_simulated_node(tmp_path):
    placement = tmp_path / "placement.json"
    placement.write_text('{"namespace": "demo", "job": "j", "nodes": [{"pod": "p0", "node": "n0"}]}')
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", "--nodes", "3", "--placement", str(placement)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and 'needs "nodes": a list of 3 {"pod", "node"} objects' in proc.stderr, proc.stderr
    placement.write_text('{"job": "j", "nodes": [{"pod": "p0", "node": "n0"}]}')
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", "--nodes", "1", "--placement", str(placement)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and 'needs "namespace"' in proc.stderr, proc.stderr
