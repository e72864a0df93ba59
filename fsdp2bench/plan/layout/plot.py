"""layout.png: the layout search's candidates, rank 0's memory against projected tokens per second per GPU (per rank,
and the memory estimated, on a CPU run)."""

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


GROUPS = (  # (fits, compute measured), marker, label
    ((True, True), "o", "fits, compute measured"), ((True, False), ".", "fits, compute estimated"),
    ((None, True), "s", "cannot tell if it fits, compute measured"),
    ((None, False), ".", "cannot tell if it fits, compute estimated"))


# The axes by the device the search ran on: a CPU run measures no GPU memory, and its ranks would share one host.
AXES = {"cuda": ("rank 0's peak reserved, GiB (measured + the memory model's difference where its shapes ran, else "
                 "estimated, calibrated where its levers were timed)",
                 "tokens/s per GPU, projected (compute + communication, no overlap)"),
        "cpu": ("rank 0's GPU memory, GiB, estimated by the memory model (a CPU run measures none)",
                "tokens/s per rank, projected (a CPU run: one rank alone on this host, GPU links assumed)")}


def plot_layout_search(plan: dict, path: str) -> None:
    """Each ranked candidate as a point, marked by whether it fits and whether its compute was measured; the cap
    as a vertical line; the winner ringed. Candidates that do not fit have no projected speed and are not drawn
    (plan.json lists them with how far over)."""
    drawn = [c for c in plan["candidates"] if c["projected"]]
    fig, ax = plt.subplots(figsize=(9, 6))
    for (fits, measured), marker, label in GROUPS:
        points = [c for c in drawn if c["fits"] is fits and c["projected"]["compute_measured"] is measured]
        if points:
            ax.scatter([memory_gib(c) for c in points], [c["projected"]["no_overlap_tokens_per_s"] for c in points],
                       marker=marker, label=f"{label} ({len(points)})", alpha=0.8 if measured else 0.3,
                       s=40 if measured else 12)
    winner = next((c for c in drawn if plan["winner"] and c["name"] == plan["winner"]["name"]), None)
    if winner:
        ax.scatter([memory_gib(winner)], [winner["projected"]["no_overlap_tokens_per_s"]], s=250, facecolors="none",
                   edgecolors="red", label=f"fastest measured: {winner['name']}")
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
