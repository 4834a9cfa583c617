"""What a torchtitan run needs on a CPU-only machine with nothing downloaded: a device shim, a tiny
llama3 flavor, an in-code tokenizer and a random-token dataloader — torchtitan's own extension
points (``Configurable`` components named in ``Trainer.Config``), no files.

**The CPU shim.** torchtitan 0.3.0 picks its device when ``torchtitan.tools.utils`` is imported:
``_get_available_device_type() or "cuda"``, so on a CPU-only torch it is ``cuda``, and
``Trainer.__init__`` fails at its first line that touches it::

    torchtitan/trainer.py: device_module.set_device(self.device)
    torch/cuda/__init__.py: torch._C._cuda_setDevice(device)
    AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'

:func:`use_cpu` (imported before any other torchtitan module, since several copy the device type
at import) sets that module's ``device_type`` to ``"cpu"`` and its ``device_module`` to
``torch.cpu`` with the few memory-statistics calls the metrics processor makes added (zeros).
``init_distributed`` then picks gloo for ``cpu`` by itself. It also gives ``torch.distributed`` the
``set_timeout`` that ``set_pg_timeouts`` calls after the first step (this torch build has it as
``distributed_c10d._set_pg_timeout``). With a GPU none of this is needed.

**The pipeline shim.** torchtitan 0.3.0 runs its pipeline with the micro-batches it made itself,
``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...,
return_outputs=False)``, an API of torch releases newer than 2.13, whose ``step`` takes only the
whole batch (to split it itself) and passes the lists on as model keyword arguments::

    torch/distributed/pipelining/schedules.py: check_type_and_len(arg_mbs, "arg_mbs")
    ValueError: Expecting 2 arg_mbs but got 1

:func:`pipeline_on_torch_2_13` (the tiny model's ``pipelining_fn``) builds torchtitan's pipeline
with ``pipeline_llm`` and gives its schedule a subclass of its own class whose ``step`` runs given
micro-batches as that newer ``step`` does: the per-step bookkeeping of torch's own ``step``, then
the schedule's ``_step_microbatches`` on the lists unsplit. A subclass, not a patched method, so
that a schedule rebuilt from ``type(schedule)`` (sdcguard's replay) takes them too. With a torch
whose ``step`` takes ``arg_mbs`` it changes nothing.
"""
from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch


def use_cpu() -> None:
    """Make torchtitan run on the CPU (see the module docstring); call before importing it."""
    import sys

    from torchtitan.tools import utils

    late = [m for m in ("torchtitan.trainer", "torchtitan.distributed.utils") if m in sys.modules]
    if late:
        raise RuntimeError(f"use_cpu() must run before {', '.join(late)} is imported")
    cpu = types.ModuleType("torchtitan_cpu_device")
    cpu.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")})
    memory = {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0}
    cpu.__dict__.update(
        current_device=lambda: 0,  # an index: set_pg_timeouts passes it to barrier(device_ids=[...])
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 30, name="cpu"),
        memory_stats=lambda *a: dict(memory), reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
    )
    utils.device_type, utils.device_module = "cpu", cpu
    import torch.distributed as dist
    if not hasattr(dist, "set_timeout"):  # set_pg_timeouts calls it after the first step; torch 2.13 names it so
        from torch.distributed.distributed_c10d import _set_pg_timeout
        dist.set_timeout = _set_pg_timeout


use_cpu()

# torchtitan's modules, after the shim
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common import (ComplexRoPE, Embedding, Linear, RMSNorm,  # noqa: E402
                                      compute_ffn_hidden_dim)
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

VOCAB = 64


class TinyTokenizer(BaseTokenizer):
    """Token ids are the characters' code points modulo the vocabulary: no files."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, *, tokenizer_path: str = "") -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
        return "".join(chr(i) for i in ids)

    def get_vocab_size(self) -> int:
        return self.vocab_size


class RandomTokens(IterableDataset):
    """Sequences of random tokens, deterministic per data-parallel rank; each sequence one
    document (positions from 0), labels the inputs shifted by one."""

    def __init__(self, seq_len: int, vocab: int, dp_rank: int, seed: int) -> None:
        self.seq_len, self.vocab = seq_len, vocab
        self.generator = torch.Generator().manual_seed(seed * 1000 + dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=self.generator)
            yield {"input": tokens[:-1], "positions": torch.arange(self.seq_len)}, tokens[1:]


class RandomTokensDataLoader(ParallelAwareDataloader):
    """torchtitan's parallel-aware dataloader over :class:`RandomTokens`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "random-tokens"
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs: Any) -> None:
        dataset = RandomTokens(seq_len, tokenizer.get_vocab_size(), dp_rank, config.seed)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         num_workers=0, snapshot_every_n_steps=snapshot_every_n_steps)


def tiny_llama3(dim: int = 32, n_layers: int = 2, n_heads: int = 2, vocab: int = VOCAB) -> ModelSpec:
    """llama3's "debugmodel" shrunk: torchtitan's own model, layers and initialisation."""
    spec = llama3.model_registry("debugmodel")  # flex attention, llama3's init and parallelize
    base = spec.model
    model = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=base.tok_embeddings.param_init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=base.norm.param_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=512, theta=500000, scaling="llama"),
            attn_backend="flex"),
    )
    # FlexAttention has no backward on CPU ("FlexAttention does not support backward on CPU"), nor
    # has varlen: torch's own scaled_dot_product_attention, causal, which torchtitan keeps for a
    # maskless model (each sequence here is one document, so causal is llama3's block-causal mask)
    for _, _, parent, attr in model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return ModelSpec(name="llama3", flavor="tiny", model=model, parallelize_fn=parallelize_on_gloo,
                     pipelining_fn=pipeline_on_torch_2_13, post_optimizer_build_fn=None, state_dict_adapter=None)


def parallelize_on_gloo(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """llama3's ``parallelize_llama``, then FSDP2 told to reduce with a plain sum.

    torchtitan divides the loss by the global token count and sets every unit's
    ``gradient_divide_factor`` to 1.0, so FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``,
    which gloo refuses (``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``, in
    ``foreach_reduce``). A factor of 1.0 with ``set_force_sum_reduction_for_comms(True)`` is
    ``ReduceOp.SUM`` and no division: the same sum, bit for bit (a product with 1.0 is exact)."""
    from torch.distributed.fsdp import FSDPModule

    model = llama3.parallelize_llama(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def pipeline_on_torch_2_13(model: torch.nn.Module, **kwargs: Any) -> Any:
    """torchtitan's ``pipeline_llm``, its schedule given micro-batch lists (the module docstring)."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    schedule, model_parts, has_first_stage, has_last_stage = pipeline_llm(model, **kwargs)
    schedule.__class__ = _taking_microbatch_lists(type(schedule))
    return schedule, model_parts, has_first_stage, has_last_stage


def _taking_microbatch_lists(schedule_class: type) -> type:
    import inspect
    if "arg_mbs" in inspect.signature(schedule_class.step).parameters:  # a newer torch: as it is
        return schedule_class

    class MicrobatchLists(schedule_class):  # type: ignore[misc, valid-type]
        def step(self, *args: Any, target: Any = None, losses: list | None = None, return_outputs: bool = True,
                 loss_kwargs: dict[str, Any] | None = None, arg_mbs: list | None = None,
                 kwarg_mbs: list | None = None, target_mbs: list | None = None, **kwargs: Any) -> Any:
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return super().step(*args, target=target, losses=losses, return_outputs=return_outputs,
                                    loss_kwargs=loss_kwargs, **kwargs)
            stages = list(getattr(self, "_stages", None) or [self._stage])
            for stage in stages:  # torch's step() does this before it splits the batch
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            for stage in stages:
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

    MicrobatchLists.__name__ = MicrobatchLists.__qualname__ = schedule_class.__name__
    return MicrobatchLists


def tiny_config(args: Any, config_class: type = Trainer.Config, **extra: Any) -> Any:
    """A tiny torchtitan job from the example's flags: float32 weights (parameters in float32 or,
    with ``--mixed-precision-param bfloat16``, bfloat16 in forward and backward), compile off, the mesh
    from ``--replicate`` / ``--shard`` / ``--tp``, accumulation through ``global_batch_size``."""
    dp = args.replicate * args.shard
    return config_class(
        model_spec=tiny_llama3(n_layers=args.layers),
        hf_assets_path="",
        dump_folder=args.out,
        tokenizer=TinyTokenizer.Config(),
        dataloader=RandomTokensDataLoader.Config(seed=args.seed),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=args.lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=args.batch_size, global_batch_size=args.batch_size * dp * args.accum,
                                seq_len=args.seq_len, steps=args.steps, max_norm=args.max_norm, dtype="float32",
                                mixed_precision_param=args.mixed_precision_param, disable_cuda_graphs=True, gc_freq=1000),
        parallelism=ParallelismConfig(data_parallel_replicate_degree=args.replicate,
                                      data_parallel_shard_degree=args.shard, tensor_parallel_degree=args.tp,
                                      pipeline_parallel_degree=args.pp, pipeline_parallel_schedule=args.pp_schedule,
                                      spmd_backend=args.spmd_backend,
                                      fsdp_reshard_after_forward=os.environ.get("TT_RESHARD", "default")),
        compile=CompileConfig(enable=args.compile),
        metrics=MetricsProcessor.Config(log_freq=1),
        activation_checkpoint=None,
        debug=DebugConfig(seed=args.seed),
        checkpoint=CheckpointManager.Config(enable=args.checkpoint_every > 0, interval=max(1, args.checkpoint_every),
                                            folder="checkpoint", last_save_model_only=False),
        **extra,
    )
