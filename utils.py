"""Model, data and the four training variants of the benchmark (and the shared command-line helpers).

The variants differ only in *when* the optimizer is created relative to
``fully_shard`` and in who does the sharding; they are listed side by side in
``VARIANTS`` at the bottom of this file.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

BYTE_VOCAB = 256

# Built-in model shapes, so that no run needs the Hub. All are Qwen2 decoders;
# the Qwen2.5 entries copy the published configs' shapes.
PRESETS: dict[str, dict] = {
    # tiny: odd sizes on purpose, so that sharding needs padding at any N > 1.
    "tiny": dict(vocab_size=509, hidden_size=64, intermediate_size=170, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 max_position_embeddings=2048),
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True,
                  max_position_embeddings=4096),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                       max_position_embeddings=32768),
}
QWEN2_COMMON = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, hidden_act="silu", use_cache=False)


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file); reported in one line."""


# --------------------------------------------------------------------------- command line

class OneLineParser(argparse.ArgumentParser):
    """A bad flag gets one line and exit code 2, like every other user error."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def exit_with(run: Callable[[], int]) -> None:
    """Run a command; a UserError becomes one line on stderr and exit code 2."""
    try:
        code = run()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


def pick_device(choice: str) -> torch.device:
    """The device the children will use. Asked through NVML, so that the main process never
    initialises CUDA (its children do, each for itself)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    has_gpu = torch.cuda.is_available()
    if choice == "cuda" and not has_gpu:
        raise UserError("--device cuda: no CUDA GPU is visible to this process")
    if choice == "cpu" or not has_gpu:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def prepare_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise UserError(f"--output_dir {path}: cannot write there ({exc.strerror})") from None


# --------------------------------------------------------------------------- model

def load_config(model: str):
    """A preset name, a local directory with config.json, or a Hub id (needs the network)."""
    from transformers import AutoConfig, Qwen2Config

    if model in PRESETS:
        return Qwen2Config(**PRESETS[model], **QWEN2_COMMON)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise UserError(f"--model {model}: directory has no config.json")
        config = AutoConfig.from_pretrained(model)
    elif os.path.sep in model or model.startswith("."):
        raise UserError(f"--model {model}: no such directory")
    else:
        try:
            config = AutoConfig.from_pretrained(model)
        except Exception as exc:  # offline, unknown id, gated repo...
            raise UserError(f"--model {model}: not a preset ({', '.join(PRESETS)}), not a local directory, "
                            f"and the Hub could not provide it ({type(exc).__name__})") from None
    config.use_cache = False
    return config


def build_model(config, device: torch.device, seed: int) -> nn.Module:
    """Random fp32 weights, built directly on ``device``: same seed, same weights on every rank."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def layer_class_names(model: nn.Module) -> list[str]:
    """The transformer block classes to shard one by one (what accelerate's auto-wrap uses too)."""
    names = sorted(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise UserError(f"{type(model).__name__} names no transformer block class (_no_split_modules)")
    return names


def max_positions(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 0)


# --------------------------------------------------------------------------- data

_SUBJECTS = ["the miller", "a sailor", "the old queen", "my brother", "the clerk", "a fox", "the weaver", "our host"]
_VERBS = ["carried", "counted", "sold", "hid", "found", "painted", "mended", "lost"]
_OBJECTS = ["barrels of salt", "red lanterns", "silver spoons", "bolts of wool", "letters", "stones", "candles"]
_PLACES = ["by the river", "in the market", "at the gate", "under the bridge", "before dawn", "in the hall"]


def builtin_text(min_bytes: int) -> str:
    """Deterministic English-like prose with simple regularities a model picks up within a few steps."""
    rng = random.Random(0)
    lines, size = [], 0
    while size < min_bytes:
        count = rng.randint(2, 40)
        line = (f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {count} {rng.choice(_OBJECTS)} "
                f"{rng.choice(_PLACES)}, and {count + 1} more the next day.\n")
        lines.append(line)
        size += len(line)
    return "".join(lines)


# One pass over the built-in data is 160 steps at batch 2, block 128 on 8 ranks.
BUILTIN_TOKENS = 160 * 2 * 128 * 8


def load_tokens(dataset: str | None, tokenizer: str | None) -> torch.Tensor:
    """Token ids of the built-in text or of a local text file; bytes unless a tokenizer is given."""
    if dataset is None:
        text = builtin_text(BUILTIN_TOKENS)
    else:
        try:
            with open(dataset, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as exc:
            raise UserError(f"--dataset {dataset}: cannot read it ({exc.strerror})") from None
    if tokenizer is None:
        ids = list(text.encode("utf-8"))
        return torch.tensor(ids[:BUILTIN_TOKENS] if dataset is None else ids, dtype=torch.long)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as exc:
        raise UserError(f"--tokenizer {tokenizer}: cannot load it ({type(exc).__name__})") from None
    return torch.tensor(tok(text)["input_ids"], dtype=torch.long)


def rank_batches(tokens: torch.Tensor, block_size: int, batch_size: int, fraction: float,
                 rank: int, world_size: int, max_steps: int | None) -> list[torch.Tensor]:
    """Cut tokens into blocks, keep ``fraction`` of them, deal them round-robin to ranks, batch them.

    Every rank gets the same number of batches, in a fixed order, so all variants see identical data.
    """
    n_blocks = int(tokens.numel() // block_size * fraction)
    steps = n_blocks // (world_size * batch_size)
    if max_steps is not None:
        steps = min(steps, max_steps)
    if steps == 0:
        raise UserError(f"the dataset gives {n_blocks} blocks of {block_size} tokens, too few for one step of "
                        f"batch {batch_size} on {world_size} ranks")
    blocks = tokens[: n_blocks * block_size].view(n_blocks, block_size)
    mine = blocks[rank::world_size]
    return [mine[i * batch_size:(i + 1) * batch_size] for i in range(steps)]


# --------------------------------------------------------------------------- the fix

def point_optimizer_at_sharded_params(optimizer: torch.optim.Optimizer, old_names: dict[int, str],
                                      model: nn.Module) -> None:
    """Replace each parameter in ``optimizer`` by the model's parameter of the same name.

    ``old_names`` maps ``id(param)`` of the parameters the optimizer was built on to their names,
    taken before ``fully_shard`` replaced them. Group options (lr, weight decay...) stay as they are.
    State already created for an old parameter would describe the unsharded tensor, so it is refused.
    """
    if optimizer.state:
        raise ValueError("optimizer already has state; create it, shard, then fix, before any step")
    current = dict(model.named_parameters(remove_duplicate=False))
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
    """What every variant needs: where to shard, hyper-parameters, and a hook to mark phases."""
    device: torch.device
    mesh: object
    learning_rate: float
    layer_classes: list[str]
    mark: Callable[[str], None]


@dataclass
class Prepared:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    backward: Callable[[torch.Tensor], None]
    autocast: bool  # torch variants autocast themselves; accelerate wraps the model's forward instead


BF16_POLICY = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)


def make_optimizer(model: nn.Module, ctx: Context) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.learning_rate)
    ctx.mark("optimizer_created")
    return optimizer


def fully_shard_blocks(model: nn.Module, mesh, layer_classes: list[str]) -> None:
    """``fully_shard`` each transformer block, then the root, with bf16 compute."""
    policy = MixedPrecisionPolicy(**BF16_POLICY)
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def shard(model: nn.Module, ctx: Context) -> None:
    fully_shard_blocks(model, ctx.mesh, ctx.layer_classes)
    ctx.mark("sharded")


def torch_backward(loss: torch.Tensor) -> None:
    loss.backward()


def optimizer_after_fsdp(model: nn.Module, ctx: Context) -> Prepared:
    shard(model, ctx)
    return Prepared(model, make_optimizer(model, ctx), torch_backward, autocast=True)


def optimizer_before_fsdp_not_fixed(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    shard(model, ctx)
    return Prepared(model, optimizer, torch_backward, autocast=True)


def optimizer_before_fsdp_fixed(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    old_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    shard(model, ctx)
    point_optimizer_at_sharded_params(optimizer, old_names, model)
    return Prepared(model, optimizer, torch_backward, autocast=True)


def make_accelerator(device: torch.device, layer_classes: list[str], cpu_ram_efficient_loading: bool = False):
    """accelerate's FSDP2 set-up as the upstream uses it: transformer-block auto-wrap, bf16."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=layer_classes,
                                            cpu_ram_efficient_loading=cpu_ram_efficient_loading)
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    if device.type == "cpu":
        force_accelerate_fsdp_on_cpu(accelerator, plugin)
    return accelerator


def accelerate_fsdp2(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    accelerator = make_accelerator(ctx.device, ctx.layer_classes)
    model, optimizer = accelerator.prepare(model, optimizer)
    if not isinstance(model, FSDPModule):
        raise RuntimeError(f"accelerate did not take its FSDP2 path (distributed type {accelerator.distributed_type})")
    ctx.mark("sharded")
    return Prepared(model, optimizer, accelerator.backward, autocast=False)


def force_accelerate_fsdp_on_cpu(accelerator, plugin) -> None:
    """Development/CI mode only: on CPU accelerate would silently pick DDP; make it take its FSDP2 path.

    This repeats what accelerate does itself when it selects FSDP on an accelerator: record the
    plugin and give it the bf16 policy (without that the variant would train in fp32).
    """
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    plugin.set_mixed_precision("bf16")


# Run order and names are those of the upstream benchmark.
VARIANTS: dict[str, Callable[[nn.Module, Context], Prepared]] = {
    "torch_optimizer_after_fsdp": optimizer_after_fsdp,                        # intended
    "torch_optimizer_before_fsdp_not_fixed": optimizer_before_fsdp_not_fixed,  # stale optimizer
    "torch_optimizer_before_fsdp_fixed": optimizer_before_fsdp_fixed,          # our fix
    "accelerate": accelerate_fsdp2,                                            # accelerate's fix
}
INTENDED = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_fixed", "accelerate"]
UNFIXED = "torch_optimizer_before_fsdp_not_fixed"
