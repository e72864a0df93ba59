"""plan.py's command line, both modes: its parser and every check, one pass before any probe or timing runs.

Each value has one parser and one message; an option that the chosen mode does not read is refused with the mode
that reads it, never taken and dropped (``UNREAD``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp2bench.cli import (OneLineParser, UserError, check_ranges, given_options, gpu_memory_gib, parse_names,
                            pick_device, say)
from fsdp2bench.files import check_output_dir, digest_of, is_ours, path_kind, refuse_foreign
from fsdp2bench.memory import estimate
from fsdp2bench.memory.accounting import built_bytes
from fsdp2bench.memory.estimate import host_bytes
from fsdp2bench.names import GIB, VARIANTS, counted
from fsdp2bench.options import accelerate_config, levers as lever_checks, fsdp as options, tuning
from fsdp2bench.options.layout import Layout
from fsdp2bench.options.links import Links, check_nodes_fit, parse_links
from fsdp2bench.options.step import LIGER, Step, check_liger
from fsdp2bench.options.tuning import Tuning
from fsdp2bench.plan.layout.candidates import (COMPILE, FLOAT8, LEVER_NAMES, Levers, candidates_of, layouts_of,
                                               parse_levers)
from fsdp2bench.plan.layout.report import CONFIG_NAME, PLAN_NAME, written_config_digest
from fsdp2bench.plan.layout.search import SearchInputs
from fsdp2bench.plan.layout.timing import timing_dir
from fsdp2bench.plan.probes import BATCH, BLOCK, BLOCK_STEP, LAYOUT, block_step
from fsdp2bench.processes.isolation import launcher_keeps_to_one_thread
from fsdp2bench.processes.simulation import check_fake_group_available, parse_world_sizes
from fsdp2bench.processes.starting import refuse_launcher
from fsdp2bench.run import arguments
from fsdp2bench.run.concurrency import host_memory_for_launch
from fsdp2bench.run.session import ModelFacts, model_facts
from fsdp2bench.run.versions import check_releases
from fsdp2bench.train.model import CPU_DEFAULT_MODEL, GPU_DEFAULT_MODEL, max_positions

if TYPE_CHECKING:  # the type alone: cli.pick_device makes the device
    import torch

SEED = 421  # main.py's: the weights are drawn the same way
DEFAULT_VARIANTS = f"{VARIANTS[0]},accelerate"
DEFAULT_UPPER = {BATCH: 4096, BLOCK: 1 << 20}  # the block's is lowered to the model's positions
# A CPU has no cap, so a search there runs to its upper bound: kept small, so that checking the search is quick.
CPU_UPPER = {BATCH: 8, BLOCK: 1024}
NUMBER_RANGES = {"global_batch": (1, 1 << 24), "global_batch_tokens": (1, 1 << 40), "max_timings": (1, 1000),
                 "confirm": (1, 1000), "time_budget_s": (0, 1 << 20),
                 "batch_size": (1, 1 << 16), "upper_bound": (1, 1 << 20),
                 "inject_oom_above": (0, 1 << 20),
                 **{name: arguments.NUMBER_RANGES[name] for name in ("ac_every", "lora_rank", "lora_alpha",
                                                                     "lora_dropout")}}

LAYOUT_ONLY = ("global_batch", "global_batch_tokens", "levers", "links", "max_timings", "confirm", "time_budget_s")
SEARCHED_LEVERS = "the layout search tries the levers itself: name them in --levers"
LINKS_OF_PROBES = (f"the links of --find {LAYOUT}'s timings; a probe's communication is emulated over "
                   "--emulate_communication WITHIN,ACROSS|FILE")
# What each mode leaves unread, and why: given there, it is refused in one line (plan.py reads each of the others).
UNREAD = {
    BATCH: {**dict.fromkeys(LAYOUT_ONLY, f"read only by --find {LAYOUT}"), "links": LINKS_OF_PROBES,
            "batch_size": f"the fixed batch of --find {BLOCK}; --find {BATCH} searches it"},
    BLOCK: {**dict.fromkeys(LAYOUT_ONLY, f"read only by --find {LAYOUT}"), "links": LINKS_OF_PROBES},
    LAYOUT: {"sets": "the layout search makes its own layouts, not matrix.py's option sets",
             "emulate_communication": "the layout search emulates every timing's communication itself, over "
                                      "--links",
             "variants": "the layout search times the intended variant",
             "batch_size": "the layout search sizes each candidate's microbatch from --global_batch",
             "upper_bound": "the layout search sizes each candidate's microbatch from --global_batch",
             "inject_oom_above": f"a test option of --find {BATCH} and {BLOCK}",
             "activation_checkpointing": f"{SEARCHED_LEVERS} (full, selective, none)",
             "ac_every": "the layout search checkpoints every block or none (--levers)",
             "compile": f"{SEARCHED_LEVERS} (compile)", "float8": f"{SEARCHED_LEVERS} (float8)",
             "loss": f"{SEARCHED_LEVERS} (model, chunked, liger)",
             "config_file": "the layout search chooses the layout and levers and writes an accelerate config for "
                            "its winner; it reads none"},
}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, set[str]]:
    """The options, and which of them the command line gave."""
    launches = [("python3 plan.py --world_size 8,64 --gpu_memory 24", "one process plays each rank it probes"),
                ("python3 plan.py --device cpu --world_size 2 --inject_oom_above 3", "a CPU has no cap: an edge injected")]
    p = OneLineParser("What fits: the largest batch (or block) per option set at N ranks on a GPU of M GiB, measured.",
                      launches, "docs/plan.md")
    p.add_argument("--model", default=None,
                   help=f"a preset or a local directory with config.json (default: {GPU_DEFAULT_MODEL} "
                        f"on a GPU, {CPU_DEFAULT_MODEL} on a CPU run)")
    p.add_argument("--world_size", default="8", metavar="N[,N...]",
                   help="the world sizes N to plan for, each played by one simulated rank (default: 8)")
    p.add_argument("--gpu_memory", type=gpu_memory_gib, default=None, metavar="SIZE",
                   help="the GPU's memory, made real on this one: 80GB (10^9 bytes: 74.5 GiB), "
                        "80GiB, or a bare number of GiB; the probes' allocator gets it less the CUDA context. A SIZE "
                        f"up to {estimate.CARD_SHORTFALL * 100:.0f}%% above this GPU's is taken for the card's "
                        "nominal size (80 on an 80 GB H100, which reports 79.2 GiB), said in one line (default: this "
                        "GPU's)")
    p.add_argument("--sets", default=",".join(options.PLUGIN_SETS),
                   help=f"comma-separated option sets of matrix.py ({', '.join(options.OPTION_SETS)}), or "
                        f"{options.EACH} for every one of them (default: {','.join(options.PLUGIN_SETS)})")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated variants ({', '.join(VARIANTS)}) (default: {DEFAULT_VARIANTS})")
    p.add_argument("--find", choices=[BATCH, BLOCK, LAYOUT], default=BATCH,
                   help=f"what to find the largest of: {BATCH} at each --block_size, or {BLOCK} at the fixed "
                        f"--batch_size; or {LAYOUT}: which layout and levers fit one N at --block_size and "
                        f"--global_batch, ranked by the speed of a step whose communication is emulated (docs/plan.md) "
                        f"(default: {BATCH})")
    p.add_argument("--block_size", default="128", metavar="L[,L...]",
                   help=f"tokens per sequence L, a list allowed; with --find {BLOCK} the search's lower bound "
                        f"(default: 128)")
    p.add_argument("--batch_size", type=int, default=1,
                   help=f"sequences per microbatch with --find {BLOCK} (default: 1)")
    p.add_argument("--upper_bound", type=int, default=None,
                   help=f"the largest value tried (default: {DEFAULT_UPPER[BATCH]} for a batch, the model's "
                        f"positions for a block; on a CPU run {CPU_UPPER[BATCH]} and {CPU_UPPER[BLOCK]}, a block never "
                        "below --block_size nor beyond the model's positions)")
    p.add_argument("--init_device", choices=["auto", "cpu", "cuda", "meta"], default="auto",
                   help="where each probe builds its model, as main.py's option; auto: on the GPU where 1.2 x the "
                        "model's fp32 bytes fit under the cap (a probe's set-up then takes about a second, not "
                        "seven), else on the CPU where they fit the host, else (only --variants "
                        "torch_optimizer_after_fsdp) empty on meta, each rank drawing its own shards (default: auto)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when a GPU is present; on a CPU run probes have no cap and run one at a "
                        "time (default: auto)")
    p.add_argument("--output_dir", default="out_plan",
                   help="plan.json here, each probe's trace in <output_dir>/probes/ (default: out_plan)")
    arguments.add_step_options(p)
    arguments.add_checkpointing_options(arguments.add_lever_options(
        p, "Levers under every set (docs/levers.md): over the config's options; a set's own options win"))
    arguments.add_config_option(p, "the options each set is put over (a set's own options win)")
    arguments.add_tuning_options(p)
    arguments.add_emulation_option(p, f"with --find {BATCH} or {BLOCK}: each collective a fresh probe (one simulated "
                                      "rank) issues")
    add_layout_options(p)
    p.add_argument("--inject_oom_above", type=int, default=None, metavar="V",
                   help="test option: every probe above V runs out of memory at its first step (default: off)")
    return p.parse_args(argv), given_options(p, argv)


def add_layout_options(p: argparse.ArgumentParser) -> None:
    """The options only the layout search reads."""
    g = p.add_argument_group(f"The layout search (--find {LAYOUT}; docs/plan.md)")
    g.add_argument("--global_batch", type=int, default=None, metavar="SEQUENCES",
                   help="SEQUENCES per optimizer step over all ranks (default: none; this or --global_batch_tokens)")
    g.add_argument("--global_batch_tokens", type=int, default=None, metavar="TOKENS",
                   help="the same in TOKENS, a multiple of --block_size (default: none)")
    g.add_argument("--levers", default=None, metavar="LEVERS",
                   help=f"the LEVERS searched, comma-separated from {', '.join(LEVER_NAMES)} (default: every one "
                        "that runs here)")
    g.add_argument("--links", default=None, metavar="WITHIN,ACROSS|FILE",
                   help="the links every timing's communication is emulated over (main.py's "
                        "--emulate_communication) and the untimed candidates' is projected over: GB/s per direction "
                        f"per GPU WITHIN a node of {Links().node_size} and ACROSS nodes, or a JSON FILE with "
                        f"node_size, within_gbps, across_gbps (default: {Links().within_gbps:g},"
                        f"{Links().across_gbps:g}: NVLink 4, 400 Gb/s RDMA)")
    g.add_argument("--max_timings", type=int, default=12,
                   help="timings at most, each one launch of one simulated rank alone on the device (every other "
                        "step with its communication emulated, the steps between its compute alone) (default: 12)")
    g.add_argument("--confirm", type=int, default=3, metavar="ROWS",
                   help="time the ranked candidates on top until the first ROWS are measured, not estimated "
                        "(default: 3)")
    g.add_argument("--time_budget_s", type=float, default=420.0, metavar="SECONDS",
                   help="no timing starts after SECONDS of timings; the first always runs (default: 420)")


@dataclass(frozen=True, kw_only=True)
class Common:
    """What both modes read, checked once."""
    sizes: list[int]
    blocks: list[int]
    device: torch.device
    model: str
    tuning: Tuning  # what every probe or timing trains, and with which optimizer


@dataclass(kw_only=True)
class Checked:
    """A batch or block plan that can run: what to search, on which model, under which cap."""
    args: argparse.Namespace
    sets: list[str]
    sizes: list[int]
    variants: list[str]
    blocks: list[int]
    upper: int
    facts: ModelFacts
    cap: estimate.GpuCap | None
    skipped: list[str]
    base: options.FsdpOptions  # what each set's options are put over: the loop, the loss and the user's config
    config: accelerate_config.ConfigOptions | None
    links: Links | None  # --emulate_communication: each fresh probe's collectives cost their time over these


@dataclass(frozen=True, kw_only=True)
class CheckedSearch:
    """A layout search that can run: its setup, its candidates and what was left out and why."""
    setup: SearchInputs
    candidates: list
    notes: list[str]
    args: argparse.Namespace


def validate(argv: list[str] | None = None) -> Checked | CheckedSearch:
    """Everything plan.py refuses, in one line, before anything runs; an option the user's config set is named by
    its field there."""
    launcher_keeps_to_one_thread()
    refuse_launcher("plan.py is one process that plays every rank")
    args, given = parse_args(argv)
    try:
        common = checked_common(args, given)
        return checked_search(args, common) if args.find == LAYOUT else checked_plan(args, common)
    except UserError as error:
        raise accelerate_config.with_fields(error, getattr(args, "config_fields", {})) from None


def checked_common(args: argparse.Namespace, given: set[str]) -> Common:
    """The checks both modes share, in the order a user would fix them."""
    check_releases()
    refuse_unread(given, args.find)
    check_ranges(args, NUMBER_RANGES)
    sizes = parse_world_sizes(args.world_size, "--world_size")
    blocks = parse_block_sizes(args.block_size)
    if args.find != BATCH and len(blocks) > 1:
        raise UserError(f"--block_size {args.block_size}: --find {args.find} takes one value (a list is for "
                        f"--find {BATCH}, one answer per block)")
    if args.find == LAYOUT and len(sizes) > 1:
        raise UserError(f"--world_size {args.world_size}: --find {LAYOUT} plans one N (run it once per N)")
    check_fake_group_available()
    device = pick_device(args.device)
    if device.type != "cuda" and args.gpu_memory is not None:
        raise UserError("--gpu_memory needs a GPU (this run is on the CPU, where a probe has no cap)")
    if args.init_device == "cuda" and device.type != "cuda":
        raise UserError("--init_device cuda needs a GPU (this run is on the CPU)")
    chosen = checked_tuning(args, device.type)
    check_output_dir(args.output_dir, PLAN_NAME)
    refuse_foreign([plan_path(args)], "--output_dir")
    model = args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)
    return Common(sizes=sizes, blocks=blocks, device=device, model=model, tuning=chosen)


def checked_tuning(args: argparse.Namespace, device_type: str) -> Tuning:
    """The fine-tuning every probe and timing trains, refused where main.py refuses it, by its checks: a knob
    without adapters, a missing package, an optimizer that cannot run, a known failure not asked for, what the
    device cannot do. The targets are checked against the model as it is built (``model_facts``)."""
    chosen = options.tuning_of(args)
    options.check_tuning(options.FsdpOptions(tuning=chosen))
    tuning.check_known_failure(chosen, args.allow_known_failure)
    tuning.check_device(chosen, device_type)
    return chosen


def build_device(asked: str, shapes, cap: estimate.GpuCap | None, variants: list[str]) -> str:
    """Where the probes build their model: as asked, or (auto) on the GPU where the whole fp32 model, with the
    margin the GPU's room gives a build (plan/room.py), fits under the cap each probe runs in, else on the host
    where it fits there, else on meta where only the variant that can be built from its shards is planned (a
    model larger than the card and the host: Llama-3.1-70B is 282 GB in fp32). On one H100 the README's 24 GiB
    plan of the 1.5B shape took 218 s with its probes built on the CPU (7.3 s a probe's set-up), 112 s built on
    the GPU (0.9 s), the same edges within a probe's spread."""
    if asked == "meta":
        arguments.check_meta_variants(asked, variants)
    if asked != "auto":
        return asked
    if cap is not None and 1.2 * built_bytes(shapes) <= cap.allocator_bytes:
        return "cuda"
    on_host = built_bytes(shapes) + estimate.HOST_RUNTIME <= host_memory_for_launch()
    return "cpu" if on_host or variants != [arguments.INIT_AFTER_SHARDING] else "meta"


def refuse_unread(given: set[str], mode: str) -> None:
    """An option the mode would drop is refused, naming the mode that reads it."""
    for name, why in UNREAD[mode].items():
        if name in given:
            raise UserError(f"--{name} is not read by --find {mode}: {why}")


def plan_path(args: argparse.Namespace) -> str:
    return os.path.join(args.output_dir, PLAN_NAME)


def parse_block_sizes(text: str) -> list[int]:
    """``--block_size``: comma-separated tokens per sequence, each in main.py's range; sorted, once each."""
    try:
        blocks = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--block_size: expected comma-separated integers, got {text!r}") from None
    low, high = arguments.NUMBER_RANGES["block_size"]
    bad = [b for b in blocks if not low <= b <= high]
    if bad:
        raise UserError(f"--block_size must be in [{low}, {high}], got {bad[0]}")
    return sorted(set(blocks))


def checked_plan(args: argparse.Namespace, common: Common) -> Checked:
    """The batch and block searches' own checks: sets, variants, the model, the user's config and the cap."""
    sets = options.parse_sets(args.sets, "--sets")
    variants = parse_names(args.variants, "--variants", VARIANTS)
    links = None if args.emulate_communication is None else \
        arguments.parse_emulation(args.emulate_communication, common.sizes)
    blocks, device = common.blocks, common.device
    cpu_said = device.type != "cuda" and (
        f"A CPU plan has no memory cap: nothing runs out of memory there unless --inject_oom_above says so, so it "
        f"finds no edge (each answer is its upper bound, {CPU_UPPER[args.find]} unless --upper_bound says) and only "
        f"checks the search{'' if args.model else f', on the {CPU_DEFAULT_MODEL} model'}. A real answer needs a GPU: "
        "the same command there, --gpu_memory the card you plan for.")
    args.model = common.model
    config = accelerate_config.read(args.config_file)
    base = base_options(args, config, common.tuning)
    options.check(base)
    arguments.check_context_parallel_device(base.layout.cp_size, device.type)  # the config's CP, before the sets
    facts = model_facts(args.model, SEED, lambda model: check_blocks(blocks, model), common.tuning)
    arguments.check_wrapped_classes(config, facts.layer_classes)
    arguments.check_step(base, facts.config, device.type)
    upper = search_upper(args, facts.config, blocks, device.type)
    check_block_steps(args, base, sets, blocks, upper)
    cap = estimate.gpu_cap(args.gpu_memory, device.index) if device.type == "cuda" else None
    args.init_device = build_device(args.init_device, facts.shapes, cap, variants)
    sets, skipped = plannable_sets(args, base, sets, common, config, facts.config)
    check_host_fits(args, [(name, n, set_options(base, name)) for name in sets for n in common.sizes
                           if set_options(base, name).layout.fits(n)], variants, facts, device.type)
    if cpu_said:  # after every check, so that a refusal is the launch's one line
        say(cpu_said)
    return Checked(args=args, sets=sets, sizes=common.sizes, variants=variants, blocks=blocks, upper=upper,
                   facts=facts, cap=cap, skipped=skipped, base=base, config=config, links=links)


def base_options(args: argparse.Namespace, config: accelerate_config.ConfigOptions | None,
                 chosen: Tuning) -> options.FsdpOptions:
    """The options every set is put over: the loop, the loss and the fine-tuning, the user's config, then the levers
    given as flags (``args.config_fields`` names, for a refusal, the config field that set an option)."""
    levers_given = {name: getattr(args, name) for name in ("activation_checkpointing", *options.LEVER_OPTIONS)
                    if getattr(args, name) is not None}
    sources = {**(dict.fromkeys(config.values, "config") if config else {}), **dict.fromkeys(levers_given, "flag")}
    args.config_fields = accelerate_config.fields_said(config, sources)
    return options.FsdpOptions(step=Step(loop=args.loop, loss=args.loss), tuning=chosen).over(
        config.values if config else {}).over(levers_given)


def plannable_sets(args: argparse.Namespace, base: options.FsdpOptions, sets: list[str], common: Common,
                   config: accelerate_config.ConfigOptions | None, model_config) -> tuple[list[str], list[str]]:
    """The sets that can run here at some N, and a note for each set or N left out."""
    device_type = common.device.type
    refused = {name: why for name in sets
               if (why := layout_refusal(args, set_options(base, name), common.blocks, model_config, device_type))}
    if len(refused) == len(sets):
        raise UserError(f"--sets {args.sets}: none can be planned here: "
                        + "; ".join(f"{name}: {why}" for name, why in refused.items()))
    sets = [name for name in sets if name not in refused]
    skipped = [f"{name}: not planned ({why})" for name, why in refused.items()]
    fits_at = {name: [n for n in common.sizes if set_options(base, name).layout.fits(n)] for name in sets}
    skipped += [f"{name}: not planned at N = {', '.join(str(n) for n in common.sizes if n not in fits_at[name])} "
                "(its layout's sizes do not divide N)" for name in sets if fits_at[name] != common.sizes]
    if not any(fits_at.values()):
        raise UserError(nothing_fits(args, base, config, common.sizes))
    return sets, skipped


def check_host_fits(args: argparse.Namespace, planned: list[tuple[str, int, options.FsdpOptions]], variants: list[str],
                    facts: ModelFacts, device_type: str) -> None:
    """Each probe is a process of its own on this host (the model built there, unless on the GPU, and on a CPU run
    its whole state): one that the host cannot hold would be killed by the kernel minutes in, with no word."""
    need, name, world_size, variant = max((host_bytes(facts.shapes, n, [v], args.init_device, chosen, device_type),
                                           name, n, v) for name, n, chosen in planned for v in variants)
    refuse_beyond_host(need, args.model, "one probe", f"{name} at N = {world_size}, {variant}")


def refuse_beyond_host(need: int, model: str, what: str, where: str) -> None:
    """Refused where ``need`` bytes, the process of ``what`` (``where``), exceed what the host has free."""
    available = host_memory_for_launch()
    if need > available:
        raise UserError(f"--model {model} needs about {need / GIB:.1f} GiB of host memory for {what} ({where}: the "
                        f"model built on the host, its state and the runtime); {available / GIB:.1f} GiB are "
                        "available: plan a smaller model here, or on a larger host")


def nothing_fits(args: argparse.Namespace, base: options.FsdpOptions, config: accelerate_config.ConfigOptions | None,
                 sizes: list[int]) -> str:
    """Why no set can be planned at any N, blaming what set the layout: the user's config, where its own sizes fit
    none of them, else the sets."""
    layout_fields = {k: v for k, v in (config.values if config else {}).items() if k in options.LAYOUT_OPTIONS}
    if layout_fields and not any(base.layout.fits(n) for n in sizes):
        said = ", ".join(f"{accelerate_config.FIELDS[k]} {v}" for k, v in layout_fields.items())
        return (f"{config.source}: its layout ({said}) fits none of --world_size {args.world_size} ("
                + "; ".join(f"N = {n}: {layout_misfit(base.layout, n)}" for n in sizes)
                + "); give a --world_size it fits, or plan without --config_file")
    return (f"--sets {args.sets}: none can run at --world_size {args.world_size} (a set's layout must divide N: an "
            f"HSDP set's {options.NODE_RANKS} shards, a TP or CP set's sizes)")


def layout_misfit(layout: Layout, world_size: int) -> str:
    """Why a layout's sizes do not fit ``world_size``, in the layout's own words."""
    try:
        layout.at(world_size)
    except UserError as exc:
        return str(exc)
    return "it fits"


def layout_refusal(args: argparse.Namespace, chosen: options.FsdpOptions, blocks: list[int], config,
                   device_type: str) -> str | None:
    """Why a set's layout cannot run this model here (it is skipped, and said so): at each fixed block, or, with
    --find block_size, at any (the search keeps to the multiples of what CP needs)."""
    tried = blocks if args.find == BATCH else [chosen.layout.sequence_divisor]
    return next((why for block in tried if (why := arguments.layout_refusal(chosen, config, block, device_type))),
                None)


def set_options(base: options.FsdpOptions, name: str) -> options.FsdpOptions:
    """An option set's options put over ``base``: the loop and the loss asked for, and the user's config."""
    return base.over(options.OPTION_SETS[name].changed())


def check_blocks(blocks: list[int], config) -> None:
    for block in blocks:
        arguments.check_positions(block, config)


def search_upper(args: argparse.Namespace, config, blocks: list[int], device_type: str) -> int:
    """The largest value a search tries: given, or the default (a block never beyond the model's positions,
    nor below the search's start; small on a CPU, where nothing caps it)."""
    positions = max_positions(config) or DEFAULT_UPPER[BLOCK]
    default = (DEFAULT_UPPER if device_type == "cuda" else CPU_UPPER)[args.find]
    upper = args.upper_bound if args.upper_bound is not None else \
        default if args.find == BATCH else max(min(default, positions), max(blocks))
    if args.find == BLOCK and upper > positions:
        raise UserError(f"--upper_bound {upper} exceeds the model's {positions} positions")
    if args.find == BLOCK and upper < max(blocks):
        raise UserError(f"--upper_bound {upper} is below --block_size {max(blocks)}, where the search starts")
    return upper


def check_block_steps(args: argparse.Namespace, base: options.FsdpOptions, sets: list[str], blocks: list[int],
                      upper: int) -> None:
    """A searched block moves in steps (probes.block_step): the range given must hold one."""
    if args.find != BLOCK:
        return
    for name in sets:
        step = block_step(set_options(base, name))
        if -(-blocks[0] // step) * step > upper:
            raise UserError(f"--block_size {blocks[0]} to --upper_bound {upper} holds no multiple of {step} tokens, "
                            f"the step a searched block moves by{' under ' + name if step != BLOCK_STEP else ''}")


def checked_search(args: argparse.Namespace, common: Common) -> CheckedSearch:
    """The layout search's own checks: the global batch, the levers, the links, and a layout that splits it."""
    world_size, block, device = common.sizes[0], common.blocks[0], common.device
    check_config_path(args.output_dir)
    check_timing_folders(args.output_dir, args.max_timings)
    facts = model_facts(common.model, SEED, lambda config: arguments.check_positions(block, config), common.tuning)
    sequences = global_sequences(args, block)
    chosen, notes = available_levers(args.levers, device.type, facts.config, common.tuning)
    links = parse_links(args.links)
    check_nodes_fit(links, world_size, "--links")
    layouts, refused = layouts_of(world_size, facts.config, block, device.type, common.tuning)
    splits = sorted({d.data_ranks for d in layouts}, reverse=True)
    if not any(sequences % ranks == 0 for ranks in splits):
        raise UserError(f"--global_batch {counted(sequences, 'sequence')}: no layout of N = {world_size} splits it "
                        f"evenly (their data-parallel ranks, {', '.join(map(str, splits))}, each leave a remainder)")
    cap = estimate.gpu_cap(args.gpu_memory, device.index) if device.type == "cuda" else None
    args.init_device = build_device(args.init_device, facts.shapes, cap, [VARIANTS[0]])
    setup = SearchInputs(model=common.model, world_size=world_size, block=block, global_sequences=sequences,
                  shapes=facts.shapes, config=facts.config,
                  base=options.FsdpOptions(step=Step(loop=args.loop), tuning=common.tuning),
                  allow_known_failure=args.allow_known_failure,
                  cap=cap, links=links, device_type=device.type, gpu_name=gpu_name() if device.type == "cuda" else None,
                  output_dir=args.output_dir, max_timings=args.max_timings, init_device=args.init_device,
                  num_parameters=facts.num_parameters, confirm=args.confirm, time_budget_s=args.time_budget_s,
                  links_given=os.path.abspath(args.links) if args.links and os.path.isfile(args.links) else args.links)
    candidates = candidates_of(layouts, chosen, sequences, device.type)
    need = min(host_bytes(facts.shapes, world_size, [VARIANTS[0]], args.init_device, options_of, device.type)
               for options_of in {c.options(setup.base) for c in candidates})
    refuse_beyond_host(need, common.model, "the lightest candidate's timing", f"N = {world_size}")
    return CheckedSearch(setup=setup, candidates=candidates, notes=notes + refused, args=args)


def check_config_path(output_dir: str) -> None:
    """accelerate_config.json carries no mark of this benchmark (accelerate's loader refuses an unknown key): one
    already there is replaced only beside this benchmark's plan.json, as a file, as that search wrote it (its
    digest in plan.json)."""
    path, plan = os.path.join(output_dir, CONFIG_NAME), os.path.join(output_dir, PLAN_NAME)
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isfile(path) or not is_ours(plan):
        raise UserError(f"--output_dir: {path} is there and this run would replace it (it is not beside a plan.json "
                        "of this benchmark); it is left untouched: move it away or choose another --output_dir")
    if digest_of(path) != written_config_digest(plan):
        raise UserError(f"--output_dir: {path} is not the file the search of {plan} wrote (edited since?) and this "
                        "run would replace it; it is left untouched: move it away or choose another --output_dir")


def check_timing_folders(output_dir: str, max_timings: int) -> None:
    """Where each timing's folder goes: a folder or nothing, with no summary.json but this benchmark's in it (main.py
    would refuse it, and the candidate be reported failing)."""
    folders = [os.path.dirname(timing_dir(output_dir, 0)),
               *(timing_dir(output_dir, i) for i in range(max_timings))]
    for folder in folders:
        if os.path.lexists(folder) and (os.path.islink(folder) or not os.path.isdir(folder)):
            what = "a symbolic link" if os.path.islink(folder) else path_kind(folder)
            raise UserError(f"--output_dir: {folder} is {what}, where a timing's folder goes; it is left untouched: "
                            "move it away or choose another --output_dir")
    refuse_foreign([os.path.join(folder, "summary.json") for folder in folders[1:]], "--output_dir")


def global_sequences(args: argparse.Namespace, block: int) -> int:
    """The global batch in sequences: given as such, or in tokens that make whole sequences."""
    if args.global_batch is not None and args.global_batch_tokens is not None:
        raise UserError(f"--global_batch {args.global_batch} and --global_batch_tokens {args.global_batch_tokens}: "
                        "give one of them (the same size, in sequences or in tokens)")
    if args.global_batch is None and args.global_batch_tokens is None:
        raise UserError(f"--find {LAYOUT} needs one of --global_batch (sequences per optimizer step over all ranks) "
                        "and --global_batch_tokens")
    if args.global_batch is not None:
        return args.global_batch
    if args.global_batch_tokens % block:
        raise UserError(f"--global_batch_tokens {args.global_batch_tokens} is not a whole number of "
                        f"--block_size {block} sequences")
    return args.global_batch_tokens // block


def available_levers(text: str | None, device_type: str, config, chosen: Tuning) -> tuple[Levers, list[str]]:
    """The levers searched: those named (each must run here and with the fine-tuning asked for, else one line says
    why), or every one that runs here, the others left out with the reason."""
    named = parse_levers(text or ",".join(LEVER_NAMES))
    checks = {COMPILE: lambda: lever_checks.check(options.FsdpOptions(compile=True), device_type, 1),
              FLOAT8: lambda: (lever_checks.check_float8(device_type),
                               options.check_tuning(options.FsdpOptions(float8=True, tuning=chosen))),
              LIGER: lambda: check_liger(config, device_type)}
    notes, drop = [], set()
    for lever, check in checks.items():
        if lever not in (text or ",".join(LEVER_NAMES)).split(","):
            continue
        try:
            check()
        except UserError as exc:
            if text is not None:
                raise UserError(f"--levers {text}: {exc}") from None
            notes.append(f"{lever}: {exc}")
            drop.add(lever)
    return dataclasses.replace(named, losses=tuple(loss for loss in named.losses if loss not in drop),
                               compile=(False,) if COMPILE in drop else named.compile,
                               float8=(False,) if FLOAT8 in drop else named.float8), notes


def gpu_name() -> str | None:
    """The GPU's name from nvidia-smi (this process never initialises CUDA), for its peak FLOP/s."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=True).stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
