"""main.py's command line: its parser, its flag groups, the ranges of its numbers and every check made
before a process or a file exists. matrix.py, plan.py and speed.py check the command lines they give
main.py with the same functions, without importing main.py."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from dataclasses import dataclass

import torch

from fsdp2bench.cli import OneLineParser, UserError, check_ranges, gpu_memory_gib, parse_names, pick_device
from fsdp2bench.files import check_output_dir, expect_path, looks_like_a_path, refuse_foreign
from fsdp2bench.memory import estimate
from fsdp2bench.names import VARIANTS, counted, listed, rank_file
from fsdp2bench.options import accelerate_config, levers, fsdp as options, step, tuning
from fsdp2bench.options.layout import CP_STRATEGIES, Layout
from fsdp2bench.options.links import Links, check_nodes_fit, parse_links
from fsdp2bench.processes import simulation
from fsdp2bench.processes.emulation import emulates
from fsdp2bench.processes.isolation import launcher_keeps_to_one_thread
from fsdp2bench.processes.starting import check_launcher_env
from fsdp2bench.run import concurrency
from fsdp2bench.run.session import ModelFacts, model_facts
from fsdp2bench.run.versions import check_releases
from fsdp2bench.train import throughput
from fsdp2bench.train.data import builtin_for_steps, load_tokens, rank_batches
from fsdp2bench.train.model import (CPU_DEFAULT_MODEL, GPU_DEFAULT_MODEL, PRESETS, default_model, max_positions,
                                     say_default_model)
from fsdp2bench.train.runner import FailureSpec

LAUNCHES = [("torchrun --nproc_per_node N main.py", "N ranks on one machine, one GPU each (or --device cpu, gloo)"),
     ("accelerate launch --num_processes N main.py", "the same through accelerate's launcher"),
     ("python3 main.py", "one rank, no launcher"),
     ("python3 main.py --simulate_world_size 8,64", "one rank of any N, measured by one process on one GPU")]


def parse_failure(text: str) -> FailureSpec:
    parts = text.split(":")
    try:
        if len(parts) not in (3, 4) or parts[0] not in VARIANTS or (len(parts) == 4 and parts[3] not in FailureSpec.HOW):
            raise ValueError
        return FailureSpec(parts[0], int(parts[1]), int(parts[2]), parts[3] if len(parts) == 4 else "raise")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected VARIANT:STEP:RANK[:kill|:oom|:thread|:nan] with a known variant, "
                                         f"got {text!r}")


SIMULATE_RANK_DEFAULT = "0"
PLAYED_RANKS_SHOWN = 8  # the ranks a refused --inject_failure lists


DEFAULT_LINKS = "h100-h200-sxm"  # --emulate_communication alone: Links' defaults


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser("FSDP2 memory and convergence benchmark: four ways to combine an optimizer with fully_shard.",
                      LAUNCHES, "docs/options.md (every option), docs/output.md (what it writes)")
    p.add_argument("--output_dir", default="out", help="where the JSON files go (default: out)")
    p.add_argument("--save_memory_snapshot", action="store_true",
                   help="also write <run>_memory_snapshot.pkl for pytorch.org/memory_viz, CUDA only (default: off)")
    p.add_argument("--batch_size", type=int, default=2, help="sequences per rank per step (default: 2)")
    p.add_argument("--block_size", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--dataset_fraction", type=float, default=1.0,
                   help="fraction of the dataset's blocks to use, in (0, 1] (default: 1.0)")
    p.add_argument("--learning_rate", type=float, default=3e-5, help="AdamW learning rate (default: 3e-5)")
    p.add_argument("--seed", type=int, default=421, help="seed for the initial weights (default: 421)")
    p.add_argument("--max_steps", type=int, default=None, help="stop each variant after this many steps; the "
                   "built-in text is repeated as often as they need, a --dataset gives at most one pass (default: one "
                   f"pass over the data, at least one step; {simulation.DEFAULT_STEPS} with --simulate_world_size)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated variants, run in the order given: {', '.join(VARIANTS)} (default: all four)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when a GPU is present, else CPU with gloo (default: auto)")
    p.add_argument("--model", default=None,
                   help=f"preset ({', '.join(PRESETS)}), a local directory with config.json, "
                        f"or a Hub id (default: {GPU_DEFAULT_MODEL} on GPUs, {CPU_DEFAULT_MODEL} on a CPU run)")
    p.add_argument("--dataset", default=None, help="local text file (default: built-in text)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory or Hub id for --dataset (default: bytes)")
    p.add_argument("--log_interval", type=float, default=0.01,
                   help="seconds between memory samples (default: 0.01)")
    p.add_argument("--concurrent_variants", default="auto", metavar="K",
                   help="run K variants at a time, each in its own processes and process group; their memory "
                        "figures do not change (each process has its own allocator), step times do. auto: as "
                        "many as GPU memory and host RAM allow by the memory model, a step's activations counted "
                        "by the planner's rule (1 on a CPU run; a sweep's runs each by the need at its own N); a "
                        "variant or run that runs out of memory while sharing is run again alone before it is "
                        "reported, and summary.json says so (default: auto)")
    p.add_argument("--tracker_overhead", action="store_true",
                   help="pause memory polling on every other step, to measure what polling costs (default: off)")
    p.add_argument("--quiet", action="store_true", help="no progress lines while the variants train (default: off)")
    p.add_argument("--gpu_memory", type=gpu_memory_gib, default=None, metavar="SIZE",
                   help="train as on a GPU of SIZE: 80GB (10^9 bytes: 74.5 GiB), 80GiB, or a bare "
                        "number of GiB; PyTorch's allocator gets SIZE less the CUDA context a process holds (measured "
                        "here), and a step that needs more runs out of memory. A SIZE up to "
                        f"{estimate.CARD_SHORTFALL * 100:.0f}%% above this GPU's is taken for the card's nominal "
                        "size (80 on an 80 GB H100, which reports 79.2 GiB), said in one line; CUDA only (default: "
                        "the whole GPU)")
    p.add_argument("--init_device", choices=["cpu", "cuda", "meta"], default="cpu",
                   help="where the model is built: cpu (the upstream's path: fully_shard moves each rank's shard "
                        "to the GPU; the weights are drawn once per rank on its share of the host's cores), cuda "
                        "(built on the GPU, faster, but the GPU holds the whole model for a moment) or meta (no memory "
                        "until sharded, then each rank draws only its shards: models larger than a GPU or the host, "
                        f"with --variants {INIT_AFTER_SHARDING}; with --peft each block drawn whole as it is sharded) "
                        "(default: cpu)")
    add_simulation_options(p)
    add_fsdp_options(p)
    add_step_options(p)
    add_tuning_options(p)
    p.add_argument("--inject_failure", type=parse_failure, default=None,
                   metavar="VARIANT:STEP:RANK[:kill|:oom|:thread|:nan]",
                   help="test option: VARIANT raises on RANK before STEP (:kill dies by SIGKILL instead, :oom raises "
                        "torch's out-of-memory error, :thread raises in the memory tracker's thread, :nan makes a "
                        "parameter NaN so that the run diverges) (default: off)")
    return p.parse_args(argv)


def add_simulation_options(p: argparse.ArgumentParser) -> None:
    """One rank of a world of N, played by one process: which N, which ranks, and its communication emulated."""
    p.add_argument("--simulate_world_size", default=None, metavar="N[,N...]",
                   help="measure one rank of a world of N instead of this launch's: one process plays that rank "
                        "on a fake process group (real allocations, no communication, losses meaningless). "
                        "Several N make a sweep, shared out among this launch's processes (default: off)")
    p.add_argument("--simulate_rank", default=SIMULATE_RANK_DEFAULT, metavar="R[,R...]",
                   help="with --simulate_world_size: the rank(s) R to play, integers in [0, N) or 'last' for N-1; "
                        "'last' is skipped where the sharding rule gives it the bytes of a rank already played "
                        "(default: 0)")
    add_emulation_option(p, "with --simulate_world_size: each collective the simulated rank issues")


def add_emulation_option(p: argparse.ArgumentParser, who: str) -> None:
    """``--emulate_communication``, as every script that starts simulated ranks takes it (``who``: the ranks whose
    collectives it prices)."""
    p.add_argument("--emulate_communication", nargs="?", const=DEFAULT_LINKS, default=None,
                   metavar="WITHIN,ACROSS|FILE",
                   help=f"{who} costs its time, as a sleep on the GPU stream it is issued on (on a CPU: priced, "
                        "nothing waits), over links of WITHIN GB/s within a node and ACROSS per NIC, or a JSON FILE "
                        f"of the links (docs/links.md); alone: {Links().within_gbps:g},{Links().across_gbps:g} in "
                        f"nodes of {Links().node_size} (H100/H200 SXM: NVLink, a 400 Gb/s NIC a GPU) (default: off: "
                        "compute only)")


def add_step_options(p: argparse.ArgumentParser) -> None:
    """The loop and the loss every variant trains with (fsdp2bench/options/step.py, docs/step.md)."""
    g = p.add_argument_group("Training step (every variant runs the same one; docs/step.md)")
    g.add_argument("--loop", choices=step.LOOPS, default=step.UPSTREAM,
                   help=f"{step.UPSTREAM}: the upstream benchmark's loop, whose loop variable keeps the outputs (the "
                        f"logits) through backward until the next forward returns; {step.TRAINER}: the Hugging Face "
                        f"Trainer's training_step (also TRL's and torchtitan's): the loss alone outlives the forward "
                        f"(default: {step.UPSTREAM})")
    g.add_argument("--loss", choices=step.LOSSES, default=step.MODEL,
                   help=f"{step.MODEL}: the model's own causal-LM loss on the full logits, upcast to fp32; "
                        f"{step.CHUNKED}: the head and cross entropy {step.CHUNK_TOKENS} tokens at a time, recomputed "
                        f"in backward, so the full logits never exist; {step.LIGER}: liger-kernel's fused linear cross "
                        f"entropy, applied by model type as the Trainer's use_liger_kernel does (GPU only; pip install "
                        f"-r {step.LIGER_REQUIREMENTS}) (default: {step.MODEL})")


def add_tuning_options(p: argparse.ArgumentParser) -> None:
    """What the step trains and with which optimizer (fsdp2bench/options/tuning.py, docs/fine-tuning.md)."""
    g = p.add_argument_group("Fine-tuning (every variant trains the same; docs/fine-tuning.md)")
    defaults = tuning.LORA_DEFAULTS
    g.add_argument("--peft", choices=tuning.PEFT_MODES, default=tuning.NO_PEFT,
                   help=f"{tuning.NO_PEFT}: full fine-tuning; {tuning.LORA}: peft's LoRA adapters over the base, "
                        "which is cast to bf16 and frozen (get_peft_model, then fully_shard); the optimizer takes the "
                        f"adapters alone; {tuning.QLORA}: the same over a 4-bit base (bitsandbytes' NF4 Linear4bit, "
                        f"quantized on the run's device), bf16 adapters (pip install -r {tuning.PEFT_REQUIREMENTS}) "
                        f"(default: {tuning.NO_PEFT})")
    g.add_argument("--lora_rank", type=int, default=None, metavar="R",
                   help=f"with --peft lora or qlora: the adapters' rank R (default: {defaults['lora_rank']})")
    g.add_argument("--lora_alpha", type=float, default=None, metavar="ALPHA",
                   help="with --peft lora or qlora: the adapters' scale is ALPHA / R "
                        f"(default: {defaults['lora_alpha']:g})")
    g.add_argument("--lora_dropout", type=float, default=None, metavar="P",
                   help=f"with --peft lora or qlora: dropout P on the adapters' input, in [0, 0.99] "
                        f"(default: {defaults['lora_dropout']:g})")
    g.add_argument("--lora_targets", default=None, metavar="NAMES",
                   help="with --peft lora or qlora: comma-separated module NAMES to adapt, as peft's target_modules "
                        "match them: a layer whose full name is a NAME or ends with a dot and it (q_proj, "
                        "self_attn.q_proj, model.layers.0.mlp.down_proj); each must select Linear layers only, and "
                        "one the others do not already select, none given twice "
                        f"(default: {defaults['lora_targets']})")
    g.add_argument("--allow_known_failure", action="store_true",
                   help="run a combination known to fail under FSDP2 (--qlora_storage uint8) instead of refusing it, "
                        "to measure it: the end-of-run checks say whether the loss was finite, fell, and whether the "
                        "base was sharded (default: off)")
    g.add_argument("--qlora_storage", choices=tuning.QLORA_STORAGES, default=None,
                   help="with --peft qlora: the dtype bitsandbytes packs the 4-bit weights in "
                        "(bnb_4bit_quant_storage): bfloat16, which FSDP2 shards like any parameter; uint8 is a known "
                        "failure under FSDP2 (accelerate#3983), refused without --allow_known_failure "
                        f"(default: {tuning.QLORA_STORAGES[0]})")
    g.add_argument("--optimizer", choices=tuning.OPTIMIZERS, default=tuning.ADAMW,
                   help=f"{tuning.ADAMW}: torch's AdamW; {tuning.ADAMW8BIT}, {tuning.ADAMW4BIT}, {tuning.ADAMW_FP8}: "
                        "torchao's low-bit AdamW, its step compiled per parameter (pip install -r "
                        f"{tuning.LOW_BIT_REQUIREMENTS}); {tuning.BNB_ADAMW8BIT} and {tuning.ADAFACTOR} are refused: "
                        "they do not run on FSDP2's DTensor parameters (docs/fine-tuning.md) "
                        f"(default: {tuning.ADAMW})")


def check_step(fsdp_options: options.FsdpOptions, config, device_type: str) -> None:
    """The loss, the levers and the fine-tuning against the model, the layout and the device (main.py's and
    plan.py's checks)."""
    step.check(fsdp_options.step, config, fsdp_options.layout, device_type)
    levers.check(fsdp_options, device_type, config.num_hidden_layers)
    tuning.check_device(fsdp_options.tuning, device_type)


def add_config_option(p: argparse.ArgumentParser, becomes: str) -> None:
    """``--config_file``, main.py's, plan.py's and loading.py's: the user's accelerate config (accelerate_config.py)."""
    p.add_argument("--config_file", default=None, metavar="PATH",
                   help=f"PATH: an accelerate config file (what accelerate config writes), read by accelerate's "
                        f"own loader: its FSDP2 plugin fields, parallelism config and mixed precision become {becomes} "
                        f"(default: none)")


def add_fsdp_options(p: argparse.ArgumentParser) -> None:
    """accelerate's FullyShardedDataParallelPlugin options, under its names; every variant applies them. Each
    is None when not given, so that a user's accelerate config can set it (apply_config)."""
    add_config_option(p, "the options below; a flag given here wins. Under accelerate launch its FSDP config is "
                         "read without this")
    g = p.add_argument_group("FSDP2 options (accelerate's plugin names; the torch variants apply the same)")
    g.add_argument("--reshard_after_forward", type=options.parse_bool, default=None, metavar="{true,false}",
                   help="free each block's gathered parameters after its forward (default: true)")
    g.add_argument("--mixed_precision_policy", choices=options.MIXED_PRECISION, default=None,
                   help=f"{options.AUTOCAST}: accelerate's mixed_precision='bf16' (autocast; FSDP2 gathers and "
                        f"reduces in bf16), the upstream's; {options.POLICY}: an FSDP2 MixedPrecisionPolicy, bf16 "
                        f"parameters and fp32 gradient reduction, no autocast; {options.FP32}: accelerate's "
                        f"mixed_precision='no', fp32 throughout (default: {options.AUTOCAST})")
    add_checkpointing_options(g)
    for name, says in (("activation_checkpointing_offload", "with --activation_checkpointing full: keep the "
                                                            "checkpoints' saved inputs in host memory"),
                       ("cpu_offload", "CPUOffloadPolicy: parameters, gradients and AdamW state on the host; the "
                                       "optimizer step runs on the CPU")):
        g.add_argument(f"--{name}", type=options.parse_bool, nargs="?", const=True, default=None,
                       metavar="{true,false}", help=f"{says}; alone it means true (default: false)")
    add_lever_options(p)
    add_scaling_options(p)


def add_checkpointing_options(g) -> None:
    """Which blocks and ops are recomputed in backward (main.py's and plan.py's)."""
    g.add_argument("--activation_checkpointing", type=options.parse_checkpointing, nargs="?", const=options.FULL_AC,
                   default=None, metavar="{full,selective,none}",
                   help="recompute activations in backward instead of keeping them: full, each block whole "
                        "(accelerate's; true and alone mean this); selective, op by op inside each block, keeping "
                        "the attention's and every other matmul's outputs (docs/levers.md); none (false) "
                        "(default: none)")
    g.add_argument("--ac_every", type=int, default=None, metavar="K",
                   help="with --activation_checkpointing full: checkpoint only every K-th block (the K-th, 2K-th, "
                        "...), the others keep their activations (default: 1, every block)")


def add_lever_options(p: argparse.ArgumentParser, title: str = "Levers for speed and memory (every variant; "
                                                                  "docs/levers.md)") -> argparse._ArgumentGroup:
    """The levers beyond accelerate's plugin, applied by the suite to every variant (fsdp2bench/options/levers.py)."""
    g = p.add_argument_group(title)
    g.add_argument("--compile", type=options.parse_bool, nargs="?", const=True, default=None, metavar="{true,false}",
                   help="compile each transformer block with torch.compile (inductor), as torchtitan and accelerate's "
                        "regional compilation do; the first steps compile and are timed apart; alone it means true "
                        "(default: false)")
    g.add_argument("--float8", type=options.parse_bool, nargs="?", const=True, default=None, metavar="{true,false}",
                   help="torchao's float8 training of the blocks' Linear layers with FSDP2's float8 all-gather, "
                        f"as accelerate's mixed_precision fp8 (AO) does; a GPU of compute capability 8.9 or more; "
                        f"pip install -r {levers.FLOAT8_REQUIREMENTS}; alone it means true (default: false)")
    return g


def add_scaling_options(p: argparse.ArgumentParser) -> None:
    """accelerate's GradientAccumulationPlugin fields and torch's all-reduce switch; the torch variants make
    the FSDP2 calls these lead to."""
    g = p.add_argument_group("Gradient accumulation (accelerate's names; the torch variants apply the same)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=None, metavar="K",
                   help="microbatches of --batch_size per optimizer step; each loss is divided by K, as "
                        "accelerate's backward does; --max_steps counts optimizer steps (default: 1)")
    g.add_argument("--sync_each_batch", type=options.parse_bool, default=None, metavar="{true,false}",
                   help="with K > 1: reduce-scatter the gradients after every microbatch (true), or keep each "
                        "parameter's whole gradient on every rank until the last one (false, accelerate's "
                        "default: its accumulate() then calls set_requires_gradient_sync(False)) (default: false)")
    g.add_argument("--requires_all_reduce", type=options.parse_bool, default=None, metavar="{true,false}",
                   help="torch's set_requires_all_reduce for the microbatches before the last: false, under HSDP "
                        "with --sync_each_batch true, reduce-scatters each one but all-reduces across replicas "
                        "only once; accelerate does not offer it (default: true)")
    add_layout_options(p)


def add_layout_options(p: argparse.ArgumentParser) -> None:
    """accelerate's ParallelismConfig fields: R x S x C x T = N (fsdp2bench/options/layout.py)."""
    g = p.add_argument_group("Parallel layout (accelerate's ParallelismConfig names; the torch variants build the "
                             "same mesh): R x S x C x T = N")
    g.add_argument("--dp_replicate_size", type=int, default=None, metavar="R",
                   help="HSDP: R replicas of an FSDP group; R must divide the data-parallel ranks N / (C x T) "
                        "(default: 1, flat FSDP)")
    g.add_argument("--dp_shard_size", type=int, default=None, metavar="S",
                   help="HSDP given by its shards instead: S ranks per FSDP group, the rest replicas; S must divide "
                        "N / (C x T) at every N, so that a sweep keeps one node's shape (default: N / (C x T))")
    g.add_argument("--cp_size", type=int, default=None, metavar="C",
                   help="context parallelism: each sequence split over C ranks (torch's context_parallel around "
                        "each microbatch; FSDP2 shards over S x C); GPU only, SDPA attention, --block_size a "
                        "multiple of 2C (default: 1)")
    g.add_argument("--tp_size", type=int, default=None, metavar="T",
                   help="tensor parallelism: each block's weights split over T ranks by the model's own plan "
                        "(its config's base_model_tp_plan); T must divide the attention heads, key/value heads and "
                        "MLP width (default: 1)")
    g.add_argument("--cp_comm_strategy", choices=CP_STRATEGIES, default=None,
                   help=f"with --cp_size above 1: how ring attention passes keys and values between the C ranks "
                        f"(default: {CP_STRATEGIES[0]})")


# What one run can do with each number (closed ranges): a block of one token has no next token to
# predict (its loss is NaN), larger batches or blocks than any GPU holds for one step, a learning rate that diverges on the first step, a seed beyond the generators' 32 bits, a
# memory sample rarer than once a minute (a trace of one sample) or more often than once a millisecond, a LoRA rank
# wider than any layer people adapt, an alpha that scales the adapters to nothing, a dropout that drops all.
NUMBER_RANGES = {"batch_size": (1, 1 << 16), "block_size": (2, 1 << 20), "max_steps": (1, 10_000_000),
                 "ac_every": (1, 1 << 16),
                 "gradient_accumulation_steps": (1, 1 << 16), "dp_replicate_size": (1, 1 << 16),
                 "dp_shard_size": (1, 1 << 16), "cp_size": (1, 1 << 16), "tp_size": (1, 1 << 16),
                 "learning_rate": (1e-12, 10.0), "seed": (0, 2**32 - 1), "log_interval": (0.001, 60.0),
                 "lora_rank": (1, 1 << 16), "lora_alpha": (1e-6, 1e6), "lora_dropout": (0.0, 0.99)}


def option_defaults() -> dict:
    """Each option a flag or an accelerate config can set, and its value when neither does: FsdpOptions' own
    (two stay None: they are refused where given without the option they modify)."""
    defaults = {name: getattr(options.FsdpOptions(), name) for name in options.OWN_FIELDS}
    defaults.update({name: getattr(Layout(), name) for name in options.LAYOUT_OPTIONS})
    return {**defaults, "sync_each_batch": None, "cp_comm_strategy": None}


def apply_config(args: argparse.Namespace) -> accelerate_config.ConfigOptions | None:
    """Each option from its flag, else from the user's accelerate config (``--config_file``, or the FSDP config
    ``accelerate launch`` passed on), else from the environment where accelerate reads it there, else its default;
    where each came from in ``args.option_sources``."""
    if hasattr(args, "option_sources"):
        return None
    config = accelerate_config.read(args.config_file)
    environment = accelerate_config.environment_values()
    sources = {}
    for name, default in option_defaults().items():
        if getattr(args, name) is not None:
            sources[name] = "flag"
        elif config is not None and name in config.values:
            setattr(args, name, config.values[name])
            sources[name] = "config"
        elif name in environment:
            setattr(args, name, environment[name])
            sources[name] = accelerate_config.ENVIRONMENT
        else:
            setattr(args, name, default)
            sources[name] = "default"
    if args.cp_size == 1 and sources["cp_comm_strategy"] == "config":  # a flag turned the file's CP off
        args.cp_comm_strategy, sources["cp_comm_strategy"] = None, "default"
    args.option_sources = sources
    args.config_fields = accelerate_config.fields_said(config, sources, args)
    return config


def check_args(args: argparse.Namespace, world_size: int) -> tuple[list[str], options.FsdpOptions]:
    """Refuse what cannot work before any process or model exists; return the variants and options.
    ``world_size``: that of the launch checked (a sweep's own N are checked instead)."""
    apply_config(args)
    try:
        return check_options(args, world_size)
    except UserError as error:
        raise accelerate_config.with_fields(error, args.config_fields) from None


def check_options(args: argparse.Namespace, world_size: int) -> tuple[list[str], options.FsdpOptions]:
    for flag in ("batch_size", "block_size"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.concurrent_variants != "auto" and not (args.concurrent_variants.isdigit()
                                                    and int(args.concurrent_variants) > 0):
        raise UserError(f"--concurrent_variants must be a positive integer or auto, got {args.concurrent_variants}")
    if args.max_steps is not None and args.max_steps <= 0:
        raise UserError(f"--max_steps must be a positive integer, got {args.max_steps}")
    if not 0 < args.dataset_fraction <= 1:
        raise UserError(f"--dataset_fraction must be in (0, 1], got {args.dataset_fraction}")
    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        raise UserError(f"--learning_rate must be a positive number, got {args.learning_rate}")
    if not args.log_interval > 0:
        raise UserError(f"--log_interval must be positive, got {args.log_interval}")
    check_ranges(args, NUMBER_RANGES)
    names = parse_names(args.variants, "--variants", VARIANTS)
    fsdp_options = options.from_args(args)
    tuning.check_known_failure(fsdp_options.tuning, args.allow_known_failure)
    if args.dataset is not None:
        expect_path(args.dataset, "--dataset", "file")
    if args.tokenizer is not None and looks_like_a_path(args.tokenizer):
        expect_path(args.tokenizer, "--tokenizer", "directory")
    if args.simulate_world_size is None and args.simulate_rank != SIMULATE_RANK_DEFAULT:
        raise UserError("--simulate_rank needs --simulate_world_size (there is no simulated rank to play)")
    if args.simulate_world_size is not None:
        sizes = simulation.parse_world_sizes(args.simulate_world_size)
        simulation.parse_ranks(args.simulate_rank, sizes)
        simulation.check_fake_group_available()
        if args.max_steps is None:
            args.max_steps = simulation.DEFAULT_STEPS
    for n in simulation.parse_world_sizes(args.simulate_world_size) if args.simulate_world_size else [world_size]:
        fsdp_options.layout.at(n)  # refuses sizes that do not multiply to N
    return names, fsdp_options


def played_ranks(args: argparse.Namespace) -> set[int]:
    """The simulated ranks a sweep plays (none without --simulate_world_size)."""
    if not args.simulate_world_size:
        return set()
    sizes = simulation.parse_world_sizes(args.simulate_world_size)
    return {n - 1 if spec == simulation.LAST else spec for n in sizes
            for spec in simulation.parse_ranks(args.simulate_rank, sizes)}


def check_failure_reachable(spec: FailureSpec, names: list[str], steps: int, ranks: set[int]) -> None:
    """A test option that would never fire is refused: a variant not run, a step past the last, a rank
    that is not played (this launch's ranks, or a sweep's simulated ones)."""
    where = f"--inject_failure {spec.name}:{spec.step}:{spec.rank}"
    if spec.name not in names:
        raise UserError(f"{where}: {spec.name} is not among --variants")
    if not 0 <= spec.step < steps:
        raise UserError(f"{where}: step {spec.step} is not among this run's steps 0..{steps - 1}")
    if spec.rank not in ranks:
        raise UserError(f"{where}: rank {spec.rank} is not among the {len(ranks)} ranks played: "
                        f"{listed([str(r) for r in sorted(ranks)], PLAYED_RANKS_SHOWN)}")


def check_positions(block_size: int, config) -> None:
    if max_positions(config) and block_size > max_positions(config):
        raise UserError(f"--block_size {block_size} exceeds the model's {max_positions(config)} positions")


def check_model(config, block_size: int, fsdp_options: options.FsdpOptions) -> None:
    """The sequence against the model's positions, and the layout against its heads, width and attention."""
    check_positions(block_size, config)
    fsdp_options.layout.check_model(config, block_size)


def check_context_parallel_device(cp_size: int | None, device_type: str) -> None:
    if cp_size is not None and cp_size > 1 and device_type != "cuda":
        raise UserError(f"--cp_size {cp_size}: context parallelism does not run on the CPU with "
                        f"torch {torch.__version__} (SDPA's CPU kernels have no rule for a sequence cut over ranks, "
                        "and its math path mixes Tensor and DTensor: pytorch #147793); measure it on a GPU, where "
                        "one GPU plays any N with --simulate_world_size")


def layout_refusal(fsdp_options: options.FsdpOptions, config, block_size: int, device_type: str) -> str | None:
    """Why an option set's layout cannot run this model on this device, or its loss under it (matrix.py and
    plan.py skip the set), or None."""
    try:
        options.check(fsdp_options)
        check_context_parallel_device(fsdp_options.layout.cp_size, device_type)
        fsdp_options.layout.check_model(config, block_size)
        check_step(fsdp_options, config, device_type)
    except UserError as exc:
        return str(exc)
    return None


def files_written(args: argparse.Namespace, names: list[str], world: int) -> list[str]:
    """summary.json and every trace (and snapshot) this launch may write: each rank of a real run, or each rank
    a sweep plays at each N (refuse_foreign)."""
    if args.simulate_world_size:
        sizes = simulation.parse_world_sizes(args.simulate_world_size)
        places = [(simulation.world_size_dir(args.output_dir, n), n - 1 if r == simulation.LAST else r)
                  for n in sizes for r in simulation.parse_ranks(args.simulate_rank, sizes)]
    else:
        places = [(args.output_dir, r) for r in range(world)]
    kinds = ["memory_usage.json"] + (["memory_snapshot.pkl"] if args.save_memory_snapshot else [])
    return [os.path.join(args.output_dir, "summary.json"),
            *(os.path.join(where, rank_file(name, kind, r)) for where, r in places for name in names for kind in kinds)]


def run_batches(args: argparse.Namespace, fsdp_options: options.FsdpOptions, vocab_size: int, data_rank: int,
                data_ranks: int) -> torch.Tensor:
    """This rank's batches: of the user's --dataset as it is, or of the built-in text repeated to the steps asked."""
    tokens = load_tokens(args.dataset, args.tokenizer, vocab_size)
    microbatches = fsdp_options.gradient_accumulation_steps
    if args.dataset is None:
        tokens = builtin_for_steps(tokens, args.block_size, args.batch_size * microbatches, args.dataset_fraction,
                                   data_ranks, args.max_steps)
    return rank_batches(tokens, args.block_size, args.batch_size, args.dataset_fraction, data_rank, data_ranks,
                        args.max_steps, microbatches)


def data_share(args: argparse.Namespace, fsdp_options: options.FsdpOptions, rank: int, world: int) -> tuple[int, int]:
    """(which batches, out of how many shares): a rank's cp and tp peers train on its batches. A simulated
    rank has no peers to share the data with: every run takes the batches of a world of one."""
    if args.simulate_world_size:
        return 0, 1
    degrees = fsdp_options.layout.at(world)
    return degrees.data_rank(rank), degrees.data_ranks


def per_optimizer_step(args: argparse.Namespace, fsdp_options: options.FsdpOptions, world_size: int) -> dict:
    """What one optimizer step takes: its microbatches, sequences and tokens per rank and in all, and the
    mesh (a simulated rank's world is each N of the sweep, so only the per-rank figures are given there).
    A rank's cp peers split its sequences, so each holds 1/C of their tokens; its tp peers share them."""
    k, b, t = fsdp_options.gradient_accumulation_steps, args.batch_size, args.block_size
    cp = fsdp_options.layout.cp_size
    step = {"microbatches": k, "sequences_per_rank": k * b, "tokens_per_rank": k * b * t // cp}
    if not args.simulate_world_size:
        degrees = fsdp_options.layout.at(world_size)
        step.update(sequences=k * b * degrees.data_ranks, tokens=k * b * t * degrees.data_ranks,
                    mesh=degrees.as_dict())
    return step


def build_threads() -> int:
    """This rank's share of the host's cores: the launcher's processes on this node share them, and
    one variant of each rank at a time draws the weights (weights.py)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def versions() -> dict:
    import accelerate
    import transformers

    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


@dataclass(kw_only=True)
class Checked:
    """A command line that main.py accepts, and what checking it produced."""
    args: argparse.Namespace
    names: list[str]
    fsdp_options: options.FsdpOptions
    facts: ModelFacts
    batches: torch.Tensor  # this rank's: (steps, sequences, block)
    cap: estimate.GpuCap | None  # --gpu_memory
    config: accelerate_config.ConfigOptions | None  # the user's accelerate config, where one is read
    links: Links | None  # --emulate_communication


def emulation_links(args: argparse.Namespace, steps: int, compiled: bool) -> Links | None:
    """--emulate_communication's links, for the simulated ranks only (real ranks communicate for real), over a run
    of ``steps`` that times both of its halves."""
    if args.emulate_communication is None:
        return None
    if not args.simulate_world_size:
        raise UserError("--emulate_communication needs --simulate_world_size: real ranks communicate for real")
    links = parse_emulation(args.emulate_communication, simulation.parse_world_sizes(args.simulate_world_size))
    check_alternating_steps(steps, compiled)
    return links


def alternating_halves(steps: int, compiled: bool) -> tuple[int, int]:
    """(compute-only, emulated) steps after the warm-up of a run of ``steps`` whose communication is emulated every
    other step (processes/emulation.py)."""
    after = range(throughput.warmup_steps(compiled), steps)
    return sum(not emulates(s) for s in after), sum(emulates(s) for s in after)


def check_alternating_steps(steps: int, compiled: bool) -> None:
    """The compute alone and the emulated step are timed in one run, every other step: each half needs a median's
    steps after the warm-up."""
    compute, emulated = alternating_halves(steps, compiled)
    least = throughput.MIN_TIMED_STEPS
    if min(compute, emulated) < least:
        needed = next(n for n in itertools.count(steps + 1) if min(alternating_halves(n, compiled)) >= least)
        warm = throughput.numbers_said(list(range(throughput.warmup_steps(compiled))))
        raise UserError(f"--emulate_communication: {counted(steps, 'step')} leave{'s' if steps == 1 else ''} "
                        f"{compute} compute-only and {counted(emulated, 'emulated step')} after the warm-up ({warm}{', which compile' if compiled else ''}); "
                        f"emulating every other step, each needs {least}: --max_steps {needed} or more (and the data "
                        "for them)")


def parse_emulation(given: str, world_sizes: list[int]) -> Links:
    """--emulate_communication's value (bare: the default links) as links whose nodes make up each N."""
    links = parse_links(None if given == DEFAULT_LINKS else given, "--emulate_communication")
    for n in world_sizes:
        check_nodes_fit(links, n, "--emulate_communication")
    return links


def validate(argv: list[str] | None = None, world_size: int | None = None) -> Checked:
    """Everything main.py refuses, in one line, before any process or file exists (tests call it
    in-process with hostile command lines); an option the user's config or environment set is named by its
    field there. ``world_size``: the launch's these options are for, where this process is not it (matrix.py's)."""
    launcher_keeps_to_one_thread()  # before this process computes anything: it forks the children
    args = parse_args(argv)
    try:
        return checked_launch(args, world_size)
    except UserError as error:
        raise accelerate_config.with_fields(error, getattr(args, "config_fields", {})) from None


INIT_AFTER_SHARDING = "torch_optimizer_after_fsdp"  # the one variant whose model may exist only as shards


def check_meta_variants(init_device: str, names: list[str]) -> None:
    """Under --init_device meta the model never exists whole, so a variant that needs it whole before sharding
    (an optimizer made over the full parameters, accelerate's prepare of a full model) has nothing to measure."""
    others = [n for n in names if n != INIT_AFTER_SHARDING]
    if init_device == "meta" and others:
        raise UserError(f"--init_device meta: the model exists only as each rank's shards, so {', '.join(others)} "
                        f"cannot run ({'each takes' if len(others) > 1 else 'it takes'} the whole model before "
                        f"sharding); add --variants {INIT_AFTER_SHARDING}")


def checked_launch(args: argparse.Namespace, world_size: int | None) -> Checked:
    check_releases()
    launch_rank, launch_world = check_launcher_env()
    launch_world = world_size or launch_world
    config = apply_config(args)
    check_context_parallel_device(args.cp_size, pick_device(args.device).type)  # the device before the sizes
    names, fsdp_options = check_args(args, launch_world)
    if not args.simulate_world_size:
        accelerate_config.check_num_processes(config, launch_world)
    device_type = pick_device(args.device).type
    model_defaulted = args.model is None
    args.model = args.model or default_model(device_type)
    if args.init_device == "cuda" and device_type != "cuda":
        raise UserError("--init_device cuda needs a GPU (this run is on the CPU)")
    check_meta_variants(args.init_device, names)
    if args.gpu_memory is not None and device_type != "cuda":
        raise UserError("--gpu_memory needs a GPU (this run is on the CPU)")
    check_output_dir(args.output_dir, "summary.json")
    refuse_foreign(files_written(args, names, launch_world), "--output_dir")
    facts = model_facts(args.model, args.seed, lambda model: check_model(model, args.block_size, fsdp_options),
                        fsdp_options.tuning)
    check_wrapped_classes(config, facts.layer_classes)
    try:
        check_step(fsdp_options, facts.config, device_type)
    except UserError as error:
        raise accelerate_config.with_fields(error, args.config_fields) from None
    batches = run_batches(args, fsdp_options, facts.config.vocab_size, *data_share(args, fsdp_options, launch_rank,
                                                                                   launch_world))
    if args.inject_failure:
        check_failure_reachable(args.inject_failure, names, len(batches),
                                played_ranks(args) or set(range(launch_world)))
    # The smallest simulated N holds the most per rank.
    fit_world = simulation.parse_world_sizes(args.simulate_world_size)[0] if args.simulate_world_size else launch_world
    concurrency.check_fits(facts.shapes, fit_world, names, args.init_device, device_type, fsdp_options,
                           estimate.rank_logits_bytes(args.batch_size, args.block_size, facts.config, fsdp_options),
                           estimate.step_bytes(args.batch_size, args.block_size, facts.config, fsdp_options))
    cap = None if args.gpu_memory is None else estimate.gpu_cap(args.gpu_memory, pick_device(args.device).index)
    links = emulation_links(args, len(batches), fsdp_options.compile)
    if model_defaulted:
        say_default_model(device_type)
    return Checked(args=args, names=names, fsdp_options=fsdp_options, facts=facts, batches=batches, cap=cap,
                   config=config, links=links)


def check_wrapped_classes(config: accelerate_config.ConfigOptions | None, layer_classes: list[str]) -> None:
    """A config that names the blocks to wrap names the model's own: the units every variant shards by."""
    if config is not None and config.layer_classes and set(config.layer_classes) != set(layer_classes):
        raise UserError(f"{config.source}: fsdp_transformer_layer_cls_to_wrap {','.join(config.layer_classes)}: "
                        f"the suite shards this model by its blocks, {','.join(layer_classes)}")


