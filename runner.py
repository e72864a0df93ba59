"""One variant, run in a process of its own on every rank.

main.py forks this process per variant and rank, so no allocator cache, host memory or
broken communicator carries over from one variant to the next, and a failure stays inside
its variant. The processes of one variant form their own process group on the launcher's
store; an "abort" key in that store tells every rank, within a second, that a peer failed
or the run was interrupted: each then writes its partial trace and leaves.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

import utils
from measure import TRACE_KEYS, MemoryTracker, write_json
from memory_model import account

STORE_TIMEOUT = timedelta(minutes=30)
POLL_S = 0.25
INTERRUPTED = "interrupted"  # the abort reason the main processes set on SIGINT / SIGTERM


@dataclass
class Job:
    """Everything one rank needs to run one variant (inherited through fork, not pickled)."""
    name: str
    args: object
    device: torch.device
    config: object
    batches: list
    layer_classes: list
    meta: dict
    rank: int
    world_size: int
    keys: "StoreKeys"


class StoreKeys:
    """Names of the launcher-store keys one variant uses; unique per launch and restart."""

    def __init__(self, name: str):
        launch = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.prefix = f"fsdp2bench/{launch}/{name}"
        self.abort = f"{self.prefix}/abort"

    def status(self, rank: int) -> str:
        return f"{self.prefix}/status/{rank}"

    def record(self, rank: int) -> str:
        return f"{self.prefix}/record/{rank}"


def set_first(store: dist.TCPStore, key: str, value: str) -> None:
    """Set ``key`` unless some rank already did: the first reason given is kept."""
    store.compare_set(key, "", value)


def connect_store() -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=STORE_TIMEOUT)


def rank_file(name: str, suffix: str, rank: int) -> str:
    """Rank 0 keeps the upstream file name; rank r adds ``_rank<r>``."""
    stem, ext = os.path.splitext(suffix)
    return f"{name}_{stem}{'' if rank == 0 else f'_rank{rank}'}{ext}"


def describe(exc: BaseException) -> str:
    """One line for a failure; out-of-memory named as such."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory ({first})"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# --------------------------------------------------------------------------- training

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


def injected_failure(job: Job, step: int) -> None:
    """``--inject_failure VARIANT:STEP:RANK[:kill]``: a test option to prove failures are contained."""
    spec = job.args.inject_failure
    if spec and spec.name == job.name and spec.step == step and spec.rank == job.rank:
        if spec.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure at step {step} on rank {job.rank}")


def train(job: Job, tracker: MemoryTracker, mesh) -> dict:
    """Build, prepare and train one variant; return this rank's record beyond the trace."""
    start = time.perf_counter()
    model = utils.build_model(job.config, job.device, job.args.seed)
    tracker.mark("model_built")
    ctx = utils.Context(job.device, mesh, job.args.learning_rate, job.layer_classes, tracker.mark)
    prep = utils.VARIANTS[job.name](model, ctx)
    del model
    accounting = {"end_of_setup": account(prep.model, prep.optimizer)}
    tracker.mark("training_started")
    last = len(job.batches) - 1
    for step, batch in enumerate(job.batches):
        injected_failure(job, step)
        t = time.perf_counter()
        hook = (lambda: accounting.update(before_zero_grad=account(prep.model, prep.optimizer))) \
            if step == last else None
        loss = train_step(prep, batch.to(job.device), hook)
        tracker.record_step(step, loss, time.perf_counter() - t)
    tracker.mark("training_finished")
    accounting["end_of_training"] = account(prep.model, prep.optimizer)
    return {"wall_s": time.perf_counter() - start, "accounting": accounting,
            "allocator": tracker.allocator_stats(), "counter_peaks": tracker.counter_peaks(),
            "polled_peaks": tracker.polled_peaks()}


# --------------------------------------------------------------------------- the process

class Finisher:
    """Writes this rank's file once, from whichever thread gets there first, then leaves."""

    def __init__(self, job: Job, tracker: MemoryTracker):
        self.job, self.tracker = job, tracker
        self.lock = threading.Lock()
        self.path = os.path.join(job.args.output_dir, rank_file(job.name, "memory_usage.json", job.rank))

    def write(self, status: str, extra: dict) -> dict:
        self.tracker.stop()
        data = {**self.tracker.record(), **extra, "status": status, "meta": self.job.meta}
        write_json(self.path, data)
        return data

    def fail(self, error: str | None, store: dist.TCPStore) -> None:
        """Tell the other ranks (the first reason set wins), write the partial trace, exit at once.

        ``error`` is this rank's own failure, or None when leaving because the abort key is set.
        """
        if not self.lock.acquire(blocking=False):
            return
        try:
            keys = self.job.keys
            if error is not None:
                set_first(store, keys.abort, f"rank {self.job.rank}: {error}")
            reason = store.get(keys.abort).decode()
            own = reason == f"rank {self.job.rank}: {error}"
            status = "interrupted" if reason == INTERRUPTED else "failed" if own else f"aborted: {reason}"
            self.write(status, {"error": error})
        finally:
            os._exit(1)


def watch_for_abort(job: Job, finisher: Finisher) -> None:
    """Background thread: leave as soon as a peer failed or the run was interrupted."""
    store = connect_store()
    while True:
        if store.check([job.keys.abort]):
            finisher.fail(None, store)
        time.sleep(POLL_S)


def variant_process(job: Job) -> None:
    """Entry point of the forked process: one variant on one rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt means
    store = connect_store()
    if job.device.type == "cuda":
        torch.cuda.set_device(job.device)
    tracker = MemoryTracker(job.device, job.args.log_interval).start()
    finisher = Finisher(job, tracker)
    threading.Thread(target=watch_for_abort, args=(job, finisher), daemon=True).start()
    snapshot = job.args.save_memory_snapshot and job.device.type == "cuda"
    try:
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        dist.init_process_group("nccl" if job.device.type == "cuda" else "gloo",
                                store=dist.PrefixStore(job.keys.prefix + "/pg", store), rank=job.rank,
                                world_size=job.world_size, timeout=timedelta(minutes=10),
                                device_id=job.device if job.device.type == "cuda" else None)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(job.device.type, (job.world_size,))
        extra = train(job, tracker, mesh)
        if snapshot:
            torch.cuda.memory._dump_snapshot(os.path.join(job.args.output_dir,
                                                          rank_file(job.name, "memory_snapshot.pkl", job.rank)))
        extra["gpu_name"] = torch.cuda.get_device_name(job.device) if job.device.type == "cuda" else None
        finisher.lock.acquire()  # from here on a late abort must not overwrite the finished trace
        data = finisher.write("ok", extra)
        store.set(job.keys.record(job.rank), json.dumps({k: v for k, v in data.items() if k not in TRACE_KEYS}))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
        if os.environ.get("FSDP2_BENCH_DEBUG"):
            traceback.print_exc()
        finisher.fail(describe(exc), store)
        os._exit(1)  # reached only if the trace was already written as finished
