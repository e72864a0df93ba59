"""A matrix of FSDP2 option sets: each set a full suite of the four variants, real and simulated N.

Each option set is two launches of main.py, so that each keeps its own processes, store and files:
one at the launch's own world size (losses and every check), then, with ``--simulate_world_size``,
a sweep of simulated ranks. Each writes its usual summary.json; ``matrix.json`` gathers one row per
(option set, variant, N) and the findings per option set. No torch here: this process only launches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from fsdp2bench.files import write_json
from fsdp2bench.names import INTENDED, MIB, UNFIXED, counted, step_peak_state
from fsdp2bench.options.fsdp import OPTION_SETS
from fsdp2bench.processes.starting import CANCELLED, GO, START_GATE, open_gate
from fsdp2bench.train import throughput

# A launch's exit code after SIGINT, SIGTERM or SIGHUP (main.py's 130; torchrun's 128 + the signal), or killed by one.
INTERRUPTED_CODES = (130, 143, 129, -2, -15, -1)
ACCELERATE, REFERENCE = "accelerate", INTENDED[0]  # accelerate against torch's intended way
SWEEP_DIR = "sweep"


def set_dir(output_dir: str, name: str) -> str:
    return os.path.join(output_dir, name)


def launch_command(nproc: int, args: list[str]) -> list[str]:
    """main.py as a user runs it: plain python for one process, torchrun for several."""
    if nproc == 1:
        return [sys.executable, "main.py", *args]
    return [sys.executable, "-m", "fsdp2bench.processes.torchrun", "--standalone", f"--nproc_per_node={nproc}", "main.py",
            *args]


def fitting_sizes(option_set: str, sizes: list[int]) -> list[int]:
    """The world sizes an option set runs at: where its layout's sizes fit N (an HSDP set's node of 8
    ranks needs N = 8, 16, ...; tp2_cp2 needs a multiple of 4)."""
    return [n for n in sizes if OPTION_SETS[option_set].layout.fits(n)]


def launches(output_dir: str, sets: list[str], wanted: list[int], sweep_steps: int, nproc: int,
             forwarded: list[str], refused: dict[str, str] | None = None) -> tuple[list[tuple[str, str, list]], list[str]]:
    """(option set, its directory, main.py arguments) of every launch, in order, and a note for each
    launch an option set cannot make at these world sizes, or at all (``refused``: why its layout cannot
    run this model here). A sweep takes ``sweep_steps`` steps whatever the real runs take: its memory
    settles after the first step; ``wanted``: the simulated world sizes, smallest first (none: no sweeps)."""
    out, skipped = [], []
    for name in sets:
        if name in (refused or {}):
            skipped.append(f"{name}: not run ({refused[name]})")
            continue
        flags = OPTION_SETS[name].flags()
        if nproc and fitting_sizes(name, [nproc]):
            out.append((name, set_dir(output_dir, name), [*forwarded, *flags, "--output_dir", set_dir(output_dir, name)]))
        elif nproc:
            skipped.append(f"{name}: no real run on {counted(nproc, 'rank')} (its layout's sizes do not divide it)")
        fitting = fitting_sizes(name, wanted)
        if fitting:
            sweep = os.path.join(set_dir(output_dir, name), SWEEP_DIR)
            out.append((name, sweep, [*forwarded, *flags, "--simulate_world_size", ",".join(map(str, fitting)),
                                      "--max_steps", str(sweep_steps), "--output_dir", sweep]))
        if len(fitting) < len(wanted):
            skipped.append(f"{name}: not simulated at N = {', '.join(str(n) for n in wanted if n not in fitting)} "
                           "(its layout's sizes do not divide N)")
    return out, skipped


class Launches:
    """The launches in order, each started while the one before it runs.

    A launch's imports and set-up (about 11 s on one H200) overlap the training of the launch before
    it; it then waits (``starting.wait_for_turn``) until this process writes its gate file, once the
    launch before it has ended, so that no two launches ever train at the same time.
    """

    def __init__(self, commands: list[list[str]], cwd: str):
        self.commands, self.cwd = commands, cwd
        self.gates = tempfile.mkdtemp(prefix="fsdp2bench-gates-")
        self.procs: dict[int, subprocess.Popen] = {}

    def _gate(self, i: int) -> str:
        return os.path.join(self.gates, str(i))

    def _start(self, i: int) -> None:
        """In a session of its own: a Ctrl-C at the terminal reaches this process, which tells the
        running launch (``run``) and cancels the waiting one (``close``), not a launch mid-import."""
        if i < len(self.commands) and i not in self.procs:
            env = {**os.environ, START_GATE: f"{os.getpid()}:{self._gate(i)}"}
            self.procs[i] = subprocess.Popen(self.commands[i], cwd=self.cwd, env=env, start_new_session=True)

    def run(self, i: int) -> int:
        """Launch ``i``, waited for (the next one starts meanwhile). On an interrupt the launch is
        told, writes what it has in bounded time, and the interrupt is passed on."""
        self._start(i)
        open_gate(self._gate(i), GO)
        self._start(i + 1)
        return wait_passing_interrupt(self.procs[i])

    def close(self) -> None:
        """Tell a launch started ahead of a turn that will not come to end; remove the gates."""
        for i, proc in self.procs.items():
            if not os.path.exists(self._gate(i)):
                open_gate(self._gate(i), CANCELLED)
            _wait_or_kill(proc)
        shutil.rmtree(self.gates, ignore_errors=True)


def wait_passing_interrupt(proc: subprocess.Popen) -> int:
    """A launch waited for in the foreground. On an interrupt it is told too (from a terminal it was
    already), given a bounded time to write what it has, and the interrupt is passed on."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        _wait_or_kill(proc)
        raise


def _wait_or_kill(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


# --------------------------------------------------------------------------- rows

def _max(figure: dict | None):
    return figure.get("max") if isinstance(figure, dict) else None


def row(option_set: str, variant: str, world_size: int, simulated: bool, rank: int | None, entry: dict) -> dict:
    """One (option set, variant, N) of matrix.json: the peaks, the state and, for a real run, the losses."""
    base = {"option_set": option_set, "variant": variant, "world_size": world_size, "simulated": simulated,
            "rank": rank, "status": entry.get("status", "not run")}
    if base["status"] != "ok":
        return base
    return {**base,
            "peak_allocated_mib": _max(entry["peak_allocated_mib"]),
            "peak_reserved_mib": _max(entry["peak_reserved_mib"]),
            "training_peak_allocated_mib": _max(entry["training_peak_allocated_mib"]),
            "training_peak_reserved_mib": _max(entry["training_peak_reserved_mib"]),
            "peak_rss_mib": _max(entry["peak_rss_mib"]),
            "state_at_step_peak_bytes": step_peak_state(entry),
            "device_bytes_at_step_peak": max(r["before_zero_grad"] for r in entry["device_bytes"]),
            "accounting_matches_expected": entry["accounting_matches_expected"],
            "final_loss": entry.get("final_loss"), "loss_drop": entry.get("loss_drop"),
            # tokens/s per GPU and MFU, compute only on a simulated rank, None where a step shared the device
            "speed": entry.get("speed")}


def rows_of(option_set: str, summary: dict) -> list[dict]:
    """The rows of one launch's summary.json: a real run's variants, or a sweep's runs."""
    if summary.get("simulated"):
        return [row(option_set, variant, int(n), True, int(rank), entry)
                for n, by_rank in summary["simulated"].items() for rank, by_variant in by_rank.items()
                for variant, entry in by_variant.items()]
    world = summary["meta"]["world_size"]
    return [row(option_set, variant, world, False, None, entry) for variant, entry in summary["variants"].items()]


def read_summary(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- findings

def compared_figure(r: dict) -> tuple[str, float | None]:
    """The figure the findings compare: the allocator's training peak on a GPU, else (on a CPU run,
    no allocator) the state held at the step peak."""
    if r.get("training_peak_allocated_mib") is not None:
        return "training_peak_allocated_mib", r["training_peak_allocated_mib"]
    return "state_at_step_peak_mib", sum(r["state_at_step_peak_bytes"].values()) / MIB if "state_at_step_peak_bytes" \
        in r else None


# What a set is compared with beyond the default: what sync_each_batch saves (or costs), and what
# holding back the all-reduce across replicas saves under HSDP.
COMPARED_SETS = {"accumulate_sync": "accumulate", "hsdp_accumulate_sync": "hsdp_accumulate",
                 "hsdp_all_reduce_last": "hsdp_accumulate_sync"}
NOT_OFFERED = "not offered by accelerate: its variant runs with sync_each_batch alone"


def findings(rows: list[dict]) -> list[dict]:
    """Per (option set, N): accelerate against torch, the stale optimizer's cost, and each variant's
    saving against the default option set at the same N (in MiB, on the rank that held the most),
    and against the set it is compared with (``COMPARED_SETS``)."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key, value = compared_figure(r)
        if value is not None:
            cell = cells.setdefault((r["option_set"], r["world_size"], r["simulated"]), {})
            cell[r["variant"]] = max(value, cell.get(r["variant"], value))
            cell["_figure"] = key
    out = []
    for (option_set, n, simulated), cell in cells.items():
        default = cells.get(("default", n, simulated), {})
        found = {"option_set": option_set, "world_size": n, "simulated": simulated, "figure": cell["_figure"],
                 "accelerate_minus_torch_mib": _minus(cell, ACCELERATE, REFERENCE),
                 "stale_optimizer_extra_mib": _minus(cell, UNFIXED, REFERENCE),
                 "saved_against_default_mib": _saved(default, cell)}
        if option_set in COMPARED_SETS:
            other = COMPARED_SETS[option_set]
            found["saved_against"] = {"option_set": other,
                                      "mib": _saved(cells.get((other, n, simulated), {}), cell)}
        if option_set in OPTION_SETS and not OPTION_SETS[option_set].requires_all_reduce:
            found["accelerate"] = NOT_OFFERED
        out.append(found)
    return out


def _saved(reference: dict, cell: dict) -> dict:
    return {v: reference[v] - cell[v] for v in cell if not v.startswith("_") and v in reference}


def _minus(cell: dict, a: str, b: str) -> float | None:
    return cell[a] - cell[b] if a in cell and b in cell else None


def checks_of(summaries: dict[str, dict]) -> dict:
    """Each launch's own checks, by launch directory name (they are the matrix's checks per option set)."""
    return {name: summary.get("checks", {}) for name, summary in summaries.items()}


def write_matrix(output_dir: str, meta: dict, summaries: dict[str, tuple[str, dict]]) -> dict:
    """matrix.json from the summaries read so far ({launch dir: (option set, summary)})."""
    rows = [r for option_set, summary in summaries.values() for r in rows_of(option_set, summary)]
    matrix = {"meta": meta, "option_sets": {n: dataclasses.asdict(OPTION_SETS[n]) for n in meta["option_sets"]},
              "rows": rows, "findings": findings(rows),
              "checks": checks_of({os.path.relpath(d, output_dir): s for d, (_, s) in summaries.items()})}
    write_json(os.path.join(output_dir, "matrix.json"), matrix)
    return matrix


def print_findings(matrix: dict) -> None:
    """One line per (option set, N), MiB on the rank that held the most."""
    print(f"\n{'option set':20} {'N':>5} {'accel - torch':>13} {'stale extra':>11} "
          f"{'saved vs default (after / accelerate)':>38} {'saved vs compared set':>22}")
    for f in matrix["findings"]:
        saved, against = f["saved_against_default_mib"], f.get("saved_against")
        n = f"{f['world_size']}{'s' if f['simulated'] else ''}"
        compared = f"{_fmt(against['mib'].get(REFERENCE))} vs {against['option_set']}" if against else ""
        accel = "not offered" if "accelerate" in f else _fmt(f["accelerate_minus_torch_mib"])
        print(f"{f['option_set']:20} {n:>5} {accel:>13} {_fmt(f['stale_optimizer_extra_mib']):>11} "
              f"{_fmt(saved.get(REFERENCE)) + ' / ' + _fmt(saved.get(ACCELERATE)):>38} {compared:>22}")
    print(f"MiB of {matrix['findings'][0]['figure'] if matrix['findings'] else 'n/a'}; N with s = simulated. accel - "
          "torch: accelerate's peak minus torch_optimizer_after_fsdp's (not offered: the set needs\n"
          "torch's set_requires_all_reduce); stale extra: the unfixed variant's minus the same; saved vs default: the "
          "default option set's\npeak minus this set's, at the same N; saved vs compared set: that set's peak minus "
          "this one's, torch_optimizer_after_fsdp.")
    failed = [f"{launch}: {key}" for launch, checks in matrix["checks"].items()
              for key, c in checks.items() if c.get("ok") is False]
    not_ok = [r for r in matrix["rows"] if r["status"] != "ok"]
    print(f"checks: {'every launch passed its checks' if not failed else 'FAILED ' + '; '.join(failed)}; "
          f"{len(matrix['rows']) - len(not_ok)} of {counted(len(matrix['rows']), 'row')} ok"
          + "".join(f"\n  {r['option_set']} N={r['world_size']} {r['variant']}: {r['status']}" for r in not_ok))


def print_speeds(matrix: dict) -> None:
    """The reference variant's peak reserved and speed per option set and N: what each lever costs and saves."""
    rows = [r for r in matrix["rows"] if r["variant"] == REFERENCE and r["status"] == "ok"]
    if not rows:
        return
    print(f"\n{'option set':24} {'N':>5} {'rank':>4} {'resv MiB':>9} {'tok/s':>8} {'MFU':>6}   ({REFERENCE})")
    for r in rows:
        resv = "n/a" if r["peak_reserved_mib"] is None else f"{r['peak_reserved_mib']:.0f}"
        print(f"{r['option_set']:24} {r['world_size']:>5} {r['rank'] if r['rank'] is not None else 'max':>4} "
              f"{resv:>9} {throughput.rate_said(r['speed']):>8} {throughput.mfu_said(r['speed']):>6}")
    print("tok/s: tokens per second per rank over the median step after warm-up, * compute only (a simulated rank); "
          "n/a: the\nlaunch's summary.json says why (speed.not_measured; no MFU on a CPU). docs/levers.md")


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:+.1f}"


def meta_of(sets: list[str], sizes: str | None, sweep_steps: int, nproc: int | None, forwarded: list[str]) -> dict:
    return {"option_sets": sets, "simulate_world_size": sizes, "sweep_steps": sweep_steps, "nproc_per_node": nproc,
            "main_args": forwarded, "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
