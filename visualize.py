"""Plot a benchmark run: memory over time per variant, loss per step, memory against world size or sequence length,
a matrix, a plan.

Reads only the JSON files main.py (or loading.py, matrix.py, plan.py) wrote: ``python3 visualize.py --dir out``.
The figures themselves are drawn in ``fsdp2bench/report/plots.py``.
"""

from __future__ import annotations

import sys

from fsdp2bench.processes.first import one_line_interrupts

if __name__ == "__main__":  # before any other import: a Ctrl-C from here on is one line, never a traceback
    one_line_interrupts()

from fsdp2bench.processes.starting import interrupts_raise, quiet_while_starting

if __name__ == "__main__":  # ahead of the imports below: a Ctrl-C during them is one line
    quiet_while_starting()

import argparse
import os
import re
import shlex
import warnings

from fsdp2bench.cli import OneLineParser, UserError, check_ranges, exit_with
from fsdp2bench.files import cannot_create_in, expect_path
from fsdp2bench.names import VARIANTS, counted, simulated_dir_name
from fsdp2bench.plan.layout.plot import plot_layout_search
from fsdp2bench.plan.plot import plot_plan
from fsdp2bench.report.matrix import SWEEP_DIR
from fsdp2bench.report.plots import (plot_loading, plot_loading_sweep, plot_matrix, plot_sequences,
                                     plot_summary_projection, plot_sweep, plot_training, sequence_runs)
from fsdp2bench.report.traces import InputError, latest_run, load_traces, loading_stems, read_json, reading


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(" ".join(__doc__.split("\n\n")[0].split()), [
        ("python3 visualize.py --dir out", "one process, no GPU: draws what the directory's JSON files hold")],
        "docs/output.md")
    p.add_argument("--dir", default="out", help="output directory of main.py (default: out)")
    p.add_argument("--memory_threshold", type=float, default=0.0, metavar="MIB",
                   help="drop samples below MIB MiB in the first part of each trace (default: 0)")
    p.add_argument("--filter_partition", type=float, default=2.0, metavar="K",
                   help="the first part is the first 1/K of the samples (default: 2)")
    return p.parse_args(argv)


# A threshold beyond any GPU's MiB, or a partition finer than one sample in a million, is a typo.
NUMBER_RANGES = {"memory_threshold": (0.0, 1e7), "filter_partition": (1e-3, 1e6)}


def validate(argv: list[str] | None = None) -> argparse.Namespace:
    """Everything visualize.py refuses in one line before it reads a file."""
    args = parse_args(argv)
    check_ranges(args, NUMBER_RANGES)
    expect_path(args.dir, "--dir", "directory")
    why = cannot_create_in(args.dir)
    if why:
        raise UserError(f"--dir {args.dir}: cannot write the figures there ({why})")
    return args


def plot(args: argparse.Namespace) -> list[str]:
    """Whatever the directory holds: a sweep, a benchmark run, loading runs. Returns the files it
    had to leave out, each with its reason."""
    plan_path = os.path.join(args.dir, "plan.json")
    if os.path.exists(plan_path):
        with reading(plan_path):
            plan = read_json(plan_path)
            name = "layout.png" if plan["meta"].get("find") == "layout" else "plan.png"
            (plot_layout_search if name == "layout.png" else plot_plan)(plan, os.path.join(args.dir, name))
        print(f"wrote {os.path.join(args.dir, name)}")
        return []
    matrix_path = os.path.join(args.dir, "matrix.json")
    if os.path.exists(matrix_path):
        with reading(matrix_path):
            matrix = read_json(matrix_path)
            plot_matrix(matrix, os.path.join(args.dir, "matrix.png"))
            sets = matrix["meta"]["option_sets"]
        print(f"wrote {os.path.join(args.dir, 'matrix.png')}")
        say_commands("each option set's own plots", [os.path.join(args.dir, name, *sub) for name in sets
                                                     for sub in ((), (SWEEP_DIR,))])
        return []
    summary_path = os.path.join(args.dir, "summary.json")
    summary = read_json(summary_path) if os.path.exists(summary_path) else {}
    if summary.get("simulated"):
        with reading(summary_path):
            plot_sweep(summary, args.dir)
            sizes = summary["meta"]["simulated"]["world_sizes"]
        say_commands("the traces of each N", [os.path.join(args.dir, simulated_dir_name(n)) for n in sizes])
        strays = load_traces(args.dir, {name: f"{name}_memory_usage" for name in VARIANTS}, [])
        if strays:  # a sweep writes its traces in its simulated_N<n> folders, none here
            print(f"note: left out {counted(sum(map(len, strays.values())), 'trace file')} of another run in "
                  f"{args.dir}: the sweep summary.json describes writes none there")
        return []
    loading_path = os.path.join(args.dir, "loading_summary.json")
    with reading(loading_path):
        loading = read_json(loading_path) if os.path.exists(loading_path) else {}
        sizes = [int(n) for n in loading.get("simulated") or {}]
    if sizes:  # loading.py --simulate_world_size: its traces are per N
        path = os.path.join(args.dir, "loading_vs_world_size.png")
        with reading(loading_path):
            plot_loading_sweep(loading, path)
        print(f"wrote {path}")
        say_commands("the loading traces of each N", [os.path.join(args.dir, simulated_dir_name(n)) for n in sizes])
        return []
    sequences = sequence_runs(args.dir) if not summary and not loading else []
    if len(sequences) > 1:  # sweeps at several sequence lengths, one per subdirectory
        path = os.path.join(args.dir, "sequence_length.png")
        plot_sequences(sequences, path)
        print(f"wrote {path}")
        return []
    return plot_traces(args, summary, loading)


def command_that_draws(directory: str) -> str | None:
    """``python3 visualize.py --dir DIRECTORY`` where it draws something there (a sweep's summary, or a usable
    rank-0 trace of main.py or loading.py), else None: a hint is a command that works."""
    summary_path = os.path.join(directory, "summary.json")
    try:
        sweep = os.path.isfile(summary_path) and bool(read_json(summary_path).get("simulated"))
    except InputError:
        sweep = False
    traces = load_traces(directory, {name: f"{name}_memory_usage" for name in VARIANTS}, []) or \
        load_traces(directory, loading_stems(directory), [])
    return f"python3 visualize.py --dir {shlex.quote(directory)}" if sweep or traces else None


def say_commands(what: str, directories: list[str]) -> None:
    """The commands that draw ``what``, for those of ``directories`` that hold something to draw (an
    interrupted sweep, a set that failed or a folder committed without its traces hold nothing)."""
    commands = [c for c in map(command_that_draws, directories) if c is not None]
    if commands:
        print(f"{what}:" + "".join(f"\n    {c}" for c in commands))


def plot_traces(args: argparse.Namespace, summary: dict, loading: dict) -> list[str]:
    """The figures of a run's traces: only those of the run its summary describes (or, without one, of the
    run that started last); a file of another run is left out, and said."""
    problems: list[str] = []
    runs = load_traces(args.dir, {name: f"{name}_memory_usage" for name in VARIANTS}, problems)
    loads = load_traces(args.dir, loading_stems(args.dir), problems)
    if not runs and not loads:
        raise InputError(problems[0] if problems else f"--dir {args.dir}: no <variant>_memory_usage.json files "
                         "from main.py (nor loading_*_memory_usage.json from loading.py)")
    runs = one_run(runs, summary_run_id(summary) or parent_sweep_run_id(args.dir), "summary.json", args.dir)
    if runs:
        plot_training(runs, args.dir, args.memory_threshold, args.filter_partition)
    elif summary:
        plot_summary_projection(args.dir)
    loads = one_run(loads, loading.get("run_id"), "loading_summary.json", args.dir)
    if loads:
        path = os.path.join(args.dir, "loading_memory.png")
        plot_loading(loads, path)
        print(f"wrote {path}")
    return problems


def one_run(traces: dict, run_id: str | None, described_by: str, directory: str) -> dict:
    """``latest_run``, saying what it left out and which run it kept."""
    kept, left_out = latest_run(traces, run_id)
    if left_out:
        which = f"the run {described_by} describes ({run_id})" if run_id else "the run that started last"
        print(f"note: left out {counted(left_out, 'trace file')} of other runs in {directory}; plotting only {which}"
              + ("" if kept else ", which has none here"))
    return kept


def summary_run_id(summary: dict) -> str | None:
    meta = summary.get("meta")
    return meta.get("run_id") if isinstance(meta, dict) and isinstance(meta.get("run_id"), str) else None


def parent_sweep_run_id(directory: str) -> str | None:
    """The run of the sweep whose ``simulated_N<n>`` folder ``directory`` is, from the sweep's summary.json."""
    parent = os.path.dirname(os.path.abspath(directory))
    path = os.path.join(parent, "summary.json")
    if not re.fullmatch(r"simulated_N\d+", os.path.basename(os.path.abspath(directory))) or not os.path.isfile(path):
        return None
    try:
        summary = read_json(path)
    except InputError:  # the folder's own traces are drawn all the same
        return None
    return summary_run_id(summary) if summary.get("simulated") else None


def warn_once(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning (matplotlib's, say) in one line, once, not its source line once per place."""
    text = " ".join(str(message).split())
    if text not in SAID:
        SAID.add(text)
        print(f"warning: {text}", file=sys.stderr)


SAID: set[str] = set()


def main(argv: list[str] | None = None) -> int:
    interrupts_raise()  # a Ctrl-C while drawing: one line (cli.exit_with); each figure is saved whole
    warnings.showwarning = warn_once
    try:
        problems = plot(validate(argv))
    except (UserError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"error: {problem}; left out, the other plots were drawn", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    exit_with(main)
