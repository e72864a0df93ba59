"""What ``plan.py --find layout`` writes: the ranked table with each figure labelled measured, projected or
estimated, the candidates that do not fit and by how much, the winner's command lines, and plan.json."""

from __future__ import annotations

import json
import os

from fsdp2bench.cli import save_summary, say
from fsdp2bench.layout_search import Assessed, Setup, commands, ranked, record

SHOWN = 15  # ranked rows on the console (plan.json holds every candidate)


def table(found: list[Assessed], setup: Setup) -> list[str]:
    """The fitting candidates, fastest first by projected tokens/s (no overlap), and the largest-memory ones
    that do not fit."""
    lines = [f"{'#':>3} {'candidate':58} {'memory GiB':>17} {'compute s':>10} {'comm s':>8} "
             f"{'tok/s/GPU':>10} {'full overlap':>12}",
             f"{'':>3} {'':58} {'':>17} {'measured':>10} {'project.':>8} {'projected':>10} {'projected':>12}"]
    for i, f in enumerate(ranked(found)[:SHOWN], 1):
        p = f.projected
        clean = "" if p["compute_clean"] else "~"
        lines.append(f"{i:>3} {f.candidate.name[:58]:58} {memory_said(f):>17} {p['compute_s']:>9.3f}{clean:1} "
                     f"{p['comm_s']:>8.3f} {p['no_overlap_tokens_per_s']:>10,.0f} "
                     f"{p['full_overlap_tokens_per_s']:>12,.0f}")
    return lines


def memory_said(found: Assessed) -> str:
    m = found.memory
    if "measured_gib" in m:
        return f"{m['measured_gib']:.1f} measured+"
    return f"{m['estimated_gib']:.1f} estimated"


def not_fitting(found: list[Assessed]) -> list[str]:
    """How many candidates do not fit, and by how much the closest of each layout misses."""
    out = [f for f in found if f.fits is False]
    if not out:
        return []
    closest: dict = {}
    for f in out:
        key = f.candidate.degrees
        over = f.memory.get("over_gib")
        if over is not None and (key not in closest or over < closest[key].memory["over_gib"]):
            closest[key] = f
    lines = [f"{len(out)} of {len(found)} candidates do not fit; the closest of each layout, by the memory "
             "model's estimate over the cap (not run):"]
    lines += [f"    {f.candidate.name}: {f.memory['over_gib']:.1f} GiB over (estimated)"
              for f in sorted(closest.values(), key=lambda f: f.memory["over_gib"])[:8]]
    measured = [f for f in out if "over_gib" not in f.memory]
    if measured:
        lines.append(f"    {len(measured)} more did not fit where a like candidate ran out of memory (measured)")
    return lines


def print_search(found: list[Assessed], setup: Setup, notes: list[str], timings: list[dict]) -> Assessed | None:
    """The table, the misses, what was left out and the winner's commands; returns the winner."""
    for line in table(found, setup):
        print(line, flush=True)
    cap = f"under {setup.cap.gib:g} GiB" if setup.cap else "(a CPU run: no cap, so it cannot tell what fits)"
    say(f"Ranked by projected tokens per second per GPU {cap}: compute measured (one simulated rank alone on the "
        f"device, {len(timings)} timings; ~ where other runs shared it), communication projected over "
        f"{setup.links.within_gbps:g} GB/s within a node of {setup.links.node_size} and {setup.links.across_gbps:g} "
        "GB/s across nodes, added (no overlap); 'full overlap' takes the larger of the two. Memory: measured+ is "
        "rank 0's peak reserved measured on a like candidate, moved by the memory model's difference.")
    for line in not_fitting(found) + [f"Left out: {note}" for note in notes]:
        say(line)
    best = ranked(found)
    if not best:
        say("No timed candidate fits: nothing to rank (see plan.json for every candidate's estimate).")
        return None
    said = commands(best[0].candidate, setup)
    print(f"\nThe fastest by projection: {best[0].candidate.name}\n    {said['torchrun']}\nCheck it on one GPU "
          f"first:\n    {said['one_gpu_check']}\naccelerate config fields (accelerate_config.json; the loss and "
          f"selective checkpointing stay main.py flags):\n    {json.dumps(said['accelerate_config'])}", flush=True)
    return best[0]


def write_search(found: list[Assessed], setup: Setup, notes: list[str], timings: list[dict], meta: dict,
                 winner: Assessed | None) -> str:
    """plan.json: every candidate (estimated, measured, projected, each labelled) and every timing."""
    path = os.path.join(setup.output_dir, "plan.json")
    said = commands(winner.candidate, setup) if winner else None
    save_summary(path, {"meta": {**meta, "find": "layout", "candidates": len(found), "timings": len(timings),
                                 "links": vars(setup.links), "left_out": notes,
                                 "labels": {"memory.estimated_gib": "estimated (memory model)",
                                            "memory.measured_gib": "measured (+ the memory model's difference)",
                                            "projected": "compute measured, communication projected",
                                            "projected_comm_s": "projected"}},
                        "winner": None if winner is None else {"name": winner.candidate.name, "commands": said},
                        "candidates": [record(f, setup.links) for f in found], "timings": timings})
    if said:
        save_summary(os.path.join(setup.output_dir, "accelerate_config.json"), said["accelerate_config"])
    return path
