"""A bare training loop of main.py's work, for speed.py: what a step costs without the suite.

The same model build, variant, wrapping, levers, loss and batches as main.py's first variant (at its first
simulated N, on a fake process group; at N = 1 without one), trained with no memory tracker, no polling, no
per-step accounting, no read-back one step late: each step's time between two CUDA events (or the clock on a
CPU). speed.py runs it beside main.py in one call, so that the suite's own cost per step is measured and stated;
under ``--emulate_communication`` its collectives are emulated as the suite's are, every other step.

    python3 -m fsdp2bench.run.bare OUT.json -- <main.py options>
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import torch

import utils
from fsdp2bench.cli import pick_device
from fsdp2bench.processes import simulation
from fsdp2bench.processes.emulation import Tally, emulated
from fsdp2bench.run.arguments import build_threads, validate
from fsdp2bench.train import throughput
from fsdp2bench.train.model import build_for_run
from fsdp2bench.train.runner import TrainStep, deterministic, steps_speed


def time_steps(step: TrainStep, batches: torch.Tensor, device: torch.device, tally: Tally | None) -> list[dict]:
    """Each step's seconds, from events recorded around it on the device (the clock on a CPU), and where its
    communication is emulated every other step (``tally``), whether it was."""
    records = []
    for index, batch in enumerate(batches):
        records.append({} if tally is None else {"communication_emulated": tally.step_starts(index)})
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step(batch.to(device, non_blocking=True))
            end.record()
            end.synchronize()
            records[-1]["step_time_s"] = begin.elapsed_time(end) / 1000
        else:
            step(batch)
            records[-1]["step_time_s"] = time.perf_counter() - start
    return records


def bare_loop(argv: list[str]) -> dict:
    """main.py's first variant trained bare at its first simulated N (else N = 1); its step times and speed."""
    with tempfile.TemporaryDirectory(prefix="fsdp2bench-bare-") as nowhere:  # it writes no run's files
        checked = validate([*argv, "--output_dir", nowhere])
    args, options = checked.args, checked.fsdp_options
    world = simulation.parse_world_sizes(args.simulate_world_size)[0] if args.simulate_world_size else 1
    device = pick_device(args.device)
    torch.set_num_threads(build_threads())
    deterministic(device)
    name = checked.names[0]
    meshes = simulation.init_simulated_group(device, 0, world, None if name == "accelerate" else
                                             options.layout.at(world))
    model = None if name == "accelerate" and options.layout.tensor_parallel else \
        build_for_run(checked.facts.config, args.init_device, device, args.seed, build_threads(), None,
                      options.tuning)[0]
    ctx = utils.Context(device, meshes, args.learning_rate, checked.facts.layer_classes, lambda *a, **k: None,
                        options, checked.facts.config)
    prep = utils.VARIANTS[name](model, ctx)
    step = TrainStep(prep, options.gradient_accumulation_steps, options.step.keeps_outputs)
    with emulated(checked.links, device) as tally:  # the suite's work: its communication emulated where it is
        records = time_steps(step, checked.batches.pin_memory() if device.type == "cuda" else checked.batches, device,
                             tally)
    speed = steps_speed(records, checked.batches.shape, options, prep.model, checked.facts.config, device,
                        bool(args.simulate_world_size), tally)
    seconds = [r["step_time_s"] for r in records]
    return {"variant": name, "world_size": world, "step_times_s": seconds, "speed": speed,
            "median_all_steps_s": statistics.median(seconds),
            "emulated": None if tally is None else tally.per_step()}


def main() -> None:
    out, rest = sys.argv[1], [a for a in sys.argv[2:] if a != "--"]
    result = bare_loop(rest)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"bare loop, {result['variant']} at N = {result['world_size']}: median step "
          f"{result['speed']['median_step_time_s']} s, {throughput.rate_said(result['speed'])} tokens/s per rank")


if __name__ == "__main__":
    main()
