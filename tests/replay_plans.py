"""Replay the committed plans' searches (on demand, not a test: ``python3 tests/replay_plans.py [DIR]``).

Each answer of every committed plan.json (results/h200; the layout search's are another search) is searched
again by this checkout's Search and Planner, every probe answered from what the plan recorded: a value it probed
gets its recorded outcome (fits with its peak, or out of memory with where it stood); another value fits at or
below the recorded largest fit (its peak on the line through the recorded fits) and fails at or above the recorded
smallest failure; a value between the two cannot be known (counted, and answered as not fitting). The shared
process's recorded values aim the searches as in the real run. So the fresh probes an answer takes here are those
this code would have taken on that GPU, and its answer must be the recorded one.

Answers recorded before plans kept their shared process's values (no ``shared`` in plan.json) and answers a plan
did not finish are left out: neither says what this code would do.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import glob
import json
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp2bench.names import MIB  # noqa: E402
from fsdp2bench.options.fsdp import FsdpOptions  # noqa: E402
from fsdp2bench.options.step import Step  # noqa: E402
from fsdp2bench.plan.probes import BLOCK, Question, leaders_of, search_for  # noqa: E402
from fsdp2bench.plan.search import Outcome, run_searches  # noqa: E402
from fsdp2bench.run.concurrency import GpuCap  # noqa: E402
from fsdp2bench.run.session import model_facts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The long-context plans: their searches are over thousands of tokens, their edges far beyond the shared values.
LONG_CONTEXT_DIRS = ("long_context_8b", "plan_cp_1.5b")


@functools.cache
def facts_of(model: str):
    return model_facts(model, 0)


@dataclass
class Recorded:
    """One answer as plan.json recorded it, in the search's units: its fresh outcomes, edge and shared values."""
    unit: int
    outcomes: dict[int, Outcome]
    largest: int | None
    smallest_failure: int | None
    shared: list[Outcome]
    unknown: list[int] = field(default_factory=list)  # values asked that the record cannot answer

    def fits(self) -> list[tuple[int, float]]:
        return sorted((v, o.peak_mib) for v, o in self.outcomes.items() if o.fits and o.peak_mib is not None)

    def peak_at(self, value: int) -> float | None:
        """A fit's peak on the line through the recorded fits beside it (the two nearest where it lies outside)."""
        points = self.fits()
        if len(points) < 2:
            return points[0][1] if points else None
        i = min(max(1, bisect.bisect_left([x for x, _ in points], value)), len(points) - 1)
        (x1, y1), (x2, y2) = points[i - 1], points[i]
        return y1 + (y2 - y1) * (value - x1) / (x2 - x1)

    def probe(self, value: int) -> Outcome:
        if value in self.outcomes:
            return self.outcomes[value]
        if self.smallest_failure is not None and value >= self.smallest_failure:
            return Outcome(value, False, None, {"replayed": "failure"})
        if self.largest is not None and value <= self.largest:
            return Outcome(value, True, self.peak_at(value), {"replayed": "fit"})
        self.unknown.append(value)
        return Outcome(value, False, None, {"replayed": "unknown"})


def outcome_of(said: dict, unit: int) -> Outcome:
    return Outcome(said["value"] // unit, said["fits"], said.get("peak_mib"),
                   {k: v for k, v in said.items() if k not in ("value", "fits", "peak_mib")})


def recorded(answer: dict, unit: int) -> Recorded:
    outcomes = {}
    for said in answer["outcomes"]:
        outcomes.setdefault(said["value"] // unit, outcome_of(said, unit))  # the first of a value rerun alone
    failure = (answer.get("above") or {}).get("value")
    largest = answer["largest"]
    return Recorded(unit, outcomes, None if largest is None else largest // unit,
                    None if failure is None else failure // unit,
                    [outcome_of(s, unit) for s in answer.get("shared") or []])


def cap_of(meta: dict) -> GpuCap | None:
    gpu = meta.get("gpu_memory")
    if not gpu:
        return None
    return GpuCap(gpu["gib"], int(gpu["gpu_total_mib"] * MIB), int(gpu["cuda_context_mib"] * MIB))


def base_of(meta: dict) -> FsdpOptions:
    step = Step(**{k: meta[k] for k in ("loop", "loss") if meta.get(k)})
    return FsdpOptions(step=step)


def replay_plan(path: str) -> list[dict]:
    """Each replayable answer of one plan.json: its recorded and replayed probes and edges."""
    with open(path) as f:
        plan = json.load(f)
    meta = plan["meta"]
    facts = facts_of(meta["model"])
    cap, base = cap_of(meta), base_of(meta)
    questions, searches, records = {}, {}, {}
    for a in plan["answers"]:
        if "shared" not in a or not a.get("finished", True) or a.get("error"):
            continue
        key = (a["option_set"], a["world_size"], a["variant"], a["fixed"])
        q = Question(a["option_set"], a["world_size"], a["rank"], a["variant"], a["searched"], a["fixed"], base)
        lower = 1 if q.searched != BLOCK else -(-min(meta["block_sizes"]) // q.unit)
        questions[key], records[key] = q, recorded(a, q.unit)
        searches[key] = search_for(q, lower, meta["upper_bound"] // q.unit, cap, facts.config)
        if records[key].shared:
            searches[key].take_shared_values(records[key].shared)
    leaders = leaders_of(questions, searches, facts.shapes)

    def run_round(wanted):
        return {(key, value): records[key].probe(value) for key, value in wanted}

    run_searches(searches, run_round, group=lambda key: key[0], leaders=leaders)
    rows = []
    for a in plan["answers"]:
        key = (a["option_set"], a["world_size"], a["variant"], a["fixed"])
        if key not in searches:
            continue
        search, record = searches[key], records[key]
        rows.append({"key": key, "recorded_probes": len(a["outcomes"]), "probes": len(search.outcomes),
                     "values": [o.value * record.unit for o in search.outcomes],
                     "same": (search.largest_fit, search.smallest_failure) == (record.largest, record.smallest_failure),
                     "found": (search.largest_fit, search.smallest_failure),
                     "record": (record.largest, record.smallest_failure), "unit": record.unit,
                     "unknown": len(record.unknown), "block": a["searched"] == BLOCK,
                     "leader": key not in leaders})
    return rows


def long_context(path: str) -> bool:
    return any(f"/{d}/" in path for d in LONG_CONTEXT_DIRS)


def said(rows: list[dict]) -> str:
    if not rows:
        return "no answers"
    n, probes, recorded_ = len(rows), sum(r["probes"] for r in rows), sum(r["recorded_probes"] for r in rows)
    return f"{n:4} answers, {probes:5} probes, {probes / n:5.2f} per answer (recorded {recorded_ / n:5.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default=os.path.join(ROOT, "results", "h200"))
    p.add_argument("--verbose", action="store_true", help="every answer's replayed values")
    args = p.parse_args(argv)
    paths = sorted(f for f in glob.glob(os.path.join(args.dir, "**", "plan*.json*"), recursive=True)
                   if "layout_" not in os.path.relpath(f, args.dir))
    every, blocks, long_, changed = [], [], [], []
    for path in paths:
        rows = replay_plan(path)
        name = os.path.relpath(path, ROOT)
        print(f"{name:58} {said(rows)}")
        every += rows
        blocks += [r for r in rows if r["block"]]
        long_ += rows if long_context(path) else []
        for r in rows:
            if args.verbose:
                print(f"    {r['key']}: {r['probes']} probes {r['values']}, edge {r['found']}")
            if not r["same"] or r["unknown"]:
                changed.append(f"{name} {r['key']}: found {r['found']}, recorded {r['record']} (units of "
                               f"{r['unit']}), {r['unknown']} value(s) the record cannot answer")
    print(f"\n{'every answer':58} {said(every)}")
    print(f"{'block searches':58} {said(blocks)}")
    print(f"{'long context (long_context_8b, plan_cp_1.5b)':58} {said(long_)}")
    leaders = [r for r in every if r["leader"]]
    print(f"{'leaders (a shared process aims them)':58} {said(leaders)}")
    print(f"{'followers (start at a leader edge)':58} {said([r for r in every if not r['leader']])}")
    print(f"answers that differ from the record or asked what it cannot answer: {len(changed)}")
    for line in changed:
        print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
