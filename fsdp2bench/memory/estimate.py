"""What one rank holds on the GPU and the host at a step's peak, estimated: the memory model's state (accounting.py)
plus what a step's tokens hold (``step_bytes``: the planner's rule for activations and logits) and what a step
holds beyond both, calibrated on the reserved peaks of one H200. ``--concurrent_variants auto``, the planner and the
layout search all price a step with it; ``GpuCap`` is the GPU a run is given (``--gpu_memory``).
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

from fsdp2bench.cli import UserError
from fsdp2bench.memory.accounting import (built_bytes, expected_device_bytes, expected_state, model_bytes,
                                         output_itemsize, residual_itemsize)
from fsdp2bench.names import GIB, MIB, PEAK_PHASES, UNFIXED, phases
from fsdp2bench.options.fsdp import AUTOCAST, SELECTIVE_AC, FsdpOptions
from fsdp2bench.options.step import logits_copies, logits_tokens

FIXED_MARGIN = 1 * GIB  # the CUDA context and cuBLAS workspaces
# What a step holds on the GPU beyond its state and its tokens' activations and logits (``step_bytes``), as a
# fraction of the model's bytes P as it holds them (fp32 for full fine-tuning; a LoRA base's bf16 and a QLoRA base's
# packed 4 bits: with their fp32 bytes the estimate was 1.5 to 2.3 times the reserved peaks of the five LoRA and two
# QLoRA runs of results/h100/fine_tuning, with these 1.02 to 1.42 times, still above each; 1.28 to 1.39 times those
# of Llama-3.1-70B QLoRA at N = 2 to 8, and 1.84 to 1.92 under CPU offload, of results/h100/qlora_70b): gathered
# units and their gradients, the allocator's cached blocks. On one H200 (results/h200/matrix_1.5b, matrix_7b and
# parallel_7b: 259 rows, every option set, N = 1 to 128) that came to at most 0.46 P for the 1.5B shape, 0.43 P for
# the 7B one and 0.58 P under its TP sets (tp2_cp2 at N = 128), beside about 0.5 P more with blocks kept gathered
# after forward, 0.2 P more with fp32 gradient reduction, 0.3 P more under CPU offload, 0.1 P more under TP;
# test_memory_model checks every row, and the long sequences of results/h200/long_context_1.5b, where the
# activations are most of the peak.
BEYOND_STATE, NO_RESHARD, FP32_REDUCE, OFFLOADED = 0.6, 0.5, 0.2, 0.3
TENSOR_PARALLEL = 0.1
# What a token adds to a step's peak on one rank, beyond the logits, raised by ACTIVATION_MARGIN (an aim, not a
# limit). Without checkpointing each block keeps about 16 hidden and 4 intermediate widths in bf16: fitted to the
# allocated peaks of plan.py's probes of the 1.5B model (one H200). Under full checkpointing no constant is fitted: a
# checkpointed block keeps its input, and the backward recomputes one block at a time, which then holds that rule's
# whole. With the logits and the margin that is 2.33 MB a token on the 1.5B shape, 1.04 to 1.08 times the slopes its
# `ac` probes measured (results/h200/plan_1.5b, results/h100/plan_1.5b); 2.54 MB on Llama-3.1-8B under LoRA, 1.22
# times its probes' (results/h100/plan_fine_tuning_8b, 24 GB); 18.0 to 18.5 GiB of tokens at 32768 a rank under the
# chunked and fused losses, where the blocks are most of a step, for 14.0 to 18.2 GiB held beyond the state
# (results/h200/long_context_8b). Selective checkpointing keeps SELECTIVE_WIDTHS hidden widths a block beside what its
# policy keeps (``selective_widths``): the 1.5B probes' earlier fit of full checkpointing, from which its difference
# was measured on the 8B shape (results/h200/levers_8b).
HIDDEN_WIDTHS, INTERMEDIATE_WIDTHS, SELECTIVE_WIDTHS, ACTIVATION_MARGIN = 16, 4, 4, 1.1
HOST_RUNTIME = 2 * GIB  # one variant's process without its model (torch, transformers, accelerate)
# Measured under cpu_offload (1.5B, one H200): RSS 29.2 GiB for 23.0 GiB of state on the host at N = 1,
# 15.0 for 11.5 at N = 2: pinned buffers and the offload's staging come on top of the state.
OFFLOAD_HOST_MARGIN = 1.25


def device_state(shapes, world_size: int, names: list[str], options: FsdpOptions, device_type: str) -> int:
    """The state on the device at the step peak, of the worst variant on the worst rank: rank 0, whose
    chunk of every parameter is the largest (accounting.shard_rows)."""
    return max(peak_device_bytes(shapes, world_size, name, options, device_type) for name in names)


def peak_device_bytes(shapes, world_size: int, name: str, options: FsdpOptions, device_type: str) -> int:
    """Rank 0's state on the device at the larger of its two peaks: after the optimizer step, or between
    microbatches (the unreduced gradients of accumulation)."""
    return max(expected_device_bytes(shapes, world_size, 0, name, phase, options, device_type)
               for phase in PEAK_PHASES if phase in phases(options.accumulates))


def variant_need(shapes, world_size: int, name: str, options: FsdpOptions, token_bytes: int) -> int:
    """Bytes one variant reserves on a GPU at its step peak, rank 0: its state there, AdamW's foreach
    temporaries (about the local fp32 parameters that train, as their gradients, while the intended variants step
    on the GPU; the unfixed one's parameters get no gradients), what a step holds beyond the state
    (``BEYOND_STATE``), its tokens' activations and logits (``token_bytes``: ``step_bytes``), and the CUDA
    context."""
    state = peak_device_bytes(shapes, world_size, name, options, "cuda")
    steps_on_gpu = name != UNFIXED and not options.cpu_offload
    temporaries = expected_state(shapes, world_size, 0, name, "before_zero_grad", options)["grad_bytes"] \
        if steps_on_gpu else 0
    fraction = BEYOND_STATE + (0 if options.reshard_after_forward else NO_RESHARD) + \
        (FP32_REDUCE if options.mixed_precision_policy != AUTOCAST else 0) + (OFFLOADED if options.cpu_offload else 0) + \
        (TENSOR_PARALLEL if options.layout.tensor_parallel else 0)
    return state + temporaries + int(model_bytes(shapes) * fraction) + token_bytes + FIXED_MARGIN


def microbatch_logits_bytes(batch_size: int, block_size: int, config) -> int:
    """One microbatch's fp32 logits on one rank: a step's largest allocation, and a lower bound of its
    activations."""
    return 4 * batch_size * block_size * config.vocab_size


def rank_logits_bytes(batch_size: int, block_size: int, config, options: FsdpOptions) -> int:
    """The fp32 logits one rank of the layout makes at once for a microbatch: a cp rank holds 1/C of each
    sequence, and a chunked or fused loss makes those of one chunk at a time (step.logits_tokens)."""
    tokens = logits_tokens(options.step, batch_size * (block_size // options.layout.cp_size), config)
    return microbatch_logits_bytes(1, tokens, config)


def activation_bytes_per_token(config, options: FsdpOptions) -> int:
    """What one more token per microbatch adds to a step's peak on the GPU: its blocks' activations
    (``block_bytes_per_token``) and, under the model's loss, its logits, raised by ``ACTIVATION_MARGIN``."""
    logits = logits_copies(options.step) * microbatch_logits_bytes(1, 1, config) if options.step.builds_logits else 0
    return int(ACTIVATION_MARGIN * (logits + block_bytes_per_token(config, options)))


def block_bytes_per_token(config, options: FsdpOptions) -> int:
    """What the blocks hold of a token at the step's peak on the GPU. Without checkpointing each block all of its
    activations (``HIDDEN_WIDTHS``, ``INTERMEDIATE_WIDTHS``, in the dtype the model computes and returns). Under full
    checkpointing (every K-th block with ``ac_every``) a checkpointed block its input alone, in the dtype of the
    residual stream, the others all of theirs, and, while the backward recomputes a checkpointed block, that one all
    of its. Selective checkpointing: ``SELECTIVE_WIDTHS`` and what its policy keeps. Offloaded: none."""
    itemsize, blocks = output_itemsize(options), config.num_hidden_layers
    if options.activation_checkpointing_offload:
        return 0
    if options.activation_checkpointing == SELECTIVE_AC:
        return blocks * itemsize * (SELECTIVE_WIDTHS * config.hidden_size + selective_widths(config))
    whole = itemsize * (HIDDEN_WIDTHS * config.hidden_size + INTERMEDIATE_WIDTHS * config.intermediate_size)
    checkpointed = blocks // options.ac_every if options.checkpoints else 0
    recomputed = whole if checkpointed else 0
    return checkpointed * residual_itemsize(options) * config.hidden_size + (blocks - checkpointed) * whole + recomputed


def selective_widths(config) -> int:
    """What selective checkpointing keeps of a block beside its input, a token's worth (levers.py's policy on a
    Llama-like block, whose matmuls run q, k, v, o, gate, up, down): the outputs of q, v, gate and down and of
    the attention kernel. On the Llama-3.1-8B shape at 2 x 8192 the measured difference from full checkpointing
    was 55,430 bytes a token and block, this rule's 55,296 (results/h200/levers_8b)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 3 * config.hidden_size + kv * head_dim + config.intermediate_size


def step_bytes(batch_size: int, block_size: int, config, options: FsdpOptions) -> int:
    """What a microbatch's tokens hold on one rank at the step peak: the planner's rule
    (``activation_bytes_per_token``: the blocks' activations and, under the model's loss, its logits) for the
    tokens of a rank (a cp rank holds 1/C of each sequence) and, under a chunked or fused loss, one chunk's
    logits."""
    tokens = batch_size * (block_size // options.layout.cp_size)
    chunk = 0 if options.step.builds_logits else \
        logits_copies(options.step) * rank_logits_bytes(batch_size, block_size, config, options)
    return activation_bytes_per_token(config, options) * tokens + chunk


def gpu_need(shapes, world_size: int, names: list[str], init_device: str, options: FsdpOptions,
             token_bytes: int) -> int:
    """Bytes one variant may take on one GPU: the largest need among ``names``, or the whole model while
    it is built there (with ``--init_device cuda``)."""
    need = max(variant_need(shapes, world_size, name, options, token_bytes) for name in names)
    return max(need, int(built_bytes(shapes) * 1.2) if init_device == "cuda" else 0)


def host_bytes(shapes, world_size: int, names: list[str], init_device: str, options: FsdpOptions,
               device_type: str, shared_build: bool = False) -> int:
    """Host memory of one variant's process at its peak: the runtime and the larger of the model built
    on the host (``fully_shard`` frees it as it shards; ``shared_build``: counted once for all processes,
    not here) and the state kept on the host (all of it on a CPU run; under CPU offload all but the unfixed
    variant's stale parameters, which stay on the GPU)."""
    build = built_bytes(shapes) if init_device == "cpu" and not shared_build else 0
    on_host = 0
    if device_type == "cpu" or options.cpu_offload:
        on_host = max(sum(expected_state(shapes, world_size, 0, name, "before_zero_grad", options).values())
                      - expected_device_bytes(shapes, world_size, 0, name, "before_zero_grad", options, device_type)
                      for name in names)
    margin = OFFLOAD_HOST_MARGIN if options.cpu_offload and device_type != "cpu" else 1
    return HOST_RUNTIME + max(build, int(on_host * margin))


def tokens_said(token_bytes: int) -> str:
    """What of an estimate a step's tokens hold, and by which rule: said wherever the estimate is."""
    return f"{token_bytes / GIB:.1f} GiB of it the activations and logits of a step, by the planner's rule"


# What a card reports short of its nominal size (the driver's and ECC's share): 80 GB H100 79.2 GiB,
# 141 GB H200 139.8, 24 GB L4 22.5, 16 GB T4 15.0. A cap within it of the card is taken for the card.
CARD_SHORTFALL = 0.08


@dataclass(frozen=True)
class GpuCap:
    """``--gpu_memory``: a GPU of ``gib`` GiB made real on a larger one. A process there holds its CUDA
    context outside PyTorch's allocator, so the allocator is given the rest
    (``torch.cuda.set_per_process_memory_fraction``), as it would be on that GPU."""
    gib: float
    total: int  # this GPU's memory, as torch reports it
    context: int  # GPU memory in use once a fresh process has made its CUDA context
    asked: float | None = None  # --gpu_memory in GiB, where it named this card's size and the card reports less

    @property
    def process_bytes(self) -> int:
        return int(self.gib * GIB)

    @property
    def allocator_bytes(self) -> int:
        return self.process_bytes - self.context

    def as_dict(self) -> dict:
        return {"gib": self.gib, "gpu_total_mib": self.total / MIB, "cuda_context_mib": self.context / MIB,
                "allocator_limit_mib": self.allocator_bytes / MIB, "asked_gib": self.asked}

    def flags(self) -> list[str]:
        """main.py's flags that give a run this cap on this GPU: none where it is the whole GPU, which a printed
        command then means on the user's card too."""
        return [] if self.gib >= self.total / GIB else ["--gpu_memory", f"{self.gib:g}"]

    def said(self) -> str | None:
        """The line that says the cap is the card's own, not the size asked, where the two differ."""
        if self.asked is None:
            return None
        return (f"--gpu_memory {self.asked:g} GiB is taken for this card's nominal size: it reports {self.gib:.1f} "
                f"GiB, the cap here (cards report up to {CARD_SHORTFALL:.0%} under their nominal size)")


MIN_ALLOCATOR = 256 * MIB  # less than this beside the context could not hold one block of any model


def measure_gpu(index: int) -> tuple[int, int]:
    """(total, in use) bytes of GPU ``index``, read by a fresh process once it has made its CUDA context
    (the process asking never makes one: its children would inherit a broken one). With nothing else
    on the GPU, what is in use is that context."""
    code = f"import torch; free, total = torch.cuda.mem_get_info({index}); print(total, total - free)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        total, used = (int(x) for x in out.stdout.split())
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise UserError(f"--gpu_memory: could not read GPU {index}'s memory ({type(exc).__name__})") from None
    return total, used


def gpu_cap(gib: float | None, index: int) -> GpuCap:
    """``--gpu_memory GIB`` on GPU ``index`` (None: the whole GPU). A cap up to ``CARD_SHORTFALL`` above what
    the GPU reports is the card's nominal size (80 on an 80 GB H100, which reports 79.2 GiB): the cap is
    the whole GPU, said. A larger one, or one that leaves PyTorch no room, is refused in one line."""
    total, context = measure_gpu(index)
    card = total / GIB
    if gib is not None and gib > card * (1 + CARD_SHORTFALL):
        raise UserError(f"--gpu_memory {gib:g} GiB: more than this GPU's {card:.1f} GiB (a cap is made real on a GPU "
                        f"at least as large): leave --gpu_memory out to run at this GPU's own {card:.1f} GiB, or pass "
                        f"--gpu_memory {math.floor(card * 10) / 10:g} or less")
    cap = GpuCap(card, total, context, gib) if gib is not None and gib > card else GpuCap(gib or card, total, context)
    if cap.allocator_bytes < MIN_ALLOCATOR:
        raise UserError(f"--gpu_memory {cap.gib:g}: under the {context / MIB:.0f} MiB that a process's CUDA context "
                        f"holds on this GPU, plus {MIN_ALLOCATOR / MIB:.0f} MiB for PyTorch; give at least "
                        f"{(context + MIN_ALLOCATOR) / GIB:.2f}")
    return cap
