"""layout.png: the layout search's candidates, rank 0's memory against tokens per second per GPU of their step (per
rank, and the memory estimated, on a CPU run), each emulated row with its no-overlap and full-overlap bounds."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fsdp2bench.names import MIB  # noqa: E402
from fsdp2bench.report.plots import save  # noqa: E402


def memory_gib(candidate: dict) -> float:
    """Measured (moved by the memory model's difference) where its shapes ran, else the estimate (calibrated where
    a timing of the same levers measured the memory model's error)."""
    memory = candidate["memory"]
    return memory.get("measured_gib", memory.get("calibrated_gib", memory["estimated_gib"]))


GROUPS = (  # (fits, its own layout timed: the step emulated), marker, label
    ((True, True), "o", "fits, step emulated"), ((True, False), ".", "fits, step estimated"),
    ((None, True), "s", "cannot tell if it fits, step emulated"),
    ((None, False), ".", "cannot tell if it fits, step estimated"))


def emulated(candidate: dict) -> bool:
    return candidate["speed"]["labels"]["step"] != "estimated"


# The axes by the device the search ran on: a CPU run measures no GPU memory, and its ranks would share one host.
AXES = {"cuda": ("rank 0's peak reserved, GiB (measured + the memory model's difference where its shapes ran, else "
                 "estimated, calibrated where its levers were timed)",
                 "tokens/s per GPU of a step, communication emulated (bars: no overlap to full overlap)"),
        "cpu": ("rank 0's GPU memory, GiB, estimated by the memory model (a CPU run measures none)",
                "tokens/s per rank (a CPU run: one rank alone on this host, GPU links priced, no overlap measured)")}


def plot_layout_search(plan: dict, path: str) -> None:
    """Each ranked candidate as a point, marked by whether it fits and whether its own layout was timed (its step
    emulated, drawn with its bounds); the cap as a vertical line; the winner ringed. Candidates that do not fit
    have no step and are not drawn (plan.json lists them with how far over)."""
    drawn = [c for c in plan["candidates"] if c["speed"]]
    fig, ax = plt.subplots(figsize=(9, 6))
    for (fits, timed), marker, label in GROUPS:
        points = [c for c in drawn if c["fits"] is fits and emulated(c) is timed]
        if points:
            ax.scatter([memory_gib(c) for c in points], [c["speed"]["tokens_per_s"] for c in points],
                       marker=marker, label=f"{label} ({len(points)})", alpha=0.8 if timed else 0.3,
                       s=40 if timed else 12)
    for c in (c for c in drawn if emulated(c)):
        ax.vlines(memory_gib(c), c["speed"]["no_overlap_tokens_per_s"], c["speed"]["full_overlap_tokens_per_s"],
                  color="grey", linewidth=0.8)
    winner = next((c for c in drawn if plan["winner"] and c["name"] == plan["winner"]["name"]), None)
    if winner:
        ax.scatter([memory_gib(winner)], [winner["speed"]["tokens_per_s"]], s=250, facecolors="none",
                   edgecolors="red", label=f"fastest, its own layout timed: {winner['name']}")
    cap = (plan["meta"].get("gpu_memory") or {}).get("allocator_limit_mib")
    if cap:
        ax.axvline(cap * MIB / (1 << 30), color="grey", linestyle="--", label="the allocator's limit")
    meta = plan["meta"]
    x_label, y_label = AXES["cpu" if meta.get("device") == "cpu" else "cuda"]
    ax.set_xlabel(x_label, fontsize=8)
    ax.set_ylabel(y_label, fontsize=8)
    ended = " (interrupted: only the timings that ended are measured)" if meta.get("interrupted") else ""
    ax.set_title(f"{meta['model']}: N = {meta['world_size']}, {meta['global_batch']} x {meta['block_size']} tokens "
                 f"a step{ended}", fontsize=10)
    ax.legend(fontsize=7)
    save(fig, path)  # marked as the benchmark's: the next search in its folder knows it as its own to remove
