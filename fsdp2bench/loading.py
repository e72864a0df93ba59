"""Four ways to load a safetensors checkpoint into an FSDP2 model, each measured in its own processes."""

from __future__ import annotations

import glob
import json
import os
import resource
import time
from dataclasses import dataclass

import torch
from torch import nn

import utils
from fsdp2bench.child import TracedChild, run_traced_child
from fsdp2bench.cli import UserError, one_line
from fsdp2bench.isolation import Finisher, StoreKeys, init_group, run_child
from fsdp2bench.memory_model import local_tensor, shard_rows
from fsdp2bench.model import build_model
from fsdp2bench.names import MIB
from measure import MemoryTracker, rss_mib

CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------- checkpoint access

def tensor_names(file: str) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error type for a bad header or a short file
        raise UserError(f"--checkpoint: {file} is not a readable safetensors file ({one_line(exc)})") from None


class Checkpoint:
    """Tensor names and files of a Hugging Face safetensors checkpoint, read lazily (memory-mapped)."""

    def __init__(self, path: str):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise UserError(f"--checkpoint {path}: no *.safetensors files")
        self.files = {}
        for file in files:  # every header is read: a corrupt or truncated file is refused before any load
            self.files.update({name: file for name in tensor_names(file)})
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

@dataclass(frozen=True)
class LoadConfig:
    """The options of a loading launch that reach the children."""
    output_dir: str
    seed: int
    log_interval: float
    checkpoint_dtype: str
    checkpoint_shard_size: str
    run_id: str


@dataclass
class LoadJob:
    mode: str
    options: LoadConfig
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
    """Entry point of the child process: one mode on one rank."""
    quiet_transformers()
    fields = {"mode": job.mode, "rank": job.rank, "world_size": job.world_size, "baseline_rss_mib": rss_mib(),
              "run_id": job.options.run_id}
    child = TracedChild(job.keys, job.rank, job.device, job.options.log_interval,
                        trace_file(job.options.output_dir, job.mode, job.rank), fields)

    def work(store, tracker: MemoryTracker) -> dict:
        mesh = init_group(job.device, job.keys, store, job.rank, job.world_size)
        start = time.perf_counter()
        model = MODES[job.mode](job, mesh)
        if job.device.type == "cuda":
            torch.cuda.synchronize()
        load_time = time.perf_counter() - start
        loaded = tracker.mark("loaded")  # its peaks cover the whole load (the tracker reset them at start)
        return {"load_time_s": load_time,
                "peak_rss_mib": max(peak_rss_mib(), tracker.polled_peaks()["peak_rss_mib"]),
                "peak_allocated_mib": loaded["peak_allocated_mib"],
                "weights_match": weights_match(model, job.checkpoint, job.rank, job.world_size)}

    run_traced_child(child, work)


def write_checkpoint_process(job: LoadJob, path: str) -> None:
    """Rank 0 writes a checkpoint of the preset's shape (random weights) for the modes to load."""
    quiet_transformers()
    finisher = Finisher(job.keys, job.rank, lambda status, extra: None)

    def work(store) -> None:
        if job.rank == 0:
            start = time.perf_counter()
            model, _ = build_model(job.config, job.device, job.options.seed)
            model.to(CHECKPOINT_DTYPES[job.options.checkpoint_dtype])
            model.save_pretrained(path, max_shard_size=job.options.checkpoint_shard_size)
            store.set(job.keys.record(0), json.dumps({"write_s": time.perf_counter() - start}))
        finisher.finish({})

    run_child(finisher, work)


# --------------------------------------------------------------------------- the report

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
