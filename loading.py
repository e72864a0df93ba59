"""Load a pretrained checkpoint into an FSDP2 model without paying for N copies of it.

``torchrun --nproc_per_node N loading.py`` (or ``accelerate launch loading.py``) loads the same
safetensors checkpoint four ways, each ending with the same sharded model ready to train, and
measures per rank the host RAM, the GPU memory and the time it took. See README.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import utils
from isolation import (Finisher, Interrupted, Piece, StoreKeys, catch_interrupts, gather_records, init_group,
                       launcher_env, leave_together, run_child, run_isolated, start_child_server)
from measure import MIB, TRACE_KEYS, MemoryTracker, rss_mib, write_json
from memory_model import local_tensor, shard_rows
from utils import UserError

CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------- checkpoint access

class Checkpoint:
    """Tensor names and files of a Hugging Face safetensors checkpoint, read lazily (memory-mapped)."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise UserError(f"--checkpoint {path}: no *.safetensors files")
            from safetensors import safe_open

            self.files = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    self.files.update({name: file for name in f.keys()})
        self.path = path

    def bytes(self) -> int:
        return sum(os.path.getsize(f) for f in set(self.files.values()))

    def dtype_name(self) -> str:
        from safetensors import safe_open

        name, file = next(iter(self.files.items()))
        with safe_open(file, framework="pt") as f:
            return str(f.get_slice(name).get_dtype())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in sorted(set(self.files.values())):
            state.update(load_file(file))
        return state

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of one tensor: only those bytes are read."""
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return f.get_slice(name)[start:stop]


def stored_name(model: nn.Module, checkpoint: Checkpoint) -> dict[int, str]:
    """For each unique parameter, the name under which the checkpoint stores it (tied weights once)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in checkpoint.files and id(param) not in names:
            names[id(param)] = name
    missing = [n for n, p in model.named_parameters() if id(p) not in names]
    if missing:
        raise KeyError(f"checkpoint {checkpoint.path} lacks {', '.join(missing[:3])}")
    return names


# --------------------------------------------------------------------------- the four modes

def empty_sharded_model(config, mesh, layer_classes: list[str], device: torch.device) -> nn.Module:
    """Parameters on the meta device until sharded, then given (uninitialised) local storage.

    Buffers such as rotary frequencies are not in checkpoints: they are computed on the CPU at
    construction and copied back after ``to_empty``.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # re-registering parameters on meta unties them; FSDP2 must see one shared tensor
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    utils.fully_shard_blocks(model, mesh, layer_classes)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return model


def load_naive(job: "LoadJob", mesh) -> nn.Module:
    """Every rank reads the whole checkpoint into a full CPU model, then shards it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job.checkpoint.path, config=job.config, dtype=torch.float32)
    utils.fully_shard_blocks(model, mesh, job.layer_classes)
    return model


def load_rank0_broadcast(job: "LoadJob", mesh) -> nn.Module:
    """Rank 0 reads the checkpoint; every rank shards an empty model; rank 0 broadcasts into the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = empty_sharded_model(job.config, mesh, job.layer_classes, job.device)
    full = {}
    if job.rank == 0:
        full = job.checkpoint.full_state_dict()
        names = stored_name(model, job.checkpoint)
        for name, param in model.named_parameters(remove_duplicate=False):  # tied names share one tensor
            if name not in full:
                full[name] = full[names[id(param)]]
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def load_accelerate(job: "LoadJob", mesh) -> nn.Module:
    """accelerate's own path: transformers loads on rank 0 only, prepare() shards and broadcasts."""
    from transformers import AutoModelForCausalLM

    os.environ["ACCELERATE_USE_FSDP"] = "true"  # what `accelerate launch` with an FSDP config sets
    accelerator = utils.make_accelerator(job.device, job.layer_classes, cpu_ram_efficient_loading=True)
    model = AutoModelForCausalLM.from_pretrained(job.checkpoint.path, config=job.config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)  # prepare() wants one; its state is lazy
    model, _ = accelerator.prepare(model, optimizer)
    return model


def load_sharded_read(job: "LoadJob", mesh) -> nn.Module:
    """Every rank reads only its own rows of each tensor straight from the files: no broadcast."""
    model = empty_sharded_model(job.config, mesh, job.layer_classes, job.device)
    names = stored_name(model, job.checkpoint)
    with torch.no_grad():
        for param in model.parameters():
            start, stop = shard_rows(param.shape[0], job.world_size, job.rank)
            if stop > start:
                param.to_local()[: stop - start].copy_(job.checkpoint.rows(names[id(param)], start, stop))
    return model


MODES = {"naive": load_naive, "rank0_broadcast": load_rank0_broadcast, "accelerate": load_accelerate,
         "sharded_read": load_sharded_read}


def weights_match(model: nn.Module, checkpoint: Checkpoint, rank: int, world_size: int) -> bool:
    """This rank's shard of every parameter equals the same rows of the checkpoint, exactly."""
    names = stored_name(model, checkpoint)
    for param in model.parameters():
        local = local_tensor(param)
        start, stop = shard_rows(param.shape[0], world_size, rank)
        expected = checkpoint.rows(names[id(param)], start, stop).to(torch.float32)
        if not torch.equal(local[: stop - start].detach().float().cpu(), expected):
            return False
    return True


# --------------------------------------------------------------------------- one mode, one rank

@dataclass
class LoadJob:
    mode: str
    args: argparse.Namespace
    device: torch.device
    config: object
    layer_classes: list
    checkpoint: Checkpoint | None
    rank: int
    world_size: int
    keys: StoreKeys


def trace_file(output_dir: str, mode: str, rank: int) -> str:
    return os.path.join(output_dir, f"loading_{mode}_memory_usage{'' if rank == 0 else f'_rank{rank}'}.json")


def peak_rss_mib() -> float:
    """The kernel's high-water mark of this process's resident memory (exact, not polled)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quiet_transformers() -> None:
    """No per-tensor progress bars in the children: they would drown the table, and in a child of
    the fork server tqdm's lock is a semaphore that Python reports as leaked at exit."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_process(job: LoadJob) -> None:
    quiet_transformers()
    if job.device.type == "cuda":
        torch.cuda.set_device(job.device)
    baseline = rss_mib()
    tracker = MemoryTracker(job.device, job.args.log_interval).start()

    def write(status: str, extra: dict) -> dict:
        tracker.stop()
        data = {**tracker.record(), **extra, "status": status, "mode": job.mode, "rank": job.rank,
                "world_size": job.world_size, "baseline_rss_mib": baseline}
        write_json(trace_file(job.args.output_dir, job.mode, job.rank), data)
        return data

    finisher = Finisher(job.keys, job.rank, write)

    def work(store) -> None:
        mesh = init_group(job.device, job.keys, store, job.rank, job.world_size)
        start = time.perf_counter()
        model = MODES[job.mode](job, mesh)
        if job.device.type == "cuda":
            torch.cuda.synchronize()
        load_time = time.perf_counter() - start
        loaded = tracker.mark("loaded")  # its peaks cover the whole load (the tracker reset them at start)
        record = {"load_time_s": load_time, "peak_rss_mib": max(peak_rss_mib(), tracker.polled_peaks()["peak_rss_mib"]),
                  "peak_allocated_mib": loaded["peak_allocated_mib"]}
        record["weights_match"] = weights_match(model, job.checkpoint, job.rank, job.world_size)
        data = finisher.finish(record)
        store.set(job.keys.record(job.rank), json.dumps({k: v for k, v in data.items() if k not in TRACE_KEYS}))
        dist.destroy_process_group()

    run_child(finisher, work)


def write_checkpoint_process(job: LoadJob, path: str) -> None:
    """Rank 0 writes a checkpoint of the preset's shape (random weights) for the modes to load."""
    quiet_transformers()
    finisher = Finisher(job.keys, job.rank, lambda status, extra: None)

    def work(store) -> None:
        if job.rank == 0:
            start = time.perf_counter()
            model = utils.build_model(job.config, job.device, job.args.seed)
            model.to(CHECKPOINT_DTYPES[job.args.checkpoint_dtype])
            model.save_pretrained(path, max_shard_size=job.args.checkpoint_shard_size)
            store.set(job.keys.record(0), json.dumps({"write_s": time.perf_counter() - start}))
        finisher.finish({})

    run_child(finisher, work)


# --------------------------------------------------------------------------- orchestration

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = utils.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help=f"preset ({', '.join(utils.PRESETS)}), local directory with config.json, or Hub id "
                        "(default: the --checkpoint directory's config, else qwen2.5-1.5b)")
    p.add_argument("--checkpoint", default=None, help="directory of a safetensors checkpoint (default: rank 0 "
                   "writes one of --model's shape into --output_dir first)")
    p.add_argument("--checkpoint_dtype", choices=list(CHECKPOINT_DTYPES), default="bfloat16",
                   help="dtype of a checkpoint written here (default: bfloat16, as published checkpoints)")
    p.add_argument("--checkpoint_shard_size", default="2GB", help="max file size of a written checkpoint")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated loading modes (default: all)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--output_dir", default="out")
    p.add_argument("--seed", type=int, default=421, help="seed of a written checkpoint's random weights")
    p.add_argument("--log_interval", type=float, default=0.01, help="seconds between memory samples")
    return p.parse_args(argv)


def summarise(records: dict) -> dict:
    """Per mode: each rank's figures, and host RAM and time over all ranks."""
    modes = {}
    for mode, ranks in records.items():
        if isinstance(ranks, str):
            modes[mode] = {"status": ranks}
            continue
        modes[mode] = {
            "status": "ok",
            "ranks": [{k: r[k] for k in ("peak_rss_mib", "baseline_rss_mib", "peak_allocated_mib",
                                         "load_time_s", "weights_match")} for r in ranks],
            "host_ram_sum_mib": sum(r["peak_rss_mib"] for r in ranks),
            "host_ram_added_sum_mib": sum(r["peak_rss_mib"] - r["baseline_rss_mib"] for r in ranks),
            "load_time_s": max(r["load_time_s"] for r in ranks),
            "weights_match": all(r["weights_match"] for r in ranks),
        }
    return modes


def print_table(summary: dict) -> None:
    print(f"\nLoading {summary['model']} ({summary['model_bytes'] / MIB:.0f} MiB of fp32 parameters) from a "
          f"{summary['checkpoint']['dtype']} checkpoint of {summary['checkpoint']['bytes'] / MIB:.0f} MiB "
          f"on {summary['world_size']} rank(s)")
    header = f"{'mode':16} {'load s':>7} {'RSS added, per rank (MiB)':>28} {'sum':>8} {'GPU peak MiB':>13} {'match':>6}"
    print(header)
    print("-" * len(header))
    for mode, m in summary["modes"].items():
        if m["status"] != "ok":
            print(f"{mode:16} {m['status']}")
            continue
        added = ", ".join(f"{r['peak_rss_mib'] - r['baseline_rss_mib']:.0f}" for r in m["ranks"])
        gpu = max((r["peak_allocated_mib"] or 0) for r in m["ranks"]) if m["ranks"][0]["peak_allocated_mib"] \
            is not None else None
        print(f"{mode:16} {m['load_time_s']:>7.2f} {added:>28} {m['host_ram_added_sum_mib']:>8.0f} "
              f"{'n/a' if gpu is None else f'{gpu:.0f}':>13} {'yes' if m['weights_match'] else 'NO':>6}")
    print("RSS added: the process's peak resident memory (kernel high-water mark) minus its resident memory "
          "when loading began;\nGPU peak: the allocator's peak counter; match: every rank's shard equals the "
          "checkpoint's rows exactly.")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UserError(f"--modes: unknown mode(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise UserError(f"--checkpoint {args.checkpoint}: no such directory")
    device = utils.pick_device(args.device)
    rank, world_size = launcher_env()
    start_child_server(device)  # its imports overlap the set-up below
    model_name = args.model or args.checkpoint or "qwen2.5-1.5b"
    config = utils.load_config(model_name)
    utils.prepare_output_dir(args.output_dir)
    meta_model = utils.build_model(config, torch.device("meta"), args.seed)
    layer_classes = utils.layer_class_names(meta_model)
    model_bytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    del meta_model
    store, _, _ = next(dist.rendezvous("env://"))
    catch_interrupts()

    def job(mode: str, checkpoint: Checkpoint | None) -> LoadJob:
        return LoadJob(mode, args, device, config, layer_classes, checkpoint, rank, world_size, StoreKeys(f"load-{mode}"))

    summary_path = os.path.join(args.output_dir, "loading_summary.json")
    try:
        write_s = None
        path = args.checkpoint
        if path is None:
            path = os.path.join(args.output_dir, f"checkpoint-{os.path.basename(model_name)}-{args.checkpoint_dtype}")
            if rank == 0:
                print(f"Writing a {args.checkpoint_dtype} checkpoint of {model_name} to {path} ...", flush=True)
            writer = job("write-checkpoint", None)
            failure, = run_isolated([Piece(write_checkpoint_process, (writer, path), writer.keys)], rank,
                                    range(world_size), store, device)
            if failure:
                raise UserError(f"writing the checkpoint failed: {failure}")
            write_s = json.loads(store.get(writer.keys.record(0)))["write_s"]
        checkpoint = Checkpoint(path)
        records: dict = {}
        summary = {"model": model_name, "world_size": world_size, "device": device.type, "model_bytes": model_bytes,
                   "checkpoint": {"path": path, "dtype": checkpoint.dtype_name(), "bytes": checkpoint.bytes(),
                                  "write_s": write_s}, "modes": {}}
        for mode in modes:
            if rank == 0:
                print(f"[{mode}] loading on {world_size} rank(s)...", flush=True)
            j = job(mode, checkpoint)
            failure, = run_isolated([Piece(load_process, (j,), j.keys)], rank, range(world_size), store, device)
            if rank == 0:
                records[mode] = f"failed: {failure}" if failure else gather_records(store, j.keys, range(world_size))
                summary["modes"] = summarise(records)
                write_json(summary_path, summary)
    except Interrupted as exc:
        print(f"Interrupted ({exc}); finished modes are in {summary_path}", file=sys.stderr)
        return 130
    leave_together(store, rank, world_size)
    if rank != 0:
        return 0
    print_table(summary)
    bad = [m for m, v in summary["modes"].items() if v["status"] != "ok" or not v["weights_match"]]
    return 1 if bad else 0


def main() -> None:
    utils.exit_with(lambda: run(parse_args()))


if __name__ == "__main__":
    main()
