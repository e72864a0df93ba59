"""FSDP2 memory and convergence benchmark: four ways to combine an optimizer with fully_shard.

Launch with ``torchrun --nproc_per_node N main.py`` or ``accelerate launch main.py``
(plain ``python main.py`` runs one rank). See README.md for every option and output.
"""

from __future__ import annotations

import argparse
import json
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
from measure import write_json
from memory_model import param_shapes
from isolation import (Interrupted, Piece, StoreKeys, catch_interrupts, launcher_env, leave_together, run_isolated,
                       start_child_server)
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
    return names


def versions() -> dict:
    import accelerate
    import transformers

    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def gather_records(store: dist.TCPStore, keys: StoreKeys, world_size: int) -> list[dict]:
    return [json.loads(store.get(keys.record(r))) for r in range(world_size)]


# --------------------------------------------------------------------------- orchestration

def run(args: argparse.Namespace) -> int:
    # Seconds since the epoch, so that speed.py can split the launch's wall time.
    timeline = {"process_created": psutil.Process().create_time(), "main_started": time.time()}
    names = check_args(args)
    device = utils.pick_device(args.device)
    rank, world_size = launcher_env()
    start_child_server(device)  # its imports overlap the set-up below
    config = utils.load_config(args.model)
    if utils.max_positions(config) and args.block_size > utils.max_positions(config):
        raise UserError(f"--block_size {args.block_size} exceeds the model's {utils.max_positions(config)} positions")
    tokens = utils.load_tokens(args.dataset, args.tokenizer)
    batches = utils.rank_batches(tokens, args.block_size, args.batch_size, args.dataset_fraction,
                                 rank, world_size, args.max_steps)
    utils.prepare_output_dir(args.output_dir)
    meta_model = utils.build_model(config, torch.device("meta"), args.seed)
    shapes = param_shapes(meta_model)
    layer_classes = utils.layer_class_names(meta_model)
    meta = {"rank": rank, "world_size": world_size, "device": device.type, "versions": versions(),
            "model": args.model, "model_type": config.model_type,
            "num_parameters": sum(p.numel() for p in meta_model.parameters()),
            "steps_per_variant": len(batches),
            "args": {k: (v if k != "inject_failure" or v is None else vars(v)) for k, v in vars(args).items()}}
    del meta_model

    store, _, _ = next(dist.rendezvous("env://"))
    if rank == 0 and device.type == "cpu":
        print("Running on CPU with gloo: a functional run. Allocator figures are n/a; RSS is host memory, "
              "not GPU memory.")
    if rank == 0 and args.save_memory_snapshot and device.type == "cpu":
        print("warning: --save_memory_snapshot needs CUDA; no snapshot is written on CPU.")

    summary = {"meta": {**{k: v for k, v in meta.items() if k != "rank"}, "timeline": timeline}, "variants": {},
               "checks": {}, "projection": None}
    summary_path = os.path.join(args.output_dir, "summary.json")
    catch_interrupts()
    any_failed = False
    timeline["variants_started"] = time.time()
    for first in range(0, len(names), args.concurrent_variants):
        group = names[first:first + args.concurrent_variants]
        if rank == 0:
            print(f"[{', '.join(group)}] {len(batches)} steps on {world_size} rank(s)...", flush=True)
        jobs = [Job(name, args, device, config, batches, layer_classes, meta, rank, world_size, StoreKeys(name))
                for name in group]
        started, started_at = time.perf_counter(), time.time()
        try:
            failures = run_isolated([Piece(variant_process, (job,), job.keys) for job in jobs], rank, world_size,
                                    store, device)
            wall = time.perf_counter() - started  # the group's, so one figure for every variant in it
        except Interrupted as exc:
            if rank == 0:
                for later in names[first:]:
                    summary["variants"][later] = {"status": "interrupted" if later in group else "not run"}
                write_json(summary_path, summary)
                print(f"Interrupted ({exc}) during {', '.join(group)}; finished variants and partial traces are in "
                      f"{args.output_dir}/", file=sys.stderr)
            return 130
        any_failed = any_failed or any(failures)
        if rank != 0:
            continue
        for job, failure in zip(jobs, failures):
            if failure is None:
                records = gather_records(store, job.keys, world_size)
                summary["meta"]["gpu_name"] = records[0]["gpu_name"]
                summary["variants"][job.name] = report.variant_summary(job.name, records, shapes)
                summary["variants"][job.name].update(process_started_at=started_at, process_wall_s=wall)
            else:
                summary["variants"][job.name] = {"status": f"failed: {failure}"}
                print(f"[{job.name}] FAILED: {failure}", file=sys.stderr, flush=True)
        summary["checks"] = report.run_checks(summary["variants"], device.type)
        summary["projection"] = report.projection_summary(shapes, summary["variants"], world_size)
        write_json(summary_path, summary)
    if rank == 0:
        timeline["variants_finished"] = time.time()
        write_json(summary_path, summary)

    leave_together(store, rank, world_size)
    if rank != 0:
        return 1 if any_failed else 0
    report.print_table(summary)
    print(f"Wrote per-rank traces and summary.json to {args.output_dir}/")
    failed = [n for n, v in summary["variants"].items() if v["status"] != "ok"]
    return 1 if failed or not all(c["ok"] for c in summary["checks"].values()) else 0


def main() -> None:
    utils.exit_with(lambda: run(parse_args()))


if __name__ == "__main__":
    main()
