"""Where each variant's memory goes: bytes counted on every rank, and the same bytes predicted.

Measured (``account``): the storages actually held by the model's parameters (their local
shards: ``DTensor.numel()`` is the global size), their gradients, the optimizer's state, and
stale parameters (tensors the optimizer holds that the model no longer uses). Each storage
is counted once, whole, so padding and shared buffers are included.

Expected (``expected_state``): FSDP2 splits dim 0 of each parameter into N chunks of
ceil(d0 / N) rows. Every rank stores its chunk padded to that size; the optimizer's state
follows the unpadded local chunk; AdamW adds a 4-byte ``step`` per parameter. With
P = the model's parameter bytes:

* after / fixed / accelerate, held between steps: P/N (params) + 2P/N (AdamW moments)
* unfixed, held between steps: P (stale full params) + P/N (params) + P/N (grads never cleared)
* during a step every variant also holds its sharded gradients (P/N) until ``zero_grad``.

So at the peak the unfixed variant holds P + 2P/N against 4P/N: equal at N = 2, worse beyond.

Under LoRA (``--peft lora``, options/tuning.py) only the adapters train: the gradients, the optimizer's state,
the unfixed variant's stale parameters and the unreduced gradients below are the adapters' alone (read their bytes
for P there), while the parameters are the shards of the bf16 base and of the fp32 adapters, each padded in its own
dtype; the frozen base holds its chunk and nothing else (``expected_frozen_bytes``). A QLoRA base's 4-bit weights are
parameters of their packed shape (n elements: (n + 1) // 4 bf16 items), sharded like the others; bitsandbytes'
quantization statistics beside them are no parameters: whole on every rank, measured apart from the state
(``four_bit_statistics``). torchao's low-bit optimizers
keep a moment of a local chunk in 1 byte an element (8-bit, fp8) or half a byte (4-bit), plus a fp32 scale a block
and a lookup table, where the chunk is large enough (``tuning.quantizes``), and the plain moment elsewhere: which
parameters are which is counted from the optimizer's own state (``moments_kept``) against that rule.

Under HSDP (R replicas x S shards = N) every parameter is split in S, not N: read S for N above
and rank mod S for the rank. With gradient accumulation (K microbatches per step) the moment between
two microbatches of a step (``between_microbatches``, counted after the first one's backward) holds,
beside the state above, the gradients not yet reduced (``unreduced_grad_bytes``):

* without ``sync_each_batch`` (accelerate's default) every parameter's whole gradient in the reduce
  dtype (bf16 under autocast, fp32 under the fp32-reduce policy) on every rank: P/2 or P at any N,
  from the first microbatch's backward to the last one's reduce-scatter; no sharded gradient yet;
* with it, the sharded gradients (P/S) from the first microbatch on, as at the step peak;
* with it and ``requires_all_reduce`` false under HSDP (the torch variants), the reduce-scatter
  outputs that wait for the last microbatch's all-reduce, P/S in the reduce dtype, instead of them.

accelerate syncs each microbatch only where it is distributed: a world of one never does.

Where it lives (``expected_device_bytes``): on a GPU run everything above is on the GPU except
AdamW's step counters (host tensors). Under ``cpu_offload`` the parameters, gradients and AdamW
state live on the host, but the unfixed variant's stale parameters do not: ``fully_shard`` moves
each managed parameter to the GPU in place before it shards and offloads, and the optimizer holds
those same parameter objects, so P stays on the GPU. The other options change no state byte:
``reshard_after_forward``, the mixed-precision policy (the sharded parameters stay fp32) and
activation checkpointing change what a step holds for a moment (gathered parameters,
activations), which the measured peaks show beyond the state.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2bench.names import ACCELERATE, MICROBATCH_PHASE, UNFIXED, counted
from fsdp2bench.options import levers
from fsdp2bench.options.fsdp import AUTOCAST, FP32, FULL_AC, NO_AC, POLICY, SELECTIVE_AC, FsdpOptions
from fsdp2bench.options.layout import Degrees, tensor_parallel_dim, tensor_parallel_plan
from fsdp2bench.options.tuning import STEP_BYTES, quantizes, state_bytes

PROJECTION_WORLD_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


# --------------------------------------------------------------------------- measured

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A rank's own tensor: a DTensor's local part, inside torchao's float8 weight wrapper where there is one."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return getattr(local, "_tensor", local)


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())  # parameters() already skips tied duplicates


def applied_setup(model: nn.Module, layer_classes: list[str]) -> dict:
    """What FSDP2 and the forward were given, read back from a prepared model: the first block's FSDP unit
    (torch's ``fully_shard.state``: its resharding, precision, offload and mesh), the checkpoint wrappers, and
    whether the forward runs inside accelerate's autocast wrapper (``convert_outputs_to_fp32``). Each
    variant's own evidence that the options reached it (``expected_setup`` says what they should give)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

    state = first_block_state(model, layer_classes)
    if state is None:  # no block of its own: nothing to read back, and the check says so
        return dict.fromkeys((*expected_setup(FsdpOptions()), "autocast", "fsdp_mesh", "compiled_outside_blocks",
                              "block_nesting"))
    group, policy = state._fsdp_param_group, state._mp_policy
    forward = getattr(model.forward, "__func__", model.forward)
    units = [unit for _, unit in levers.blocks(model, layer_classes)]
    return {"reshard_after_forward": group.post_forward_mesh_info is not None,
            "param_dtype": dtype_name(policy.param_dtype), "reduce_dtype": dtype_name(policy.reduce_dtype),
            "autocast": type(getattr(forward, "__wrapped__", None)).__name__ == "ConvertOutputsToFp32",
            **checkpointing_read_back([levers.checkpoint_mode(unit) for unit in units]),
            "activation_checkpointing_offload": any(isinstance(m, OffloadWrapper) for m in model.modules()),
            "cpu_offload": any(p.offload_to_cpu for p in group.fsdp_params),
            "compiled": compiled_read_back(model, units),
            "compiled_outside_blocks": [name for name, m in model.named_modules() if levers.compiled(m)
                                        and all(m is not u and m is not levers.block_of(u) for u in units)],
            "float8_linears": levers.float8_linears(model),
            "fsdp_mesh": list(group.mesh_info.mesh.shape),
            "block_nesting": block_nesting(units[0])}


def block_nesting(unit: nn.Module) -> list[str]:
    """A block's wrappers as a call meets them, from the outside in, down to the block's class: where FSDP2's
    hooks sit against the compiled region and the checkpoint decides what dynamo can trace (a module compiled in
    place runs its hooks inside the compiled call; one replaced by its compiled module, outside)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, OffloadWrapper
    from torch.distributed.fsdp import FSDPModule

    nesting, module = [], unit
    while True:
        if getattr(module, "_compiled_call_impl", None) is not None:
            nesting.append("compiled")
        if isinstance(module, FSDPModule):
            nesting.append("fully_shard")
        if hasattr(module, "_orig_mod"):
            nesting.append("compiled")
            module = module._orig_mod
        elif isinstance(module, ActivationWrapper):
            nesting.append("offloaded" if isinstance(module, OffloadWrapper) else "checkpointed")
            module = module._checkpoint_wrapped_module
        else:  # fully_shard gives the block a class of its own over the model's
            return [*nesting, next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))]


def first_block_state(model: nn.Module, layer_classes: list[str]):
    """FSDP2's state of the first block's unit (the block, its checkpoint wrapper or its compiled module, whichever
    ``fully_shard`` was given), or None where no block is a unit of its own."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return next((s for m in model.modules() if isinstance(m, FSDPModule) and levers.is_block(m, layer_classes)
                 and (s := fully_shard.state(m))._fsdp_param_group is not None), None)


def checkpointing_read_back(modes: list[str | None]) -> dict:
    """The checkpointing mode and K of every K-th block, from each block's wrapper (None: not wrapped); K is None
    where the wrapped blocks follow no such pattern."""
    wrapped = [mode is not None for mode in modes]
    mode = SELECTIVE_AC if SELECTIVE_AC in modes else FULL_AC if any(wrapped) else NO_AC
    every = next((k for k in range(1, len(modes) + 1)
                  if wrapped == [levers.checkpointed(i, k) for i in range(len(modes))]), None)
    return {"activation_checkpointing": mode, "ac_every": 1 if mode == NO_AC else every}


def compiled_read_back(model: nn.Module, units: list[nn.Module]) -> str:
    """What was compiled: every block (on its own), the whole model at once, none, or only some blocks."""
    count = sum(levers.compiled(u) or levers.compiled(levers.block_of(u)) for u in units)
    if units and count == len(units):
        return "blocks"
    if levers.compiled(model):
        return "model"
    return "none" if count == 0 else f"{count} of {counted(len(units), 'block')}"


def gathered_block_bytes(model: nn.Module, layer_classes: list[str]) -> int | None:
    """Bytes FSDP2 all-gathered for the first block's unit (its all-gather outputs, kept allocated or not), once
    the block has run; None where torch keeps no such record."""
    state = first_block_state(model, layer_classes)
    params = state._fsdp_param_group.fsdp_params if state is not None else []
    outputs = [t for p in params for t in getattr(p, "all_gather_outputs", None) or []]
    return sum(t.numel() * t.element_size() for t in outputs) if outputs else None


def expected_setup(options: FsdpOptions, shapes=()) -> dict:
    """What ``applied_setup`` reads back from a variant prepared with ``options``, its mesh and autocast
    aside (the torch variants wrap the forward in bf16 autocast as the upstream does; accelerate's FSDP2 path
    leaves it to the policy's bf16 parameters)."""
    bf16 = options.mixed_precision_policy != FP32
    return {"reshard_after_forward": options.reshard_after_forward,
            "param_dtype": "bfloat16" if bf16 else "float32",
            "reduce_dtype": "bfloat16" if options.mixed_precision_policy == AUTOCAST else "float32",
            "activation_checkpointing": options.activation_checkpointing,
            "ac_every": options.ac_every,
            "activation_checkpointing_offload": options.activation_checkpointing_offload,
            "cpu_offload": options.cpu_offload,
            "compiled": "blocks" if options.compile else "none",
            "float8_linears": sum(map(float8_weight, shapes)) if options.float8 else 0}


def float8_weight(param: ParamShape) -> bool:
    """A weight that float8 training converts: a Linear layer's inside a block, of a shape float8 matmuls take."""
    return param.block is not None and param.linear_weight and levers.float8_eligible(param.shape)


def dtype_name(dtype: torch.dtype | None) -> str:
    """A policy's dtype by name; None (FSDP2 keeps the parameters' own) is fp32 here."""
    return str(dtype or torch.float32).removeprefix("torch.")


def account(model: nn.Module, optimizer: torch.optim.Optimizer, outputs=None) -> dict:
    """Bytes held on this rank by parameters, gradients, optimizer state and stale parameters, and
    (``kept_output_bytes``, beside the state) the tensors of the model's ``outputs`` that the loop keeps,
    other than the loss.

    ``device_bytes`` is the part of the state that lives on the accelerator (AdamW keeps its
    step counters on the host), used to explain measured allocated memory.
    """
    seen: set = set()
    device_total = 0

    def held(tensors) -> int:
        nonlocal device_total
        total = 0
        for t in (inner for tensor in tensors for inner in plain_tensors(tensor)):
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr(), storage.nbytes())
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
            if t.device.type != "cpu":
                device_total += storage.nbytes()
        return total

    params = _unique_params(model)
    in_model = {id(p) for p in params}
    frozen = [p for p in params if not p.requires_grad]
    result = {
        "param_bytes": held(params),
        "grad_bytes": held(p.grad for p in params if p.grad is not None),
        "optimizer_state_bytes": held(tensors_of_state(optimizer.state.values())),
        "stale_param_bytes": held(p for group in optimizer.param_groups for p in group["params"]
                                  if id(p) not in in_model),
        "unreduced_grad_bytes": held(unreduced_grads(model)),
    }
    state_on_device = device_total  # before the kept outputs are counted: they are not state
    kept = held(v for k, v in (outputs or {}).items() if k != "loss" and torch.is_tensor(v))
    return {**result, "device_bytes": state_on_device, "kept_output_bytes": kept, **frozen_held(frozen, optimizer),
            "four_bit_statistics_bytes": sum(t.untyped_storage().nbytes() for t in four_bit_statistics(model))}


def four_bit_statistics(model: nn.Module) -> list[torch.Tensor]:
    """bitsandbytes' statistics of each 4-bit layer (its blocks' absmax, the code, the offset, and the absmax's own
    absmax and code under double quantization): attributes of the layer, no parameter, so FSDP2 leaves them whole on
    every rank (not counted among the state)."""
    found = []
    for module in model.modules():
        state = module.__dict__.get("quant_state")
        if state is None or not hasattr(state, "absmax"):
            continue
        nested = getattr(state, "state2", None)
        found += [t for t in (state.absmax, state.code, state.offset, *((nested.absmax, nested.code) if nested else ()))
                  if torch.is_tensor(t)]
    return found


def frozen_held(frozen: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict:
    """What the frozen parameters hold on this rank (counted among the state above): their shards, their gradients
    and optimizer state (none, where nothing trains them)."""
    def nbytes(tensors) -> int:
        return sum(t.untyped_storage().nbytes() for tensor in tensors for t in plain_tensors(tensor))

    return {"frozen_param_bytes": nbytes(frozen),
            "frozen_grad_bytes": nbytes(p.grad for p in frozen if p.grad is not None),
            "frozen_state_bytes": nbytes(tensors_of_state(optimizer.state.get(p, {}) for p in frozen))}


QUANTIZED, FULL_PRECISION = "quantized", "full_precision"  # the kinds of moments a torchao optimizer holds


def moments_kept(optimizer: torch.optim.Optimizer) -> dict:
    """How the optimizer holds each trained parameter's moments on this rank, as it made them: quantized (a tensor
    subclass of codes, scales and a table) or plain, in full precision (torchao's rule leaves a small chunk so, in
    silence); per kind the parameters, their local elements and the state bytes each holds (moments and step)."""
    kept = no_moments()
    for state in optimizer.state.values():
        moment = state.get("exp_avg")
        if not torch.is_tensor(moment):
            continue
        local = local_tensor(moment)
        kind = QUANTIZED if hasattr(local, "__tensor_flatten__") else FULL_PRECISION
        tally(kept[kind], local.numel(), sum(t.untyped_storage().nbytes() for v in tensors_of_state([state])
                                             for t in plain_tensors(v)))
    return kept


def no_moments() -> dict:
    """An empty count of moments by kind, as ``moments_kept`` and ``expected_moments_kept`` fill it."""
    return {kind: {"tensors": 0, "elements": 0, "state_bytes": 0} for kind in (QUANTIZED, FULL_PRECISION)}


def tally(kind: dict, elements: int, state: int) -> None:
    """One more parameter of ``kind``: the measured count and the rule's add alike."""
    kind["tensors"] += 1
    kind["elements"] += elements
    kind["state_bytes"] += state


def tensors_of_state(states) -> list[torch.Tensor]:
    return [v for state in states for v in state.values() if torch.is_tensor(v)]


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor's bytes on this rank: a DTensor's local part, and the inner tensors of a
    wrapper subclass (torchao's float8 weights, its low-bit optimizer states: codes, scales and lookup table)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None:
        return [local]
    return [inner for name in flatten()[0] for inner in plain_tensors(getattr(local, name))]


def unreduced_grads(model: nn.Module) -> list[torch.Tensor]:
    """Gradients FSDP2 holds outside the parameters' ``.grad`` while it accumulates: each parameter's
    unsharded gradient (kept in the parameter dtype, or cast to the reduce dtype) when a backward was
    not reduced, and each group's reduce-scatter output waiting for the all-reduce across replicas."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is None:
            continue
        if getattr(group, "_partial_reduce_output", None) is not None:
            found.append(group._partial_reduce_output)
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            found += [g for g in (fsdp_param.unsharded_accumulated_grad, getattr(unsharded, "grad", None))
                      if g is not None]
    return found


# --------------------------------------------------------------------------- expected

class ParamShape(NamedTuple):
    """One unique parameter of the unsharded model: its shape, bytes per element, the dim the model's
    tensor-parallel plan splits (None: kept whole on every tp rank), the transformer block that holds it (None:
    outside the blocks), whether it is a Linear layer's weight (what float8 converts), whether it trains (a LoRA
    base does not), whether its dtype is a floating one (a QLoRA base packed in uint8 is not: no policy casts it)
    and, for a QLoRA base's 4-bit weight, its elements before packing (the model is built with them, and computes
    with them)."""
    shape: tuple[int, ...]
    itemsize: int
    tp_dim: int | None = None
    block: int | None = None
    linear_weight: bool = False
    trainable: bool = True
    floating: bool = True
    packed_from: int | None = None  # None: nothing packed, its shape's elements


def trainable(shapes) -> list:
    """The parameters that get gradients and optimizer state (a shape given as a bare tuple trains)."""
    return [p for p in shapes if getattr(p, "trainable", True)]


def param_shapes(model: nn.Module, config=None, layer_classes: list[str] = ()) -> list[ParamShape]:
    """Each unique parameter of the unsharded model (a meta model will do), with its tensor-parallel dim
    under ``config``'s plan and its block among ``layer_classes``."""
    plan = tensor_parallel_plan(config) if config is not None else {}
    prefix = getattr(model, "base_model_prefix", "")
    blocks = [f"{name}." for name, _ in levers.blocks(model, list(layer_classes))]
    linear = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return [ParamShape(tuple(p.shape), p.element_size(), tensor_parallel_dim(name, plan, prefix),
                       next((i for i, block in enumerate(blocks) if name.startswith(block)), None), name in linear,
                       p.requires_grad, p.is_floating_point(), elements_before_packing(linear.get(name), p))
            for name, p in model.named_parameters()]


def elements_before_packing(linear: nn.Linear | None, weight: torch.Tensor) -> int | None:
    """A Linear layer's elements where its weight holds fewer (bitsandbytes' 4-bit codes, packed several an item),
    else None."""
    elements = linear.in_features * linear.out_features if linear is not None else weight.numel()
    return elements if elements != weight.numel() else None


def expected_gathered_block_bytes(shapes, world_size: int, rank: int, options: FsdpOptions) -> int:
    """What FSDP2 all-gathers for the first block on ``rank``: each parameter's chunk from every rank of its
    shard group, padded to ceil(d0 / S) rows as FSDP2 pads it (TP's part first), in the dtype it gathers: the
    policy's parameter dtype (bf16), each parameter's own under fp32 (a LoRA base's bf16 beside fp32 adapters) or
    where it is not floating (a QLoRA base packed in uint8), or one byte for a weight float8 converts."""
    degrees = options.layout.at(world_size)
    fsdp, tp_rank = degrees.fsdp_degree, degrees.coordinates(rank)["tp"]
    total = 0
    for param in (p for p in shapes if p.block == 0):
        shape = tp_local_shape(param, degrees.tp, tp_rank)
        item = 1 if options.float8 and float8_weight(param) else \
            param.itemsize if options.mixed_precision_policy == FP32 or not param.floating else 2
        total += math.ceil((shape[0] if shape else 1) / fsdp) * fsdp * math.prod(shape[1:]) * item
    return total


def model_bytes(shapes) -> int:
    """P: the bytes of the unsharded model's parameters, from ``param_shapes``."""
    return sum(math.prod(p[0]) * p[1] for p in shapes)


def built_bytes(shapes) -> int:
    """The bytes of the model as it is built, every parameter fp32, before a LoRA base is cast to bf16 or a QLoRA
    base packed into 4 bits."""
    return 4 * parameter_count(shapes)


def parameter_count(shapes) -> int:
    """The unsharded model's parameters, from ``param_shapes`` (a QLoRA base's 4-bit weights by their elements, not
    by the packed items that hold them)."""
    return sum(getattr(p, "packed_from", None) or math.prod(p[0]) for p in shapes)


def trainable_parameters(shapes) -> int:
    """The parameters that train: the whole model's, or the adapters' alone over a frozen base."""
    return parameter_count(trainable(shapes))


def shard_rows(d0: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows ``rank`` holds under FSDP2's Shard(0): chunks of ceil(d0 / N)."""
    chunk = math.ceil(d0 / world_size)
    start = min(d0, rank * chunk)
    return start, min(d0, start + chunk)


def tp_local_shape(param, tp: int, tp_rank: int) -> tuple[int, ...]:
    """The part of a parameter a tp rank holds: its plan's dim cut in T chunks as torch's Shard cuts it."""
    shape, dim = list(param[0]), param[2] if len(param) > 2 else None
    if tp > 1 and dim is not None:
        start, stop = shard_rows(shape[dim], tp, tp_rank)
        shape[dim] = stop - start
    return tuple(shape)


def _shards(shapes, degrees: Degrees, rank: int):
    """(parameter, padded shard bytes, elements of its unpadded local chunk, full bytes) of each parameter on
    ``rank``: TP's part first, then FSDP2's chunk of its dim 0 over dp_shard x cp."""
    fsdp, index, tp_rank = degrees.fsdp_degree, degrees.fsdp_index(rank), degrees.coordinates(rank)["tp"]
    for param in shapes:
        shape, item = tp_local_shape(param, degrees.tp, tp_rank), param[1]
        d0 = shape[0] if shape else 1
        row = math.prod(shape[1:])
        start, stop = shard_rows(d0, fsdp, index)
        # every rank stores its chunk padded to full size
        yield param, math.ceil(d0 / fsdp) * row * item, (stop - start) * row, math.prod(param[0]) * item


def _shard_bytes(shapes, degrees: Degrees, rank: int) -> tuple[int, int, int]:
    """(padded shard bytes, unpadded shard bytes, full bytes) summed over parameters, on ``rank``."""
    padded = local = full = 0
    for param, stored, elements, whole in _shards(shapes, degrees, rank):
        padded, local, full = padded + stored, local + elements * param[1], full + whole
    return padded, local, full


def optimizer_bytes(shapes, degrees: Degrees, rank: int, optimizer: str) -> int:
    """What ``optimizer`` holds on ``rank`` once it has stepped: for each trainable parameter, its moments of the
    local chunk and a step counter (tuning.state_bytes)."""
    return sum(kind["state_bytes"] for kind in moments_by_rule(shapes, degrees, rank, optimizer).values())


def moments_by_rule(shapes, degrees: Degrees, rank: int, optimizer: str) -> dict:
    """``moments_kept`` of ``optimizer`` on ``rank`` once it has stepped, by torchao's rule (tuning.quantizes)."""
    kept = no_moments()
    for param, _, elements, _ in _shards(trainable(shapes), degrees, rank):
        tally(kept[QUANTIZED if quantizes(optimizer, elements) else FULL_PRECISION], elements,
              state_bytes(optimizer, elements, param[1]))
    return kept


def expected_moments_kept(shapes, world_size: int, rank: int, variant: str, options: FsdpOptions) -> dict:
    """What ``moments_kept`` should find after training: none in the unfixed variant, whose optimizer never steps."""
    if variant == UNFIXED:
        return no_moments()
    return moments_by_rule(shapes, options.layout.at(world_size), rank, options.tuning.optimizer)


def expected_frozen_bytes(shapes, world_size: int, rank: int, options: FsdpOptions = FsdpOptions()) -> dict:
    """What the frozen parameters should hold on ``rank``: their padded chunks (1/S of them each), of their
    unsharded bytes; no gradient and no optimizer state."""
    frozen = [p for p in shapes if not getattr(p, "trainable", True)]
    padded, _, full = _shard_bytes(frozen, options.layout.at(world_size), rank)
    return {"frozen_param_bytes": padded, "frozen_full_bytes": full, "frozen_grad_bytes": 0, "frozen_state_bytes": 0}


def _tensor_parallel_bytes(shapes) -> int:
    """Full bytes of the parameters the plan splits: those ``parallelize_module`` replaces by new ones."""
    return sum(math.prod(p[0]) * p[1] for p in shapes if len(p) > 2 and p[2] is not None)


def output_itemsize(options: FsdpOptions) -> int:
    """Bytes per element of the outputs the model returns: bf16 under either bf16 precision, fp32 under
    fp32. Under autocast accelerate's ``convert_outputs_to_fp32`` runs inside the forward, and FSDP2's policy
    then casts the root's outputs to its ``output_dtype``, bf16; under the policy the head computes in the
    bf16 parameter dtype; under LoRA the base, its head among it, is bf16 whatever the policy."""
    return 4 if options.mixed_precision_policy == FP32 and not options.tuning.adapters else 2


def residual_itemsize(options: FsdpOptions) -> int:
    """Bytes per element of the hidden states passed from block to block: the dtype of the embeddings' output, fp32
    where the parameters are (autocast computes the matmuls in bf16, but their outputs are added to the fp32
    stream), bf16 under the bf16-parameter policy and over a bf16 or 4-bit base."""
    return 2 if options.mixed_precision_policy == POLICY or options.tuning.adapters else 4


def reduce_dtype_bytes(options: FsdpOptions) -> int:
    """Bytes per element of the gradient reduction: bf16 under autocast, fp32 under the fp32-reduce policy
    and under fp32."""
    return 2 if options.mixed_precision_policy == AUTOCAST else 4


def syncs_each_microbatch(variant: str, options: FsdpOptions, world_size: int) -> bool:
    """Whether the first microbatch of a step is reduce-scattered: accelerate's ``accumulate()`` skips
    ``no_sync`` for ``sync_each_batch`` only in a distributed run."""
    return options.sync_each_batch and (variant != ACCELERATE or world_size > 1)


def holds_back_all_reduce(variant: str, options: FsdpOptions, world_size: int) -> bool:
    """``requires_all_reduce`` false on a mesh that has replicas to all-reduce over (torch variants only)."""
    return not options.requires_all_reduce and variant != ACCELERATE and options.layout.at(world_size).replicate > 1


def expected_state(shapes, world_size: int, rank: int, variant: str, phase: str,
                   options: FsdpOptions = FsdpOptions(), steps: int = 2) -> dict:
    """What ``account`` should find for ``variant`` at ``phase`` on ``rank`` of a run of ``steps``
    optimizer steps.

    phase: "end_of_setup" (sharded, no step yet), "before_zero_grad" (after the last
    optimizer step), "end_of_training" (after the last ``zero_grad``) or, with accumulation,
    "between_microbatches" (the last step's first microbatch done, its optimizer step not yet).
    """
    degrees = options.layout.at(world_size)
    if phase == MICROBATCH_PHASE:
        return _between_microbatches(shapes, world_size, degrees, rank, variant, options, steps > 1)
    padded = _shard_bytes(shapes, degrees, rank)[0]
    trained_padded, _, trained_full = _shard_bytes(trainable(shapes), degrees, rank)
    unfixed = variant == UNFIXED
    trained = phase != "end_of_setup"
    grads_alive = trained and (unfixed or phase == "before_zero_grad")
    return {
        "param_bytes": padded,
        "grad_bytes": trained_padded if grads_alive else 0,
        "optimizer_state_bytes": optimizer_bytes(shapes, degrees, rank, options.tuning.optimizer)
        if trained and not unfixed else 0,
        "stale_param_bytes": trained_full if unfixed else 0,
        "unreduced_grad_bytes": 0,
    }


def _between_microbatches(shapes, world_size: int, degrees: Degrees, rank: int, variant: str, options: FsdpOptions,
                          stepped: bool) -> dict:
    """The state after the last step's first microbatch on ``rank`` (see the module text); ``stepped``: an
    optimizer step came before it. The unfixed variant's sharded gradients are never cleared. The gradient
    not yet reduced is that of this rank's tp part of each trainable parameter, whole."""
    padded = _shard_bytes(shapes, degrees, rank)[0]
    trained_padded, _, trained_full = _shard_bytes(trainable(shapes), degrees, rank)
    tp_rank = degrees.coordinates(rank)["tp"]
    as_items = [ParamShape(tp_local_shape(p, degrees.tp, tp_rank), 1) for p in trainable(shapes)]
    padded_items, _, full_items = _shard_bytes(as_items, Degrees(replicate=1, shard=degrees.fsdp_degree),
                                               degrees.fsdp_index(rank))
    unfixed = variant == UNFIXED
    synced = syncs_each_microbatch(variant, options, world_size)
    held_back = synced and holds_back_all_reduce(variant, options, world_size)
    waiting = full_items if not synced else padded_items if held_back else 0
    return {
        "param_bytes": padded,
        "grad_bytes": trained_padded if (synced and not held_back) or (unfixed and stepped) else 0,
        "optimizer_state_bytes": optimizer_bytes(shapes, degrees, rank, options.tuning.optimizer)
        if stepped and not unfixed else 0,
        "stale_param_bytes": trained_full if unfixed else 0,
        "unreduced_grad_bytes": waiting * reduce_dtype_bytes(options),
    }


def expected_device_bytes(shapes, world_size: int, rank: int, variant: str, phase: str,
                          options: FsdpOptions, device_type: str, steps: int = 2, built_on: str = "cpu") -> int:
    """The part of ``expected_state`` that ``account`` should find on the accelerator (see the module
    text): under CPU offload the stale parameters and the unreduced gradients, which live beside the
    unsharded parameters on the GPU. Under TP a model built on the host leaves the stale copies of the
    parameters the plan splits there (``parallelize_module`` makes new ones on the GPU)."""
    if device_type == "cpu":
        return 0
    state = expected_state(shapes, world_size, rank, variant, phase, options, steps)
    if state["stale_param_bytes"] and built_on == "cpu" and options.layout.tp_size > 1:
        state["stale_param_bytes"] -= _tensor_parallel_bytes(shapes)
    if options.cpu_offload:
        return state["stale_param_bytes"] + state["unreduced_grad_bytes"]
    counters = STEP_BYTES * len(trainable(shapes)) if state["optimizer_state_bytes"] else 0
    return sum(state.values()) - counters


def projection(shapes, variants: list[str], sizes: list[int] = PROJECTION_WORLD_SIZES,
               options: FsdpOptions = FsdpOptions()) -> dict:
    """Per-rank state of each variant for larger clusters, between steps and at the step peak, on rank 0
    (whose chunk of every parameter is the largest: ``shard_rows``), under the run's options and layout: at
    the sizes the layout fits (a TP set's T divides N), each parameter cut by TP first."""
    return {str(n): {name: {phase: sum(expected_state(shapes, n, 0, name, phase, options).values())
                            for phase in ("end_of_training", "before_zero_grad")} for name in variants}
            for n in sizes if options.layout.fits(n)}


CROSSOVER_SEARCH = 1 << 16  # the largest N a crossover is looked for at (the simulation's largest world)


def unfixed_costs_more_from(shapes, reference: str, options: FsdpOptions = FsdpOptions()) -> tuple[int, dict] | None:
    """The exact smallest N at which the unfixed variant's state at the step peak exceeds
    ``reference``'s, by the sharding rule at every N the layout fits in turn (not only the projection's
    powers of two), with both states there; None where it never does up to ``CROSSOVER_SEARCH``."""
    for n in range(1, CROSSOVER_SEARCH + 1):
        if not options.layout.fits(n):
            continue
        held = {name: sum(expected_state(shapes, n, 0, name, "before_zero_grad", options).values())
                for name in (UNFIXED, reference)}
        if held[UNFIXED] > held[reference]:
            return n, held
    return None
