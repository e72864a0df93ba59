"""What fits: the largest batch (or block) per option set at N ranks on a GPU of M GiB, measured.

Each answer comes from probes: one simulated rank of N (the most loaded one), in a fresh process,
trained two steps under the cap (``torch.cuda.set_per_process_memory_fraction``); it fits when it
completes. One shared process per option set and N, built once, first measures a few values well under
the cap; the line through their peaks aims the fresh probes, which confirm the edge from both sides, and
the other variants' probes start at the edge the first one found.
``python3 plan.py --model qwen2.5-1.5b --world_size 8,64 --gpu_memory 80`` writes ``<output_dir>/plan.json``
with every probe; ``python3 visualize.py --dir <output_dir>`` draws peak allocated against batch.
"""

from __future__ import annotations

import sys

from fsdp2bench.first import one_line_interrupts

if __name__ == "__main__":  # before any other import: a Ctrl-C from here on is one line, never a traceback
    one_line_interrupts()

from fsdp2bench.starting import check_launcher_env, start_before_imports

if __name__ == "__main__":  # ahead of the imports below: the fork server's overlap them
    start_before_imports(sys.argv[1:])

import argparse
import os
import shlex
import time
from dataclasses import dataclass

from fsdp2bench import accelerate_config, arguments, concurrency, fitting, layout_plan, options, weights
from fsdp2bench.candidates import LEVER_NAMES
from fsdp2bench.cli import (OneLineParser, UserError, check_output_dir, check_ranges, exit_with,
                            parse_names, pick_device, refuse_foreign, save_summary, say)
from fsdp2bench.data import load_tokens
from fsdp2bench.isolation import Interrupted, launcher_keeps_to_one_thread
from fsdp2bench.model import CPU_DEFAULT_MODEL, GPU_DEFAULT_MODEL, max_positions
from fsdp2bench.names import INTENDED, MIB, VARIANTS
from fsdp2bench.probes import (BATCH, BLOCK, BLOCK_STEP, LAYOUT, ProbeRunner, Question, block_step, heaviest_rank,
                               leaders_of, search_for)
from fsdp2bench.runner import TrainConfig
from fsdp2bench.series import PROBE_STEPS
from fsdp2bench.session import ModelFacts, model_facts, open_session, say_interrupted
from fsdp2bench.simulation import check_fake_group_available, parse_world_sizes
from fsdp2bench.step import Step
from fsdp2bench.versions import check_releases

DEFAULT_VARIANTS = f"{INTENDED[0]},accelerate"
SEED = 421  # main.py's: the weights are drawn the same way
DEFAULT_UPPER = {BATCH: 4096, BLOCK: 1 << 20}  # the block's is lowered to the model's positions
# A CPU has no cap, so a search there runs to its upper bound: kept small, so that checking the search is quick.
CPU_UPPER = {BATCH: 8, BLOCK: 1024}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(__doc__.splitlines()[0], [
        ("python3 plan.py --world_size 8,64 --gpu_memory 24", "one process plays each rank it probes"),
        ("python3 plan.py --device cpu --world_size 2 --inject_oom_above 3", "a CPU has no cap: an edge injected")],
        "docs/plan.md")
    p.add_argument("--model", default=None,
                   help=f"a preset or a local directory with config.json (default: {GPU_DEFAULT_MODEL} "
                        f"on a GPU, {CPU_DEFAULT_MODEL} on a CPU run)")
    p.add_argument("--world_size", default="8", metavar="N[,N...]",
                   help="the world sizes N to plan for, each played by one simulated rank (default: 8)")
    p.add_argument("--gpu_memory", type=float, default=None, metavar="GIB",
                   help="the GPU's memory, GIB GiB, made real on this one: the probes' allocator gets it less the "
                        "CUDA context (default: this GPU's)")
    p.add_argument("--sets", default=",".join(options.PLUGIN_SETS),
                   help=f"comma-separated option sets of matrix.py ({', '.join(options.OPTION_SETS)}), or "
                        f"{options.EACH} for every one of them (default: {','.join(options.PLUGIN_SETS)})")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated variants ({', '.join(VARIANTS)}) (default: {DEFAULT_VARIANTS})")
    p.add_argument("--find", choices=[BATCH, BLOCK, LAYOUT], default=BATCH,
                   help=f"what to find the largest of: {BATCH} at each --block_size, or {BLOCK} at the fixed "
                        f"--batch_size; or {LAYOUT}: which layout and levers fit one N at --block_size and "
                        f"--global_batch, ranked by projected speed (docs/plan.md) (default: {BATCH})")
    p.add_argument("--block_size", default="128", metavar="L[,L...]",
                   help=f"tokens per sequence L, a list allowed; with --find {BLOCK} the search's lower bound "
                        f"(default: 128)")
    p.add_argument("--batch_size", type=int, default=1,
                   help=f"sequences per microbatch with --find {BLOCK} (default: 1)")
    p.add_argument("--upper_bound", type=int, default=None,
                   help=f"the largest value tried (default: {DEFAULT_UPPER[BATCH]} for a batch, the model's "
                        f"positions for a block)")
    p.add_argument("--init_device", choices=["cpu", "cuda"], default="cpu",
                   help="where each probe builds its model, as main.py's option (default: cpu)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when a GPU is present; on a CPU run probes have no cap and run one at a "
                        "time (default: auto)")
    p.add_argument("--output_dir", default="out_plan",
                   help="plan.json here, each probe's trace in <output_dir>/probes/ (default: out_plan)")
    arguments.add_step_options(p)
    arguments.add_checkpointing_options(arguments.add_lever_options(
        p, "Levers under every set (docs/levers.md): over the config's options; a set's own options win"))
    arguments.add_config_option(p, "the options each set is put over (a set's own options win)")
    add_layout_options(p)
    p.add_argument("--inject_oom_above", type=int, default=None, metavar="V",
                   help="test option: every probe above V runs out of memory at its first step (default: off)")
    return p.parse_args(argv)


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
                   help="GB/s per direction per GPU WITHIN a node of 8 and ACROSS nodes, or a JSON FILE with "
                        "node_size, within_gbps, across_gbps (default: 450,50: NVLink 4, 400 Gb/s RDMA)")
    g.add_argument("--max_timings", type=int, default=12,
                   help="timing launches at most, one simulated rank alone on the device each (default: 12)")
    g.add_argument("--confirm", type=int, default=3, metavar="ROWS",
                   help="time the ranked candidates on top until the first ROWS are measured, not estimated "
                        "(default: 3)")
    g.add_argument("--time_budget_s", type=float, default=420.0, metavar="SECONDS",
                   help="no timing starts after SECONDS of timings; the first always runs (default: 420)")


NUMBER_RANGES = {"global_batch": (1, 1 << 24), "global_batch_tokens": (1, 1 << 40), "max_timings": (1, 1000),
                 "confirm": (1, 1000), "time_budget_s": (0, 1 << 20),
                 "batch_size": (1, 1 << 16), "upper_bound": (1, 1 << 20), "gpu_memory": (0.001, 1 << 20),
                 "inject_oom_above": (0, 1 << 20), "ac_every": arguments.NUMBER_RANGES["ac_every"]}


@dataclass
class Checked:
    """A plan that can run: what to search, on which model, under which cap."""
    args: argparse.Namespace
    sets: list[str]
    sizes: list[int]
    variants: list[str]
    blocks: list[int]
    upper: int
    facts: ModelFacts
    cap: concurrency.GpuCap | None
    skipped: list[str]
    base: options.FsdpOptions  # what each set's options are put over: the loop, the loss and the user's config
    config: accelerate_config.ConfigOptions | None


def validate(argv: list[str] | None = None) -> Checked | layout_plan.CheckedSearch:
    """Everything plan.py refuses, in one line, before any probe runs; an option the user's config set is named by
    its field there."""
    launcher_keeps_to_one_thread()
    args = parse_args(argv)
    try:
        return checked_plan(args)
    except UserError as error:
        raise accelerate_config.with_fields(error, getattr(args, "config_fields", {})) from None


def checked_plan(args: argparse.Namespace) -> Checked | layout_plan.CheckedSearch:
    check_releases()
    if check_launcher_env()[1] != 1:
        raise UserError("plan.py is one process that plays every rank: run it with python3, not a launcher")
    check_ranges(args, NUMBER_RANGES)
    if args.find == LAYOUT:
        return layout_plan.checked(args)
    sets = options.parse_sets(args.sets, "--sets")
    sizes = parse_world_sizes(args.world_size, "--world_size")
    variants = parse_names(args.variants, "--variants", VARIANTS)
    blocks = sorted(set(parse_block_sizes(args.block_size)))
    if args.find == BLOCK and len(blocks) > 1:
        raise UserError(f"--block_size {args.block_size}: with --find {BLOCK} it is the search's lower bound, one "
                        f"value (a list is for --find {BATCH}, one answer per block)")
    check_fake_group_available()
    device = pick_device(args.device)
    if device.type != "cuda" and args.gpu_memory is not None:
        raise UserError("--gpu_memory needs a GPU (this run is on the CPU, where a probe has no cap)")
    if args.init_device == "cuda" and device.type != "cuda":
        raise UserError("--init_device cuda needs a GPU (this run is on the CPU)")
    if args.find == BATCH and args.batch_size != 1:
        raise UserError(f"--batch_size is the fixed batch of --find {BLOCK}; with --find {BATCH} it is searched")
    check_output_dir(args.output_dir, "plan.json")
    refuse_foreign([plan_path(args)], "--output_dir")
    if device.type != "cuda":
        say(f"A CPU plan has no memory cap: nothing runs out of memory there unless --inject_oom_above says so, so it "
            f"finds no edge (each answer is its upper bound, {CPU_UPPER[args.find]} unless --upper_bound says) and "
            f"only checks the search{'' if args.model else f', on the {CPU_DEFAULT_MODEL} model'}. A real answer "
            f"needs a GPU: python3 plan.py --world_size 8,64 --gpu_memory 24")
    args.model = args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)
    config = accelerate_config.read(args.config_file)
    levers_given = {name: getattr(args, name) for name in ("activation_checkpointing", *options.LEVER_OPTIONS)
                    if getattr(args, name) is not None}
    sources = {**(dict.fromkeys(config.values, "config") if config else {}), **dict.fromkeys(levers_given, "flag")}
    args.config_fields = accelerate_config.fields_said(config, sources)
    base = options.FsdpOptions(step=chosen_step(args)).over(config.values if config else {}).over(levers_given)
    options.check(base)
    arguments.check_context_parallel_device(base.layout.cp_size, device.type)  # the config's CP, before the sets
    facts = model_facts(args.model, SEED, lambda model: check_blocks(blocks, model))
    arguments.check_wrapped_classes(config, facts.layer_classes)
    arguments.check_step(base, facts.config, device.type)
    upper = search_upper(args, facts.config, blocks, device.type)
    check_block_steps(args, base, sets, blocks, upper)
    cap = concurrency.gpu_cap(args.gpu_memory, device.index) if device.type == "cuda" else None
    refused = {name: why for name in sets
               if (why := layout_refusal(args, set_options(base, name), blocks, facts.config, device.type))}
    if len(refused) == len(sets):
        raise UserError(f"--sets {args.sets}: none can be planned here: "
                        + "; ".join(f"{name}: {why}" for name, why in refused.items()))
    sets = [name for name in sets if name not in refused]
    skipped = [f"{name}: not planned ({why})" for name, why in refused.items()]
    fits_at = {name: [n for n in sizes if set_options(base, name).layout.fits(n)] for name in sets}
    skipped += [f"{name}: not planned at N = {', '.join(str(n) for n in sizes if n not in fits_at[name])} "
                "(its layout's sizes do not divide N)" for name in sets if fits_at[name] != sizes]
    if not any(fits_at.values()):
        raise UserError(nothing_fits(args, base, config, sizes))
    return Checked(args, sets, sizes, variants, blocks, upper, facts, cap, skipped, base, config)


def nothing_fits(args: argparse.Namespace, base: options.FsdpOptions, config: accelerate_config.ConfigOptions | None,
                 sizes: list[int]) -> str:
    """Why no set can be planned at any N, blaming what set the layout: the user's config, where its own sizes fit
    none of them, else the sets."""
    layout_fields = {k: v for k, v in (config.values if config else {}).items() if k in options.LAYOUT_OPTIONS}
    if layout_fields and not any(base.layout.fits(n) for n in sizes):
        said = ", ".join(f"{accelerate_config.FIELDS[k]} {v}" for k, v in layout_fields.items())
        return (f"{config.source}: its layout ({said}) fits none of --world_size {args.world_size}: its sizes must "
                f"multiply to N, or divide it; give a --world_size it fits, or plan without --config_file")
    return (f"--sets {args.sets}: none can run at --world_size {args.world_size} (a set's layout must divide N: an "
            f"HSDP set's {options.NODE_RANKS} shards, a TP or CP set's sizes)")


def layout_refusal(args: argparse.Namespace, chosen: options.FsdpOptions, blocks: list[int], config,
                   device_type: str) -> str | None:
    """Why a set's layout cannot run this model here (it is skipped, and said so): at each fixed block, or, with
    --find block_size, at any (the search keeps to the multiples of what CP needs)."""
    tried = blocks if args.find == BATCH else [chosen.layout.sequence_divisor]
    return next((why for block in tried if (why := arguments.layout_refusal(chosen, config, block, device_type))),
                None)


def chosen_step(args: argparse.Namespace) -> Step:
    return Step(loop=args.loop, loss=args.loss)


def set_options(base: options.FsdpOptions, name: str) -> options.FsdpOptions:
    """An option set's options put over ``base``: the loop and the loss asked for, and the user's config."""
    return base.over(options.OPTION_SETS[name].changed())


def parse_block_sizes(text: str) -> list[int]:
    try:
        blocks = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--block_size: expected comma-separated integers, got {text!r}") from None
    low, high = arguments.NUMBER_RANGES["block_size"]
    bad = [b for b in blocks if not low <= b <= high]
    if bad:
        raise UserError(f"--block_size must be in [{low}, {high}], got {bad[0]}")
    return blocks


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


def questions_of(checked: Checked) -> tuple[dict, dict]:
    """Every (option set, N, variant, block or batch) to answer, and a search for each."""
    questions, searches = {}, {}
    shapes = checked.facts.shapes
    fixed_values = checked.blocks if checked.args.find == BATCH else [checked.args.batch_size]
    for name in checked.sets:
        chosen = set_options(checked.base, name)
        for n in [n for n in checked.sizes if chosen.layout.fits(n)]:
            for variant in checked.variants:
                for fixed in fixed_values:
                    rank = heaviest_rank(shapes, n, variant, chosen)
                    q = Question(name, n, rank, variant, checked.args.find, fixed, checked.base)
                    lower = 1 if checked.args.find == BATCH else -(-min(checked.blocks) // q.unit)
                    key = (name, n, variant, fixed)
                    questions[key] = q
                    searches[key] = search_for(q, lower, checked.upper // q.unit, checked.cap, checked.facts.config)
    return questions, searches


def run(argv: list[str] | None = None) -> int:
    started = time.time()
    checked = validate(argv)
    if isinstance(checked, layout_plan.CheckedSearch):
        return layout_plan.run(checked, started)
    args = checked.args
    session = open_session(checked.facts, args.device, args.output_dir, "plan.json")
    questions, searches = questions_of(checked)
    cores = arguments.build_threads()
    train = TrainConfig(seed=SEED, learning_rate=3e-5, log_interval=0.01, save_memory_snapshot=False,
                        tracker_overhead=False, inject_failure=None,
                        init_device=args.init_device if session.device.type == "cuda" else "cpu", build_threads=cores,
                        compute_threads=max(1, cores // 4),
                        weights=weights.create() if args.init_device == "cpu" else None, quiet=True,
                        allocator_limit=checked.cap.allocator_bytes if checked.cap else None)
    tokens = load_tokens(None, None, session.config.vocab_size)
    runner = ProbeRunner(session, train, tokens, questions, searches, checked.cap, args.output_dir,
                         args.inject_oom_above, leaders_of(questions, searches, session.shapes))
    meta = plan_meta(checked, session, started)
    line = accelerate_config.said(checked.config, {}, args)
    if line:
        say(line)
    for note in checked.skipped:
        print(f"Skipped: {note}", flush=True)
    say(f"Planning {len(searches)} answers ({args.find} per option set, N and variant): a shared process per "
        f"option set and N measures a few values, then fresh probes confirm each edge (another variant starts at "
        f"the first one's), {PROBE_STEPS} steps of one simulated rank each{cap_said(checked.cap)}...")
    landed: dict = {}  # each landed answer's time

    def save(interrupted: bool = False) -> dict:
        """plan.json as it stands: after every probe, so that an interrupt or a failure loses none."""
        meta.update(wall_s=time.time() - started)
        plan = fitting.plan_record(meta, questions, searches, runner.probes, runner.shared_records(),
                                   runner.stood_down, interrupted)
        save_summary(plan_path(args), plan)
        if not interrupted:
            say_landed(plan, questions, searches, landed, time.time() - started)
        return plan

    # A shared process for each answer that leads its set, N and fixed value; shares learned within a set
    planner = fitting.Planner(searches, group=lambda key: key[0], unready=set(searches) - set(runner.leaders),
                              leaders=runner.leaders)
    try:
        runner.run_plan(planner, save)
    except Interrupted as exc:
        ended = save(interrupted=True)["meta"]["probes"]
        return say_interrupted(session, exc, f"; the {ended} probe(s) that ended are in {plan_path(args)}" if ended
                               else f"; no probe had ended ({plan_path(args)} says what was planned)")
    return said_plan(save(), args)


def said_plan(plan: dict, args: argparse.Namespace) -> int:
    """The plan's table, where it is drawn, its findings and what failed; the exit code."""
    fitting.print_plan(plan)
    drawn = any(o["fits"] for a in plan["answers"] for o in a["outcomes"] + a.get("shared", []))
    hint = f"draw it with:\n    python3 visualize.py --dir {shlex.quote(args.output_dir)}" if drawn else \
        "no probe fit, so there is nothing to draw"
    print(f"Wrote {plan_path(args)}; {hint}", flush=True)
    findings = [a["error"] for a in plan["answers"] if fitting.unsupported(a)]  # each names its probe
    if findings:  # as main.py and matrix.py report the same layout: a finding, the run not failed
        say(f"unsupported by the installed libraries (a finding, not a failure of the plan): {len(findings)} "
            f"answer(s): {'; '.join(findings)}")
    failed = [a["error"] for a in plan["answers"] if a["error"] and not fitting.unsupported(a)]
    if failed:  # last: the answers the plan could not give
        print(f"FAILED: {len(failed)} answer(s): {'; '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def say_landed(plan: dict, questions: dict, searches: dict, landed: dict, elapsed: float) -> None:
    """A line for each answer that has just landed: the running count, and the time left at the pace of the
    answers since the first (a rough estimate: before it, the shared processes take a time of their own,
    and the answers left may take more or fewer probes)."""
    answers = dict(zip(searches, plan["answers"]))
    for key in [key for key, search in searches.items() if search.done and key not in landed]:
        landed[key] = elapsed
        a, left = answers[key], len(searches) - len(landed)
        value = f"failed ({a['error']})" if a["error"] else f"{'B' if a['searched'] == BATCH else 'L'} = " \
            f"{a['largest'] or 'nothing fits'}"
        pace = (elapsed - min(landed.values())) / (len(landed) - 1) if len(landed) > 1 else None
        eta = f", about {pace * left:.0f} s left" if left and pace is not None else ""
        print(f"[answer {len(landed)}/{len(searches)}] {questions[key].title}: {value} "
              f"({a['probes']} probes; {elapsed:.0f} s{eta})", flush=True)


def plan_path(args: argparse.Namespace) -> str:
    return os.path.join(args.output_dir, "plan.json")


def cap_said(cap: concurrency.GpuCap | None) -> str:
    if cap is None:
        return " (a CPU run: no cap, the probes find only the out-of-memory errors injected or raised)"
    return (f" under a cap of {cap.gib:g} GiB (the allocator gets {cap.allocator_bytes / MIB:.0f} MiB beside "
            f"{cap.context / MIB:.0f} MiB of CUDA context)")


def plan_meta(checked: Checked, session, started: float) -> dict:
    args = checked.args
    return {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "model": args.model, "num_parameters": session.num_parameters, "device": session.device.type,
            "versions": arguments.versions(), "find": args.find, "sets": checked.sets, "world_sizes": checked.sizes,
            "variants": checked.variants, "block_sizes": checked.blocks, "batch_size": args.batch_size,
            "loop": args.loop, "loss": args.loss,
            "upper_bound": checked.upper, "probe_steps": PROBE_STEPS, "init_device": args.init_device,
            "gpu_memory": checked.cap.as_dict() if checked.cap else None, "skipped": checked.skipped,
            "option_sets": {name: options.OPTION_SETS[name].changed() for name in checked.sets},
            "options_from": accelerate_config.summary_of(checked.config, {k: "config" for k in
                                                                          (checked.config.values if checked.config
                                                                           else {})})}


def main() -> None:
    exit_with(run)


if __name__ == "__main__":
    main()
