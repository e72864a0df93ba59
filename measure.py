"""Memory measurement: a polled trace plus the allocator's own peak counters.

Polling every few milliseconds draws the curve but can miss a short peak between two
samples; the allocator's peak counters cannot. So every phase mark and every optimizer
step reads the counters and resets them: each moment of a run belongs to exactly one
segment, and the variant's true peak is the maximum over segments.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below: said at once
    from fsdp2bench.cli import not_a_script

    not_a_script("measure.py holds the memory tracker of main.py's runs", "python3 main.py")

import os
import re
import threading
import time

import psutil
import torch

from fsdp2bench.names import MIB, TRACE_KEYS


_process: psutil.Process | None = None


def rss_mib() -> float:
    """Resident memory of the calling process (a forked child must not read its parent's)."""
    global _process
    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return _process.memory_info().rss / MIB


class MemoryTracker:
    """Samples memory in a background thread and records phase marks and steps on one clock."""

    def __init__(self, device: torch.device, interval_s: float):
        self.cuda = device.type == "cuda"
        self.device = device
        self.interval_s = interval_s
        self.samples: dict[str, list] = {key: [] for key in TRACE_KEYS}
        self.events: list[dict] = []
        self.steps: list[dict] = []
        self.polling = True  # cleared to measure what the polling costs (see --tracker_overhead)
        self.fail_with: Exception | None = None  # raised by the polling thread (--inject_failure ...:thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="memory tracker", daemon=True)
        self.started_at = time.time()
        self._t0 = time.perf_counter()

    # ----------------------------------------------------------------- polling
    def start(self) -> "MemoryTracker":
        self._reset_peaks()
        self.started_at = time.time()  # the clock's zero, in seconds since the epoch
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _poll(self) -> None:
        while not self._stop.is_set():
            if self.fail_with is not None:
                raise self.fail_with
            if self.polling:
                self._sample()
            self._stop.wait(self.interval_s)
        self._sample()

    def _sample(self) -> None:
        s = self.samples
        s["timestamps"].append(self.now())
        current = self._current()
        s["allocated_memory"].append(current["allocated_mib"])
        s["reserved_memory"].append(current["reserved_mib"])
        s["virtual_memory"].append(rss_mib())

    def _allocator(self, kind: str) -> dict:
        """One reading of the allocator's counters, ``kind`` being "current" or "peak", in MiB.

        ``torch.cuda.memory_allocated`` and its siblings each flatten and sort the allocator's
        whole statistics table in Python; the nested table is one C++ call. At a 10 ms poll the
        difference is the tracker's cost on the training thread (it holds the GIL meanwhile).
        """
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # {} before CUDA is initialized
        return {f"{name}_mib": stats[f"{name}_bytes"]["all"][kind] / MIB if stats else 0.0
                for name in ("allocated", "reserved")}

    # ----------------------------------------------------------------- counters
    def _reset_peaks(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _read_peaks(self, wait_for_device: bool = True) -> dict:
        """Peak allocated/reserved since the last reset, then reset: one closed segment.

        The allocator counts on the host, in the order work is queued, so the counters need no
        wait for the GPU; a phase mark waits all the same, so that its time is when the phase ended.
        """
        if not self.cuda:
            return {"peak_allocated_mib": None, "peak_reserved_mib": None}
        if wait_for_device:
            torch.cuda.synchronize(self.device)
        peaks = {f"peak_{key}": value for key, value in self._allocator("peak").items()}
        self._reset_peaks()
        return peaks

    def _current(self) -> dict:
        if not self.cuda:
            return {"allocated_mib": None, "reserved_mib": None}
        return self._allocator("current")

    def mark(self, name: str, **details) -> dict:
        """Close the phase that ends here; the event carries that phase's peaks (and ``details``)."""
        self.events.append({"name": name, "t": self.now(), **self._read_peaks(), "rss_mib": rss_mib(), **details})
        return self.events[-1]

    def record_step(self, step: int) -> dict:
        """One optimizer step, as soon as it is queued: its peaks and what stays allocated after it.
        Its loss and time are filled in once the device has run it (``runner.StepReadback``)."""
        record = {"step": step, "loss": None, "step_time_s": None, "polling": self.polling, "t": self.now(),
                  **self._read_peaks(wait_for_device=False), **self._current(), "rss_mib": rss_mib()}
        self.steps.append(record)
        return record

    def allocator_stats(self) -> dict:
        if not self.cuda:
            return {"num_alloc_retries": None, "num_ooms": None}
        stats = torch.cuda.memory_stats(self.device)
        return {"num_alloc_retries": stats.get("num_alloc_retries", 0), "num_ooms": stats.get("num_ooms", 0)}

    def at_failure(self, error: str | None) -> dict:
        """Where a failed run stood: its last phase and step, the allocator's peak up to the failure
        (the open segment included), and, for an out-of-memory error, the allocation that failed."""
        state = {"last_event": self.events[-1]["name"] if self.events else None, "steps_done": len(self.steps),
                 "peak_allocated_mib_so_far": None, "num_alloc_retries": None, "num_ooms": None,
                 "failed_allocation_mib": failed_allocation_mib(error or ""), **held_at_failure(error or "")}
        try:
            open_segment = self._allocator("peak")["allocated_mib"] if self.cuda else None
            state.update(self.allocator_stats(), peak_allocated_mib_so_far=_max_or_none(
                [seg["peak_allocated_mib"] for seg in self.events + self.steps] + [open_segment]))
        except RuntimeError:  # a broken CUDA context: what the trace holds must do
            pass
        return state

    # ----------------------------------------------------------------- summaries
    def counter_peaks(self) -> dict:
        """Exact peaks: the maximum over every closed segment (events and steps)."""
        segments = self.events + self.steps
        return {key: _max_or_none(seg[key] for seg in segments)
                for key in ("peak_allocated_mib", "peak_reserved_mib")}

    def polled_peaks(self) -> dict:
        return {"peak_allocated_mib": _max_or_none(self.samples["allocated_memory"]),
                "peak_reserved_mib": _max_or_none(self.samples["reserved_memory"]),
                "peak_rss_mib": _max_or_none(self.samples["virtual_memory"])}

    def record(self) -> dict:
        """The per-rank JSON: upstream's four trace keys plus steps and events."""
        return {**self.samples, "steps": self.steps, "events": self.events, "started_at": self.started_at}


_SIZE = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"
_UNITS = {"B": 1 / MIB, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0, "TiB": 1024.0 ** 2}


def failed_allocation_mib(error: str) -> float | None:
    """The size in "Tried to allocate 2.00 GiB" of torch's out-of-memory message."""
    return _size_mib(rf"Tried to allocate {_SIZE}", error)


HELD_AT_FAILURE = ("allowed_mib", "allocated_by_pytorch_mib", "reserved_unallocated_mib")
_HELD_SAID = (rf"{_SIZE} allowed;", rf"{_SIZE} is allocated by PyTorch",
              rf"{_SIZE} is reserved by PyTorch but unallocated")
# The sentence that ends torch's message with them (isolation.describe keeps it where the line is cut short)
OOM_HELD = re.compile(rf"{_HELD_SAID[0]} Of the allocated memory {_HELD_SAID[1]}, and {_HELD_SAID[2]}")


def held_at_failure(error: str) -> dict:
    """What torch's out-of-memory message says the process held when the allocation failed: its limit
    ("39.49 GiB allowed"), allocated, and reserved but not allocated (what fragmentation kept from the
    allocation); None each where the message does not say."""
    return {key: _size_mib(pattern, error) for key, pattern in zip(HELD_AT_FAILURE, _HELD_SAID)}


def gpu_free_mib(error: str) -> float | None:
    """What the GPU had free when the allocation failed ("... of which 122.81 GiB is free"): where it is more than
    the allocation, the process's own limit refused it, not a full GPU."""
    return _size_mib(rf"of which {_SIZE} is free", error)


def _size_mib(pattern: str, error: str) -> float | None:
    match = re.search(pattern, error)
    return float(match.group(1)) * _UNITS[match.group(2)] if match else None


def _max_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None
