"""Is accelerate on par with torch under each FSDP2 option, and what does a stale optimizer cost there?

Runs the benchmark once per option set (each a full suite of the four variants) at this launch's
world size and, with ``--simulate_world_size``, at simulated N; writes ``<output_dir>/matrix.json``
with a row per (option set, variant, N). Every other option goes to main.py unchanged, e.g.
``python3 matrix.py --model qwen2.5-1.5b --max_steps 20 --simulate_world_size 2,8,32,128``.
``python3 visualize.py --dir <output_dir>`` draws it.
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
import os
import shlex
import textwrap

from fsdp2bench.cli import CONSOLE_WIDTH, OneLineParser, UserError, check_ranges, exit_with, pick_device
from fsdp2bench.files import check_output_dir, prepare_output_dir, refuse_foreign
from fsdp2bench.options import accelerate_config, fsdp as options
from fsdp2bench.processes.simulation import DEFAULT_STEPS, parse_world_sizes
from fsdp2bench.report import matrix
from fsdp2bench.run import arguments
from fsdp2bench.run.session import move_earlier_runs_aside, new_run_id

NUMBER_RANGES = {"nproc_per_node": (0, 4096), "sweep_steps": (1, 10_000_000)}  # 0 processes: sweeps only
# main.py's FSDP2, accumulation and layout options: each launch gets those of its option set (over the user's
# accelerate config, with --config_file). The loop and the loss are not the sets' (every launch takes them as
# given: they go to main.py unchanged).
OWNED = options.OWN_FIELDS + options.LAYOUT_OPTIONS


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = OneLineParser(__doc__.splitlines()[0], [
        ("python3 matrix.py", "main.py per set (torchrun above 1 rank)"),
        ("python3 matrix.py --nproc_per_node 0 --simulate_world_size 8,32", "simulated ranks only, one GPU")],
        "docs/fsdp-options.md")
    p.add_argument("--option_sets", default=options.EACH,
                   help=f"comma-separated option sets ({', '.join(options.OPTION_SETS)}; the set all turns every "
                        f"plugin option on at once), or {options.EACH} for every one of them (default: {options.EACH})")
    p.add_argument("--nproc_per_node", type=int, default=1,
                   help="ranks of the real runs: 1 runs main.py with python, more with torchrun; 0: no real runs, "
                        "only the sweeps (default: 1)")
    p.add_argument("--simulate_world_size", default=None, metavar="N[,N...]",
                   help="also measure one rank of each of these world sizes N, per option set (default: none)")
    p.add_argument("--sweep_steps", type=int, default=DEFAULT_STEPS,
                   help=f"steps of each simulated run (default: {DEFAULT_STEPS})")
    p.add_argument("--output_dir", default="out_matrix",
                   help="matrix.json here, each option set's launches in <output_dir>/<set>/ (default: out_matrix)")
    p.epilog = passed_through_said()
    return p.parse_known_args(argv)


def passed_through_said() -> str:
    """The end of --help: every other option is main.py's, and goes to each launch as given."""
    return textwrap.fill(
        "main.py's options pass through: every option not listed above goes to each launch of main.py unchanged "
        "(python3 main.py --help lists them), among them --model, --batch_size, --block_size, --max_steps, --device, "
        "--variants, --loop, --loss and --config_file. Each option set gives its launches their FSDP2, accumulation "
        f"and layout options, so these are refused here: {', '.join('--' + name for name in OWNED)}.",
        CONSOLE_WIDTH)


def check(args: argparse.Namespace, forwarded: list[str]) -> tuple[list[str], dict[str, str], dict]:
    """Refuse in one line, before any launch, what main.py would refuse or what the matrix owns; return the
    sets, why a set's layout cannot run this model here (it is skipped, and said so), and where the options
    each set is put over came from (a user's accelerate config, forwarded as --config_file)."""
    sets = options.parse_sets(args.option_sets)
    check_ranges(args, NUMBER_RANGES)
    if args.nproc_per_node == 0 and not args.simulate_world_size:
        raise UserError("--nproc_per_node 0 runs only the sweeps: give --simulate_world_size")
    if args.sweep_steps != DEFAULT_STEPS and not args.simulate_world_size:
        raise UserError("--sweep_steps needs --simulate_world_size (there is no sweep to run)")
    check_output_dir(args.output_dir, "matrix.json")
    refuse_foreign([os.path.join(args.output_dir, "matrix.json")], "--output_dir")
    # main.py's checks of the options forwarded, at the world size its launches will have: --nproc_per_node, or
    # the sweeps' simulated N where there are no real runs
    sweeps = ["--simulate_world_size", args.simulate_world_size] if args.nproc_per_node == 0 else []
    checked = arguments.validate([*forwarded, *sweeps, "--output_dir", args.output_dir], max(1, args.nproc_per_node))
    given = checked.args
    owned = [name for name in OWNED if given.option_sources[name] == "flag"]  # main.py's own flags
    if owned:
        raise UserError(f"--{owned[0]} is set by matrix.py for each launch from its option set; choose the sets "
                        f"with --option_sets")
    device_type = pick_device(given.device).type
    refused = {name: why for name in sets if (why := arguments.layout_refusal(
        checked.fsdp_options.over(options.OPTION_SETS[name].changed()), checked.facts.config,
        given.block_size, device_type))}
    plan, skipped = matrix.launches(args.output_dir, sets, sweep_sizes(args), args.sweep_steps, args.nproc_per_node,
                                    forwarded, refused)
    if not plan:
        raise UserError(f"nothing to run: {'; '.join(skipped)}")
    for _, _, main_args in plan:  # every launch's command line, as main.py will check it
        launch = arguments.parse_args(main_args)
        arguments.check_args(launch, max(1, args.nproc_per_node))
    return sets, refused, accelerate_config.summary_of(checked.config, given.option_sources)


def sweep_sizes(args: argparse.Namespace) -> list[int]:
    """``--simulate_world_size`` as main.py reads it (refused in one line where it would refuse it)."""
    return parse_world_sizes(args.simulate_world_size) if args.simulate_world_size else []


def run(args: argparse.Namespace, forwarded: list[str]) -> int:
    interrupts_raise()  # the launches' loop passes a Ctrl-C on (matrix.Launches)
    sets, refused, options_from = check(args, forwarded)
    prepare_output_dir(args.output_dir)
    move_earlier_runs_aside(args.output_dir, new_run_id())  # the sets' own folders are their runs' to keep
    meta = matrix.meta_of(sets, args.simulate_world_size, args.sweep_steps, args.nproc_per_node, forwarded)
    meta["options_from"] = options_from  # each set's options are put over these
    summaries: dict[str, tuple[str, dict]] = {}
    failed = False
    plan, skipped = matrix.launches(args.output_dir, sets, sweep_sizes(args), args.sweep_steps,
                                    args.nproc_per_node, forwarded, refused)
    for note in skipped:
        print(f"Skipped: {note}", flush=True)
    meta["skipped"] = skipped
    launches = matrix.Launches([matrix.launch_command(max(1, args.nproc_per_node), main_args)
                                for _, _, main_args in plan], os.path.dirname(os.path.abspath(__file__)))
    try:
        for i, (option_set, directory, main_args) in enumerate(plan):
            print(f"=== option set {option_set}: main.py {' '.join(main_args)}", flush=True)
            try:
                code = launches.run(i)
            except KeyboardInterrupt:
                code = matrix.INTERRUPTED_CODES[0]
            if code == 2:  # main.py refused the launch and said why
                return 2
            failed = failed or code != 0
            summary = matrix.read_summary(directory)
            if summary is not None:
                summaries[directory] = (option_set, summary)
                matrix.write_matrix(args.output_dir, meta, summaries)
            if code in matrix.INTERRUPTED_CODES:  # here, or in the launch alone (a signal this process may not have had)
                matrix.write_matrix(args.output_dir, meta, summaries)
                ran = f"the option sets that ran are in {os.path.join(args.output_dir, 'matrix.json')}" \
                    if summaries else "no option set had finished"
                print(f"Interrupted; {ran}", file=sys.stderr)
                return 130
    finally:
        launches.close()
    result = matrix.write_matrix(args.output_dir, meta, summaries)
    matrix.print_findings(result)
    matrix.print_speeds(result)
    drawn = any(r["status"] == "ok" for r in result["rows"])  # visualize.py draws the finished rows alone
    print(f"Wrote {os.path.join(args.output_dir, 'matrix.json')}; " + (
        f"draw it with:\n    python3 visualize.py --dir {shlex.quote(args.output_dir)}" if drawn else
        "no option set finished a run, so there is nothing to draw"))
    return 1 if failed else 0


def main() -> None:
    exit_with(lambda: run(*launched_alone_args()))


def launched_alone_args() -> tuple[argparse.Namespace, list[str]]:
    """The command line, read once this process is known to be the only one (matrix.py starts main.py's ranks)."""
    refuse_launcher("matrix.py is one process that launches main.py for each option set")
    return parse_args()


if __name__ == "__main__":
    main()
