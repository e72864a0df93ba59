"""The four training variants of the benchmark, side by side, and the optimizer fix.

The variants differ only in *when* the optimizer is created relative to ``fully_shard`` and
in who does the sharding. Everything else (model, data, processes, measurement) is the same
for all four and lives in the ``fsdp2bench`` package and ``measure.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdp2bench import names
from fsdp2bench.options import AUTOCAST, FsdpOptions


# --------------------------------------------------------------------------- the fix

def release_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[int, str]:
    """Before ``fully_shard``: swap the optimizer's parameters for meta-device placeholders, so that
    it does not keep the whole unsharded model alive (on the GPU, once ``fully_shard`` has moved
    it) while the shards are made. Returns ``id(placeholder) -> parameter name`` for the fix."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    placeholders: dict[int, str] = {}
    for group in optimizer.param_groups:
        swapped = []
        for param in group["params"]:
            stand_in = torch.empty_like(param, device="meta")
            placeholders[id(stand_in)] = names.get(id(param))
            swapped.append(stand_in)
        group["params"] = swapped
    return placeholders


def canonical_name(name: str) -> str:
    """A parameter's name without the activation-checkpointing wrappers' segments, which wrapping
    inserts between the optimizer's creation and the fix."""
    return name.replace("._checkpoint_wrapped_module", "")


def point_optimizer_at_sharded_params(optimizer: torch.optim.Optimizer, old_names: dict[int, str],
                                      model: nn.Module) -> None:
    """Replace each parameter in ``optimizer`` by the model's parameter of the same name.

    ``old_names`` maps ``id(param)`` of the parameters the optimizer holds to their names, taken
    before ``fully_shard`` replaced them (``release_params`` gives it for its placeholders). Group
    options (lr, weight decay...) stay as they are.
    State already created for an old parameter would describe the unsharded tensor, so it is refused.
    """
    if optimizer.state:
        raise ValueError("optimizer already has state; create it, shard, then fix, before any step")
    current = {canonical_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    for group in optimizer.param_groups:
        swapped = []
        for param in group["params"]:
            name = old_names.get(id(param))
            if name is None or name not in current:
                raise KeyError(f"optimizer parameter {name or '<unnamed>'} has no counterpart in the sharded model")
            swapped.append(current[name])
        group["params"] = swapped


# --------------------------------------------------------------------------- the variants

@dataclass
class Context:
    """What every variant needs: where to shard, hyper-parameters, the FSDP2 options, and a hook to mark phases."""
    device: torch.device
    mesh: object
    learning_rate: float
    layer_classes: list[str]
    mark: Callable[[str], None]
    options: FsdpOptions = FsdpOptions()


def one_microbatch(last: bool) -> ContextManager:
    return contextlib.nullcontext()


@dataclass
class Prepared:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    backward: Callable[[torch.Tensor], None]
    # The context of one microbatch under gradient accumulation, given whether it is the step's last.
    microbatch: Callable[[bool], ContextManager] = one_microbatch


BF16_POLICY = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)


def mixed_precision_policy(options: FsdpOptions) -> MixedPrecisionPolicy:
    """What accelerate gives ``fully_shard``: its bf16 policy for ``mixed_precision="bf16"`` (beside
    autocast), or the policy the option names (bf16 parameters, gradients reduced in fp32)."""
    if options.mixed_precision_policy == AUTOCAST:
        return MixedPrecisionPolicy(**BF16_POLICY)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def offload_policy(options: FsdpOptions, device: torch.device) -> OffloadPolicy:
    """FSDP2's CPU offload, with pinned host memory on a GPU (torch cannot pin without one)."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if options.cpu_offload else OffloadPolicy()


def make_optimizer(model: nn.Module, ctx: Context) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.learning_rate)
    ctx.mark("optimizer_created")
    return optimizer


def checkpoint_blocks(model: nn.Module, layer_classes: list[str], options: FsdpOptions) -> None:
    """Activation checkpointing as accelerate applies it before sharding: each transformer block in a
    ``checkpoint_wrapper`` without RNG state, inside an ``offload_wrapper`` when its saved inputs go to
    the host."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    blocks = [(name, m) for name, m in model.named_modules() if type(m).__name__ in layer_classes]
    for name, block in blocks:
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.set_submodule(name, offload_wrapper(wrapped) if options.activation_checkpointing_offload else wrapped)


def fully_shard_blocks(model: nn.Module, mesh, layer_classes: list[str], options: FsdpOptions = FsdpOptions(),
                       device: torch.device | None = None) -> None:
    """``fully_shard`` each transformer block with accelerate's arguments for ``options``, then the
    root, which keeps FSDP2's own choice of resharding (as accelerate leaves it)."""
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(options),
                  offload_policy=offload_policy(options, device or torch.device("cpu")))
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, reshard_after_forward=options.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)


def compute_in_bf16(model: nn.Module, device: torch.device) -> None:
    """What accelerate does to the model for ``mixed_precision="bf16"``, so that the torch variants
    match it: the forward runs under bf16 autocast and its floating outputs come back in fp32."""
    from accelerate.utils import convert_outputs_to_fp32

    model.forward = convert_outputs_to_fp32(torch.autocast(device.type, dtype=torch.bfloat16)(model.forward))


def shard(model: nn.Module, ctx: Context) -> None:
    if ctx.options.activation_checkpointing:
        checkpoint_blocks(model, ctx.layer_classes, ctx.options)
    fully_shard_blocks(model, ctx.mesh, ctx.layer_classes, ctx.options, ctx.device)
    if ctx.options.mixed_precision_policy == AUTOCAST:
        compute_in_bf16(model, ctx.device)
    ctx.mark("sharded")


def torch_backward(loss: torch.Tensor) -> None:
    loss.backward()


def torch_prepared(model: nn.Module, optimizer: torch.optim.Optimizer, options: FsdpOptions) -> Prepared:
    """The torch variants' training calls: with K microbatches a step, what accelerate's
    ``backward`` and ``accumulate()`` do, as FSDP2 calls (``sync_each_batch`` false: no reduction
    before the last microbatch), plus torch's own choice, ``requires_all_reduce``."""
    k = options.gradient_accumulation_steps
    if k == 1:
        return Prepared(model, optimizer, torch_backward)

    def microbatch(last: bool) -> ContextManager:
        model.set_requires_gradient_sync(last or options.sync_each_batch)
        if not options.requires_all_reduce:
            model.set_requires_all_reduce(last)
        return contextlib.nullcontext()

    return Prepared(model, optimizer, lambda loss: (loss / k).backward(), microbatch)


def optimizer_after_fsdp(model: nn.Module, ctx: Context) -> Prepared:
    shard(model, ctx)
    return torch_prepared(model, make_optimizer(model, ctx), ctx.options)


def optimizer_before_fsdp_not_fixed(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    shard(model, ctx)
    return torch_prepared(model, optimizer, ctx.options)


def optimizer_before_fsdp_fixed(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    old_names = release_params(optimizer, model)
    shard(model, ctx)
    point_optimizer_at_sharded_params(optimizer, old_names, model)
    return torch_prepared(model, optimizer, ctx.options)


def make_accelerator(device: torch.device, layer_classes: list[str], cpu_ram_efficient_loading: bool = False,
                     options: FsdpOptions = FsdpOptions()):
    """accelerate's FSDP2 set-up as the upstream uses it (transformer-block auto-wrap), with ``options``
    given to its plugin (bf16 through ``mixed_precision="bf16"``, or the policy through the plugin),
    its accumulation plugin and, for HSDP, its parallelism config (which builds its own mesh)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    autocast = options.mixed_precision_policy == AUTOCAST
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=layer_classes,
        cpu_ram_efficient_loading=cpu_ram_efficient_loading, reshard_after_forward=options.reshard_after_forward,
        mixed_precision_policy=None if autocast else mixed_precision_policy(options),
        activation_checkpointing=options.activation_checkpointing,
        # Named only when on: the field came in accelerate 1.15 (options.check_libraries refuses it before).
        **({"activation_checkpointing_offload": True} if options.activation_checkpointing_offload else {}),
        cpu_offload=offload_policy(options, device))
    scaling = accelerate_scaling(options)
    # On the CPU its parallelism config would refuse the MULTI_CPU type it starts with: given after the switch.
    parallelism = scaling.pop("parallelism_config", None) if device.type == "cpu" else None
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16" if autocast else "no",
                              cpu=device.type == "cpu", **scaling)
    if device.type == "cpu":
        force_accelerate_fsdp_on_cpu(accelerator, plugin, autocast, parallelism)
    return accelerator


def accelerate_scaling(options: FsdpOptions) -> dict:
    """``Accelerator`` arguments for accumulation and HSDP; none where they are off, as before they existed.
    ``requires_all_reduce`` has no accelerate counterpart: the variant runs as ``sync_each_batch`` says."""
    import torch.distributed as dist

    kwargs = {}
    if options.accumulates:
        from accelerate.utils import GradientAccumulationPlugin

        kwargs["gradient_accumulation_plugin"] = GradientAccumulationPlugin(
            num_steps=options.gradient_accumulation_steps, sync_each_batch=options.sync_each_batch)
    replicas, shards = options.mesh_shape(dist.get_world_size())
    if replicas > 1:
        from accelerate import ParallelismConfig

        kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shards)
    return kwargs


def accelerate_fsdp2(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    accelerator = make_accelerator(ctx.device, ctx.layer_classes, options=ctx.options)
    model, optimizer = accelerator.prepare(model, optimizer)
    if not isinstance(model, FSDPModule):
        raise RuntimeError(f"accelerate did not take its FSDP2 path (distributed type {accelerator.distributed_type})")
    ctx.mark("sharded")
    return Prepared(model, optimizer, accelerator.backward, lambda last: accelerator.accumulate(model))


def force_accelerate_fsdp_on_cpu(accelerator, plugin, autocast: bool = True, parallelism=None) -> None:
    """Development/CI mode only: on CPU accelerate would silently pick DDP; make it take its FSDP2 path.

    This repeats what accelerate does itself when it selects FSDP on an accelerator: record the
    plugin and, for ``mixed_precision="bf16"``, give it the bf16 policy (without that the variant
    would train in fp32); for HSDP, take the parallelism config, build its mesh and check it.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    # Both shared states: accelerate copies the process state's type back into its own during prepare().
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if autocast:
        plugin.set_mixed_precision("bf16")
    if parallelism is not None:
        accelerator.state.parallelism_config = parallelism
        accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")
        parallelism._validate_accelerator(accelerator)


# Run order and names are those of the upstream benchmark (fsdp2bench.names.VARIANTS).
VARIANTS: dict[str, Callable[[nn.Module, Context], Prepared]] = {
    "torch_optimizer_after_fsdp": optimizer_after_fsdp,                        # intended
    "torch_optimizer_before_fsdp_not_fixed": optimizer_before_fsdp_not_fixed,  # stale optimizer
    "torch_optimizer_before_fsdp_fixed": optimizer_before_fsdp_fixed,          # our fix
    "accelerate": accelerate_fsdp2,                                            # accelerate's fix
}
assert list(VARIANTS) == names.VARIANTS
