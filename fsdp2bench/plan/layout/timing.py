"""The layout search's timings: which candidate to time next, one timing of it (main.py launches), and what it
tells every candidate of the same per-rank shapes.

A timing runs main.py on one simulated rank of the candidate's own layout with ``--emulate_communication`` over the
search's links: each collective FSDP2 issues waits its time on the stream it is issued on, so the step measured is
what FSDP2's schedule leaves exposed. Every other step of that launch is not emulated: its compute alone, timed in
the same process, with the same allocator state and compiled graphs (two launches differed by up to 6% on an H100,
more than the exposure they were to tell). On a CPU nothing waits: the compute is measured and the communication
priced.

Before any timing has run, the candidates go in the order of a prior (``search.prior_speed``), one per
per-rank shape, until one runs through. From then on every candidate ranks (untimed ones by an estimated
step), and the next timing is the first row on top that is not yet decided (its own layout not timed, or its
memory not measured closely enough to name it): the loop ends when the first ``confirm`` rows are all decided, or
at ``max_timings`` timings, or past ``time_budget_s``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time

from fsdp2bench.files import PROJECT_ROOT, is_ours
from fsdp2bench.names import GIB, MIB, seconds_said
from fsdp2bench.options.links import DTENSOR
from fsdp2bench.plan.layout.candidates import TRAINED, Candidate, estimated_bytes
from fsdp2bench.plan.layout.search import (TIMING_STEPS, Assessed, SearchInputs, calibrate, decided, emulation_flags,
                                           local_share, main_flags, prior_speed, project, ranked)
from fsdp2bench.processes.starting import own_launch_env


def exact_key(row: Assessed) -> tuple:
    """What one timing measures exactly: a layout and its per-rank shapes."""
    return row.candidate.degrees, row.key


RETIMES = 1  # a timing other runs shared (no clean speed, no optimizer time) is taken again this many times


def next_to_time(rows: list[Assessed], setup: SearchInputs, tried: dict, references: list) -> Assessed | None:
    """The most promising untimed shape by the prior until one timing ran through; then the first row on top that
    is not yet decided (None once ``confirm`` rows are): untimed, or timed only beside other runs (``RETIMES``)."""
    if not references:
        shapes = {key for _, key in tried}
        pool = [f for f in rows if f.fits is not False and not f.failed and f.key not in shapes]
        return min(pool, key=lambda f: (-prior_speed(f, setup), f.estimated_bytes), default=None)
    confirmed = 0
    for row in ranked(rows):
        if decided(row, setup):
            confirmed += 1
            if confirmed >= setup.confirm:
                return None
        elif exact_key(row) not in tried or (row.emulated is not None and not row.emulated["clean"]
                                             and tried[exact_key(row)] <= RETIMES):
            return row
    return None


def choose_and_time(rows: list[Assessed], setup: SearchInputs, say, timings: list[dict]) -> None:
    """Time candidates one at a time (``next_to_time``) and project every candidate after each timing, each
    timing into ``timings`` as it ends (an interrupt keeps those)."""
    tried: dict = {}  # each exact key timed: how many times
    references, ratios = [], {}
    started = time.monotonic()
    while len(timings) < setup.max_timings:
        if timings and time.monotonic() - started > setup.time_budget_s:  # the first runs: it names a reference
            say(f"--time_budget_s {setup.time_budget_s:g} s spent: no further timing starts")
            break
        each = next_to_time(rows, setup, tried, references)
        if each is None:
            break
        tried[exact_key(each)] = tried.get(exact_key(each), 0) + 1
        timing = run_timing(each, setup, len(timings))
        timings.append(timing)
        take_timing(timing, each, rows, setup)
        if timing["fits"] and timing.get("microbatch_s"):
            references.append((each.candidate, timing))
        if timing["fits"] and timing.get("peak_reserved_mib") is not None:
            learn_ratio(each, ratios)
            calibrate(rows, setup, ratios)
        for f in rows:
            project(f, setup, references)
        say(f"[timing {len(timings)}/{setup.max_timings}] {each.candidate.name}: " + timing_said(timing))


def learn_ratio(timed: Assessed, ratios: dict) -> None:
    """What the timed candidate's measured memory is of the memory model's estimate, for its levers (with and
    without its loss; the first timing of a kind sets it)."""
    c, ratio = timed.candidate, timed.memory["measured_gib"] * GIB / timed.estimated_bytes
    ratios.setdefault((c.ac, c.loss, c.compile, c.float8), ratio)
    ratios.setdefault((c.ac, c.compile, c.float8), ratio)


def timing_command(candidate: Candidate, setup: SearchInputs, output_dir: str) -> list[str]:
    """main.py for one simulated rank of the candidate's layout, one microbatch a step, alone on the device, its
    communication emulated over the search's links every other step (its compute alone the steps between)."""
    one = dataclasses.replace(candidate, microbatches=1, sync_each_batch=False)
    return [sys.executable, "main.py", *main_flags(one, setup), "--simulate_world_size", str(setup.world_size),
            "--max_steps", str(TIMING_STEPS), "--concurrent_variants", "1", "--quiet", "--output_dir", output_dir,
            *emulation_flags(setup), *(setup.cap.flags() if setup.cap else []),
            *(["--device", "cpu"] if setup.device_type != "cuda" else
              ["--init_device", setup.init_device] if setup.init_device != "meta" else [])]


def timing_dir(output_dir: str, index: int) -> str:
    """The folder of a search's timing ``index`` (its main.py's --output_dir)."""
    return os.path.join(output_dir, "timings", f"t{index}")


def run_timing(row: Assessed, setup: SearchInputs, index: int) -> dict:
    """One timing: one launch, its summary read back into the figures the ranking uses; an out-of-memory error (or
    any other failure) is kept with its words."""
    directory = timing_dir(setup.output_dir, index)
    ran = launch(timing_command(row.candidate, setup, directory), directory, setup.world_size)
    record = {"candidate": row.candidate.name, **{k: ran[k] for k in ("command", "exit_code", "wall_s")},
              "local_share": local_share(row.candidate)}
    if "error" in ran:
        return failed(record, ran["error"])
    return {**record, "fits": True, **timed_figures(ran["entry"])}


def failed(record: dict, why: str) -> dict:
    return {**record, "fits": False if "out of memory" in why else None, "error": why}


def launch(command: list[str], directory: str, world_size: int) -> dict:
    """One main.py launch and rank 0's entry of its summary, or why there is none (an earlier search's summary in
    a directory run again is never read as this launch's)."""
    summary = os.path.join(directory, "summary.json")
    if is_ours(summary):
        os.remove(summary)
    began = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, env=own_launch_env())
    ran = {"command": shlex.join(["python3", *command[1:]]), "exit_code": proc.returncode,
           "wall_s": round(time.monotonic() - began, 1)}
    entry = summary_entry(summary, world_size)
    if entry is None or entry.get("status") != "ok":
        return {**ran, "error": (entry or {}).get("status") or (proc.stderr.strip().splitlines() or ["no summary"])[-1]}
    return {**ran, "entry": entry}


def timed_figures(entry: dict) -> dict:
    """What a timing's launch measured: its compute (a microbatch and its optimizer step: the median of the steps not
    emulated), rank 0's peaks, and its emulated step: on a GPU the median of the emulated steps, on a CPU (nothing
    waited) the compute + the communication priced. Its communication is FSDP2's and HSDP's, whose overlap the step
    shows; DTensor's (TP's, CP's), waited whole on the compute stream, apart (``dtensor_s``). Clean only where the
    steps of both halves were; beside other runs the compute is the median of every step, which decides nothing."""
    tally, halves = entry["emulated"][0], entry["speed"]["emulation"]
    waited, compute = tally["waited_on_the_gpu"], halves["compute_only"]
    unclean = unclean_why(compute) or (unclean_why(halves["emulated"]) if waited else None)
    microbatch = compute["median_step_time_s"] or entry["median_step_time_s"]
    step = (halves["emulated"]["median_step_time_s"] or microbatch) if waited else \
        microbatch + tally["emulated_s_per_step"]
    dtensor = sum(e["emulated_s"] for kind, e in tally["per_step"].items() if kind.endswith(DTENSOR))
    return {"clean": unclean is None, **({"unclean": unclean} if unclean else {}), "speed": entry["speed"],
            "microbatch_s": microbatch, "optimizer_s": compute["median_optimizer_s"],
            "peak_reserved_mib": entry["training_peak_reserved_mib"]["max"],
            "peak_allocated_mib": entry["training_peak_allocated_mib"]["max"],
            "emulated": {"step_s": step, "comm_s": tally["emulated_s_per_step"] - dtensor, "dtensor_s": dtensor,
                         "waited_on_the_gpu": waited, "per_step": tally["per_step"]}}


def unclean_why(speed: dict) -> str | None:
    """Why a half of a timing's steps cannot rank a candidate (None where it can): steps shared with other runs leave
    no clean speed and no optimizer time (taken as 0, it made layouts that differ in their optimizer's share tie)."""
    if speed.get("tokens_per_s_per_gpu") is None:
        return speed.get("not_measured") or "no clean step"
    if speed.get("median_optimizer_s") is None:
        return "no optimizer time measured"
    return None


def summary_entry(path: str, world_size: int) -> dict | None:
    try:
        with open(path) as f:
            summary = json.load(f)
        return summary["simulated"][str(world_size)]["0"][TRAINED]
    except (OSError, ValueError, KeyError):
        return None


def take_timing(timing: dict, probed: Assessed, everyone: list[Assessed], setup: SearchInputs) -> None:
    """A timing to every candidate of the same per-rank shapes: its compute, and its memory moved by what the
    memory model says each holds beside the timed launch (a measurement on a candidate's own layout is kept over
    one on a like layout)."""
    one = dataclasses.replace(probed.candidate, microbatches=1, sync_each_batch=False)
    probed_one = estimated_bytes(one, setup.shapes, setup.config, setup.block, setup.base, setup.held)
    for row in (f for f in everyone if f.key == probed.key):
        moved = row.estimated_bytes - probed_one
        if timing["fits"] is None:
            row.failed = f"a timing of its shapes failed: {timing['error']}"
        elif timing["fits"] is False:
            if moved >= 0:
                row.fits, row.out_of_memory = False, True
                row.memory["how"] = f"out of memory where a like candidate ran: {timing['error']}"
        else:
            own = row.candidate.degrees == probed.candidate.degrees
            take_measured(row, timing, moved, own, setup)
            if own and (row.emulated is None or timing["clean"] or not row.emulated["clean"]):
                row.emulated = timing  # its own layout's step, the communication emulated (a clean one kept)


def take_measured(row: Assessed, timing: dict, moved: int, own: bool, setup: SearchInputs) -> None:
    """A timing on the candidate's own layout wins over one on a like layout, for its compute (a rank holding
    more state can run slower than its FLOPs say, its allocator nearer the cap) as for its memory; for its compute,
    a clean timing wins over both (one beside other runs has no clean speed and no optimizer time)."""
    held = None if row.compute is None else (bool(row.compute.get("clean")), row.compute_own)
    new = (bool(timing["clean"]), own)
    if held is None or new > held or (own and new == held):
        row.compute, row.compute_own = timing, own
    if timing["peak_reserved_mib"] is None or (row.memory.get("own_layout") and not own):
        return  # a CPU run has no allocator peaks
    measured = timing["peak_reserved_mib"] * MIB + moved
    row.memory.pop("over_gib", None)
    row.memory.update(measured_gib=measured / GIB, moved_gib=moved / GIB, own_layout=own,
                        how=f"measured on rank 0 ({'its own layout' if own else 'a like candidate'} at one "
                            "microbatch) + the memory model's difference")
    if setup.cap is not None:
        row.fits = measured <= setup.cap.allocator_bytes


def clipped(text: str, width: int) -> str:
    """``text`` within ``width`` characters for a console line, cut at a word and said to be cut (plan.json keeps
    it whole)."""
    if len(text) <= width:
        return text
    return text[:width - 4].rsplit(" ", 1)[0] + " ..."


def timing_said(timing: dict) -> str:
    if not timing["fits"]:
        return f"did not run through ({clipped(timing.get('error', ''), 160)})"
    clean = "" if timing["clean"] else f" (not clean: {timing['unclean']}; it decides no ranking)"
    peak, emulated = timing["peak_reserved_mib"], timing["emulated"]
    comm = seconds_said(emulated["comm_s"])
    how = (f"{seconds_said(emulated['step_s'])} with its {comm} of communication emulated" if
           emulated["waited_on_the_gpu"] else f"its {comm} of communication priced (a CPU: nothing waits)")
    return f"{seconds_said(timing['microbatch_s'])} a microbatch of compute measured, {how}{clean}" + \
        (f", {peak:,.0f} MiB reserved measured" if peak is not None else "") + f" ({timing['wall_s']:.0f} s)"
