"""The FSDP2 internals the sharded checks rely on (sdcguard.sharding.fsdp_internals): present in
the torch the tests run, and a model whose FSDP2 lacks one is refused with one line naming it."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sdcguard.sharding.fsdp_internals import missing, require_supported


@pytest.fixture
def sharded(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    yield model
    dist.destroy_process_group()


def test_this_torch_has_every_internal_the_sharded_checks_use(sharded):
    assert missing(sharded) == []
    require_supported(sharded)


def test_a_missing_internal_is_named_before_any_step(sharded):
    group = sharded[0]._get_fsdp_state()._fsdp_param_groups[0]
    del group._partial_reduce_output  # as a torch release that renamed it would look
    with pytest.raises(TypeError, match=r"FSDPParamGroup\._partial_reduce_output.*torch 2\.13"):
        require_supported(sharded)


def test_check_4_is_planned_only_for_fsdp2s_plain_average(tmp_path):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from sdcguard.sharding.layout import param_groups
    from sdcguard.sharding.layout import plain_average

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plans = {}
        for name, policy in (("fp32", MixedPrecisionPolicy()),
                             ("bf16 params, fp32 reduce", MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
                             ("fp16 reduce", MixedPrecisionPolicy(reduce_dtype=torch.float16))):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4))
            fully_shard(model, mesh=mesh, mp_policy=policy)
            plans[name] = plain_average([g for _, _, g in param_groups(model)])
        assert plans == {"fp32": True, "bf16 params, fp32 reduce": True, "fp16 reduce": False}
    finally:
        dist.destroy_process_group()


def test_the_one_rank_shard_group_path_is_checked_in_this_torchs_source():
    # a (R, 1) mesh relies on foreach_reduce's order: input allocated and filled, output allocated
    # (recorded there), a copy instead of the reduce-scatter, the all-reduce, its hook
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from sdcguard.sharding.fsdp_internals import order_gaps, single_shard_gaps

    assert single_shard_gaps() == []
    source = inspect.getsource(_fsdp_collectives.foreach_reduce)
    assert order_gaps(source) == []
    # a release that filled the input only after allocating the output would be refused
    fill = "foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size)"
    assert fill in source
    moved = source.replace(fill, "").replace("_div_if_needed(reduce_scatter_input, predivide_factor)",
                                             fill + "\n_div_if_needed(reduce_scatter_input, predivide_factor)")
    assert order_gaps(moved) and "order" in order_gaps(moved)[0]
    # one that called the comm for one rank too (no copy) likewise
    assert order_gaps(source.replace("reduce_output.copy_(reduce_scatter_input", "pass  # ("))
