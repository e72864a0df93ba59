"""FSDP2 memory and convergence benchmark: four ways to combine an optimizer with fully_shard.

Launch with ``torchrun --nproc_per_node N main.py`` or ``accelerate launch main.py``
(plain ``python main.py`` runs one rank). See README.md for every option and output.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

import report
import utils
import simulation
from isolation import (Interrupted, Piece, StoreKeys, catch_interrupts, gather_records, launcher_env, leave_together,
                       run_isolated, start_child_server)
from measure import write_json
from memory_model import PROJECTION_WORLD_SIZES, param_shapes
from runner import Job, variant_process
from utils import VARIANTS, UserError


@dataclass
class FailureSpec:
    name: str
    step: int
    rank: int
    kill: bool


def parse_failure(text: str) -> FailureSpec:
    parts = text.split(":")
    try:
        if len(parts) not in (3, 4) or parts[0] not in VARIANTS or (len(parts) == 4 and parts[3] != "kill"):
            raise ValueError
        return FailureSpec(parts[0], int(parts[1]), int(parts[2]), len(parts) == 4)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected VARIANT:STEP:RANK[:kill] with a known variant, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = utils.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default="out", help="where the JSON files go (default: out)")
    p.add_argument("--save_memory_snapshot", action="store_true",
                   help="also write <run>_memory_snapshot.pkl for pytorch.org/memory_viz (CUDA only)")
    p.add_argument("--batch_size", type=int, default=2, help="sequences per rank per step (default: 2)")
    p.add_argument("--block_size", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--dataset_fraction", type=float, default=1.0,
                   help="fraction of the dataset's blocks to use, in (0, 1] (default: 1.0)")
    p.add_argument("--learning_rate", type=float, default=3e-5, help="AdamW learning rate (default: 3e-5)")
    p.add_argument("--seed", type=int, default=421, help="seed for the initial weights (default: 421)")
    p.add_argument("--max_steps", type=int, default=None, help="stop each variant after this many steps "
                   "(default: one pass over the data)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated run names, run in the order given (default: all four)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when a GPU is present, else CPU with gloo (default: auto)")
    p.add_argument("--model", default="qwen2.5-1.5b",
                   help=f"preset ({', '.join(utils.PRESETS)}), a local directory with config.json, "
                        "or a Hub id (default: qwen2.5-1.5b)")
    p.add_argument("--dataset", default=None, help="local text file (default: built-in text)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory or Hub id for --dataset (default: bytes)")
    p.add_argument("--log_interval", type=float, default=0.01,
                   help="seconds between memory samples (default: 0.01)")
    p.add_argument("--concurrent_variants", type=int, default=1, metavar="K",
                   help="run K variants at a time, each in its own processes and process group; their memory "
                        "figures do not change (each process has its own allocator), step times do. Needs K "
                        "times the memory of one variant on every GPU (default: 1, one after the other)")
    p.add_argument("--tracker_overhead", action="store_true",
                   help="pause memory polling on every other step, to measure what polling costs")
    p.add_argument("--simulate_world_size", default=None, metavar="N[,N...]",
                   help="measure one rank of a world of N instead of this launch's: one process plays that rank "
                        "on a fake process group (real allocations, no communication, losses meaningless). "
                        "Several N make a sweep, shared out among this launch's processes (default: off)")
    p.add_argument("--simulate_rank", default="0", metavar="R[,R...]",
                   help="with --simulate_world_size: the rank(s) to play, integers in [0, N) or 'last' for N-1; "
                        "'last' is skipped where the sharding rule gives it the bytes of a rank already played "
                        "(default: 0)")
    p.add_argument("--inject_failure", type=parse_failure, default=None, metavar="VARIANT:STEP:RANK[:kill]",
                   help="test option: raise (or, with :kill, die by SIGKILL) on that rank before that step")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """Refuse what cannot work before any process or model exists; return the variant list."""
    for flag in ("batch_size", "block_size"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.concurrent_variants <= 0:
        raise UserError(f"--concurrent_variants must be a positive integer, got {args.concurrent_variants}")
    if args.max_steps is not None and args.max_steps <= 0:
        raise UserError(f"--max_steps must be a positive integer, got {args.max_steps}")
    if not 0 < args.dataset_fraction <= 1:
        raise UserError(f"--dataset_fraction must be in (0, 1], got {args.dataset_fraction}")
    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        raise UserError(f"--learning_rate must be a positive number, got {args.learning_rate}")
    if not args.log_interval > 0:
        raise UserError(f"--log_interval must be positive, got {args.log_interval}")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise UserError(f"--variants: unknown name(s) {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(VARIANTS)}")
    if len(set(names)) != len(names):
        raise UserError("--variants: a name is given twice")
    if args.dataset is not None and not os.path.isfile(args.dataset):
        raise UserError(f"--dataset {args.dataset}: no such file")
    if args.simulate_world_size is not None:
        sizes = simulation.parse_world_sizes(args.simulate_world_size)
        simulation.parse_ranks(args.simulate_rank, sizes)
        simulation.check_fake_group_available()
        if args.max_steps is None:
            args.max_steps = simulation.DEFAULT_STEPS
    return names


def versions() -> dict:
    import accelerate
    import transformers

    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


@dataclass
class Session:
    """What every rank has set up before the first variant starts."""
    args: argparse.Namespace
    names: list[str]
    device: torch.device
    rank: int
    world_size: int
    config: object
    batches: list
    shapes: list
    layer_classes: list[str]
    meta: dict
    store: dist.TCPStore
    summary: dict
    summary_path: str

    def job(self, name: str, keys: StoreKeys, rank: int, world_size: int, output_dir: str,
            simulated: bool = False) -> Job:
        meta = {**self.meta, "rank": rank, "world_size": world_size, "simulated": simulated}
        return Job(name, self.args, self.device, self.config, self.batches, self.layer_classes, meta, rank,
                   world_size, keys, output_dir, simulated)


def set_up(args: argparse.Namespace, timeline: dict) -> Session:
    names = check_args(args)
    device = utils.pick_device(args.device)
    rank, world_size = launcher_env()
    start_child_server(device)  # its imports overlap the set-up below
    config = utils.load_config(args.model)
    if utils.max_positions(config) and args.block_size > utils.max_positions(config):
        raise UserError(f"--block_size {args.block_size} exceeds the model's {utils.max_positions(config)} positions")
    tokens = utils.load_tokens(args.dataset, args.tokenizer)
    # A simulated rank has no peers to share the data with: every run takes the batches of a world of one.
    data_rank, data_world = (0, 1) if args.simulate_world_size else (rank, world_size)
    batches = utils.rank_batches(tokens, args.block_size, args.batch_size, args.dataset_fraction,
                                 data_rank, data_world, args.max_steps)
    utils.prepare_output_dir(args.output_dir)
    meta_model = utils.build_model(config, torch.device("meta"), args.seed)
    meta = {"rank": rank, "world_size": world_size, "device": device.type, "versions": versions(),
            "model": args.model, "model_type": config.model_type,
            "num_parameters": sum(p.numel() for p in meta_model.parameters()),
            "steps_per_variant": len(batches),
            "args": {k: (v if k != "inject_failure" or v is None else vars(v)) for k, v in vars(args).items()}}
    store, _, _ = next(dist.rendezvous("env://"))
    summary = {"meta": {**{k: v for k, v in meta.items() if k != "rank"}, "timeline": timeline}}
    return Session(args, names, device, rank, world_size, config, batches, param_shapes(meta_model),
                   utils.layer_class_names(meta_model), meta, store, summary,
                   os.path.join(args.output_dir, "summary.json"))


# --------------------------------------------------------------------------- orchestration

def run_variants(s: Session) -> int:
    """The benchmark proper: every variant on every rank, ``--concurrent_variants`` at a time."""
    s.summary.update(variants={}, checks={}, projection=None)
    any_failed = False
    for first in range(0, len(s.names), s.args.concurrent_variants):
        group = s.names[first:first + s.args.concurrent_variants]
        if s.rank == 0:
            print(f"[{', '.join(group)}] {len(s.batches)} steps on {s.world_size} rank(s)...", flush=True)
        jobs = [s.job(name, StoreKeys(name), s.rank, s.world_size, s.args.output_dir) for name in group]
        started, started_at = time.perf_counter(), time.time()
        try:
            failures = run_isolated([Piece(variant_process, (job,), job.keys) for job in jobs], s.rank,
                                    range(s.world_size), s.store, s.device)
            wall = time.perf_counter() - started  # the group's, so one figure for every variant in it
        except Interrupted as exc:
            if s.rank == 0:
                for later in s.names[first:]:
                    s.summary["variants"][later] = {"status": "interrupted" if later in group else "not run"}
                write_json(s.summary_path, s.summary)
                print(f"Interrupted ({exc}) during {', '.join(group)}; finished variants and partial traces are in "
                      f"{s.args.output_dir}/", file=sys.stderr)
            return 130
        any_failed = any_failed or any(failures)
        if s.rank == 0:
            record_group(s, jobs, failures, started_at, wall)
    return finish(s, report.print_table, any_failed)


def record_group(s: Session, jobs: list[Job], failures: list[str | None], started_at: float, wall: float) -> None:
    """Rank 0: summarise the variants that just ended and rewrite summary.json."""
    for job, failure in zip(jobs, failures):
        if failure is None:
            records = gather_records(s.store, job.keys, range(s.world_size))
            s.summary["meta"]["gpu_name"] = records[0]["gpu_name"]
            s.summary["variants"][job.name] = report.variant_summary(job.name, records, s.shapes)
            s.summary["variants"][job.name].update(process_started_at=started_at, process_wall_s=wall)
        else:
            s.summary["variants"][job.name] = {"status": f"failed: {failure}"}
            print(f"[{job.name}] FAILED: {failure}", file=sys.stderr, flush=True)
    s.summary["checks"] = report.run_checks(s.summary["variants"], s.device.type)
    s.summary["projection"] = report.projection_summary(s.shapes, s.summary["variants"], s.world_size)
    write_json(s.summary_path, s.summary)


def run_sweep(s: Session) -> int:
    """``--simulate_world_size``: each run plays one rank of N alone; the launch's processes share them."""
    sizes = simulation.parse_world_sizes(s.args.simulate_world_size)
    runs, notes = simulation.plan(sizes, simulation.parse_ranks(s.args.simulate_rank, sizes), s.names, s.shapes)
    s.summary["meta"]["simulated"] = {"world_sizes": sizes, "ranks": s.args.simulate_rank, "runs": len(runs),
                                      "steps": len(s.batches), "processes": s.world_size, "notes": notes}
    if s.rank == 0:
        for note in notes:
            print(note)
        print(f"Simulating {len(runs)} runs ({len(sizes)} world sizes x {len(s.names)} variants x the ranks played) "
              f"over {s.world_size} process(es), {len(s.batches)} steps each...", flush=True)
    for n in sizes:
        os.makedirs(simulation.world_size_dir(s.args.output_dir, n), exist_ok=True)

    def make_job(run: simulation.SimulatedRun) -> Job:
        return s.job(run.variant, run.keys, run.rank, run.world_size,
                     simulation.world_size_dir(s.args.output_dir, run.world_size), simulated=True)

    try:
        own_failed = simulation.run_share(runs, make_job, variant_process, s.rank, s.world_size, s.store, s.device,
                                          s.args.concurrent_variants)
        if s.rank == 0:
            simulation.wait_for_sweep(runs, s.store)
    except Interrupted as exc:
        if s.rank == 0:
            record_sweep(s, runs, sizes)
            print(f"Interrupted ({exc}); finished runs are in {s.summary_path}", file=sys.stderr)
        return 130
    if s.rank == 0:
        record_sweep(s, runs, sizes)
    failed = own_failed or (s.rank == 0 and any(e["status"] != "ok"
                                                for *_, e in report.simulated_entries(s.summary["simulated"])))
    return finish(s, report.print_sweep_table, failed)


def record_sweep(s: Session, runs: list, sizes: list[int]) -> None:
    """Rank 0: summary.json of a sweep, with every run that has ended (the rest marked not run)."""
    simulated: dict = {}
    for run, status in simulation.statuses(runs, s.store).items():
        if status == "ok":
            record = simulation.record_of(run, s.store)
            s.summary["meta"]["gpu_name"] = record["gpu_name"]
            entry = report.memory_summary(run.variant, [record], s.shapes, run.world_size, [run.rank])
        else:
            entry = {"status": status}
        simulated.setdefault(str(run.world_size), {}).setdefault(str(run.rank), {})[run.variant] = \
            {"label": run.label, **entry}
    s.summary["simulated"] = simulated
    s.summary["checks"] = report.sweep_checks(simulated)
    s.summary["simulation_findings"] = {"unfixed_exceeds_intended_from_world_size": report.measured_crossover(simulated)}
    s.summary["projection"] = report.state_projection(s.shapes, s.names,
                                                      sorted(set(PROJECTION_WORLD_SIZES) | set(sizes)))
    write_json(s.summary_path, s.summary)


def finish(s: Session, print_results, any_failed: bool) -> int:
    """Every rank leaves together; rank 0 prints the results and decides the exit code."""
    if s.rank == 0:
        s.summary["meta"]["timeline"]["variants_finished"] = time.time()
        write_json(s.summary_path, s.summary)
    leave_together(s.store, s.rank, s.world_size)
    if s.rank != 0:
        return 1 if any_failed else 0
    print_results(s.summary)
    print(f"Wrote per-rank traces and summary.json to {s.args.output_dir}/")
    failed = any_failed or any(v["status"] != "ok" for v in s.summary.get("variants", {}).values())
    return 1 if failed or not report.checks_passed(s.summary["checks"]) else 0


def run(args: argparse.Namespace) -> int:
    # Seconds since the epoch, so that speed.py can split the launch's wall time.
    timeline = {"process_created": psutil.Process().create_time(), "main_started": time.time()}
    s = set_up(args, timeline)
    if s.rank == 0 and s.device.type == "cpu":
        print(f"Running on CPU{'' if args.simulate_world_size else ' with gloo'}: a functional run. Allocator "
              "figures are n/a; RSS is host memory, not GPU memory.")
    if s.rank == 0 and args.save_memory_snapshot and s.device.type == "cpu":
        print("warning: --save_memory_snapshot needs CUDA; no snapshot is written on CPU.")
    catch_interrupts()
    timeline["variants_started"] = time.time()
    try:
        return run_sweep(s) if args.simulate_world_size else run_variants(s)
    except Interrupted as exc:  # while waiting for the other ranks, after this rank's results were written
        print(f"Interrupted ({exc}) while waiting for the other ranks; results so far are in {args.output_dir}/",
              file=sys.stderr)
        return 130


def main() -> None:
    utils.exit_with(lambda: run(parse_args()))


if __name__ == "__main__":
    main()
