"""Time a whole benchmark launch and say where the time goes: writes speed.json.

    python3 speed.py --nproc_per_node 2 --json results/h200x2/speed.json -- --model qwen2.5-1.5b --max_steps 144

runs ``torchrun --nproc_per_node N main.py <args> --tracker_overhead`` (memory polling paused on
every other step, so its cost is measured inside the same run), times it from launch to exit,
and splits each variant's time into phases from rank 0's phase marks.
"""

from __future__ import annotations

import sys

from fsdp2bench.processes.first import one_line_interrupts

if __name__ == "__main__":  # before any other import: a Ctrl-C from here on is one line, never a traceback
    one_line_interrupts()

from fsdp2bench.processes.starting import interrupts_raise, quiet_while_starting, refuse_launcher

if __name__ == "__main__":  # ahead of the imports below: a Ctrl-C during them is one line
    quiet_while_starting()

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time

from fsdp2bench.cli import OneLineParser, UserError, check_ranges, environment_changed, exit_with
from fsdp2bench.files import check_writable_file, expect_path, refuse_foreign, write_json
from fsdp2bench.names import counted
from fsdp2bench.report.matrix import INTERRUPTED_CODES, read_summary, wait_passing_interrupt

ROOT = os.path.dirname(os.path.abspath(__file__))
# The upstream scripts timed on 2x H200 on the same work: 282 s and 302 s for two launches.
UPSTREAM_SUITE_WALL_S = 282.0
UPSTREAM_WORK = {"model": "qwen2.5-1.5b", "batch_size": 2, "block_size": 128, "steps_per_variant": 144, "world_size": 2}


def phases(trace: dict, variant: dict) -> dict:
    """Seconds per phase of one variant on rank 0, from its event marks (which close each phase)."""
    t = {e["name"]: e["t"] for e in trace["events"]}
    child_start = trace["started_at"] - variant["process_started_at"]
    return {
        "child_start_s": child_start,  # from asking for the child to its first line (fork server, unpickling)
        "group_start_s": t["group_ready"],  # CUDA context and process group
        "build_s": t["model_built"] - t["group_ready"],
        "optimizer_and_shard_s": t["training_started"] - t["model_built"],
        "steps_s": t["training_finished"] - t["training_started"],
        # writing the trace, leaving the process group, exiting, and waiting for the other
        # ranks (and, with --concurrent_variants, for the other variants started with it)
        "teardown_and_wait_s": variant["process_wall_s"] - child_start - t["training_finished"],
    }


def same_work_as_upstream(summary: dict) -> bool:
    """The upstream figure is a comparison only for its own configuration, all four variants, real ranks."""
    meta = summary["meta"]
    if "variants" not in summary:
        return False
    given = {**meta["args"], "steps_per_variant": meta["steps_per_variant"], "world_size": meta["world_size"]}
    return all(given[k] == v for k, v in UPSTREAM_WORK.items()) and len(meta["args"]["variants"].split(",")) == 4


def launch_phases(timeline: dict, launched: float, wall: float) -> dict:
    """Rank 0's main process, from the launch to the exit, in seconds. A process's creation time is
    known to the kernel's clock tick (10 ms) only, so a phase it bounds can come out a little below
    zero: such a phase is 0."""
    phases_s = {
        "launcher_start_s": timeline["process_created"] - launched,  # torchrun starting the rank processes
        "imports_s": timeline["main_started"] - timeline["process_created"],
        "setup_s": timeline["variants_started"] - timeline["main_started"],  # config, data, rendezvous
        "variants_s": timeline["variants_finished"] - timeline["variants_started"],
        "report_and_exit_s": launched + wall - timeline["variants_finished"],
    }
    return {name: max(0.0, seconds) for name, seconds in phases_s.items()}


def launcher(nproc: int, tree: str, main_args: list[str], python: str = sys.executable,
             module: str = "fsdp2bench.processes.torchrun") -> list[str]:
    """torchrun, or this project's quiet form of it (``fsdp2bench.processes.torchrun``) where the tree has it."""
    return [python, "-m", module, f"--nproc_per_node={nproc}", os.path.join(tree, "main.py"), *main_args]


# This project's quiet torchrun by where a tree keeps it: today's, then before the package had wings.
TREE_LAUNCHERS = (("fsdp2bench/processes/torchrun.py", "fsdp2bench.processes.torchrun"),
                  ("fsdp2bench/torchrun.py", "fsdp2bench.torchrun"))


def tree_launcher(tree: str) -> str:
    """The launcher module of another version's tree: its own quiet torchrun, or torch's in a version before it."""
    return next((module for path, module in TREE_LAUNCHERS if os.path.isfile(os.path.join(tree, path))),
                "torch.distributed.run")


def time_baseline(tree: str, nproc: int, main_args: list[str], output_dir: str, python: str) -> dict:
    """The other version's (or environment's) run on the same work, timed from launch to exit."""
    tree, output_dir = os.path.abspath(tree), os.path.abspath(f"{output_dir}_baseline")
    start = time.perf_counter()
    module = tree_launcher(tree)
    code = wait_passing_interrupt(subprocess.Popen(
        launcher(nproc, tree, [*main_args, "--output_dir", output_dir], python, module), cwd=tree))
    return {"tree": tree, "python": python, "output_dir": output_dir, "suite_wall_s": time.perf_counter() - start,
            "exit_code": code}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(__doc__.splitlines()[0], [
        ("python3 speed.py --nproc_per_node 2 -- <main.py options>", "times a launch of main.py (torchrun)")],
        "docs/performance.md")
    p.add_argument("--nproc_per_node", type=int, default=2,
                   help="ranks of the timed launch: 1 runs main.py with python, more with torchrun (default: 2)")
    p.add_argument("--json", default=None,
                   help="where to write the result (default: speed.json in --output_dir, beside the run it times)")
    p.add_argument("--output_dir", default="out_speed",
                   help="main.py's output directory for this run (default: out_speed)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="DIR holds the tree of another version (a git archive of it): its main.py runs first with "
                        "the same arguments, in the same call, and speed.json gets both walls and their ratio "
                        "(default: none)")
    p.add_argument("--baseline_python", default=None, metavar="PYTHON",
                   help="PYTHON, another environment's interpreter, runs the baseline (this tree where --baseline "
                        "is not given): speed.json then compares the two environments' libraries on the same work, "
                        "their versions, peaks and losses (default: this interpreter)")
    p.add_argument("--bare_loop", action="store_true",
                   help="first time a bare loop of the same work (main.py's first variant at its first N: the same "
                        "model, wrapping, levers and loss, no tracker, no polling, no accounting), then the launch; "
                        "speed.json gets both medians and the suite's own cost per step (default: off)")
    p.add_argument("main_args", nargs=argparse.REMAINDER, help="arguments for main.py, after -- (default: none)")
    args, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}{where_main_options_go(unknown)}")
    return args


def where_main_options_go(unknown: list[str]) -> str:
    """Where main.py's options go, said where one was given before the ``--`` (speed.py's parser knows none)."""
    from fsdp2bench.run import arguments

    main_options = {f"--{name}" for name in vars(arguments.parse_args([]))}
    given = [word.split("=", 1)[0] for word in unknown if word.split("=", 1)[0] in main_options]
    return f" ({given[0]} is main.py's: its options go after --, python3 speed.py -- {given[0]} ...)" if given else ""


def validate(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Everything speed.py refuses in one line before it launches: its own options, then main.py's
    arguments as the timed launch's rank 0 will check them."""
    from fsdp2bench.run import arguments

    refuse_launcher("speed.py is one process that launches the main.py it times")
    args = parse_args(argv)
    check_ranges(args, {"nproc_per_node": (1, 4096)})
    json_flag = "--json" if args.json is not None else "--output_dir"
    args.json = args.json if args.json is not None else os.path.join(args.output_dir, "speed.json")
    check_writable_file(args.json, json_flag)
    refuse_foreign([args.json], json_flag)
    check_baseline(args)
    extra = [a for a in args.main_args if a != "--"]
    with launched_as_rank_zero(args.nproc_per_node):
        arguments.validate([*extra, "--output_dir", args.output_dir])
    return args, extra


def check_baseline(args: argparse.Namespace) -> None:
    """The baseline's tree and interpreter, each refused by its own flag; ``args.baseline_said`` names the
    baseline as the user gave it, for every later line about it."""
    given = [f"--{flag} {getattr(args, flag)}" for flag in ("baseline", "baseline_python")
             if getattr(args, flag) is not None]
    args.baseline_said = " ".join(given)
    if args.baseline is not None:  # an empty path would be the current directory's main.py
        expect_path(args.baseline, "--baseline", "directory")
        if not os.path.isfile(os.path.join(args.baseline, "main.py")):
            raise UserError(f"--baseline {args.baseline}: not a tree of this project (no main.py in it)")
    if args.baseline_python is not None:
        expect_path(args.baseline_python, "--baseline_python", "file")
        if not os.access(args.baseline_python, os.X_OK):
            raise UserError(f"--baseline_python {args.baseline_python}: a file that cannot be run")
        args.baseline = args.baseline or ROOT
        check_interpreter(args.baseline_python, args.baseline)


PYTHON_READY = "fsdp2bench: the libraries import"


def check_interpreter(python: str, tree: str) -> None:
    """Any program given as the baseline's Python must import what main.py imports: one that is no Python, or a
    Python without the libraries, is refused now, not after a timed run that cannot be compared."""
    probe = f"import torch, accelerate, transformers; print({PYTHON_READY!r})"
    try:
        ran = subprocess.run([python, "-c", probe], cwd=tree, capture_output=True, text=True, timeout=600)
        ready = PYTHON_READY in ran.stdout
        why = (ran.stderr.strip().splitlines() or [f"it printed nothing and exited with code {ran.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        ready, why = False, str(exc)
    if not ready:
        raise UserError(f"--baseline_python {python}: cannot run the benchmark: it must be a Python that imports "
                        f"torch, accelerate and transformers ({why[:200]})")


@contextlib.contextmanager
def launched_as_rank_zero(nproc: int):
    """The launcher's variables as the timed launch's rank 0 will have them (torchrun on this host), for as long
    as main.py's checks read them: what depends on the world size is checked at the launch's own."""
    with environment_changed({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(nproc),
                              "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}):
        yield


def finished_runs(summary: dict, output_dir: str) -> dict[str, tuple[dict, str | None]]:
    """Every variant run that finished, named as a reader names it, with rank 0's trace where its
    phases can be read from it (a simulated run records no process start, so it has none)."""
    if "simulated" not in summary:
        return {name: (v, os.path.join(output_dir, f"{name}_memory_usage.json"))
                for name, v in summary["variants"].items() if v["status"] == "ok"}
    return {f"N={n} rank {rank} {name}": (v, None)
            for n, ranks in summary["simulated"].items() for rank, variants in ranks.items()
            for name, v in variants.items() if v["status"] == "ok"}


def against_baseline(ours: dict, theirs: dict) -> dict:
    """Peaks (MiB, ours minus theirs) and losses of the runs both versions finished: a speed-up
    counts only for the same work."""
    common = [k for k in ours if k in theirs]

    def difference(key: str, kind: str) -> float | None:
        a, b = (runs[key][0][f"peak_{kind}_mib"]["max"] for runs in (ours, theirs))
        return None if a is None or b is None else a - b  # a CPU run has no allocator peaks

    differences = {k: {kind: difference(k, kind) for kind in ("allocated", "reserved")} for k in common}
    measured = [d for diff in differences.values() for d in diff.values() if d is not None]
    with_losses = [k for k in common if "losses" in ours[k][0] and "losses" in theirs[k][0]]
    return {"runs_compared": len(common), "runs_only_in_one": sorted(set(ours) ^ set(theirs)),
            "peak_differences_mib": differences,
            "peaks_equal": all(d == 0 for d in measured) if measured else None,
            "losses_bit_equal": all(ours[k][0]["losses"] == theirs[k][0]["losses"] for k in with_losses)
            if with_losses else None}


def baseline_did_the_same_work(summary: dict, runs: dict, baseline: dict, theirs: dict) -> dict | str:
    """The comparison of the two versions' runs, or why the baseline's wall time is no comparison: it ran
    other steps, ranks or variants."""
    for key in ("steps_per_variant", "world_size"):
        if theirs["meta"].get(key) != summary["meta"][key]:
            return f"its run's {key} was {theirs['meta'].get(key)}, this run's {summary['meta'][key]}"
    same = against_baseline(runs, finished_runs(theirs, baseline["output_dir"]))
    if same["runs_only_in_one"] or not same["runs_compared"]:
        return f"the two runs did not finish the same variants ({', '.join(same['runs_only_in_one']) or 'none'})"
    return {**same, "versions": {"this": summary["meta"].get("versions"), "baseline": theirs["meta"].get("versions")}}


def main(argv: list[str] | None = None) -> int:
    interrupts_raise()  # the timed launch is told of a Ctrl-C (wait_passing_interrupt)
    args, extra = validate(argv)
    try:
        return timed(args, extra)
    except KeyboardInterrupt:
        print(f"Interrupted; {what_the_runs_wrote(args)}; {args.json} was not written", file=sys.stderr)
        return 130


def what_the_runs_wrote(args: argparse.Namespace) -> str:
    """Where to look after an interrupt: the runs' folders that are there (an early one made none)."""
    there = [d for d in (args.output_dir, f"{args.output_dir}_baseline" if args.baseline else None)
             if d is not None and os.path.isdir(d)]
    return f"what the runs wrote is in {' and '.join(there)}" if there else "no run wrote anything"


def run_baseline(args: argparse.Namespace, extra: list[str]) -> tuple[dict, dict]:
    """The baseline's launch and its summary, before the timed run: one that failed or wrote no summary is
    refused at once, by the flags that asked for it."""
    baseline = time_baseline(args.baseline, args.nproc_per_node, extra, args.output_dir,
                             args.baseline_python or sys.executable)
    theirs = read_summary(baseline["output_dir"])
    if baseline["exit_code"] != 0:
        why = f"its run failed (exit code {baseline['exit_code']})"
    elif theirs is None or "meta" not in theirs or not ("variants" in theirs or "simulated" in theirs):
        why = f"its run wrote no readable {baseline['output_dir']}/summary.json"
    else:
        return baseline, theirs
    raise UserError(f"{args.baseline_said}: {why}; the timed run was not started and no ratio is recorded")


def run_bare_loop(args: argparse.Namespace, extra: list[str]) -> dict:
    """The bare loop's figures (fsdp2bench/run/bare.py), in a process of its own before the launch."""
    path = os.path.join(f"{args.output_dir}_bare", "bare.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    here = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    code = wait_passing_interrupt(subprocess.Popen([sys.executable, "-m", "fsdp2bench.run.bare", path, "--", *extra],
                                                   env=here))
    if code != 0 or not os.path.isfile(path):
        raise UserError(f"--bare_loop: the bare loop failed (exit code {code}); the timed run was not started")
    with open(path) as f:
        return json.load(f)


def suite_cost(bare: dict, runs: dict) -> dict:
    """The suite's median clean step of the bare loop's variant at its N (rank 0) against the bare loop's."""
    name = bare["variant"] if not any(k.startswith("N=") for k in runs) else \
        f"N={bare['world_size']} rank 0 {bare['variant']}"
    ours = (runs.get(name, ({},))[0].get("speed") or {}).get("median_step_time_s")
    theirs = bare["speed"]["median_step_time_s"]
    return {"run": name, "suite_median_step_s": ours, "bare_median_step_s": theirs,
            "suite_cost_per_step": None if ours is None or not theirs else ours / theirs - 1}


def timed(args: argparse.Namespace, extra: list[str]) -> int:
    """The baseline's launch (or the bare loop), then this version's, timed; speed.json from this version's
    summary."""
    baseline, theirs = run_baseline(args, extra) if args.baseline else (None, None)
    bare = run_bare_loop(args, extra) if args.bare_loop else None
    # Against a bare loop the suite runs as users run it; otherwise polling pauses every other step, to measure it.
    polling = [] if args.bare_loop else ["--tracker_overhead"]
    command = launcher(args.nproc_per_node, ROOT, [*extra, *polling, "--output_dir", args.output_dir])
    launched, start = time.time(), time.perf_counter()
    here = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    code = wait_passing_interrupt(subprocess.Popen(command, env=here))  # our torchrun module from any directory
    wall = time.perf_counter() - start
    summary = read_summary(args.output_dir)
    if summary is None:
        print(f"error: the run wrote no readable {args.output_dir}/summary.json (exit code {code})", file=sys.stderr)
        return 2
    if "variants_finished" not in summary["meta"]["timeline"]:  # a signal to the launch alone, or its crash
        interrupted = code in INTERRUPTED_CODES
        said = f"was interrupted (exit code {code})" if interrupted else f"ended before it finished (exit code {code})"
        print(f"error: the timed run {said}; what it wrote is in {args.output_dir}/; {args.json} was not written",
              file=sys.stderr)
        return 130 if interrupted else 1
    result = {"suite_wall_s": wall, "exit_code": code, "command": command[2:],
              "steps_per_variant": summary["meta"]["steps_per_variant"],
              "world_size": summary["meta"]["world_size"], "gpu_name": summary["meta"].get("gpu_name"),
              "upstream_suite_wall_s": UPSTREAM_SUITE_WALL_S,
              "speedup_vs_upstream": UPSTREAM_SUITE_WALL_S / wall if same_work_as_upstream(summary) else None,
              "concurrent_variants": summary["meta"].get("concurrent_variants",
                                                         summary["meta"]["args"]["concurrent_variants"]),
              "launch_phases": launch_phases(summary["meta"]["timeline"], launched, wall),
              "emulated_links": summary["meta"].get("emulated_links"),
              "median_step_time_s": {}, "phases": {}, "peak_allocated_mib": {}, "peak_reserved_mib": {},
              "tracker_overhead_ratio": None}
    runs = finished_runs(summary, args.output_dir)
    if baseline:
        same = baseline_did_the_same_work(summary, runs, baseline, theirs)
        if isinstance(same, str):
            print(f"error: {args.baseline_said}: {same}; no ratio is recorded", file=sys.stderr)
            return 2
        result.update(baseline={**baseline, "same_work": same}, wall_ratio_to_baseline=wall / baseline["suite_wall_s"])
    if bare:
        result["bare_loop"] = {**bare, **suite_cost(bare, runs)}
    add_run_figures(result, runs)
    write_json(args.json, result)
    say_result(result, args.json)
    return code


def add_run_figures(result: dict, runs: dict) -> None:
    """Each finished run's phases, median step time and peaks, and the tracker's overhead where measured."""
    ratios = {}
    for name, (v, trace_path) in runs.items():
        if trace_path is not None:
            with open(trace_path) as f:
                result["phases"][name] = phases(json.load(f), v)
        result["median_step_time_s"][name] = v["median_step_time_s"]
        result["peak_allocated_mib"][name] = v["peak_allocated_mib"]["max"]
        result["peak_reserved_mib"][name] = v["peak_reserved_mib"]["max"]
        if v.get("tracker_overhead_ratio") is not None:
            ratios[name] = v["tracker_overhead_ratio"]
        if v.get("emulated"):  # --emulate_communication: rank 0's communication a step, as the links price it, and
            # its compute-only, emulated and exposed figures, from the launch's own alternating steps
            result.setdefault("emulated_s_per_step", {})[name] = v["emulated"][0]["emulated_s_per_step"]
            result.setdefault("emulation", {})[name] = v["speed"]["emulation"]
    if ratios:
        result["tracker_overhead_ratio"] = statistics.median(ratios.values())
        result["tracker_overhead_ratio_per_variant"] = ratios


def say_result(result: dict, json_path: str) -> None:
    """The figures a reader compares first, then what differed from the baseline's run."""
    print(json.dumps({k: result.get(k) for k in ("suite_wall_s", "wall_ratio_to_baseline", "speedup_vs_upstream",
                                                 "tracker_overhead_ratio", "median_step_time_s", "launch_phases")},
                     indent=1))
    bare = result.get("bare_loop")
    if bare and bare["suite_cost_per_step"] is not None:
        print(f"bare loop against the suite ({bare['run']}): median clean step {bare['bare_median_step_s']:.4f} s "
              f"bare, {bare['suite_median_step_s']:.4f} s in the suite: the suite costs "
              f"{bare['suite_cost_per_step']:+.1%} a step")
    same = (result.get("baseline") or {}).get("same_work")
    if same:
        peaks = {True: "equal to the byte", False: "they differ"}.get(same["peaks_equal"],
                                                                       "no allocator peaks to compare (a CPU run has none)")
        losses = {True: "bit-equal", False: "they differ"}.get(same["losses_bit_equal"],
                                                              "none recorded to compare (a simulated rank records none)")
        print(f"against the baseline: {counted(same['runs_compared'], 'run')}, peaks: {peaks}, losses: {losses}")
        theirs = same["versions"]["baseline"] or {}
        changed = {lib: (theirs.get(lib), v) for lib, v in (same["versions"]["this"] or {}).items()
                   if theirs.get(lib) != v}
        print("versions: " + (", ".join(f"{lib} {a} -> {b}" for lib, (a, b) in changed.items()) or "the same") +
              "; per run, the peaks' differences (MiB, this minus the baseline) are in " + json_path)


if __name__ == "__main__":
    exit_with(main)
