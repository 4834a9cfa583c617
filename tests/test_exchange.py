"""What crosses between ranks (sdcguard.checks.exchange): plain data only, never code.

Before: replay payloads were unpickled with ``torch.load(weights_only=False)`` and details with
``all_gather_object``, so any process that could reach the job's gloo / rendezvous ports ran code
in every rank it exchanged with. Now a batch is loaded with torch's restricted loader and the
details travel as JSON; the collectives themselves run in tests/test_guard.py and the drills."""
import io
import pickle

import pytest
import torch

from sdcguard.checks.exchange import Incoming, WireError, serialize
from sdcguard.checks.replay import Payload, Weighting


class Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').write('owned')",))


def received(blob: torch.Tensor):
    """What a rank makes of these bytes arriving from its ring neighbour (no process group needed:
    the transfer is done, only the decoding is left)."""
    return Incoming(note=bytes(16), buffer=blob, works=[], device=torch.device("cpu"), sending=None).receive()


def test_a_payload_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "owned"
    buf = io.BytesIO()
    torch.save({"step": 3, "owner": 0, "micro_batches": [Exploit(marker)]}, buf)
    with pytest.raises(WireError, match="weights_only=True"):
        received(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    raw = pickle.dumps(Exploit(marker))  # a bare pickle, not even torch.save's format
    with pytest.raises(WireError):
        received(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    assert not marker.exists()


def test_a_real_payload_crosses_intact():
    batches = [(torch.randn(2, 3), torch.tensor([1, 0])), {"x": torch.ones(2), "mask": [True, False], "n": 7}]
    payload = Payload(5, 2, batches, [{"running_mean": torch.zeros(3)}], [Weighting("div", 2.0), None])
    back = Payload.from_wire(received(serialize(payload)))
    assert (back.step, back.owner, back.weighting) == (5, 2, [Weighting("div", 2.0), None])
    assert torch.equal(back.micro_batches[0][0], batches[0][0]) and back.micro_batches[1]["mask"] == [True, False]
    assert torch.equal(back.buffers[0]["running_mean"], torch.zeros(3))
