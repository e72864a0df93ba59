"""Plot a benchmark run: memory over time per variant, loss per step, memory against world size.

Reads only the JSON files main.py (or loading.py) wrote: ``python3 visualize.py --dir out``.
The figures themselves are drawn in ``fsdp2bench/plots.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

from fsdp2bench.names import VARIANTS
from fsdp2bench.plots import (InputError, load_traces, loading_stems, plot_loading, plot_sweep, plot_training,
                              read_json)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="out", help="output directory of main.py (default: out)")
    p.add_argument("--memory_threshold", type=float, default=0.0,
                   help="drop samples below this many MiB in the first part of each trace (default: 0)")
    p.add_argument("--filter_partition", type=float, default=2.0,
                   help="the first part is the first 1/K of the samples (default: K=2)")
    return p.parse_args(argv)


def plot(args: argparse.Namespace) -> None:
    """Whatever the directory holds: a sweep, a benchmark run, loading runs."""
    if not os.path.isdir(args.dir):
        raise InputError(f"--dir {args.dir}: no such directory")
    summary_path = os.path.join(args.dir, "summary.json")
    if os.path.exists(summary_path) and read_json(summary_path).get("simulated"):
        plot_sweep(read_json(summary_path), args.dir)
        return
    runs = load_traces(args.dir, {name: f"{name}_memory_usage" for name in VARIANTS})
    loads = load_traces(args.dir, loading_stems(args.dir))
    if not runs and not loads:
        raise InputError(f"--dir {args.dir}: no <variant>_memory_usage.json files from main.py "
                         "(nor loading_*_memory_usage.json from loading.py)")
    if runs:
        plot_training(runs, args.dir, args.memory_threshold, args.filter_partition)
    if loads:
        path = os.path.join(args.dir, "loading_memory.png")
        plot_loading(loads, path)
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.filter_partition <= 0:
        print("error: --filter_partition must be positive", file=sys.stderr)
        return 2
    try:
        plot(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
