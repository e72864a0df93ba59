"""What a rank sends and receives in one optimizer step, and how long a link table says that takes: a projection.

Modelled, per rank, as ring collectives (each rank receives (G-1)/G of an all-gather's or reduce-scatter's whole,
and 2(G-1)/G of an all-reduce's), from the exact parameter shapes of the memory model:

* FSDP2 (over dp_shard x cp): each block's parameters all-gathered in forward and again in backward (resharded
  after forward), the root's (embeddings, final norm, head) once, each microbatch, in the gathered dtype (bf16, a
  byte for a float8 weight, fp32 under fp32); the gradients reduce-scattered in the reduce dtype once a step, or
  each microbatch under ``sync_each_batch``.
* HSDP: the reduce-scattered shard all-reduced across the replicas, as often.
* TP: per microbatch, an all-reduce of bf16 activations of the rank's tokens for each rowwise layer's output in
  forward (a recomputed block's again but its last) and each colwise layer's input gradient in backward, as
  DTensor issues them (the emulation counts them: processes/emulation.py).
* CP (all-gather): per block and microbatch, the keys and values all-gathered in forward and in backward and
  their gradients reduce-scattered (one more all-gather under full checkpointing).

Each is priced over its group's shape (``Links.gbps``: NVLink within a node, one NIC per member of the group in a
node across nodes). Left out: a tied head's TP gather, latency and the ring's start-up, overlap with compute (the
caller combines by a stated rule), congestion, stragglers. FSDP2's and HSDP's collectives are the ones whose
overlap a timing's emulation measures (``Collective.emulated``: FSDP2 issues them on streams of its own); TP's and
CP's go through DTensor's functional collectives, issued and waited on the compute stream (the emulation counts
them apart, eager or compiled), so they are projected here and added whole. No torch: the planner imports it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from fsdp2bench.memory.accounting import float8_weight, reduce_dtype_bytes, tp_local_shape
from fsdp2bench.options.fsdp import FP32, FULL_AC, SELECTIVE_AC, FsdpOptions
from fsdp2bench.options.layout import Degrees, tensor_parallel_plan
from fsdp2bench.options.links import Links

BF16 = 2


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: its group's size, the consecutive ranks the group spans (with the size,
    its shape over the nodes: options/links.py), and the bytes one rank receives in the step."""
    name: str
    group: int
    span: int
    bytes: int
    emulated: bool = True  # a timing under --emulate_communication waits for it (TP's and CP's it does not see)

    def seconds(self, links: Links) -> float:
        return self.bytes / (links.gbps(self.group, self.span) * 1e9)

    def as_dict(self, links: Links) -> dict:
        return {**asdict(self), "gbps": links.gbps(self.group, self.span), "projected_s": self.seconds(links)}


@functools.lru_cache(maxsize=4096)
def gathered_bytes(shapes: tuple, fsdp: int, tp: int, float8: bool, param_bytes: int) -> tuple[int, int, int]:
    """(blocks' bytes, root's bytes, elements) FSDP2 all-gathers on rank 0 over ``fsdp`` shards: each parameter's
    tp part, its dim 0 padded to a multiple of ``fsdp``, in the dtype it gathers (a byte for a float8 weight)."""
    blocks, root, elements = 0, 0, 0
    for param in shapes:
        shape = tp_local_shape(param, tp, 0)
        count = math.ceil((shape[0] if shape else 1) / fsdp) * fsdp * math.prod(shape[1:])
        size = count * (1 if float8 and float8_weight(param) else param_bytes)
        blocks, root = (blocks + size, root) if param.block is not None else (blocks, root + size)
        elements += count
    return blocks, root, elements


def ring(group: int) -> float:
    """The share of a whole an all-gather or reduce-scatter moves into each rank of a ring of ``group``."""
    return (group - 1) / group


def fsdp_collectives(shapes, degrees: Degrees, options: FsdpOptions, microbatches: int) -> list[Collective]:
    """FSDP2's all-gathers and reduce-scatters, and HSDP's all-reduce across replicas."""
    blocks, root, elements = gathered_bytes(tuple(shapes), degrees.fsdp_degree, degrees.tp, options.float8,
                                            4 if options.mixed_precision_policy == FP32 else BF16)
    fsdp, span = degrees.fsdp_degree, degrees.fsdp_degree * degrees.tp
    reduced = microbatches if options.sync_each_batch else 1
    gathers = (2 if options.reshard_after_forward else 1) * blocks + root
    out = [Collective("FSDP all-gather of parameters", fsdp, span, int(ring(fsdp) * gathers * microbatches)),
           Collective("FSDP reduce-scatter of gradients", fsdp, span,
                      int(ring(fsdp) * elements * reduce_dtype_bytes(options) * reduced))]
    if degrees.replicate > 1:
        shard = elements // fsdp * reduce_dtype_bytes(options)
        out.append(Collective("HSDP all-reduce across replicas", degrees.replicate, degrees.world_size,
                              int(2 * ring(degrees.replicate) * shard * reduced)))
    return [c for c in out if c.bytes]


def tensor_parallel_all_reduces(config, recomputed_blocks: int) -> int:
    """All-reduces of a microbatch's activations under the model's TP plan: each rowwise layer's (and split
    embedding's) output in forward, and each colwise layer's input gradient in backward (DTensor makes each colwise
    input its own replicated tensor, so q, k and v reduce theirs apart). A block recomputed in the backward
    (``recomputed_blocks``) issues its rowwise all-reduces again but the last: torch's checkpoint stops once the
    backward has what it needs, before the block's output, and selective checkpointing keeps that output (the MLP's
    down projection, levers.py) and recomputes the attention's. Measured on the CPU, 5 blocks of the tiny shape:
    35 without checkpointing, 40 under full and under selective."""
    count, rowwise_per_block = 0, 0
    for pattern, style in tensor_parallel_plan(config).items():
        times = config.num_hidden_layers if "*" in pattern else 1
        if style in ("colwise", "rowwise", "embedding_rowwise"):
            count += times
        if style == "rowwise" and "*" in pattern:
            rowwise_per_block += 1
    return count + recomputed_blocks * max(0, rowwise_per_block - 1)


def recomputed_blocks(config, options: FsdpOptions) -> int:
    """The blocks whose forward the backward runs again: all under selective checkpointing, every K-th under full
    (``ac_every``), none without."""
    if options.activation_checkpointing == SELECTIVE_AC:
        return config.num_hidden_layers
    return config.num_hidden_layers // options.ac_every if options.checkpoints else 0


def tensor_parallel_collectives(config, degrees: Degrees, options: FsdpOptions, batch: int, block: int,
                                microbatches: int) -> list[Collective]:
    if degrees.tp == 1:
        return []
    activation = batch * (block // degrees.cp) * config.hidden_size * BF16
    calls = tensor_parallel_all_reduces(config, recomputed_blocks(config, options))
    moved = 2 * ring(degrees.tp) * activation * calls * microbatches
    return [Collective("TP all-reduce of activations and their gradients", degrees.tp, degrees.tp, int(moved),
                       emulated=False)]


def context_parallel_collectives(config, degrees: Degrees, options: FsdpOptions, batch: int, block: int,
                                 microbatches: int) -> list[Collective]:
    if degrees.cp == 1:
        return []
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    local = batch * (block // degrees.cp) * (heads // degrees.tp) * head_dim * 2 * BF16  # keys and values
    per_block = 3 + (1 if options.activation_checkpointing == FULL_AC else 0)
    moved = (degrees.cp - 1) * local * per_block * config.num_hidden_layers * microbatches
    return [Collective("CP all-gather of keys and values, reduce-scatter of their gradients", degrees.cp,
                       degrees.cp * degrees.tp, int(moved), emulated=False)]


def step_collectives(shapes, config, degrees: Degrees, options: FsdpOptions, batch: int, block: int,
                     microbatches: int) -> list[Collective]:
    """Every collective of one optimizer step of ``microbatches`` microbatches of ``batch`` x ``block`` on rank 0."""
    return [*fsdp_collectives(shapes, degrees, options, microbatches),
            *tensor_parallel_collectives(config, degrees, options, batch, block, microbatches),
            *context_parallel_collectives(config, degrees, options, batch, block, microbatches)]
