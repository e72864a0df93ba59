"""``plan.py --find layout``: its checks of the command line (one line, exit 2, nothing written) and its run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from fsdp2bench import arguments, concurrency, levers as lever_checks
from fsdp2bench.candidates import (COMPILE, FLOAT8, LEVER_NAMES, Levers, candidates_of, layouts_of, parse_levers)
from fsdp2bench.cli import (UserError, check_output_dir, is_ours, pick_device, prepare_output_dir, refuse_foreign,
                            say)
from fsdp2bench.layout_report import CONFIG_NAME, print_search, winner_said, write_search
from fsdp2bench.layout_search import Setup, assess
from fsdp2bench.layout_timing import choose_and_time
from fsdp2bench.model import CPU_DEFAULT_MODEL, GPU_DEFAULT_MODEL
from fsdp2bench.options import FsdpOptions
from fsdp2bench.session import model_facts
from fsdp2bench.simulation import check_fake_group_available, parse_world_sizes
from fsdp2bench.starting import interrupts_raise
from fsdp2bench.step import LIGER, Step, check_liger
from fsdp2bench.traffic import parse_links

SEED = 421


@dataclass(frozen=True)
class CheckedSearch:
    """A layout search that can run: its setup, its candidates and what was left out and why."""
    setup: Setup
    candidates: list
    notes: list[str]
    args: argparse.Namespace


def checked(args: argparse.Namespace) -> CheckedSearch:
    """Everything the layout search refuses, before anything runs."""
    world_size = one_value(parse_world_sizes(args.world_size, "--world_size"), "--world_size", args.world_size)
    block = one_value([int(b) for b in block_sizes(args.block_size)], "--block_size", args.block_size)
    check_fake_group_available()
    device = pick_device(args.device)
    if device.type != "cuda" and args.gpu_memory is not None:
        raise UserError("--gpu_memory needs a GPU (this run is on the CPU, where a probe has no cap)")
    check_output_dir(args.output_dir, "plan.json")
    refuse_foreign([f"{args.output_dir}/plan.json"], "--output_dir")
    check_config_path(args.output_dir)
    model = args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)
    facts = model_facts(model, SEED, lambda config: arguments.check_positions(block, config))
    sequences = global_sequences(args, block)
    chosen, notes = available_levers(args.levers, device.type, facts.config)
    layouts, refused = layouts_of(world_size, facts.config, block, device.type)
    splits = sorted({d.data_ranks for d in layouts}, reverse=True)
    if not any(sequences % ranks == 0 for ranks in splits):
        raise UserError(f"--global_batch {sequences} sequences: no layout of N = {world_size} splits it evenly "
                        f"(their data-parallel ranks, {', '.join(map(str, splits))}, each leave a remainder)")
    base = FsdpOptions(step=Step(loop=args.loop, loss=args.loss))
    cap = concurrency.gpu_cap(args.gpu_memory, device.index) if device.type == "cuda" else None
    setup = Setup(model, world_size, block, sequences, facts.shapes, facts.config, base, cap, parse_links(args.links),
                  device.type, gpu_name() if device.type == "cuda" else None, args.output_dir, args.max_timings,
                  args.init_device, sum(_count(p.shape) for p in facts.shapes), args.confirm, args.time_budget_s)
    return CheckedSearch(setup, candidates_of(layouts, chosen, sequences, device.type), notes + refused, args)


def check_config_path(output_dir: str) -> None:
    """accelerate_config.json carries no mark of this benchmark (accelerate's loader refuses an unknown key): one
    already there is replaced only beside this benchmark's plan.json, as a file."""
    path, plan = os.path.join(output_dir, CONFIG_NAME), os.path.join(output_dir, "plan.json")
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path) or not is_ours(plan)):
        raise UserError(f"--output_dir: {path} is there and this run would replace it (it is not beside a plan.json "
                        "of this benchmark); it is left untouched: move it away or choose another --output_dir")


def _count(shape: tuple) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def one_value(values: list[int], flag: str, text: str) -> int:
    if len(values) != 1:
        raise UserError(f"{flag} {text}: the layout search plans one value (run it once per value)")
    return values[0]


def block_sizes(text: str) -> list[str]:
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise UserError(f"--block_size: expected comma-separated integers, got {text!r}")
    low, high = arguments.NUMBER_RANGES["block_size"]
    if any(not low <= int(p) <= high for p in parts):
        raise UserError(f"--block_size must be in [{low}, {high}], got {text}")
    return parts


def global_sequences(args: argparse.Namespace, block: int) -> int:
    """The global batch in sequences: given as such, or in tokens that make whole sequences."""
    if (args.global_batch is None) == (args.global_batch_tokens is None):
        raise UserError("--find layout needs one of --global_batch (sequences per optimizer step over all ranks) "
                        "and --global_batch_tokens")
    if args.global_batch is not None:
        return args.global_batch
    if args.global_batch_tokens % block:
        raise UserError(f"--global_batch_tokens {args.global_batch_tokens} is not a whole number of "
                        f"--block_size {block} sequences")
    return args.global_batch_tokens // block


def available_levers(text: str | None, device_type: str, config) -> tuple[Levers, list[str]]:
    """The levers searched: those named (each must run here, else one line says why), or every one that runs
    here, the others left out with the reason."""
    named = parse_levers(text or ",".join(LEVER_NAMES))
    checks = {COMPILE: lambda: lever_checks.check(FsdpOptions(compile=True), device_type, 1),
              FLOAT8: lambda: lever_checks.check_float8(device_type),
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
    return dataclasses.replace(named, losses=tuple(l for l in named.losses if l not in drop),
                               compile=(False,) if COMPILE in drop else named.compile,
                               float8=(False,) if FLOAT8 in drop else named.float8), notes


def gpu_name() -> str | None:
    """The GPU's name from nvidia-smi (this process never initialises CUDA), for its peak FLOP/s."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=True).stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def run(search: CheckedSearch, started: float) -> int:
    """Assess every candidate, time the most promising, rank, print and write plan.json."""
    interrupts_raise()  # a Ctrl-C or SIGTERM raises: during the timings what they measured is still written
    setup = search.setup
    prepare_output_dir(setup.output_dir)
    found = [assess(c, setup) for c in search.candidates]
    out = sum(f.fits is False for f in found)
    near = sum(f.fits is None for f in found)
    say(f"{len(found)} candidates of N = {setup.world_size} at {setup.global_sequences} x {setup.block} tokens a "
        f"step: {out} over the cap by the memory model's estimate (not run), {near} "
        + ("near it" if setup.cap else "that a CPU run cannot place (no cap)")
        + f", {len(found) - out - near} well under it; timing the most promising one at a time...")
    timings: list[dict] = []
    try:
        choose_and_time(found, setup, say, timings)
    except KeyboardInterrupt as exc:
        meta = run_meta(setup, started, interrupted=True)
        path = write_search(found, setup, search.notes, timings, meta, winner_said(found, setup))
        print(f"Interrupted ({str(exc) or 'SIGINT'}); the {len(timings)} timing(s) that ended are ranked in {path}",
              file=sys.stderr, flush=True)
        return 130
    said = winner_said(found, setup)
    print_search(found, setup, search.notes, timings, said)
    path = write_search(found, setup, search.notes, timings, run_meta(setup, started, interrupted=False), said)
    print(f"Wrote {path}; draw it with:\n    python3 visualize.py --dir {setup.output_dir}", flush=True)
    return 0


def run_meta(setup: Setup, started: float, interrupted: bool) -> dict:
    return {"command": " ".join(sys.argv), "model": setup.model, "world_size": setup.world_size,
            "block_size": setup.block, "global_batch": setup.global_sequences, "device": setup.device_type,
            "gpu_name": setup.gpu_name, "gpu_memory": setup.cap.as_dict() if setup.cap else None,
            "versions": arguments.versions(), "wall_s": time.time() - started, "interrupted": interrupted}
