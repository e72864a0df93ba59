"""Five ways to load a checkpoint into an FSDP2 model, each measured in its own processes."""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field

import torch
from torch import nn

import utils
from fsdp2bench.loading.checkpoints import Checkpoint, write_bin
from fsdp2bench.memory.accounting import local_tensor, shard_rows
from fsdp2bench.names import MIB, counted, size_said
from fsdp2bench.options.layout import Degrees
from fsdp2bench.processes import simulation
from fsdp2bench.processes.child import TracedChild, run_traced_child
from fsdp2bench.processes.isolation import Finisher, StoreKeys, init_group, run_child
from fsdp2bench.train import weights
from fsdp2bench.train.model import build_empty, build_model
from measure import MemoryTracker, rss_mib

CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------- checkpoint names

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


# --------------------------------------------------------------------------- the five modes

def empty_sharded_model(config, mesh, layer_classes: list[str], device: torch.device) -> nn.Module:
    """Parameters on the meta device until sharded, then given (uninitialised) local storage.

    Buffers such as rotary frequencies are not in checkpoints: they are computed on the CPU at
    construction and copied back after ``to_empty``.
    """
    model = build_empty(config)
    utils.fully_shard_blocks(model, mesh, layer_classes)
    utils.give_shards_storage(model, device)
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


def fill_own_rows(model: nn.Module, job: "LoadJob", rows) -> None:
    """Copy into each parameter's local shard its own rows, ``rows(name, start, stop)`` of the
    checkpoint's tensor (converted to the parameter's dtype on the way)."""
    names = stored_name(model, job.checkpoint)
    with torch.no_grad():
        for param in model.parameters():
            start, stop = shard_rows(param.shape[0], job.world_size, job.rank)
            if stop > start:
                param.to_local()[: stop - start].copy_(rows(names[id(param)], start, stop))


def load_sharded_read(job: "LoadJob", mesh) -> nn.Module:
    """Every rank reads only its own rows of each tensor straight from the files: no broadcast."""
    model = empty_sharded_model(job.config, mesh, job.layer_classes, job.device)
    fill_own_rows(model, job, job.checkpoint.rows)
    return model


def load_shared_memory(job: "LoadJob", mesh) -> nn.Module:
    """One host copy of the checkpoint per node, which every local rank maps and takes its own rows
    from: the first local rank to come reads the checkpoint into an in-memory file that the node's
    first launcher process holds (``node_copy``); C bytes once per node, whatever the number of ranks
    and whatever the checkpoint's format."""
    model = empty_sharded_model(job.config, mesh, job.layer_classes, job.device)
    copy = node_copy(job)
    fill_own_rows(model, job, lambda name, start, stop: copy[name][start:stop] if name in copy
                  else job.checkpoint.rows(name, start, stop))
    return model


def node_copy(job: "LoadJob") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in the node's shared file (mapped, read as they are used), filled
    first if no local rank has. Empty tensors are not in it (no pages to map)."""
    def fill(views: list) -> None:
        for name, view in views:
            view.copy_(job.checkpoint.tensor(name))

    named = [(name, meta) for name in job.checkpoint.files
             if (meta := job.checkpoint.meta(name)).numel() > 0]
    found = weights.shared_tensors(job.node_copy, named, fill) if job.node_copy is not None and named else None
    if found is None:
        raise RuntimeError("the node's shared copy cannot be used here (no memfd, or /proc is not readable)")
    tensors, filled = found
    spans = weights.layout(named)
    job.notes.update(filled_node_copy=filled, node_copy_bytes=spans[-1][0] + spans[-1][1])
    return {name: tensor for (name, _), tensor in zip(named, tensors)}


MODES = {"naive": load_naive, "rank0_broadcast": load_rank0_broadcast, "accelerate": load_accelerate,
         "sharded_read": load_sharded_read, "shared_memory": load_shared_memory}
# A rank played alone on a fake process group receives nothing from the others.
SIMULABLE = ("naive", "sharded_read", "shared_memory")
NEEDS_PEERS = "needs data from the other ranks (a broadcast), which a simulated rank does not receive"


# --------------------------------------------------------------------------- host memory, before anything runs

def mode_host_bytes(mode: str, world_size: int, local_ranks: int, params: int, stored: int, device_type: str) -> int:
    """What a mode holds on one node's host at its peak, beyond each process's runtime: the whole model in fp32
    (4 P) where a process reads it into a full model, the checkpoint's ``stored`` bytes where one process or the
    node holds them, and each rank's fp32 shard (4 P / N) where the shards live on the host (a CPU run)."""
    full = 4 * params
    shards = 0 if device_type == "cuda" else local_ranks * full // world_size
    held = {"naive": local_ranks * full, "rank0_broadcast": stored, "accelerate": full, "sharded_read": 0,
            "shared_memory": stored}
    return held[mode] + shards


def host_need(modes: list[str], sizes: list[int], local_ranks: int, params: int, stored: int, device_type: str,
              writes_checkpoint: bool) -> tuple[int, str]:
    """The largest host peak of a launch (bytes, beyond the processes' runtime) and what holds it: writing the
    checkpoint of ``stored`` bytes (the model built in fp32 first on a CPU run), or a mode at one of its N."""
    needs = [(mode_host_bytes(mode, n, local_ranks, params, stored, device_type), f"{mode} at N = {n}")
             for n in sizes for mode in modes]
    if writes_checkpoint:
        needs.append((4 * params if device_type == "cpu" else stored,
                      "writing the checkpoint (the model built in fp32 first)" if device_type == "cpu" else
                      "writing the checkpoint"))
    return max(needs)


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
    checkpoint_format: str  # of a checkpoint written here: safetensors or bin
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
    node_copy: weights.SharedWeights | None = None  # the node's shared file, for shared_memory
    simulated: bool = False  # rank ``rank`` of ``world_size`` played alone on a fake process group
    notes: dict = field(default_factory=dict)  # what a mode adds to this rank's record


def trace_file(output_dir: str, mode: str, rank: int) -> str:
    return os.path.join(output_dir, f"loading_{mode}_memory_usage{'' if rank == 0 else f'_rank{rank}'}.json")


def job_dir(job: "LoadJob") -> str:
    """Where a job's trace goes: the output directory, or its simulated world size's folder in it."""
    return simulation.world_size_dir(job.options.output_dir, job.world_size) if job.simulated \
        else job.options.output_dir


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
                        trace_file(job_dir(job), job.mode, job.rank), fields)

    def work(store, tracker: MemoryTracker) -> dict:
        flat = Degrees(replicate=1, shard=job.world_size)  # loading shards over every rank
        meshes = simulation.init_simulated_group(job.device, job.rank, job.world_size, flat) if job.simulated else \
            init_group(job.device, job.keys, store, job.rank, job.world_size, flat)
        mesh = meshes.fsdp
        start = time.perf_counter()
        model = MODES[job.mode](job, mesh)
        if job.device.type == "cuda":
            torch.cuda.synchronize()
        load_time = time.perf_counter() - start
        loaded = tracker.mark("loaded")  # its peaks cover the whole load (the tracker reset them at start)
        return {"load_time_s": load_time,
                "peak_rss_mib": max(peak_rss_mib(), tracker.polled_peaks()["peak_rss_mib"]),
                "peak_allocated_mib": loaded["peak_allocated_mib"],
                "weights_match": weights_match(model, job.checkpoint, job.rank, job.world_size), **job.notes}

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
            if job.options.checkpoint_format == "bin":  # transformers 5 writes safetensors only
                from transformers.utils.hub import convert_file_size_to_int

                write_bin(model.state_dict(), path, convert_file_size_to_int(job.options.checkpoint_shard_size))
                model.config.save_pretrained(path)
            else:
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
                                         "load_time_s", "weights_match", "filled_node_copy") if k in r}
                      for r in ranks],
            "host_ram_sum_mib": sum(r["peak_rss_mib"] for r in ranks),
            "host_ram_added_sum_mib": sum(r["peak_rss_mib"] - r["baseline_rss_mib"] for r in ranks),
            "load_time_s": max(r["load_time_s"] for r in ranks),
            "weights_match": all(r["weights_match"] for r in ranks),
        }
        if "node_copy_bytes" in ranks[0]:  # shared_memory: one copy per node, counted in each RSS that maps it
            modes[mode]["node_copy_mib"] = ranks[0]["node_copy_bytes"] / MIB
    return modes


def loaded_what(summary: dict) -> str:
    """The model and the checkpoint a table is about."""
    checkpoint = summary["checkpoint"]
    return (f"\nLoading {summary['model']} ({size_said(summary['model_bytes'], 0)} of fp32 parameters) from a "
            f"{checkpoint['dtype']} {checkpoint['format']} checkpoint of {size_said(checkpoint['bytes'], 0)}")


def on_gpu(summary: dict) -> bool:
    """Whether the tables have a GPU column: a CPU run has no allocator to read."""
    return summary["device"] != "cpu"


def gpu_cell(text: str, summary: dict) -> str:
    return f" {text:>13}" if on_gpu(summary) else ""


def print_table(summary: dict) -> None:
    print(f"{loaded_what(summary)} on {counted(summary['world_size'], 'rank')}")
    header = f"{'mode':16} {'load s':>7} {'RSS added, per rank (MiB)':>28} {'sum':>8}" \
             f"{gpu_cell('GPU peak MiB', summary)} {'match':>6}"
    print(header)
    print("-" * len(header))
    for mode, m in summary["modes"].items():
        if m["status"] != "ok":
            print(f"{mode:16} {m['status']}")
            continue
        added = ", ".join(f"{r['peak_rss_mib'] - r['baseline_rss_mib']:.0f}" for r in m["ranks"])
        gpu = max((r["peak_allocated_mib"] or 0) for r in m["ranks"]) if m["ranks"][0]["peak_allocated_mib"] \
            is not None else None
        print(f"{mode:16} {m['load_time_s']:>7.2f} {added:>28} {m['host_ram_added_sum_mib']:>8.0f}"
              f"{gpu_cell('n/a' if gpu is None else f'{gpu:.0f}', summary)} {'yes' if m['weights_match'] else 'NO':>6}")
    print("RSS added: the process's peak resident memory (kernel high-water mark) minus its resident memory "
          "when loading began;\n" + ("GPU peak: the allocator's peak counter; " if on_gpu(summary) else "")
          + "match: every rank's shard equals the checkpoint's rows exactly.")
    shared = summary["modes"].get("shared_memory", {})
    if shared.get("status") == "ok":
        fillers = ", ".join(str(i) for i, r in enumerate(shared["ranks"]) if r["filled_node_copy"])
        print(f"shared_memory: one copy of {shared['node_copy_mib']:.0f} MiB per node, filled by rank {fillers}; its "
              f"pages count in the RSS of every rank that maps them.")


def print_simulated(summary: dict) -> None:
    """One line per (simulated N, mode): rank 0 of N, played alone."""
    print(f"{loaded_what(summary)}, as rank 0 of simulated world sizes")
    header = f"{'N':>5} {'mode':16} {'load s':>7} {'RSS added MiB':>14} {'node copy MiB':>14}" \
             f"{gpu_cell('GPU peak MiB', summary)} {'match':>6}"
    print(header)
    print("-" * len(header))
    for n, by_mode in summary["simulated"].items():
        for mode, m in by_mode.items():
            if m["status"] != "ok":
                print(f"{n:>5} {mode:16} {m['status']}")
                continue
            r = m["ranks"][0]
            gpu = "n/a" if r["peak_allocated_mib"] is None else f"{r['peak_allocated_mib']:.0f}"
            copy = f"{m['node_copy_mib']:.0f}" if "node_copy_mib" in m else "-"
            print(f"{n:>5} {mode:16} {m['load_time_s']:>7.2f} {r['peak_rss_mib'] - r['baseline_rss_mib']:>14.0f} "
                  f"{copy:>14}{gpu_cell(gpu, summary)} {'yes' if m['weights_match'] else 'NO':>6}")
    print("RSS added: the process's peak resident memory minus its resident memory when loading began (a node "
          "copy's pages count in it\nonce mapped); node copy: shared_memory's one copy of the checkpoint per node.")
