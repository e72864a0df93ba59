"""FSDP2 memory and convergence benchmark: four ways to combine an optimizer with fully_shard.

Launch with ``torchrun --nproc_per_node N main.py`` or ``accelerate launch main.py``
(plain ``python main.py`` runs one rank). See docs/options.md and docs/output.md for every option and output.

Where things are: the four variants and the fix in ``utils.py``; the command line and its checks
in ``fsdp2bench/run/arguments.py``; the parallel layout in ``fsdp2bench/options/layout.py``; the memory tracker in
``measure.py``; one variant's training in ``fsdp2bench/train/runner.py``; failures, interrupts and
fresh processes in ``fsdp2bench/processes/isolation.py``; the summary and checks in ``fsdp2bench/report/summary.py``.
"""

from __future__ import annotations

import sys

from fsdp2bench.processes.first import one_line_interrupts

if __name__ == "__main__":  # before any other import: a Ctrl-C from here on is one line, never a traceback
    one_line_interrupts()

from fsdp2bench.processes.starting import CANCELLED, start_before_imports, wait_for_turn

if __name__ == "__main__":  # ahead of the imports below, on purpose: the fork server's overlap them
    start_before_imports(sys.argv[1:])

import argparse
import dataclasses
import time

import psutil

from fsdp2bench.cli import exit_with, say
from fsdp2bench.memory import estimate
from fsdp2bench.options import accelerate_config, fsdp as options
from fsdp2bench.options.levers import FLOAT8_EAGER
from fsdp2bench.processes import simulation
from fsdp2bench.processes.isolation import Interrupted
from fsdp2bench.run import concurrency
from fsdp2bench.run.arguments import build_threads, per_optimizer_step, validate, versions
from fsdp2bench.run.session import Session, open_session, say_interrupted
from fsdp2bench.run.suite import Suite, run_sweep, run_variants
from fsdp2bench.train import weights
from fsdp2bench.train.runner import TrainConfig


def variants_at_once(args: argparse.Namespace, session: Session, names: list[str],
                     fsdp_options: options.FsdpOptions, cap: estimate.GpuCap | None,
                     shared_weights: bool) -> tuple[int, concurrency.SweepRoom | None]:
    """``--concurrent_variants``: a number as given; auto: for a sweep on a GPU, each run as its own need
    allows when it starts (``SweepRoom``), else decided by rank 0 for every rank (the variants' groups must be
    the same on all of them; a sweep's processes each run their own share)."""
    if args.concurrent_variants != "auto":
        return int(args.concurrent_variants), None
    sizes = simulation.parse_world_sizes(args.simulate_world_size) if args.simulate_world_size else None
    tokens = estimate.step_bytes(args.batch_size, args.block_size, session.config, fsdp_options)
    room = concurrency.sweep_room(session.shapes, sizes, names, args.init_device, fsdp_options, tokens, cap,
                                  shared_weights) if sizes and session.device.type == "cuda" else None
    if room is not None:
        k, reason = room.most, room.said()
    elif sizes:  # sized by the smallest N, whose runs hold the most
        k, reason = concurrency.decide(session.shapes, min(sizes), names, args.init_device, session.device.type,
                                       fsdp_options, len(names) * len(sizes), tokens, cap)
    else:
        decision = concurrency.decide(session.shapes, session.world_size, names, args.init_device, session.device.type,
                                      fsdp_options, len(names), tokens, cap) if session.rank == 0 else None
        k, reason = concurrency.agree(session.store, session.rank, decision)
    if session.rank == 0 and session.device.type == "cuda":
        say(f"{'Runs' if sizes else 'Variants'} at a time: {reason} (--concurrent_variants K chooses)")
    return k, room


def run(argv: list[str] | None = None) -> int:
    # Seconds since the epoch, so that speed.py can split the launch's wall time.
    timeline = {"process_created": psutil.Process().create_time(), "main_started": time.time()}
    checked = validate(argv)
    args, names, fsdp_options, batches = checked.args, checked.names, checked.fsdp_options, checked.batches
    # Started by matrix.py ahead of its turn, and checked: it waits here, having written nothing (a
    # Ctrl-C meanwhile ends it in one line: starting.start_before_imports).
    turn = wait_for_turn()
    if turn == CANCELLED:  # matrix.py ends before this launch's turn, and says why
        return 0
    if turn is not None:
        timeline["turn_came"] = time.time()
    session = open_session(checked.facts, args.device, args.output_dir, "summary.json")
    meta = {"run_id": session.run_id, "world_size": session.world_size, "device": session.device.type,
            "init_device": args.init_device if session.device.type == "cuda" else "cpu",
            "versions": versions(),
            "model": args.model, "model_type": session.config.model_type, "num_parameters": session.num_parameters,
            "steps_per_variant": len(batches), "fsdp_options": dataclasses.asdict(fsdp_options),
            "loop": fsdp_options.step.loop, "loss": fsdp_options.step.loss,
            "options_from": accelerate_config.summary_of(checked.config, args.option_sources),
            "per_optimizer_step": per_optimizer_step(args, fsdp_options, session.world_size),
            "gpu_memory": checked.cap.as_dict() if checked.cap else None,
            "emulated_links": vars(checked.links) if checked.links else None,
            "args": {k: (v if k != "inject_failure" or v is None else vars(v)) for k, v in vars(args).items()}}
    shared = weights.create() if args.init_device == "cpu" else None
    concurrent, room = variants_at_once(args, session, names, fsdp_options, checked.cap, shared is not None)
    cores = build_threads()
    meta["concurrent_variants"] = concurrent
    meta["threads_per_variant"] = max(1, cores // concurrent)
    train = TrainConfig(seed=args.seed, learning_rate=args.learning_rate, log_interval=args.log_interval,
                        save_memory_snapshot=args.save_memory_snapshot, tracker_overhead=args.tracker_overhead,
                        inject_failure=args.inject_failure, init_device=args.init_device, build_threads=cores,
                        compute_threads=meta["threads_per_variant"],
                        weights=shared, quiet=args.quiet,
                        options=fsdp_options, allocator_limit=checked.cap.allocator_bytes if checked.cap else None,
                        links=checked.links)
    suite = Suite(session, names, train, batches, meta, args.output_dir, concurrent,
                  {"meta": {**meta, "timeline": timeline}}, room)
    line = accelerate_config.said(checked.config, args.option_sources, args)
    if session.rank == 0 and line:
        say(line)
    if session.rank == 0 and checked.cap is not None and checked.cap.said():
        say(checked.cap.said())
    if session.rank == 0 and fsdp_options.float8 and not fsdp_options.compile:
        say(FLOAT8_EAGER)
    if session.rank == 0 and session.device.type == "cpu":
        print(f"Running on CPU{'' if args.simulate_world_size else ' with gloo'}: a functional run. Allocator "
              "figures are n/a; RSS is host memory, not GPU memory.")
    if session.rank == 0 and args.save_memory_snapshot and session.device.type == "cpu":
        print("warning: --save_memory_snapshot needs CUDA; no snapshot is written on CPU.")
    timeline["variants_started"] = time.time()
    try:
        if args.simulate_world_size:
            sizes = simulation.parse_world_sizes(args.simulate_world_size)
            return run_sweep(suite, sizes, simulation.parse_ranks(args.simulate_rank, sizes))
        return run_variants(suite)
    except Interrupted as exc:  # while waiting for the other ranks, after this rank's results were written
        return say_interrupted(session, exc, f" while waiting for the other ranks; results so far are in "
                                             f"{args.output_dir}/")


def main() -> None:
    exit_with(run)


if __name__ == "__main__":
    main()
