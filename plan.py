"""What fits: the largest batch (or block) per option set at N ranks on a GPU of M GiB, measured.

Each answer comes from probes: one simulated rank of N (the most loaded one), in a fresh process,
trained two steps under the cap (``torch.cuda.set_per_process_memory_fraction``); it fits when it
completes. One shared process per option set and N, built once, first measures a few values well under
the cap; the line through their peaks aims the fresh probes, which confirm the edge from both sides, and
the other variants' probes start at the edge the first one found.
``python3 plan.py --model qwen2.5-1.5b --world_size 8,64 --gpu_memory 80`` writes ``<output_dir>/plan.json``
with every probe; ``python3 visualize.py --dir <output_dir>`` draws peak allocated against batch.
"""

from __future__ import annotations

import sys

from fsdp2bench.processes.first import one_line_interrupts

if __name__ == "__main__":  # before any other import: a Ctrl-C from here on is one line, never a traceback
    one_line_interrupts()

from fsdp2bench.processes.starting import start_before_imports

if __name__ == "__main__":  # ahead of the imports below: the fork server's overlap them
    start_before_imports(sys.argv[1:])

import argparse
import dataclasses
import shlex
import time

from fsdp2bench.cli import exit_with, say
from fsdp2bench.files import save_summary
from fsdp2bench.memory import estimate
from fsdp2bench.memory.accounting import trainable_parameters
from fsdp2bench.names import MIB, counted
from fsdp2bench.options import accelerate_config, fsdp
from fsdp2bench.options.links import Links, links_said
from fsdp2bench.plan.checks import SEED, Checked, CheckedSearch, parse_args, plan_path, set_options, validate
from fsdp2bench.plan.layout.run import run_search
from fsdp2bench.plan.probes import BATCH, ProbeRunner, Question, heaviest_rank, leaders_of, search_for
from fsdp2bench.plan.report import plan_record, print_plan, unsupported
from fsdp2bench.plan.search import Planner
from fsdp2bench.plan.shared import PROBE_STEPS
from fsdp2bench.processes.isolation import Interrupted
from fsdp2bench.run import arguments
from fsdp2bench.run.session import open_session, say_interrupted
from fsdp2bench.train import weights
from fsdp2bench.train.data import load_tokens
from fsdp2bench.train.runner import TrainConfig

__all__ = ["parse_args", "run", "validate"]  # parse_args and validate: the command line, for the tests


def questions_of(checked: Checked) -> tuple[dict, dict]:
    """Every (option set, N, variant, block or batch) to answer, and a search for each."""
    questions, searches = {}, {}
    shapes = checked.facts.shapes
    fixed_values = checked.blocks if checked.args.find == BATCH else [checked.args.batch_size]
    for name in checked.sets:
        chosen = set_options(checked.base, name)
        for n in [n for n in checked.sizes if chosen.layout.fits(n)]:
            for variant in checked.variants:
                for fixed in fixed_values:
                    rank = heaviest_rank(shapes, n, variant, chosen)
                    q = Question(name, n, rank, variant, checked.args.find, fixed, checked.base)
                    lower = 1 if checked.args.find == BATCH else -(-min(checked.blocks) // q.unit)
                    key = (name, n, variant, fixed)
                    questions[key] = q
                    searches[key] = search_for(q, lower, checked.upper // q.unit, checked.cap, checked.facts.config)
    return questions, searches


def run(argv: list[str] | None = None) -> int:
    started = time.time()
    checked = validate(argv)
    cap = checked.setup.cap if isinstance(checked, CheckedSearch) else checked.cap
    if cap is not None and cap.said():
        say(cap.said())
    if isinstance(checked, CheckedSearch):
        return run_search(checked, started)
    args = checked.args
    session = open_session(checked.facts, args.device, args.output_dir, "plan.json")
    questions, searches = questions_of(checked)
    cores = arguments.build_threads()
    train = TrainConfig(seed=SEED, learning_rate=3e-5, log_interval=0.01, save_memory_snapshot=False,
                        tracker_overhead=False, inject_failure=None,
                        init_device=args.init_device if session.device.type == "cuda" or args.init_device == "meta"
                        else "cpu", build_threads=cores, compute_threads=max(1, cores // 4),
                        weights=weights.create() if args.init_device == "cpu" else None, quiet=True,
                        allocator_limit=checked.cap.allocator_bytes if checked.cap else None, links=checked.links)
    tokens = load_tokens(None, None, session.config.vocab_size)
    runner = ProbeRunner(session, train, tokens, questions, searches, checked.cap, args.output_dir,
                         args.inject_oom_above, leaders_of(questions, searches, session.shapes))
    meta = plan_meta(checked, session, started)
    line = accelerate_config.said(checked.config, {}, args)
    if line:
        say(line)
    for note in checked.skipped:
        print(f"Skipped: {note}", flush=True)
    trains = checked.base.tuning.said()  # what every probe trains, where not the whole model with AdamW
    say(f"Planning {counted(len(searches), 'answer')} for {args.model}{', ' + trains if trains else ''} "
        f"({args.find} per option set, N and variant): a shared process per option set and N measures a few values, "
        f"then fresh probes confirm each edge (another variant starts at the first one's), {PROBE_STEPS} steps of "
        f"one simulated rank each{cap_said(checked.cap)}{emulation_said(checked.links)}...")
    landed: dict = {}  # each landed answer's time

    def save(interrupted: bool = False) -> dict:
        """plan.json as it stands: after every probe, so that an interrupt or a failure loses none."""
        meta.update(wall_s=time.time() - started)
        plan = plan_record(meta, questions, searches, runner.probes, runner.shared_records(),
                                   runner.stood_down, interrupted)
        save_summary(plan_path(args), plan)
        if not interrupted:
            say_landed(plan, questions, searches, landed, time.time() - started)
        return plan

    # A shared process for each answer that leads its set, N and fixed value; the blocks free learned within a set
    planner = Planner(searches, group=lambda key: key[0], unready=set(searches) - set(runner.leaders),
                              leaders=runner.leaders)
    try:
        runner.run_plan(planner, save)
    except Interrupted as exc:
        ended = save(interrupted=True)["meta"]["probes"]
        return say_interrupted(session, exc, f"; the {counted(ended, 'probe')} that ended "
                               f"{'is' if ended == 1 else 'are'} in {plan_path(args)}" if ended
                               else f"; no probe had ended ({plan_path(args)} says what was planned)")
    return said_plan(save(), args)


def said_plan(plan: dict, args: argparse.Namespace) -> int:
    """The plan's table, where it is drawn, its findings and what failed; the exit code."""
    print_plan(plan)
    drawn = any(o["fits"] for a in plan["answers"] for o in a["outcomes"] + a.get("shared", []))
    hint = f"draw it with:\n    python3 visualize.py --dir {shlex.quote(args.output_dir)}" if drawn else \
        "no probe fit, so there is nothing to draw"
    print(f"Wrote {plan_path(args)}; {hint}", flush=True)
    findings = [a["error"] for a in plan["answers"] if unsupported(a)]  # each names its probe
    if findings:  # as main.py and matrix.py report the same layout: a finding, the run not failed
        say(f"unsupported by the installed libraries (a finding, not a failure of the plan): "
            f"{counted(len(findings), 'answer')}: {'; '.join(findings)}")
    failed = [a["error"] for a in plan["answers"] if a["error"] and not unsupported(a)]
    if failed:  # last: the answers the plan could not give
        print(f"FAILED: {counted(len(failed), 'answer')}: {'; '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def say_landed(plan: dict, questions: dict, searches: dict, landed: dict, elapsed: float) -> None:
    """A line for each answer that has just landed: the running count, and the time left at the pace of the
    answers since the first (a rough estimate: before it, the shared processes take a time of their own,
    and the answers left may take more or fewer probes)."""
    answers = dict(zip(searches, plan["answers"]))
    for key in [key for key, search in searches.items() if search.done and key not in landed]:
        landed[key] = elapsed
        a, left = answers[key], len(searches) - len(landed)
        value = f"failed ({a['error']})" if a["error"] else f"{'B' if a['searched'] == BATCH else 'L'} = " \
            f"{a['largest'] or 'nothing fits'}"
        pace = (elapsed - min(landed.values())) / (len(landed) - 1) if len(landed) > 1 else None
        eta = f", about {pace * left:.0f} s left" if left and pace is not None else ""
        print(f"[answer {len(landed)}/{len(searches)}] {questions[key].title}: {value} "
              f"({counted(a['probes'], 'probe')}; {elapsed:.0f} s{eta})", flush=True)


def emulation_said(links: Links | None) -> str:
    if links is None:
        return ""
    return (f"; each fresh probe's collectives emulated over {links_said(links)} (per probe in plan.json: calls, "
            "bytes, seconds; the shared processes' are not)")


def cap_said(cap: estimate.GpuCap | None) -> str:
    if cap is None:
        return " (a CPU run: no cap, the probes find only the out-of-memory errors injected or raised)"
    return (f" under a cap of {cap.gib:g} GiB (the allocator gets {cap.allocator_bytes / MIB:.0f} MiB beside "
            f"{cap.context / MIB:.0f} MiB of CUDA context)")


def plan_meta(checked: Checked, session, started: float) -> dict:
    args = checked.args
    return {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "model": args.model, "num_parameters": session.num_parameters, "device": session.device.type,
            "versions": arguments.versions(), "find": args.find, "sets": checked.sets, "world_sizes": checked.sizes,
            "variants": checked.variants, "block_sizes": checked.blocks, "batch_size": args.batch_size,
            "loop": args.loop, "loss": args.loss, "tuning": dataclasses.asdict(checked.base.tuning),
            "trainable_parameters": trainable_parameters(session.shapes), "upper_bound": checked.upper,
            "probe_steps": PROBE_STEPS, "init_device": args.init_device,
            "gpu_memory": checked.cap.as_dict() if checked.cap else None, "skipped": checked.skipped,
            "emulated_links": vars(checked.links) if checked.links else None,
            "option_sets": {name: fsdp.OPTION_SETS[name].changed() for name in checked.sets},
            "options_from": accelerate_config.summary_of(checked.config, {k: "config" for k in
                                                                          (checked.config.values if checked.config
                                                                           else {})})}


def main() -> None:
    exit_with(run)


if __name__ == "__main__":
    main()
