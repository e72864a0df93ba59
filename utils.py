"""The four training variants of the benchmark, side by side, and the optimizer fix.

The variants differ only in *when* the optimizer is created relative to ``fully_shard`` and
in who does the sharding. Everything else (model, data, processes, measurement) is the same
for all four and lives in the ``fsdp2bench`` package and ``measure.py``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below: said at once
    from fsdp2bench.cli import not_a_script

    not_a_script("utils.py holds main.py's four variants", "python3 main.py")

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp2bench import names
from fsdp2bench.options import levers, tuning
from fsdp2bench.options.accelerate_config import options_alone
from fsdp2bench.options.fsdp import AUTOCAST, FP32, FULL_AC, FsdpOptions
from fsdp2bench.options.layout import Degrees, Meshes, planned_style, tensor_parallel_plan
from fsdp2bench.options.step import CHUNK_TOKENS, CHUNKED, LIGER
from fsdp2bench.processes.isolation import Unsupported


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
    """A parameter's name without the segments that activation checkpointing's wrappers and compiled modules
    insert between the optimizer's creation and the fix."""
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


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
    """What every variant needs: where to shard, hyper-parameters, the FSDP2 options and layout, the model's
    config (its tensor-parallel plan), and a hook to mark phases."""
    device: torch.device
    meshes: Meshes | None  # the torch variants' (accelerate builds its own)
    learning_rate: float
    layer_classes: list[str]
    mark: Callable[[str], None]
    options: FsdpOptions = FsdpOptions()
    config: object = None


def one_microbatch(last: bool) -> ContextManager:
    return contextlib.nullcontext()


@contextlib.contextmanager
def whole_sequences(input_ids: torch.Tensor) -> Iterator[dict]:
    """A causal LM's inputs: the tokens, and the same tokens as labels (the model shifts them)."""
    yield {"input_ids": input_ids, "labels": input_ids}


# --------------------------------------------------------------------------- the loss (fsdp2bench/options/step.py)

IGNORE_INDEX = -100  # transformers' label for "no token to predict"


def model_loss(model: nn.Module, inputs: dict):
    """The model's own loss (or liger's, which replaces the causal LM's forward): its outputs, loss included."""
    return model(**inputs)


def chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               labels: torch.Tensor) -> torch.Tensor:
    """One chunk's summed cross entropy, upcast to fp32 as transformers' causal-LM loss upcasts the logits."""
    logits = nn.functional.linear(hidden, weight, bias).float()
    return nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """The mean cross entropy over the tokens that have a label, ``chunk`` tokens at a time: each chunk's
    logits are freed once its loss is summed and recomputed in backward (torch's non-reentrant checkpoint),
    so that at most one chunk's logits exist."""
    from torch.utils.checkpoint import checkpoint

    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = sum(checkpoint(chunk_loss, h, weight, bias, y, use_reentrant=False)
                for h, y in zip(hidden.split(chunk), labels.split(chunk)))
    return total / (labels != IGNORE_INDEX).sum()


def next_token_labels(inputs: dict) -> torch.Tensor:
    """Each position's next token (what the model's loss shifts its labels into), or the labels already
    shifted before context parallelism cut the sequence."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    return nn.functional.pad(inputs["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)


def loss_in_head(model: nn.Module, chunk: int = CHUNK_TOKENS) -> None:
    """The chunked loss computed by the output head itself, inside the model's forward: FSDP2 gathers the
    head's weight only around the forward of the unit that owns it (the root here, a unit of its own under
    accelerate), so the loss runs where the weight is whole, and its backward inside the unit's backward. Given
    labels (``chunked_loss``), the head returns the loss in place of the logits; any model whose forward
    passes its last hidden states to ``get_output_embeddings()`` takes it (step.check refuses models that
    change the logits after the head)."""
    head = model.get_output_embeddings()
    head.next_token_labels = None

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if head.next_token_labels is None:
            return nn.functional.linear(hidden, head.weight, head.bias)
        return chunked_cross_entropy(hidden, head.weight, head.bias, head.next_token_labels, chunk)

    head.forward = forward


def chunked_loss(model: nn.Module, inputs: dict):
    """The model's forward without labels, its head (``loss_in_head``) given them: outputs holding the loss
    alone, as a fused loss returns it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    head = model.get_output_embeddings()
    head.next_token_labels = next_token_labels(inputs)
    try:
        loss = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}).logits
    finally:
        head.next_token_labels = None
    return CausalLMOutputWithPast(loss=loss)


def adopt_loss(model: nn.Module, loss: str) -> None:
    """What the loss changes in the model before a variant shards it: liger's kernels, by the model's type
    (its own function, as the Trainer's ``use_liger_kernel`` calls it), or the chunked head."""
    if loss == LIGER:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif loss == CHUNKED:
        loss_in_head(model)


def loss_forward(loss: str) -> Callable[[nn.Module, dict], object]:
    return chunked_loss if loss == CHUNKED else model_loss


@dataclass
class Prepared:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    backward: Callable[[torch.Tensor], None]
    # The forward and its loss, from the model and a microbatch's inputs to outputs with ``.loss``.
    forward: Callable[[nn.Module, dict], object] = model_loss
    # The context of one microbatch under gradient accumulation, given whether it is the step's last.
    microbatch: Callable[[bool], ContextManager] = one_microbatch
    # The model's inputs for a microbatch, inside which its forward and backward run (CP splits them there).
    inputs: Callable[[torch.Tensor], ContextManager[dict]] = whole_sequences


BF16_POLICY = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)


def mixed_precision_policy(options: FsdpOptions) -> MixedPrecisionPolicy:
    """What accelerate gives ``fully_shard``: its bf16 policy for ``mixed_precision="bf16"`` (beside
    autocast), FSDP2's default (fp32 throughout) for ``mixed_precision="no"``, or the policy the option
    names (bf16 parameters, gradients reduced in fp32)."""
    if options.mixed_precision_policy == AUTOCAST:
        return MixedPrecisionPolicy(**BF16_POLICY)
    if options.mixed_precision_policy == FP32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def offload_policy(options: FsdpOptions, device: torch.device) -> OffloadPolicy:
    """FSDP2's CPU offload, with pinned host memory on a GPU (torch cannot pin without one)."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if options.cpu_offload else OffloadPolicy()


def make_optimizer(model: nn.Module, ctx: Context) -> torch.optim.Optimizer:
    """The optimizer (AdamW, or the one ``--optimizer`` names) over the parameters that train: all of them, or
    under LoRA the adapters alone, the frozen base left out."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = tuning.make_optimizer(trainable, ctx.options.tuning, ctx.learning_rate)
    ctx.mark("optimizer_created")
    return optimizer


def fully_shard_blocks(model: nn.Module, mesh, layer_classes: list[str], options: FsdpOptions = FsdpOptions(),
                       device: torch.device | None = None,
                       before_each: Callable[[nn.Module], None] | None = None) -> None:
    """``fully_shard`` each transformer block with accelerate's arguments for ``options`` (the block inside its
    checkpoint wrapper, or its compiled module: ``levers.shard_unit``), then the root, which keeps FSDP2's own
    choice of resharding (as accelerate leaves it); ``before_each`` is given each unit just before it is sharded."""
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(options),
                  offload_policy=offload_policy(options, device or torch.device("cpu")))
    for _, unit in levers.blocks(model, layer_classes):
        if before_each:
            before_each(unit)
        fully_shard(levers.shard_unit(unit), reshard_after_forward=options.reshard_after_forward, **kwargs)
    if before_each:
        before_each(model)
    fully_shard(model, **kwargs)


def give_shards_storage(model: nn.Module, device: torch.device) -> None:
    """A model on the meta device (sharded or whole) gets storage for its own parameters only; its buffers (computed
    on the CPU when it was built) are copied back, as ``to_empty`` leaves them uninitialised."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def draw_weight(name: str, tensor: torch.Tensor, std: float, seed: int) -> None:
    """A base weight as transformers initialises these decoders: ~ N(0, std), norm scales 1, biases 0."""
    with torch.no_grad():
        if name.endswith("bias"):
            tensor.zero_()
        elif tensor.dim() == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=torch.Generator(tensor.device).manual_seed(seed))


def materialize_shards(model: nn.Module, device: torch.device, std: float) -> None:
    """Storage and random weights for this rank's shards of a model built on meta (``--init_device meta``), each
    shard drawn on ``device`` from its own generator seeded by the run's seed, the parameter's index and the rank,
    so that no rank ever holds more than its shards."""
    give_shards_storage(model, device)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for index, (name, param) in enumerate(model.named_parameters()):
        local = param.to_local() if isinstance(param, DTensor) else param
        draw_weight(name, local, std, (torch.initial_seed() * 1_000_003 + index) * 4099 + rank)


def unit_by_unit(model: nn.Module, device: torch.device, std: float) -> Callable[[nn.Module], None]:
    """Under ``--init_device meta`` with adapters, what draws each FSDP2 unit whole just before it is sharded: its
    base weights (the same on every rank), under QLoRA quantized to 4 bits there (quantizing needs each weight
    whole, as a loader reading a checkpoint has it), then the adapters as peft initialises them. A rank holds its
    shards and one unit, never the model."""
    seed = torch.initial_seed()
    where = {id(p): (i, n) for i, (n, p) in enumerate(model.named_parameters(remove_duplicate=False))}
    drawn: dict[int, nn.Parameter] = {}  # a tied parameter is drawn once and put back everywhere it sits

    def draw(param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        index, name = where[id(param)]
        draw_weight(name, tensor, std, seed * 1_000_003 + index)
        return tensor

    def whole(param: nn.Parameter) -> nn.Parameter:
        if id(param) not in drawn:
            drawn[id(param)] = nn.Parameter(draw(param, torch.empty_like(param, device=device)),
                                            requires_grad=param.requires_grad)
        return drawn[id(param)]

    def build(unit: nn.Module) -> None:
        adapters = [(m, where[id(next(iter(m.lora_A.values())).weight)][0]) for m in unit.modules()
                    if hasattr(m, "reset_lora_parameters") and any(p.is_meta for p in m.lora_A.parameters())]
        for module in unit.modules():
            weight = module._parameters.get("weight")
            tuning.quantize_drawn(module, lambda shape, w=weight: draw(w, torch.empty(shape, dtype=torch.bfloat16,
                                                                                      device=device)))
            for key, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    module._parameters[key] = whole(param)
        for module, index in adapters:  # peft's own start: A drawn, B zero
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed * 1_000_003 + index)
                module.reset_lora_parameters("default", True)

    return build


def compute_in_bf16(model: nn.Module, device: torch.device) -> None:
    """What accelerate does to the model for ``mixed_precision="bf16"``, so that the torch variants
    match it: the forward runs under bf16 autocast and its floating outputs come back in fp32."""
    from accelerate.utils import convert_outputs_to_fp32

    model.forward = convert_outputs_to_fp32(torch.autocast(device.type, dtype=torch.bfloat16)(model.forward))


def tensor_parallel(model: nn.Module, mesh, config) -> None:
    """The model's own tensor-parallel plan (its config's ``base_model_tp_plan``) applied to its base model with
    torch's API on the tp mesh: each planned Linear's weight split by output (colwise) or input (rowwise)
    features, a planned embedding by rows (torch's rowwise on an Embedding). What the plan leaves out (norms,
    and the embeddings and head unless it names them) stays whole on every tp rank. A head tied to a split
    embedding splits with it: its outputs gathered, as the model's own plan has it (colwise_gather_output)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # An embedding's input, the token ids, is whole on every tp rank (torch's rowwise takes a Linear's input split).
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    plan = tensor_parallel_plan(config)
    base = model.get_submodule(model.base_model_prefix)
    modules = {name: styles[style]() for name, _ in base.named_modules() if (style := planned_style(name, plan))}
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    parallelize_module(base, mesh, modules)
    if tied and isinstance(embeddings.weight, DTensor):
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()))
        head.weight = embeddings.weight  # tied again: one split weight, as before the split


def causal_attention_only(model: nn.Module) -> None:
    """Context parallelism's ring attention takes no mask: every attention is called plain causal (what
    accelerate's hooks do for its own CP), which is this model's mask for unpadded blocks."""
    def drop_mask(_module, args, kwargs):
        if "attention_mask" in kwargs:
            kwargs.update(attention_mask=None, is_causal=True)
        return args, kwargs

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(drop_mask, with_kwargs=True)


def sequence_split(enter: Callable[[list[torch.Tensor]], ContextManager]) -> Callable[[torch.Tensor],
                                                                                    ContextManager[dict]]:
    """Each microbatch inside a context-parallel context (``enter(buffers)``: torch's ``context_parallel`` or
    accelerate's ``maybe_context_parallel``), which cuts the tokens, their next-token labels and their
    positions along the sequence, two chunks per cp rank (one early, one late: the causal mask's work
    balanced), and runs attention as a ring over the cp ranks. The labels are shifted before the cut, so
    that no rank loses the token after its chunk."""
    @contextlib.contextmanager
    def inputs(input_ids: torch.Tensor) -> Iterator[dict]:
        tokens = input_ids.clone()  # cut in place: a batch's own storage, not a view of it
        labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).repeat(input_ids.shape[0], 1)
        with enter([tokens, labels, positions]):
            yield {"input_ids": tokens, "labels": labels, "shift_labels": labels, "position_ids": positions}

    return inputs


def torch_context_parallel(mesh, strategy: str) -> Callable[[torch.Tensor], ContextManager[dict]]:
    """torch's ``context_parallel`` on the cp mesh, keys and values passed as ``strategy`` says."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(strategy)
    return sequence_split(lambda buffers: context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                           no_restore_buffers=set(buffers)))


def shard(model: nn.Module, ctx: Context) -> None:
    """The loss's changes to the model, then TP on the tp mesh, then float8, activation checkpointing and
    compilation of each block, then FSDP2 over dp_shard x cp (the order torchtitan and accelerate keep)."""
    adopt_loss(model, ctx.options.step.loss)
    layout = ctx.options.layout
    if layout.tensor_parallel:
        tensor_parallel(model, ctx.meshes.tp, ctx.config)
    if layout.context_parallel:
        causal_attention_only(model)
    if ctx.options.float8:
        levers.convert_to_float8(model, ctx.layer_classes)
    if ctx.options.checkpoints:
        levers.checkpoint_blocks(model, ctx.layer_classes, ctx.options)
    if ctx.options.compile:
        levers.compile_blocks(model, ctx.layer_classes)
    std, meta = getattr(ctx.config, "initializer_range", 0.02), next(model.parameters()).is_meta
    fully_shard_blocks(model, ctx.meshes.fsdp, ctx.layer_classes, ctx.options, ctx.device,
                       unit_by_unit(model, ctx.device, std) if meta and ctx.options.tuning.adapters else None)
    if next(model.parameters()).is_meta:  # --init_device meta: only now does this rank's share get memory
        materialize_shards(model, ctx.device, std)
    if ctx.options.mixed_precision_policy == AUTOCAST:
        compute_in_bf16(model, ctx.device)
    ctx.mark("sharded")


def torch_backward(loss: torch.Tensor) -> None:
    loss.backward()


def torch_prepared(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: Context) -> Prepared:
    """The torch variants' training calls: with K microbatches a step, what accelerate's
    ``backward`` and ``accumulate()`` do, as FSDP2 calls (``sync_each_batch`` false: no reduction
    before the last microbatch), plus torch's own choice, ``requires_all_reduce``; under CP each
    microbatch inside ``context_parallel``."""
    options = ctx.options
    if options.float8:
        optimizer.register_step_post_hook(levers.precompute_float8_scales(model))
    inputs = torch_context_parallel(ctx.meshes.cp, options.layout.cp_comm_strategy) \
        if options.layout.context_parallel else whole_sequences
    k, forward = options.gradient_accumulation_steps, loss_forward(options.step.loss)
    if k == 1:
        return Prepared(model, optimizer, torch_backward, forward, inputs=inputs)

    def microbatch(last: bool) -> ContextManager:
        model.set_requires_gradient_sync(last or options.sync_each_batch)
        if not options.requires_all_reduce:
            model.set_requires_all_reduce(last)
        return contextlib.nullcontext()

    return Prepared(model, optimizer, lambda loss: (loss / k).backward(), forward, microbatch, inputs)


def optimizer_after_fsdp(model: nn.Module, ctx: Context) -> Prepared:
    shard(model, ctx)
    return torch_prepared(model, make_optimizer(model, ctx), ctx)


def optimizer_before_fsdp_not_fixed(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    shard(model, ctx)
    return torch_prepared(model, optimizer, ctx)


def optimizer_before_fsdp_fixed(model: nn.Module, ctx: Context) -> Prepared:
    optimizer = make_optimizer(model, ctx)
    old_names = release_params(optimizer, model)
    shard(model, ctx)
    point_optimizer_at_sharded_params(optimizer, old_names, model)
    return torch_prepared(model, optimizer, ctx)


def make_accelerator(device: torch.device, layer_classes: list[str], cpu_ram_efficient_loading: bool = False,
                     options: FsdpOptions = FsdpOptions(), model: nn.Module | None = None):
    """accelerate's FSDP2 set-up as the upstream uses it (transformer-block auto-wrap), with ``options``
    given to its plugin (bf16 through ``mixed_precision="bf16"``, or the policy through the plugin),
    its accumulation plugin, for HSDP its parallelism config (which builds its own mesh), and the levers it
    has: regional compilation, and float8 through ``mixed_precision="fp8"`` with torchao (``model``: whose
    blocks' Linear layers it converts)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    autocast = options.mixed_precision_policy == AUTOCAST
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=layer_classes,
        cpu_ram_efficient_loading=cpu_ram_efficient_loading, reshard_after_forward=options.reshard_after_forward,
        mixed_precision_policy=None if options.mixed_precision_policy in (AUTOCAST, FP32) else
        mixed_precision_policy(options),
        activation_checkpointing=checkpoints_whole_blocks(options),
        # Named only when on: the field came in accelerate 1.15 (options.check_libraries refuses it before).
        **({"activation_checkpointing_offload": True} if options.activation_checkpointing_offload else {}),
        cpu_offload=offload_policy(options, device))
    scaling = accelerate_scaling(options)
    # On the CPU its parallelism config would refuse the MULTI_CPU type it starts with: given after the switch.
    parallelism = scaling.pop("parallelism_config", None) if device.type == "cpu" else None
    with options_alone():
        accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="fp8" if options.float8 else
                                  "bf16" if autocast else "no", cpu=device.type == "cpu",
                                  **accelerate_levers(options, model, layer_classes), **scaling)
    if device.type == "cpu":
        force_accelerate_fsdp_on_cpu(accelerator, plugin, autocast, parallelism)
    return accelerator


def checkpoints_whole_blocks(options: FsdpOptions) -> bool:
    """Whether accelerate's plugin checkpoints the blocks itself: every block whole. Every K-th block, or op by op
    inside each block, is wrapped before ``prepare`` by the suite (``levers.checkpoint_blocks``), as a user would
    do it: the plugin knows neither."""
    return options.activation_checkpointing == FULL_AC and options.ac_every == 1


def checkpointing_by(variant: str, options: FsdpOptions) -> str | None:
    """Who wrapped the blocks for checkpointing: accelerate's plugin (whole blocks), or the suite (the torch
    variants, and accelerate's for every K-th block or op-level checkpointing, before ``prepare``)."""
    if not options.checkpoints:
        return None
    if variant != names.ACCELERATE:
        return "the suite"
    return "accelerate's plugin" if checkpoints_whole_blocks(options) else "the suite, before prepare"


def accelerate_levers(options: FsdpOptions, model: nn.Module | None, layer_classes: list[str]) -> dict:
    """``Accelerator`` arguments for compile (its regional compilation with inductor) and float8 (torchao's recipe
    with the suite's config and filter, so that all four variants convert the same layers); made without the
    launcher's dynamo variables, which would otherwise choose for it."""
    from accelerate.utils import TorchDynamoPlugin

    with options_alone():
        dynamo = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True, mode="default",
                                   fullgraph=False) if options.compile else TorchDynamoPlugin(backend="no")
    if not options.float8:
        return {"dynamo_plugin": dynamo}
    from accelerate.utils import AORecipeKwargs

    recipe = AORecipeKwargs(config=levers.float8_config(),
                            module_filter_func=levers.float8_filter(model, layer_classes))
    return {"dynamo_plugin": dynamo, "kwargs_handlers": [recipe]}


def accelerate_scaling(options: FsdpOptions) -> dict:
    """``Accelerator`` arguments for accumulation and the layout; none where they are off, as before they
    existed. ``requires_all_reduce`` has no accelerate counterpart: the variant runs as ``sync_each_batch``
    says."""
    import torch.distributed as dist

    kwargs = {}
    if options.accumulates:
        from accelerate.utils import GradientAccumulationPlugin

        kwargs["gradient_accumulation_plugin"] = GradientAccumulationPlugin(
            num_steps=options.gradient_accumulation_steps, sync_each_batch=options.sync_each_batch)
    degrees = options.layout.at(dist.get_world_size())
    if through_parallelism_config(degrees):
        from accelerate import ParallelismConfig

        cp = {}
        if degrees.cp > 1:
            from accelerate.utils import TorchContextParallelConfig

            cp = {"cp_size": degrees.cp,
                  "cp_handler": TorchContextParallelConfig(cp_comm_strategy=options.layout.cp_comm_strategy)}
        kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=degrees.replicate,
                                                         dp_shard_size=degrees.shard, tp_size=degrees.tp, **cp)
    return kwargs


def through_parallelism_config(degrees: Degrees) -> bool:
    """Whether accelerate gets a ParallelismConfig for this layout: replicas, context or tensor groups."""
    return degrees.replicate > 1 or degrees.cp > 1 or degrees.tp > 1


def accelerate_fsdp2(model: nn.Module | None, ctx: Context) -> Prepared:
    """accelerate's own path. Under TP it takes no model built here (``model`` is None): it needs one that
    transformers made tensor-parallel. Wherever the layout goes through accelerate's ParallelismConfig (HSDP,
    TP, CP), a refusal of that set-up by accelerate's own checks (made as ``Accelerator`` is built, before the
    model is prepared) or a failure of it is the libraries' answer for these releases, said as such
    (``Unsupported``), whatever the layout."""
    import torch.distributed as dist

    if not through_parallelism_config(ctx.options.layout.at(dist.get_world_size())):
        return _accelerate_prepared(model, ctx)
    try:
        return _accelerate_prepared(model, ctx)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - what accelerate and transformers do: reported, never patched
        if not isinstance(exc, Unsupported) and not raised_by_libraries(exc):
            raise  # this benchmark's own failure, not theirs
        import accelerate
        import transformers

        said = str(exc) if isinstance(exc, Unsupported) else failure_said(exc)
        raise Unsupported(f"fails at accelerate {accelerate.__version__} + transformers {transformers.__version__}: "
                          f"{said}") from exc


def raised_by_libraries(exc: BaseException) -> bool:
    """Whether an exception came out of a call into accelerate or transformers (a frame of theirs on its way)."""
    libraries = tuple(f"{os.sep}{name}{os.sep}" for name in ("accelerate", "transformers"))
    frame = exc.__traceback__
    while frame is not None:
        if any(part in frame.tb_frame.f_code.co_filename for part in libraries):
            return True
        frame = frame.tb_next
    return False


def _accelerate_prepared(model: nn.Module | None, ctx: Context) -> Prepared:
    accelerator = make_accelerator(ctx.device, ctx.layer_classes, options=ctx.options, model=model)
    split_wrong = None
    if ctx.options.layout.tensor_parallel:
        missing = name_prepare_cannot_import()
        if missing is not None:
            raise Unsupported(f"prepare() under FSDP2 + TP imports ReplicateParallel from "
                              f"transformers.integrations.tensor_parallel: {missing} (asked before transformers "
                              "builds the model: prepare() fails there whatever it is given)")
        model = tensor_parallel_by_transformers(ctx.config, accelerator)
        split = getattr(model, "tp_size", None) or 1
        if split != ctx.options.layout.tp_size:
            split_wrong = (f"from_pretrained(tp_plan='auto', device_mesh=<tp mesh of {ctx.options.layout.tp_size}>) "
                           + ("left the model whole" if split == 1 else f"split the model over {split} ranks"))
    adopt_loss(model, ctx.options.step.loss)
    if ctx.options.checkpoints and not checkpoints_whole_blocks(ctx.options):
        levers.checkpoint_blocks(model, ctx.layer_classes, ctx.options)
    optimizer = make_optimizer(model, ctx)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    except Exception as exc:
        if split_wrong is None:
            raise
        raise Unsupported(f"{split_wrong}; then prepare() raised {failure_said(exc)}") from exc
    if split_wrong is not None:
        raise Unsupported(split_wrong)
    if not isinstance(model, FSDPModule):
        raise RuntimeError(f"accelerate did not take its FSDP2 path (distributed type {accelerator.distributed_type})")
    ctx.mark("sharded")
    inputs = sequence_split(lambda buffers: accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers))) \
        if ctx.options.layout.context_parallel else whole_sequences
    return Prepared(model, optimizer, accelerator.backward, loss_forward(ctx.options.step.loss),
                    lambda last: accelerator.accumulate(model), inputs)


def name_prepare_cannot_import() -> str | None:
    """The ImportError that accelerate's ``prepare()`` meets under FSDP2 + TP where transformers lacks the name it
    imports there (accelerate 1.11.0 to 1.15.0 with transformers 5.1.0 to 5.24.0), asked first: reached the long
    way, it comes after ``from_pretrained`` has built the whole model. None where the installed accelerate does
    not import it, or the import works."""
    import inspect

    import accelerate.accelerator

    if "import ReplicateParallel" not in inspect.getsource(accelerate.accelerator):
        return None
    try:
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
    except ImportError as exc:
        return failure_said(exc)
    return None


def failure_said(exc: BaseException) -> str:
    """"ImportError: cannot import name ..." without the file path an ImportError adds (it says nothing more)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {re.sub(r' [(]/[^)]*[)]', '', first)}"


def tensor_parallel_by_transformers(config, accelerator) -> nn.Module:
    """What accelerate requires under TP: a model that transformers' ``from_pretrained`` made tensor-parallel
    with the model's own plan (``tp_plan="auto"``) on the accelerator's tp mesh. The checkpoint holds the
    config and no tensor, so transformers draws the weights itself (the same shapes and bytes as the torch
    variants'; other values)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="fsdp2bench-tp-") as directory:
        config.save_pretrained(directory)
        save_file({}, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=torch.float32,
                                                    device_mesh=accelerator.torch_device_mesh["tp"])


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
