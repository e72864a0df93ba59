"""What every isolated child does that traces memory: a training variant or a loading mode.

It starts the tracker at once (so the trace covers everything the child does), runs the work,
and writes its trace exactly once: finished, failed, or aborted because a peer failed or the
run was interrupted. On success it also posts its record (the trace less the sampled lists) to
the launcher's store, where rank 0 collects every rank's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from fsdp2bench.files import write_json
from fsdp2bench.processes.isolation import Finisher, StoreKeys, run_child, without_trace
from measure import MemoryTracker


@dataclass
class TracedChild:
    keys: StoreKeys
    rank: int
    device: torch.device
    log_interval: float
    trace_path: str
    fields: dict  # written into the trace beside the tracker's record and the status


def run_traced_child(child: TracedChild, work: Callable[[dist.Store, MemoryTracker], dict]) -> None:
    """Body of the child process: ``work(store, tracker)`` returns what the trace adds on success."""
    if child.device.type == "cuda":
        torch.cuda.set_device(child.device)  # before the tracker's first allocator reading
    tracker = MemoryTracker(child.device, child.log_interval).start()

    def write(status: str, extra: dict) -> dict:
        tracker.stop()
        if status != "ok":
            extra = {**extra, "failure": tracker.at_failure(extra.get("error"))}
        data = {**tracker.record(), **extra, "status": status, **child.fields}
        write_json(child.trace_path, data)
        return data

    finisher = Finisher(child.keys, child.rank, write)

    def body(store: dist.Store) -> None:
        data = finisher.finish(work(store, tracker))
        store.set(child.keys.record(child.rank), json.dumps(without_trace(data)))
        if dist.is_initialized():
            dist.destroy_process_group()

    run_child(finisher, body)
