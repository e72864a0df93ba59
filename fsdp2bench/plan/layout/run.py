"""``plan.py --find layout``: its run (its command line is checked in plan/checks.py)."""

from __future__ import annotations

import sys
import time

from fsdp2bench.cli import say
from fsdp2bench.files import prepare_output_dir
from fsdp2bench.plan.checks import CheckedSearch
from fsdp2bench.plan.layout.report import print_search, winner_said, write_search
from fsdp2bench.plan.layout.search import Setup, assess
from fsdp2bench.plan.layout.timing import choose_and_time
from fsdp2bench.processes.starting import interrupts_raise
from fsdp2bench.run import arguments


def run_search(search: CheckedSearch, started: float) -> int:
    """Assess every candidate, time the most promising, rank, print and write plan.json."""
    interrupts_raise()  # a Ctrl-C, SIGTERM or SIGHUP raises: during the timings what they measured is still written
    setup = search.setup
    prepare_output_dir(setup.output_dir)
    found = [assess(c, setup) for c in search.candidates]
    out = sum(f.fits is False for f in found)
    near = sum(f.fits is None for f in found)
    say(f"{len(found)} candidates of N = {setup.world_size} at {setup.global_sequences} x {setup.block} tokens a "
        f"step: {out} over the cap by the memory model's estimate (not run), {near} "
        + ("near it" if setup.cap else "that a CPU run cannot place (no cap)")
        + f", {len(found) - out - near} well under it; timing the most promising one at a time...")
    timings: list[dict] = []
    try:
        choose_and_time(found, setup, say, timings)
    except KeyboardInterrupt as exc:
        meta = run_meta(setup, started, interrupted=True)
        path = write_search(found, setup, search.notes, timings, meta, winner_said(found, setup))
        print(f"Interrupted ({str(exc) or 'SIGINT'}); the {len(timings)} timing(s) that ended are ranked in {path}",
              file=sys.stderr, flush=True)
        return 130
    said = winner_said(found, setup)
    print_search(found, setup, search.notes, timings, said)
    path = write_search(found, setup, search.notes, timings, run_meta(setup, started, interrupted=False), said)
    print(f"Wrote {path}; draw it with:\n    python3 visualize.py --dir {setup.output_dir}", flush=True)
    return 0


def run_meta(setup: Setup, started: float, interrupted: bool) -> dict:
    return {"command": " ".join(sys.argv), "model": setup.model, "world_size": setup.world_size,
            "block_size": setup.block, "global_batch": setup.global_sequences, "device": setup.device_type,
            "gpu_name": setup.gpu_name, "gpu_memory": setup.cap.as_dict() if setup.cap else None,
            "versions": arguments.versions(), "wall_s": time.time() - started, "interrupted": interrupted}
