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

import torch
import torch.distributed as dist

import utils
from measure import MemoryTracker, write_json
from utils import INTENDED, UNFIXED, VARIANTS, UserError

# Losses are compared step by step. On CPU the intended variants are bit-identical; on GPUs
# accelerate groups its parameters differently, which may change bf16 rounding a little.
LOSS_TOLERANCE = {"cpu": 0.0, "cuda": 1e-2}  # relative
# The unfixed variant "trained" if its loss fell by more than this fraction.
TRAINED_DROP = 0.01


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

def train_step(prep: utils.Prepared, input_ids: torch.Tensor) -> float:
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=prep.autocast):
        loss = prep.model(input_ids=input_ids, labels=input_ids).loss
    prep.backward(loss.float())
    prep.optimizer.step()
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
    tracker.mark("training_started")
    for step, batch in enumerate(batches):
        t = time.perf_counter()
        loss = train_step(prep, batch.to(device))
        tracker.record_step(step, loss, time.perf_counter() - t)
    tracker.mark("training_finished")
    wall_s = time.perf_counter() - start
    tracker.stop()
    if snapshot:
        torch.cuda.memory._dump_snapshot(os.path.join(output_dir, rank_file(name, "memory_snapshot.pkl", rank)))
        torch.cuda.memory._record_memory_history(enabled=None)
    record = {**tracker.record(), "wall_s": wall_s, "allocator": tracker.allocator_stats(),
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


# --------------------------------------------------------------------------- summary

def loss_drop(losses: list[float]) -> float:
    """Relative fall from the mean of the first quarter of steps to the mean of the last quarter."""
    window = max(1, len(losses) // 4)
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    return (first - last) / first


def variant_summary(per_rank: list[dict]) -> dict:
    """Combine every rank's record of one variant into the summary's entry."""
    def across(values: list) -> dict:
        present = [v for v in values if v is not None]
        return {"per_rank": values, "max": max(present) if present else None}

    losses = [s["loss"] for s in per_rank[0]["steps"]]
    return {
        "status": "ok",
        "steps": len(losses),
        "losses": losses,
        "final_loss": losses[-1],
        "loss_drop": loss_drop(losses),
        "peak_allocated_mib": across([r["counter_peaks"]["peak_allocated_mib"] for r in per_rank]),
        "peak_reserved_mib": across([r["counter_peaks"]["peak_reserved_mib"] for r in per_rank]),
        "peak_rss_mib": across([r["polled_peaks"]["peak_rss_mib"] for r in per_rank]),
        "polled_peak_allocated_mib": across([r["polled_peaks"]["peak_allocated_mib"] for r in per_rank]),
        "allocator": [r["allocator"] for r in per_rank],
        "wall_s": max(r["wall_s"] for r in per_rank),
    }


def run_checks(variants: dict, device_type: str) -> dict:
    """The upstream's equality check plus: the unfixed variant must not have trained."""
    checks = {}
    ran = [n for n in INTENDED if variants.get(n, {}).get("status") == "ok"]
    if len(ran) >= 2:
        tol = LOSS_TOLERANCE[device_type]
        ref = variants[ran[0]]["losses"]
        diffs = {n: max(abs(a - b) / abs(b) for a, b in zip(variants[n]["losses"], ref)) for n in ran[1:]}
        checks["intended_losses_match"] = {"ok": all(d <= tol for d in diffs.values()), "reference": ran[0],
                                           "relative_tolerance": tol, "max_relative_diff": diffs}
    if variants.get(UNFIXED, {}).get("status") == "ok":
        drop = variants[UNFIXED]["loss_drop"]
        checks["unfixed_did_not_train"] = {"ok": drop <= TRAINED_DROP, "loss_drop": drop,
                                           "threshold": TRAINED_DROP}
    return checks


def fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(summary: dict) -> None:
    world = summary["meta"]["world_size"]
    print(f"\nResults over {world} rank(s); peaks are the maximum over ranks.")
    header = f"{'variant':40} {'steps':>5} {'first loss':>10} {'final loss':>10} {'drop':>7} " \
             f"{'peak alloc MiB':>14} {'peak resv MiB':>13} {'peak RSS MiB':>12} {'wall s':>7}"
    print(header)
    print("-" * len(header))
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            print(f"{name:40} {v['status']}")
            continue
        print(f"{name:40} {v['steps']:>5} {v['losses'][0]:>10.4f} {v['final_loss']:>10.4f} "
              f"{v['loss_drop']:>7.1%} {fmt(v['peak_allocated_mib']['max']):>14} "
              f"{fmt(v['peak_reserved_mib']['max']):>13} {fmt(v['peak_rss_mib']['max']):>12} {v['wall_s']:>7.1f}")
    print("peak alloc / resv: the CUDA caching allocator's own peak counters (exact, not polled); "
          "peak RSS: host memory of the process, polled;\ndrop: relative fall of the loss from the "
          "first to the last quarter of the steps (rank 0's own batches).")
    for key, check in summary["checks"].items():
        print(f"check {key}: {'PASS' if check['ok'] else 'FAIL'} "
              f"({', '.join(f'{k}={v}' for k, v in check.items() if k != 'ok')})")


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
    layer_classes = utils.layer_class_names(meta_model)
    del meta_model
    meta = run_meta(args, device, rank, world_size, config, n_params, len(batches))
    summary = {"meta": {k: v for k, v in meta.items() if k != "rank"}, "variants": {}, "checks": {}}

    for name in names:
        if rank == 0:
            print(f"[{name}] {len(batches)} steps on {world_size} rank(s)...", flush=True)
        record = run_variant(name, args, device, mesh, config, batches, layer_classes, args.output_dir, rank)
        write_json(os.path.join(args.output_dir, rank_file(name, "memory_usage.json", rank)),
                   {**record, "meta": meta})
        gathered = [None] * world_size
        dist.all_gather_object(gathered, {k: v for k, v in record.items() if k not in ("timestamps",
                                          "allocated_memory", "reserved_memory", "virtual_memory", "events")})
        summary["variants"][name] = variant_summary(gathered)
        summary["checks"] = run_checks(summary["variants"], device.type)
        if rank == 0:
            write_json(os.path.join(args.output_dir, "summary.json"), summary)

    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print_table(summary)
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
