"""What ``plan.py --find layout`` writes: the ranked table with each figure labelled measured, emulated, projected or
estimated, the candidates that do not fit and by how much, the winner's figures and command lines, and plan.json."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

import utils

from fsdp2bench.cli import UserError, say
from fsdp2bench.files import digest_of, save_summary, write_bytes
from fsdp2bench.memory.estimate import GpuCap
from fsdp2bench.names import GIB, counted, seconds_said, size_said
from fsdp2bench.options import accelerate_config
from fsdp2bench.options.links import links_said
from fsdp2bench.options.tuning import Tuning
from fsdp2bench.plan.layout.search import Assessed, SearchInputs, commands, decided, ranked, record, winner_of
from fsdp2bench.plan.layout.timing import RETIMES, clipped

CONFIG_NAME = "accelerate_config.json"
PLAN_NAME = "plan.json"  # both modes' record
SHOWN = 15  # ranked rows on the console (plan.json holds every candidate)


def table(rows: list[Assessed], setup: SearchInputs) -> list[str]:
    """The fitting candidates, fastest first by their step, each figure with its mark, the bounds beside it."""
    per = "GPU" if setup.cap else "rank"  # a CPU run has ranks, no GPU
    lines = [f"{'#':>3} {'candidate':58} {'memory GiB':>17} {'compute s':>10} {'comm s':>9} {'step s':>9} "
             f"{'tok/s/' + per:>10} {'no overlap':>10} {'full overlap':>12}",
             f"{'':>3} {'':58} {'':>17} {'':>10} {'':>9} {'':>9} {'by step':>10} {'bound':>10} {'bound':>12}"]
    in_order = ranked(rows)
    for i, f in enumerate(in_order[:SHOWN], 1):
        p = f.speed
        lines.append(f"{i:>3} {f.candidate.name[:58]:58} {memory_said(f):>17} {p['compute_s']:>9.3f}"
                     f"{compute_mark(p):1} {p['comm_s']:>8.3f}{comm_mark(p):1} {p['step_s']:>8.3f}{step_mark(p):1} "
                     f"{p['tokens_per_s']:>10,.0f} {p['no_overlap_tokens_per_s']:>10,.0f} "
                     f"{p['full_overlap_tokens_per_s']:>12,.0f}{undecided_said(f, setup)}")
    if len(in_order) > SHOWN:
        lines.append(f"{'':>3} the first {SHOWN} of {counted(len(in_order), 'ranked row')} shown; the other "
                     f"{len(in_order) - SHOWN} are in {os.path.join(setup.output_dir, PLAN_NAME)} (every candidate)")
    return lines


def undecided_said(row: Assessed, setup: SearchInputs) -> str:
    """Why a row cannot be named: its compute timed only beside other runs, or not measured enough."""
    if decided(row, setup):
        return ""
    return "  (not clean)" if row.speed["compute_measured"] and not row.speed["compute_clean"] \
        else "  (estimated)"


def unclean_said(timings: list[dict]) -> str | None:
    """The line that says which timings decide nothing (shared with other runs), or None."""
    unclean = [t for t in timings if t.get("fits") and not t["clean"]]
    if not unclean:
        return None
    return (f"{len(unclean)} of {counted(len(timings), 'timing')} not clean ({unclean[0]['unclean']}): no clean "
            f"speed or no optimizer time, each taken again up to {counted(RETIMES, 'time')}; the rows resting on "
            "them (~, marked 'not clean') rank but decide nothing, never the winner. Run it again with the device to "
            "itself.")


def compute_mark(speed: dict) -> str:
    """Blank where measured on the candidate's own shapes alone on the device; ``~`` measured beside other runs;
    ``e`` estimated from a like timing."""
    if not speed["compute_measured"]:
        return "e"
    return "" if speed["compute_clean"] else "~"


def comm_mark(speed: dict) -> str:
    """Blank where the emulation counted it on the candidate's own layout; ``p`` projected from the shapes."""
    return "" if speed["labels"]["communication"].startswith("emulated") else "p"


def step_mark(speed: dict) -> str:
    """Blank where its own layout's timing gave the exposed share; ``e`` where a like layout's did."""
    return "e" if speed["labels"]["step"] == "estimated" else ""


def memory_said(row: Assessed) -> str:
    m = row.memory
    if "measured_gib" in m:
        return f"{m['measured_gib']:.1f} measured" + ("" if m.get("own_layout") else "+")
    if "calibrated_gib" in m:
        return f"{m['calibrated_gib']:.1f} calibrated"
    return f"{m['estimated_gib']:.1f} estimated"


LISTED = 8  # candidates named per line of what does not fit (plan.json holds every one)


def not_fitting(rows: list[Assessed], cap: GpuCap | None) -> list[str]:
    """How many candidates do not fit, each counted once by what decided it (a like candidate's timing that ran out
    of memory, else rank 0's measured peak, else the estimate), and the closest of each kind."""
    out = [f for f in rows if f.fits is False]
    if not out:
        return []
    failed = [f for f in out if f.out_of_memory]
    measured = [f for f in out if not f.out_of_memory and "measured_gib" in f.memory]
    estimated = [f for f in out if not f.out_of_memory and "measured_gib" not in f.memory]
    kinds = [(failed, "measured: a like candidate's timing ran out of memory"),
             (measured, "measured: rank 0's peak reserved, moved by the memory model's difference (accumulation, a "
                        "larger shard), over the allocator's limit"),
             (estimated, "estimated: over the cap by the memory model's estimate, calibrated where a timing of the "
                         "same levers measured it (not run)")]
    lines = [f"{len(out)} of {counted(len(rows), 'candidate')} {'does' if len(out) == 1 else 'do'} not fit, each "
             "counted once: " + "; ".join(f"{len(kind)} {what}" for kind, what in kinds if kind)]
    if failed:
        lines.append("    out of memory where a like candidate ran: " + names_said(failed))
    if measured:
        limit = cap.allocator_bytes / GIB  # a measurement rules a candidate out only under a cap
        closest = sorted(measured, key=lambda f: f.memory["measured_gib"])
        lines.append(f"    over the allocator's limit of {limit:.1f} GiB, the closest: " + names_said(
            closest, lambda f: f" ({' GiB '.join(memory_said(f).split(' ', 1))}, "
                               f"{size_said((f.memory['measured_gib'] - limit) * GIB)} over)"))
    if estimated:
        closest_of_layout: dict = {}
        for f in sorted(estimated, key=lambda f: f.memory["over_gib"]):
            closest_of_layout.setdefault(f.candidate.degrees, f)
        lines.append("    over the cap by the estimate, the closest of each layout: " + names_said(
            list(closest_of_layout.values()), lambda f: f" ({f.memory['over_gib']:.1f} GiB over, {estimate_kind(f)})"))
    return lines


def estimate_kind(row: Assessed) -> str:
    return "calibrated" if "calibrated_gib" in row.memory else "estimated"


def names_said(rows: list[Assessed], figures: Callable[[Assessed], str] = lambda f: "") -> str:
    """The first ``LISTED`` candidates by name, each with its ``figures``, and how many more there are."""
    said = "; ".join(f"{f.candidate.name}{figures(f)}" for f in rows[:LISTED])
    return said + (f"; and {len(rows) - LISTED} more (plan.json)" if len(rows) > LISTED else "")


def print_search(rows: list[Assessed], setup: SearchInputs, notes: list[str], timings: list[dict],
                 said: dict | None) -> None:
    """The table, the misses, what was left out and the winner's commands (``said``)."""
    for line in table(rows, setup):
        print(line, flush=True)
    say(legend(rows, setup, timings))
    unclean = unclean_said(timings)
    for line in not_fitting(rows, setup.cap) + not_ranked(rows) + ([unclean] if unclean else []) + \
            [f"Left out: {note}" for note in notes]:
        say(line)
    if said is None:
        say("No candidate is measured enough to name (see plan.json for every estimate): raise --max_timings or "
            "--time_budget_s.")
        return
    place = said["place"]
    above = f" (row {place}: the {place - 1} above it rest on estimates or on timings that are not clean)" \
        if place > 1 else ""
    tuned = ", the fine-tuning (--peft, --optimizer)" if setup.base.tuning != Tuning() else ""
    config = (f"accelerate config fields ({CONFIG_NAME}; the loss, selective checkpointing{tuned} and the "
              f"accumulation stay main.py flags):\n    {json.dumps(said['accelerate_config'])}"
              if not said["accelerate_refuses"] else
              f"accelerate refuses this layout ({said['accelerate_refuses']}): train it with torchrun")
    check = "Check it on one GPU first" if setup.cap else "Check it here first (a CPU run: one process plays rank 0)"
    print(f"\nThe fastest by its step, its own layout timed{above}: {said['name']}\n    {said['figures']}"
          f"\n    {said['torchrun']}\n{check}:\n    {said['one_gpu_check']}\n{config}", flush=True)
    if not setup.cap:
        say(CPU_TELLS)


def figures_said(row: Assessed, setup: SearchInputs) -> str:
    """Each of a row's figures with what it is: measured, emulated, projected or estimated."""
    p, per = row.speed, "GPU" if setup.cap else "rank"
    labels = p["labels"]
    hidden = f", {1 - p['exposed_share']:.0%} of it hidden by FSDP2's schedule" if labels["step"] == "emulated" else ""
    return (f"compute {seconds_said(p['compute_s'])} a step {labels['compute']}; communication "
            f"{seconds_said(p['comm_s'])} {labels['communication']}; step {seconds_said(p['step_s'])} {labels['step']}"
            f"{hidden}: {p['tokens_per_s']:,.0f} "
            f"tokens/s per {per} (bounds: {p['no_overlap_tokens_per_s']:,.0f} with no overlap, "
            f"{p['full_overlap_tokens_per_s']:,.0f} with full overlap)")


def winner_said(rows: list[Assessed], setup: SearchInputs) -> dict | None:
    """The winner's name, place and command lines, its accelerate config written and read back through accelerate's
    own loader and objects (a layout accelerate refuses gets no config file, and its reason)."""
    winner, place = winner_of(rows, setup)
    if winner is None:
        return None
    said = {"name": winner.candidate.name, "place": place, "figures": figures_said(winner, setup),
            **commands(winner.candidate, setup)}
    path = os.path.join(setup.output_dir, CONFIG_NAME)
    said["accelerate_refuses"] = write_unmarked(path, said["accelerate_config"]) or tp_refusal(winner.candidate, path)
    said[CONFIG_DIGEST] = None if said["accelerate_refuses"] else digest_of(path)
    return said


CONFIG_DIGEST = "accelerate_config_sha256"  # in plan.json: the config as written, told from one edited since


def written_config_digest(plan: str) -> str | None:
    """The digest of the accelerate config the search that wrote ``plan`` (plan.json) wrote beside it, or None."""
    try:
        with open(plan) as f:
            winner = json.load(f).get("winner") or {}
        return (winner.get("commands") or {}).get(CONFIG_DIGEST)
    except (OSError, ValueError, AttributeError):
        return None


# What a search on the CPU can and cannot tell, said where its winner is.
CPU_TELLS = ("A CPU run checks the search, not the speed: each timing is one simulated rank alone on this host's cores "
             "(N ranks here would share them); on a CPU nothing waits for the emulated communication, so the overlap "
             "is not measured: each step is the compute plus the communication priced over GPU links it does not have, "
             "added with no overlap (the no-overlap bound). The memory column is the memory model's estimate for a GPU "
             "(its CUDA context and workspaces included), not this host's. What it does tell: which layouts and levers "
             "this model admits at N, the collectives each one issues, that each candidate's commands run, and how the "
             "search would rank them. A real ranking needs a GPU.")


def legend(rows: list[Assessed], setup: SearchInputs, timings: list[dict]) -> str:
    cap = f"under {setup.cap.gib:g} GiB" if setup.cap else "(a CPU run: no cap, so it cannot tell what fits)"
    per = "GPU" if setup.cap else "rank"
    rows = ranked(rows)
    measured = sum(f.speed["compute_measured"] for f in rows)
    emulated = sum(f.speed["labels"]["step"] != "estimated" for f in rows)
    overlap = ("each collective FSDP2 issues waited its time on the stream it is issued on, held by the links' "
               "channels as CTAs that take SMs and move its bytes, so the step is what FSDP2's schedule leaves exposed"
               if setup.device_type == "cuda" else
               "on a CPU nothing waits: the step is compute + the communication priced, no overlap (not measured)")
    return (f"Ranked by tokens per second per {per} of a step {cap}, {counted(len(rows), 'candidate')}. Step: "
            f"emulated on {emulated} (their own layout timed with its communication emulated over "
            f"{links_said(setup.links)}: {overlap}); e: estimated, the compute + the share of the "
            "communication the timed layouts of the same shape (which axes are split) left exposed, else every timed "
            f"layout's. Compute measured on {measured} (one simulated rank alone on the device, "
            f"{counted(len(timings), 'timing')} of one launch each, its compute in the steps between the emulated "
            "ones; ~ where other runs shared it), estimated (e) on the rest from the nearest timing's FLOP/s and the "
            "levers' ratios. Communication: counted by the emulation on the candidate's own layout, else projected "
            "(p) from the shapes; TP's and CP's are projected and add whole (the emulation waits them on the compute "
            "stream, so a timing's exposed share leaves them out). Bounds: compute + all the communication (no "
            "overlap), the larger of the two (full overlap). Memory: measured is rank 0's peak reserved on the "
            "candidate's own layout, measured+ on a like candidate, each moved by the memory model's difference "
            "(accumulation); calibrated is the memory model's estimate times the ratio of measured to estimated under "
            "the same levers; estimated is the memory model alone. Rows marked (estimated) are not measured enough to "
            "be named.")


def not_ranked(rows: list[Assessed]) -> list[str]:
    failed = [f for f in rows if f.failed]
    return [f"{counted(len(failed), 'candidate')} not ranked: {clipped(failed[0].failed, 240)}"] if failed else []


def write_search(rows: list[Assessed], setup: SearchInputs, notes: list[str], timings: list[dict], meta: dict,
                 said: dict | None) -> str:
    """plan.json: every candidate (estimated, measured, projected, each labelled) and every timing."""
    path = os.path.join(setup.output_dir, PLAN_NAME)
    save_summary(path, {"meta": {**meta, "find": "layout", "candidates": len(rows), "timings": len(timings),
                                 "unclean_timings": unclean_said(timings),
                                 "links": vars(setup.links), "left_out": notes,
                                 "labels": {"memory.estimated_gib": "estimated (memory model)",
                                            "memory.state_bytes": "exact (memory model: rank 0's parameters, "
                                                                  "gradients and optimizer state after its step)",
                                            "memory.measured_gib": "measured (+ the memory model's difference)",
                                            "speed": "each figure's own in speed.labels: compute measured or "
                                                     "estimated (compute_clean false: measured beside other runs, "
                                                     "deciding nothing); communication emulated (counted on its own "
                                                     "layout) or projected; step_s emulated or estimated (from "
                                                     "exposed_share_from); no_overlap and full_overlap: bounds",
                                            "projected_comm_s": "projected"}},
                        "winner": None if said is None else {"name": said["name"], "commands": said},
                        "candidates": [record(f, setup.links) for f in rows], "timings": timings})
    return path


def tp_refusal(candidate, path: str) -> str | None:
    """accelerate's prepare() under FSDP2 + TP imports a name the installed transformers may lack (main.py reports
    such a run as unsupported): no config is offered for a layout it could not prepare."""
    missing = utils.name_prepare_cannot_import() if candidate.degrees.tp > 1 else None
    if missing is None:
        return None
    if os.path.isfile(path):
        os.remove(path)
    return f"the installed accelerate cannot prepare FSDP2 + TP with this transformers ({missing})"


def write_unmarked(path: str, fields: dict) -> str | None:
    """The accelerate config without the benchmark's mark, which accelerate's loader would refuse as an unknown
    key (``checks.check_config_path`` guards the name instead), read back as main.py's --config_file reads
    it: None, or why accelerate refuses it (the file then removed)."""
    try:
        write_bytes(path, json.dumps(fields, indent=1).encode())
    except OSError as exc:
        print(f"warning: cannot write {path} ({exc.strerror or type(exc).__name__})", file=sys.stderr, flush=True)
        return None
    try:
        accelerate_config.read(path)
    except UserError as exc:
        os.remove(path)
        return str(exc).split(": accelerate refuses it: ", 1)[-1]
    return None
