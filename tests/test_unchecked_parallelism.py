"""Context and expert parallelism are refused at start-up, naming the mesh dimension
(``sharding/layout.py``: ``unchecked_dim``): a CP group splits one batch's sequence and exchanges keys
and values (ring attention), an EP group sends several data-parallel ranks' tokens to each other's
experts; sdcguard's replay ring and attribution model neither. torchtitan's own settings are
refused by its adapter (tests/test_integration_torchtitan.py)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import sdcguard
from sdcguard.config import Config
from sdcguard.sharding.layout import unchecked_dim


@pytest.mark.parametrize("names, named", [
    (("dp_replicate", "fsdp", "tp"), None),                  # torchtitan's HSDP x TP: checked
    (("data_parallel", "tensor_parallel"), None),            # Lightning's ModelParallelStrategy mesh
    (("dp", "cp", "tp"), "'cp' (context parallelism)"),
    (("dp_shard_cp",), "'dp_shard_cp' (context parallelism)"),  # cp flattened into FSDP's dimension
    (("replicate", "context_parallel"), "'context_parallel' (context parallelism)"),
    (("dp_replicate", "efsdp", "ep"), "'ep' (expert parallelism)"),
    (None, None),
])
def test_mesh_dimensions_of_context_and_expert_parallelism_are_named(names, named):
    why = unchecked_dim(names)
    assert (why is None) == (named is None)
    if named is not None:
        assert f"the device mesh dimension {named} is not checked" in why


def test_a_cp_or_ep_dimension_of_size_one_is_no_parallelism_to_refuse():
    # older torchtitan names its FSDP dimension dp_shard_cp even without context parallelism
    assert unchecked_dim(("dp_shard_cp",), {"dp_shard": 4, "cp": 1, "dp_shard_cp": 4}) is None
    assert unchecked_dim(("dp", "cp"), {"dp": 4, "cp": 1}) is None
    assert "context parallelism" in unchecked_dim(("dp_shard_cp",), {"dp_shard": 2, "cp": 2})
    assert "expert parallelism" in unchecked_dim(("ep",), {"ep": 2})


@pytest.mark.parametrize("names", [("dp_shard_cp",)])  # cp's own size unknown: refused
def test_a_guard_on_a_model_sharded_over_a_cp_dimension_is_refused_before_any_step(tmp_path, names):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        mesh = init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=rf"fully_shard\(0\): the device mesh dimension '{names[-1]}' "
                                            r"\(context parallelism\) is not checked"):
            sdcguard.Guard(model, opt, lambda m, b: m(b).sum(), config=Config(audit_every=1))
    finally:
        dist.destroy_process_group()
