"""The levers people pull for memory and speed beyond accelerate's plugin: activation checkpointing of every K-th
block or op by op inside each block, per-block compilation, and float8 training. One place that every variant
calls, so that a difference between the torch variants and accelerate's stays accelerate's.

The order is the one torchtitan and accelerate keep: float8 converts the Linear layers first, then checkpointing
wraps each block, then each block (with its wrapper) is compiled, then ``fully_shard`` shards it. docs/levers.md
says what each costs and saves.

Selective checkpointing's policy: inside a checkpointed block the outputs of the attention kernel and of every
other matmul are kept; everything else (norms, activations, rotary embeddings, the other matmuls) is recomputed
in backward. The attention kernel is the most expensive op to recompute for what it keeps (one hidden width of
output); the matmuls hold most of a block's FLOPs, so keeping half of them halves what recomputation costs
while keeping about half of their outputs. The matmuls are counted in the order the block runs them, in the
forward and in the recomputation alike, so both make the same choice. The float8 scales' amax reductions (one
number each) are kept too: recomputing them would recompute the scales.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp2bench.cli import UserError, quiet_imports
from fsdp2bench.names import counted
from fsdp2bench.options.fsdp import FULL_AC, SELECTIVE_AC, FsdpOptions

if TYPE_CHECKING:
    from torch import nn

FLOAT8_REQUIREMENTS = "requirements-float8.txt"
FLOAT8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper on
FLOAT8_ALIGNMENT = 16  # torch._scaled_mm wants both dims of a weight divisible by 16
# float8 without compile: torchao's casts and scales run as eager kernels around every matmul.
FLOAT8_EAGER = ("--float8 without --compile: torchao's casts then run eagerly around every matmul, which costs more "
                "than float8 saves (the 1.5B shape at N = 8, 2 x 2048 tokens, one H100: 0.520 s a step, against "
                "0.183 s with --compile alone); add --compile")


# --------------------------------------------------------------------------- blocks

def block_of(module: nn.Module) -> nn.Module:
    """The transformer block inside its compiled module and checkpoint (and offload) wrappers, if any."""
    inner = getattr(module, "_orig_mod", None) or getattr(module, "_checkpoint_wrapped_module", None)
    return module if inner is None else block_of(inner)


def is_block(module: nn.Module, layer_classes: list[str]) -> bool:
    """Whether a module is (or wraps) a transformer block, sharded or not (fully_shard renames its class FSDP...)."""
    return type(block_of(module)).__name__.removeprefix("FSDP") in layer_classes


def blocks(model: nn.Module, layer_classes: list[str]) -> list[tuple[str, nn.Module]]:
    """The model's transformer blocks, each by its outermost wrapper where it has one, in forward order."""
    found, inside = [], set()
    for name, module in model.named_modules():
        if is_block(module, layer_classes) and id(block_of(module)) not in inside:
            inside.add(id(block_of(module)))
            found.append((name, module))
    return found


def checkpointed(index: int, every: int) -> bool:
    """Whether block ``index`` (from 0) is checkpointed when every ``every``-th one is: the K-th, 2K-th, ..."""
    return (index + 1) % every == 0


# --------------------------------------------------------------------------- activation checkpointing

def selective_contexts():
    """The forward's and the recomputation's contexts of one checkpointed block call (torch's ``context_fn``)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}
    attention = {getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
        if hasattr(aten, name)}
    kept = attention | {aten.max.default}
    counted = {False: 0, True: 0}  # matmuls seen in the forward, and in the recomputation

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            counted[ctx.is_recompute] += 1
            keep = counted[ctx.is_recompute] % 2 == 1
        else:
            keep = op in kept
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(model: nn.Module, layer_classes: list[str], options: FsdpOptions) -> None:
    """Each checkpointed block in torch's ``checkpoint_wrapper`` (without RNG state, as accelerate wraps it), with
    the selective policy under ``selective``, inside an ``offload_wrapper`` when its saved inputs go to the host."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    extra = {"context_fn": selective_contexts} if options.activation_checkpointing == SELECTIVE_AC else {}
    every = options.ac_every if options.activation_checkpointing == FULL_AC else 1
    for index, (name, block) in enumerate(blocks(model, layer_classes)):
        if checkpointed(index, every):
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, **extra)
            model.set_submodule(name, offload_wrapper(wrapped) if options.activation_checkpointing_offload else wrapped)


def checkpoint_mode(module: nn.Module) -> str | None:
    """How a block's wrapper checkpoints it: full, selective, or None where it is not wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapper = next((m for m in module.modules() if isinstance(m, CheckpointWrapper)), None)
    if wrapper is None:
        return None
    keywords = getattr(wrapper.checkpoint_fn, "keywords", {})
    return SELECTIVE_AC if keywords.get("context_fn") is selective_contexts else FULL_AC


# --------------------------------------------------------------------------- compile

def same_compiler_settings() -> None:
    """What accelerate's regional compilation sets before it compiles blocks under FSDP2 (its per-block recipe is
    torchtitan's): the torch variants compile under the same dynamo settings."""
    import torch._dynamo

    torch._dynamo.config.capture_scalar_outputs = True
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_blocks(model: nn.Module, layer_classes: list[str]) -> None:
    """Each block, with its checkpoint wrapper, replaced by its compiled module (inductor), as torchtitan compiles
    them: ``fully_shard`` then shards the compiled module, so that its gathers and frees run outside the graph."""
    import torch

    same_compiler_settings()
    for name, unit in blocks(model, layer_classes):
        model.set_submodule(name, torch.compile(unit, backend="inductor"))


def graph_breaks() -> int:
    """Graph breaks dynamo has met in this process so far: a block that breaks runs the broken part eagerly."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def compiled(module: nn.Module) -> bool:
    """Compiled either way: replaced by torch.compile's module, or in place (``Module.compile``, accelerate's)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


def shard_unit(unit: nn.Module) -> nn.Module:
    """What ``fully_shard`` takes for a block: its compiled module, else the block itself inside any checkpoint
    wrapper (as accelerate shards it)."""
    return unit if hasattr(unit, "_orig_mod") else block_of(unit)


# --------------------------------------------------------------------------- float8

def float8_eligible(shape: tuple[int, ...]) -> bool:
    """A Linear weight that float8 matmuls can take: both dims divisible by ``FLOAT8_ALIGNMENT``."""
    return len(shape) == 2 and all(d % FLOAT8_ALIGNMENT == 0 for d in shape)


def float8_filter(model: nn.Module, layer_classes: list[str]) -> Callable[[nn.Module, str], bool]:
    """torchao's module filter: the Linear layers inside the blocks (never the output head), of eligible shape."""
    from torch import nn

    prefixes = tuple(f"{name}." for name, _ in blocks(model, layer_classes))

    def convert(module: nn.Module, name: str) -> bool:
        return (isinstance(module, nn.Linear) and name.startswith(prefixes)
                and float8_eligible(tuple(module.weight.shape)))

    return convert


def float8_config():
    """torchtitan's recipe: dynamic tensorwise scaling, FSDP2 all-gathers the weights in float8, and the float8
    weights are recomputed in backward instead of kept."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(enable_fsdp_float8_all_gather=True, force_recompute_fp8_weight_in_bwd=True)


def convert_to_float8(model: nn.Module, layer_classes: list[str]) -> None:
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, config=float8_config(), module_filter_fn=float8_filter(model, layer_classes))


def precompute_float8_scales(model: nn.Module) -> Callable:
    """An optimizer step post-hook: the float8 scales of every sharded weight in one pass after each step, so that
    the next all-gather sends float8 (what torchtitan and accelerate's AO path do)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda *args, **kwargs: precompute_float8_dynamic_scale_for_fsdp(model)


def float8_linears(model: nn.Module) -> int:
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


# --------------------------------------------------------------------------- checks

def check(options: FsdpOptions, device_type: str, num_blocks: int) -> None:
    """A lever that cannot run here, refused in one line with the reason, before anything runs."""
    if options.ac_every > num_blocks:
        raise UserError(f"--ac_every {options.ac_every}: this model has {counted(num_blocks, 'block')}, so no block "
                        "would be checkpointed")
    if options.compile and device_type == "cpu":
        check_cpp_compiler("--compile on the CPU: inductor builds C++ there")
    if options.float8:
        check_float8(device_type)


DEFAULT_CXX = "clang++" if sys.platform == "darwin" else "g++"  # inductor's, where CXX is not set
COMPILER_WAIT_S = 30.0


def cpp_compiler() -> str | None:
    """The C++ compiler inductor builds with on the CPU, where it runs (``--version`` answers, as inductor asks it):
    the one CXX names where it is set, as inductor and torch's C++ extensions take it, else inductor's default."""
    name = os.environ.get("CXX", DEFAULT_CXX)
    path = shutil.which(name) if name.strip() else None
    if path is None:
        return None
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=COMPILER_WAIT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def check_cpp_compiler(needed_by: str) -> None:
    """Refused in one line, after ``needed_by`` (what builds C++), where inductor would find no C++ compiler."""
    if cpp_compiler() is not None:
        return
    cxx = os.environ.get("CXX")
    missing = f"CXX={cxx!r} names no C++ compiler that runs" if cxx is not None else \
        f"no C++ compiler: {DEFAULT_CXX} is not on the PATH (or set CXX to one)"
    raise UserError(f"{needed_by}, and {missing}")


def check_float8(device_type: str) -> None:
    if device_type != "cuda":
        raise UserError("--float8 needs a GPU of compute capability 8.9 or more (float8 matmuls run on its tensor "
                        "cores); this run is on the CPU")
    capability = gpu_capability()
    if capability is not None and capability < FLOAT8_MIN_CAPABILITY:
        raise UserError(f"--float8 needs a GPU of compute capability 8.9 or more (float8 tensor cores); this one "
                        f"has {capability[0]}.{capability[1]}")
    try:
        with quiet_imports():
            import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise UserError(f"--float8: torchao cannot be imported ({exc}); install it with pip install -r "
                        f"{FLOAT8_REQUIREMENTS}") from None


def gpu_capability() -> tuple[int, int] | None:
    """The smallest compute capability among the GPUs, from nvidia-smi (the main process never initialises CUDA);
    None where it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return min(tuple(int(part) for part in line.strip().split(".")) for line in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
