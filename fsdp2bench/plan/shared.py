"""A shared-process probe: one simulated rank, built and sharded once, trained two steps at each of a
ladder of values (search.Ladder), each value's peaks posted to the store as soon as it is measured.

Almost all of a fresh probe's time goes before its first step (the process, the CUDA context, the model,
FSDP2's first step); here that is paid once for several values. The peaks of values measured after
others are not those of a fresh run (the allocator's cache holds the earlier values' blocks), so they
aim the fresh probes (probes.py) and decide nothing. Each value runs two steps, as a fresh probe does,
so that its second forward runs with the first one's outputs alive, and its allocator limit is below
the probes' (``search.SHARED_LIMIT``): a line wrong by much ends its ladder, never a probe beside it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fsdp2bench.options.layout import Meshes
from fsdp2bench.plan.search import Ladder
from fsdp2bench.processes.isolation import name_process
from fsdp2bench.train.data import rank_batches, repeated
from fsdp2bench.train.runner import FailureSpec, Job, TrainStep, collector_paused, prepare, run_variant_child
from measure import MemoryTracker

if TYPE_CHECKING:  # probes.py starts shared processes: the type alone, no cycle
    from fsdp2bench.plan.probes import Question


PROBE_STEPS = 2  # per value, in a probe of either kind: the first creates AdamW's state; the second runs with it


def probe_batches(tokens: torch.Tensor, batch: int, block: int, microbatches: int) -> torch.Tensor:
    """``PROBE_STEPS`` steps of data at any batch and block: the built-in text repeated as often as it
    takes (a simulated rank's losses mean nothing, its memory is the same for any tokens)."""
    return rank_batches(repeated(tokens, PROBE_STEPS * microbatches * batch * block), block, batch, 1.0, 0, 1,
                        PROBE_STEPS, microbatches)


@dataclass(frozen=True)
class AtValue:
    """A fresh probe's job at the value its parent names at its gate (plan.py sets a search's next probe up
    before it knows the value): its batches, and the out-of-memory error a test injects above a value."""
    tokens: torch.Tensor
    question: object  # probes.Question
    inject_oom_above: int | None = None

    def __call__(self, job: Job, value: int) -> Job:
        q = self.question
        batch, block = q.batch_and_block(value)
        job.meta["probe"].update(batch_size=batch, block_size=block)  # the trace's header holds this dict
        inject = FailureSpec(q.variant, 0, q.rank, "oom") \
            if self.inject_oom_above is not None and value > self.inject_oom_above else None
        return dataclasses.replace(job, batches=probe_batches(self.tokens, batch, block,
                                                              q.options.gradient_accumulation_steps),
                                   train=dataclasses.replace(job.train, inject_failure=inject))


@dataclass(kw_only=True)
class SharedJob(Job):
    """A ``Job`` whose batches are made here, per value, from ``tokens`` (probes.probe_batches)."""
    question: Question
    ladder: Ladder | None = None
    tokens: torch.Tensor | None = None


def point_key(job: SharedJob, index: int) -> str:
    return f"{job.keys.prefix}/point/{index}"


def run_shared_process(job: SharedJob) -> None:
    """Entry point of the child process (``ps`` shows it as plan-shared)."""
    name_process("plan-shared")
    run_variant_child(job, measure_ladder)


def measure_ladder(job: SharedJob, tracker: MemoryTracker, meshes: Meshes | None, store: dist.Store) -> dict:
    """Each value of the ladder in turn, until it ends or a value runs out of memory (the error ends the
    process; the values before it are already in the store)."""
    started = time.perf_counter()
    prep = prepare(job, tracker, meshes)
    tracker.mark("training_started")
    setup_s = time.perf_counter() - started
    points: list[tuple[int, float | None]] = []
    microbatches = job.train.options.gradient_accumulation_steps
    with collector_paused():
        while (value := job.ladder.next_value(points)) is not None:
            step = TrainStep(prep, microbatches)  # no outputs of the value before held through this one
            if job.ladder.inject_oom_above is not None and value > job.ladder.inject_oom_above:
                raise torch.OutOfMemoryError(f"injected: Tried to allocate 1.00 GiB at {value} on rank {job.rank}")
            batches = probe_batches(job.tokens, *job.question.batch_and_block(value), microbatches)
            if job.device.type == "cuda":
                torch.cuda.empty_cache()  # what the value before cached is not this one's
            tracker.mark(f"value_{value}_start")
            clock = time.perf_counter()
            for batch in batches:
                step(batch.to(job.device, non_blocking=True))
            peaks = tracker.mark(f"value_{value}")  # waits for the device
            point = {"value": value, "peak_allocated_mib": peaks["peak_allocated_mib"],
                     "peak_reserved_mib": peaks["peak_reserved_mib"], "wall_s": time.perf_counter() - clock}
            store.set(point_key(job, len(points)), json.dumps(point))
            points.append((value, point["peak_allocated_mib"]))
    return {"setup_s": setup_s, "values": len(points), "wall_s": time.perf_counter() - started}
