"""FSDP2 memory and convergence benchmark: four ways to combine an optimizer with fully_shard.

Launch with ``torchrun --nproc_per_node N main.py`` or ``accelerate launch main.py``
(plain ``python main.py`` runs one rank). See README.md for every option and output.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

import report
import utils
from measure import TRACE_KEYS, MemoryTracker, write_json
from memory_model import account, param_shapes
from utils import VARIANTS, UserError

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """Refuse what cannot work before any process group or model exists; return the variant list."""
    for flag in ("batch_size", "block_size"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
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


def pick_device(choice: str) -> torch.device:
    has_gpu = torch.cuda.is_available()
    if choice == "cuda" and not has_gpu:
        raise UserError("--device cuda: no CUDA GPU is visible to this process")
    if choice == "cpu" or not has_gpu:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join the launcher's process group, or make a one-rank group for plain ``python main.py``."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size()


def prepare_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise UserError(f"--output_dir {path}: cannot write there ({exc.strerror})") from None


def versions() -> dict:
    import accelerate
    import transformers

    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def run_meta(args, device: torch.device, rank: int, world_size: int, config, n_params: int, steps: int) -> dict:
    return {"rank": rank, "world_size": world_size, "device": device.type,
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "versions": versions(), "model": args.model, "model_type": config.model_type,
            "num_parameters": n_params, "steps_per_variant": steps, "args": vars(args)}


# --------------------------------------------------------------------------- one variant

def train_step(prep: utils.Prepared, input_ids: torch.Tensor,
               before_zero_grad: Callable[[], None] | None = None) -> float:
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=prep.autocast):
        loss = prep.model(input_ids=input_ids, labels=input_ids).loss
    prep.backward(loss.float())
    prep.optimizer.step()
    if before_zero_grad is not None:
        before_zero_grad()
    prep.optimizer.zero_grad()
    return loss.item()


def run_variant(name: str, args, device: torch.device, mesh, config, batches: list[torch.Tensor],
                layer_classes: list[str], output_dir: str, rank: int) -> dict:
    """Build, prepare and train one variant; return this rank's record (trace, steps, events)."""
    snapshot = args.save_memory_snapshot and device.type == "cuda"
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    tracker = MemoryTracker(device, args.log_interval).start()
    start = time.perf_counter()
    model = utils.build_model(config, device, args.seed)
    tracker.mark("model_built")
    ctx = utils.Context(device, mesh, args.learning_rate, layer_classes, tracker.mark)
    prep = VARIANTS[name](model, ctx)
    del model
    accounting = {"end_of_setup": account(prep.model, prep.optimizer)}
    tracker.mark("training_started")
    last = len(batches) - 1
    for step, batch in enumerate(batches):
        t = time.perf_counter()
        hook = (lambda: accounting.update(before_zero_grad=account(prep.model, prep.optimizer))) \
            if step == last else None
        loss = train_step(prep, batch.to(device), hook)
        tracker.record_step(step, loss, time.perf_counter() - t)
    tracker.mark("training_finished")
    accounting["end_of_training"] = account(prep.model, prep.optimizer)
    wall_s = time.perf_counter() - start
    tracker.stop()
    if snapshot:
        torch.cuda.memory._dump_snapshot(os.path.join(output_dir, rank_file(name, "memory_snapshot.pkl", rank)))
        torch.cuda.memory._record_memory_history(enabled=None)
    record = {**tracker.record(), "wall_s": wall_s, "accounting": accounting, "allocator": tracker.allocator_stats(),
              "counter_peaks": tracker.counter_peaks(), "polled_peaks": tracker.polled_peaks()}
    release(prep)
    return record


def release(prep: utils.Prepared) -> None:
    """Free everything a variant held, so the next one starts from an empty allocator."""
    if prep.accelerator is not None:
        prep.accelerator.free_memory()
    prep.model = prep.optimizer = prep.accelerator = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rank_file(name: str, suffix: str, rank: int) -> str:
    """Rank 0 keeps the upstream file name; rank r adds ``_rank<r>``."""
    stem, ext = os.path.splitext(suffix)
    return f"{name}_{stem}{'' if rank == 0 else f'_rank{rank}'}{ext}"


# --------------------------------------------------------------------------- orchestration

def run(args: argparse.Namespace) -> int:
    names = check_args(args)
    device = pick_device(args.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    config = utils.load_config(args.model)
    if utils.max_positions(config) and args.block_size > utils.max_positions(config):
        raise UserError(f"--block_size {args.block_size} exceeds the model's {utils.max_positions(config)} positions")
    tokens = utils.load_tokens(args.dataset, args.tokenizer)
    rank, world_size = init_distributed(device)
    batches = utils.rank_batches(tokens, args.block_size, args.batch_size, args.dataset_fraction,
                                 rank, world_size, args.max_steps)
    prepare_output_dir(args.output_dir)
    if rank == 0 and device.type == "cpu":
        print("Running on CPU with gloo: a functional run. Allocator figures are n/a; RSS is host memory, "
              "not GPU memory.")
    if rank == 0 and args.save_memory_snapshot and device.type == "cpu":
        print("warning: --save_memory_snapshot needs CUDA; no snapshot is written on CPU.")

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    meta_model = utils.build_model(config, torch.device("meta"), args.seed)
    n_params = sum(p.numel() for p in meta_model.parameters())
    shapes = param_shapes(meta_model)
    layer_classes = utils.layer_class_names(meta_model)
    del meta_model
    meta = run_meta(args, device, rank, world_size, config, n_params, len(batches))
    summary = {"meta": {k: v for k, v in meta.items() if k != "rank"}, "variants": {}, "checks": {},
               "projection": None}

    for name in names:
        if rank == 0:
            print(f"[{name}] {len(batches)} steps on {world_size} rank(s)...", flush=True)
        record = run_variant(name, args, device, mesh, config, batches, layer_classes, args.output_dir, rank)
        write_json(os.path.join(args.output_dir, rank_file(name, "memory_usage.json", rank)),
                   {**record, "meta": meta})
        gathered = [None] * world_size
        dist.all_gather_object(gathered, {k: v for k, v in record.items() if k not in TRACE_KEYS})
        summary["variants"][name] = report.variant_summary(name, gathered, shapes)
        summary["checks"] = report.run_checks(summary["variants"], device.type)
        summary["projection"] = report.projection_summary(shapes, summary["variants"], world_size)
        if rank == 0:
            write_json(os.path.join(args.output_dir, "summary.json"), summary)

    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        report.print_table(summary)
        print(f"Wrote per-rank traces and summary.json to {args.output_dir}/")
    return 0 if all(c["ok"] for c in summary["checks"].values()) else 1


def main() -> None:
    try:
        code = run(parse_args())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
