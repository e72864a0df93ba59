"""Replays the block-size answers of committed plan.json files through today's search, on demand (not a test):
how many fresh probes each answer takes now, against what the run took.

    python3 tests/replay_plans.py [PLAN.json ...]   (default: every block-size plan.json under results/h200)

Each answer is replayed alone: the shared process's recorded values aim the search as in the run, and a value the
search asks for is answered from the record, fits where it is at most the recorded largest fit (its peak on the
line through the recorded fits), fails above. Only answers with a shared process of their own (leaders) are
replayed: the seeds and learned shares that pass between answers are not. Imports torch for the model's shapes.
"""

from __future__ import annotations

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp2bench.concurrency import GpuCap  # noqa: E402
from fsdp2bench.fitting import Outcome  # noqa: E402
from fsdp2bench.names import MIB  # noqa: E402
from fsdp2bench.options import FsdpOptions  # noqa: E402
from fsdp2bench.probes import BLOCK, Question, search_for  # noqa: E402
from fsdp2bench.session import model_facts  # noqa: E402
from fsdp2bench.step import Step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_line(points: list[tuple[int, float]]):
    """The recorded fits' peaks as a function of tokens: through the two largest (extrapolated beyond)."""
    (x1, y1), (x2, y2) = sorted(points)[-2:]
    return lambda x: y2 + (y2 - y1) / (x2 - x1) * (x - x2)


def replay(plan: dict, answer: dict) -> tuple[int, int, bool]:
    """(probes now, probes in the run, same edge)."""
    meta = plan["meta"]
    facts = model_facts(os.path.join(ROOT, meta["model"]) if os.path.isdir(os.path.join(ROOT, meta["model"]))
                        else meta["model"], 421)
    base = FsdpOptions(step=Step(loop=meta.get("loop", "upstream"), loss=meta.get("loss", "model")))
    q = Question(answer["option_set"], answer["world_size"], answer["rank"], answer["variant"], BLOCK,
                 answer["fixed"], base)
    gpu = meta["gpu_memory"]
    cap = GpuCap(gpu["gib"], gpu["gpu_total_mib"] * MIB, gpu["cuda_context_mib"] * MIB)
    lower = -(-min(meta["block_sizes"]) // q.unit)
    search = search_for(q, lower, meta["upper_bound"] // q.unit, cap, facts.config)
    # plan.json gives values in tokens; the search counts steps of q.unit tokens
    search.take_shared([Outcome(o["value"] // q.unit, o["fits"], o.get("peak_mib")) for o in answer["shared"]])
    fresh = [(o["value"], o["peak_mib"]) for o in answer["outcomes"] if o["fits"]]
    if len(fresh) < 2:  # one fresh fit: the line to it from the shared process's largest value
        fresh += [(o["value"], o["peak_mib"]) for o in answer["shared"] if o["fits"]][-1:]
    largest, line = answer["largest"] // q.unit, peak_line(fresh)
    while values := search.next_values():
        for v in values:
            fits = v <= largest
            search.record(Outcome(v, fits, line(v * q.unit) if fits else None))
    return len(search.outcomes), len(answer["outcomes"]), search.largest_fit == largest


def main(paths: list[str]) -> None:
    now = run = answers = 0
    for path in paths or sorted(glob.glob(os.path.join(ROOT, "results/h200/**/plan.json"), recursive=True)):
        with open(path) as f:
            plan = json.load(f)
        if plan["meta"].get("find") != BLOCK or plan["meta"].get("batch_size") != 1:
            continue
        for answer in plan["answers"]:
            if not any(o["fits"] and o.get("peak_mib") for o in answer["shared"]):
                continue  # a follower of another variant's answer: its seed is not replayed
            probes, recorded, same = replay(plan, answer)
            now, run, answers = now + probes, run + recorded, answers + 1
            print(f"{os.path.relpath(path, ROOT)} {answer['option_set']}: {probes} probes now, {recorded} in the run"
                  + ("" if same else " (a different edge!)"))
    print(f"{answers} answers: {now / answers:.2f} probes each now, {run / answers:.2f} in the runs")


if __name__ == "__main__":
    main(sys.argv[1:])
