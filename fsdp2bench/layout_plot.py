"""layout.png: the layout search's candidates, rank 0's memory against projected tokens per second per GPU."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fsdp2bench.names import MIB  # noqa: E402

GIB_PER_MIB = 1 / 1024


def memory_gib(candidate: dict) -> float:
    """Measured (moved by the memory model's difference) where a like candidate ran, else the estimate."""
    memory = candidate["memory"]
    return memory.get("measured_gib", memory["estimated_gib"])


def plot_layout_search(plan: dict, path: str) -> None:
    """Each projected candidate as a point: filled where it fits (or, without a cap, may), crossed where it does
    not; the cap as a vertical line; the winner ringed. Candidates with no timing have no projected speed and are
    not drawn (plan.json lists them)."""
    drawn = [c for c in plan["candidates"] if c["projected"]]
    fig, ax = plt.subplots(figsize=(9, 6))
    for fits, marker, label in ((True, "o", "fits"), (None, "o", "cannot tell (no cap)"), (False, "x", "does not fit")):
        points = [c for c in drawn if c["fits"] is fits]
        if points:
            ax.scatter([memory_gib(c) for c in points], [c["projected"]["no_overlap_tokens_per_s"] for c in points],
                       marker=marker, label=label, alpha=0.7, facecolors="none" if fits is None else None)
    winner = next((c for c in drawn if plan["winner"] and c["name"] == plan["winner"]["name"]), None)
    if winner:
        ax.scatter([memory_gib(winner)], [winner["projected"]["no_overlap_tokens_per_s"]], s=250, facecolors="none",
                   edgecolors="red", label=f"fastest: {winner['name']}")
    cap = (plan["meta"].get("gpu_memory") or {}).get("allocator_limit_mib")
    if cap:
        ax.axvline(cap * MIB / (1 << 30), color="grey", linestyle="--", label="the allocator's limit")
    meta = plan["meta"]
    ax.set_xlabel("rank 0's peak reserved, GiB (measured on a like candidate + the memory model's difference, "
                  "else estimated)", fontsize=8)
    ax.set_ylabel("tokens/s per GPU, projected (compute measured + communication projected, no overlap)", fontsize=8)
    ax.set_title(f"{meta['model']}: N = {meta['world_size']}, {meta['global_batch']} x {meta['block_size']} tokens "
                 f"a step", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
