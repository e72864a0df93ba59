"""``--concurrent_variants auto``: as many variants at once as GPU memory and host RAM allow.

A step is bound by the host, not the GPU (its kernels take about a quarter of it on 2x H200), so
variants side by side nearly divide the time, each in its own processes with its own allocator,
which leaves every memory figure unchanged. What each variant needs is memory/estimate.py's (``gpu_need``,
``host_bytes``); here, how many fit, and the refusal of a run that cannot fit at all (``check_fits``). A variant
that still runs out of memory while sharing is run again alone (suite.py).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import psutil
import torch.distributed as dist

from fsdp2bench.cli import UserError
from fsdp2bench.memory.accounting import built_bytes
from fsdp2bench.memory.estimate import GpuCap, device_state, gpu_need, host_bytes, tokens_said
from fsdp2bench.names import GIB, counted
from fsdp2bench.options.fsdp import FsdpOptions
from fsdp2bench.processes.isolation import StoreKeys, wait_for_keys
from fsdp2bench.processes.starting import started_ahead


def gpu_memory() -> int | None:
    """The smallest GPU's total memory, from nvidia-smi (the main process never initialises CUDA)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return min(int(line) for line in out.split()) * 1024 * 1024
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def decide(shapes, world_size: int, names: list[str], init_device: str, device_type: str,
           options: FsdpOptions, pieces: int, token_bytes: int, cap: GpuCap | None = None) -> tuple[int, str]:
    """How many of ``pieces`` (variants, or a sweep's runs at world size ``world_size`` or more) to
    run at once on this node, and why (the estimate, and what of it the step's tokens hold); under a cap a
    variant takes at most the cap's memory."""
    if device_type != "cuda":
        return 1, "a CPU run: variants would only share the same cores"
    total = gpu_memory()
    if total is None:
        return 1, "nvidia-smi did not report the GPUs' memory"
    need = gpu_need(shapes, world_size, names, init_device, options, token_bytes)
    need = need if cap is None else min(need, cap.process_bytes)
    per_process = host_bytes(shapes, world_size, names, init_device, options, device_type)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    by_gpu, by_host = total // need, host_memory_for_launch() // (per_process * processes)
    k = max(1, min(pieces, by_gpu, by_host))
    return k, (f"{k} at a time: about {need / GIB:.1f} GiB per variant on a {total / GIB:.0f} GiB GPU "
               f"({tokens_said(token_bytes)}), {per_process / GIB:.1f} GiB of host RAM per process")


@dataclass(frozen=True)
class SweepRoom:
    """A sweep's runs side by side on one GPU: each starts once its own need (``gpu_need`` at its N, for its
    variant) fits beside the runs going, so that runs at a large N, which hold a fraction of those at a small
    one, run more at a time (each need covers the reserved peak of every run on one H200:
    test_memory_model). The host holds the weights once (weights.py: every run maps the same pages,
    29.7 GiB of RSS in each 7B run on one H200 for one copy) and each run's process beside them."""
    gpu: int  # the GPU's bytes
    host: int  # host bytes for their processes, the shared weights taken out
    needs: dict  # (N, variant) -> (GPU bytes, host bytes) of one run
    token_bytes: int  # what each run's step's tokens hold on the GPU (step_bytes), part of every need

    def fits(self, runs: list) -> bool:
        """Whether ``runs`` (each with ``world_size`` and ``variant``) can run together."""
        wanted = [self.needs[(r.world_size, r.variant)] for r in runs]
        return sum(g for g, _ in wanted) <= self.gpu and sum(h for _, h in wanted) <= self.host

    @property
    def most(self) -> int:
        """Runs at once at best (the cheapest ones together): what the host's cores are shared by."""
        gpu, host = min(g for g, _ in self.needs.values()), max(1, min(h for _, h in self.needs.values()))
        return max(1, min(len(self.needs), self.gpu // gpu, self.host // host))

    def said(self) -> str:
        by_n: dict[int, int] = {}
        for (n, _), (g, _) in self.needs.items():
            by_n[n] = max(g, by_n.get(n, 0))
        span = ", ".join(f"{g / GIB:.1f} at N = {n}" for n, g in sorted(by_n.items()))
        return (f"as many as fit on the {self.gpu / GIB:.0f} GiB GPU, each by its own need (GiB, the most costly "
                f"variant: {span}; {tokens_said(self.token_bytes)})")


def host_memory_for_launch() -> int:
    """Host memory this launch may count on. A launch started ahead of its turn (matrix.py) sees the memory
    of the launch before it, which will be gone when it trains: it counts the host's whole memory."""
    memory = psutil.virtual_memory()
    return memory.total if started_ahead() else memory.available


def sweep_room(shapes, sizes: list[int], names: list[str], init_device: str, options: FsdpOptions,
               token_bytes: int, cap: GpuCap | None, shared_build: bool) -> SweepRoom | None:
    """The room of a sweep on this node's GPU (None where nvidia-smi does not say it)."""
    total = gpu_memory()
    if total is None:
        return None
    host = host_memory_for_launch() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    host -= built_bytes(shapes) if shared_build and init_device == "cpu" else 0
    needs = {}
    for n in sizes:
        for name in names:
            gpu = gpu_need(shapes, n, [name], init_device, options, token_bytes)
            needs[(n, name)] = (gpu if cap is None else min(gpu, cap.process_bytes),
                                host_bytes(shapes, n, [name], init_device, options, "cuda", shared_build))
    return SweepRoom(total, host, needs, token_bytes)


def check_fits(shapes, world_size: int, names: list[str], init_device: str, device_type: str,
               options: FsdpOptions, logits_bytes: int, tokens_bytes: int) -> None:
    """Refuse a run whose state (the memory model at the step peak, no margin) and one step's fp32
    logits (``logits_bytes``, a lower bound of its activations) exceed the device, or whose host
    processes exceed the host's RAM (on a CPU run with what a step's tokens hold, ``tokens_bytes``, the
    planner's rule: tiny at batch 4096 peaked at 6.99 GiB where it says 6.94): it could only run out of
    memory, or be killed by the host, after minutes of building."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    on_gpu = device_state(shapes, world_size, names, options, device_type) + logits_bytes
    host = processes * (host_bytes(shapes, world_size, names, init_device, options, device_type)
                        + (max(logits_bytes, tokens_bytes) if device_type == "cpu" else 0))
    available = host_memory_for_launch()
    if host > available:
        raise UserError(f"--model (with --batch_size and --block_size) needs about {host / GIB:.1f} GiB of host memory "
                        f"({counted(processes, 'process')} at N = {world_size}: the model built on the host, its state"
                        f"{', a step' if device_type == 'cpu' else ''} and the runtime); {available / GIB:.1f} GiB "
                        "are available")
    total = gpu_memory() if device_type == "cuda" else None
    if total is not None and on_gpu > total:
        raise UserError(f"--model, --batch_size and --block_size at N = {world_size} need at least {on_gpu / GIB:.1f} "
                        f"GiB per GPU at the step peak (parameters, gradients, AdamW and the fp32 logits), more than "
                        f"the GPU's {total / GIB:.1f} GiB")


def agree(store: dist.TCPStore, rank: int, decision: tuple[int, str] | None) -> tuple[int, str]:
    """Rank 0's decision for every rank: the groups of variants must be the same on all of them."""
    key = StoreKeys("concurrency").prefix
    if rank == 0:
        store.set(key, f"{decision[0]}|{decision[1]}")
    wait_for_keys(store, [key])
    k, reason = store.get(key).decode().split("|", 1)
    return int(k), reason
