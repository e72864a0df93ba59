"""``plan.py --find layout``: its run (its command line is checked in plan/checks.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

from fsdp2bench.cli import UserError, say
from fsdp2bench.files import is_ours, prepare_output_dir
from fsdp2bench.memory.accounting import trainable_parameters
from fsdp2bench.names import counted
from fsdp2bench.plan.checks import CheckedSearch
from fsdp2bench.plan.layout.report import CONFIG_NAME, print_search, winner_said, write_search
from fsdp2bench.plan.layout.search import SearchInputs, assess
from fsdp2bench.plan.layout.timing import choose_and_time, timing_dir
from fsdp2bench.processes.starting import interrupts_raise
from fsdp2bench.run import arguments


def run_search(search: CheckedSearch, started: float) -> int:
    """Assess every candidate, time the most promising, rank, print and write plan.json."""
    interrupts_raise()  # a Ctrl-C, SIGTERM or SIGHUP raises: during the timings what they measured is still written
    setup = search.setup
    prepare_output_dir(setup.output_dir)
    clear_earlier_search(setup.output_dir)
    rows = [assess(c, setup) for c in search.candidates]
    out = sum(f.fits is False for f in rows)
    near = sum(f.fits is None for f in rows)
    trains = setup.base.tuning.said()  # what every timing trains, where not the whole model with AdamW
    say(f"{counted(len(rows), 'candidate')} of N = {setup.world_size} for {setup.model}"
        f"{', ' + trains if trains else ''} at {setup.global_sequences} x {setup.block} tokens a step: {out} over "
        f"the cap by the memory model's estimate (not run), {near} "
        + ("near it" if setup.cap else "that a CPU run cannot place (no cap)")
        + f", {len(rows) - out - near} well under it; timing the most promising one at a time...")
    timings: list[dict] = []
    try:
        choose_and_time(rows, setup, say, timings)
    except KeyboardInterrupt as exc:
        meta = run_meta(setup, started, interrupted=True)
        path = write_search(rows, setup, search.notes, timings, meta, winner_said(rows, setup))
        ended = len(timings)
        print(f"Interrupted ({str(exc) or 'SIGINT'}); the {counted(ended, 'timing')} that ended "
              f"{'is' if ended == 1 else 'are'} ranked in {path}", file=sys.stderr, flush=True)
        return 130
    said = winner_said(rows, setup)
    print_search(rows, setup, search.notes, timings, said)
    path = write_search(rows, setup, search.notes, timings, run_meta(setup, started, interrupted=False), said)
    print(f"Wrote {path}; draw it with:\n    python3 visualize.py --dir {setup.output_dir}", flush=True)
    return 0


def clear_earlier_search(output_dir: str) -> None:
    """A search owns its folder: an earlier search's own files there (its accelerate config, checked unedited before
    anything ran; its layout.png; every marked file of its timings) go before this one writes, so that none is read
    as this one's. A file without the benchmark's mark stays, and the folders that hold one."""
    timings = os.path.dirname(timing_dir(output_dir, 0))
    rows = [os.path.join(root, name) for root, _, names in os.walk(timings) for name in names]
    ours = [path for path in rows + [os.path.join(output_dir, "layout.png")] if is_ours(path)]  # judged, then gone
    config = os.path.join(output_dir, CONFIG_NAME)
    for path in ours + ([config] if os.path.isfile(config) else []):
        try:
            os.remove(path)
        except OSError as exc:
            raise UserError(f"--output_dir {output_dir}: cannot remove the earlier search's {path} ({exc.strerror}); "
                            "move it away or choose another --output_dir") from None
    for root, _, _ in sorted(os.walk(timings), key=lambda entry: -len(entry[0])):
        with contextlib.suppress(OSError):  # left where it holds another program's files
            os.rmdir(root)


def run_meta(setup: SearchInputs, started: float, interrupted: bool) -> dict:
    return {"command": " ".join(sys.argv), "model": setup.model, "world_size": setup.world_size,
            "block_size": setup.block, "global_batch": setup.global_sequences, "device": setup.device_type,
            "tuning": dataclasses.asdict(setup.base.tuning), "num_parameters": setup.num_parameters,
            "trainable_parameters": trainable_parameters(setup.shapes),
            "gpu_name": setup.gpu_name, "gpu_memory": setup.cap.as_dict() if setup.cap else None,
            "versions": arguments.versions(), "wall_s": time.time() - started, "interrupted": interrupted}
