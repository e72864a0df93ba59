"""``plan.py --find layout``: which layout and levers fit N GPUs of M GiB at a sequence length and global batch, and
which of them trains fastest, by measured compute and projected communication.

Every candidate (``candidates.py``) is first held against the memory model: those it puts well over the cap are
left out with how far over, before anything runs. Then the candidates most likely to rank first are timed one at
a time, each in one main.py launch of one simulated rank alone on the device (``TIMING_STEPS`` steps, one
microbatch a step): that gives a clean compute speed (``throughput.py``) and a measured peak on rank 0. One timing
serves every candidate of the same per-rank shapes (tp and cp sizes, local batch, sequence, levers): a rank's
compute does not depend on how the others split into replicas and shards, nor on how many microbatches make a
step; the memory of those others is the measured peak moved by what the memory model says they hold more or less.
Communication is a projection over a link table (``traffic.py``). A step's projected time is compute plus
communication (no overlap: a bound from below on speed) or the larger of the two (full overlap: from above);
candidates rank by the first. Every figure is labelled measured, projected or estimated where it is written.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from fsdp2bench.candidates import TRAINED, Candidate, estimated_bytes
from fsdp2bench.names import GIB, MIB
from fsdp2bench.throughput import model_flops_per_token, peak_flops
from fsdp2bench.traffic import Links, step_collectives

TIMING_STEPS = 4  # warm-up (two under compile) and at least two clean steps after it
EDGE = 0.2  # an estimate this far over the cap is left out; within it of the cap a candidate is probed
# For the order in which candidates are timed only (never a reported figure): the speed of each lever relative to
# full checkpointing, from the Llama-3.1-8B shape on one H200 (docs/levers.md; no checkpointing taken as a third
# faster than full, its recomputed forward), and an MFU to set compute beside communication.
AC_PRIOR = {"full": 1.0, "selective": 1.10, "none": 1.33}
COMPILE_PRIOR, FLOAT8_PRIOR, PRIOR_MFU, PRIOR_FLOPS = 1.18, 1.30, 0.4, 1e11


@dataclass
class Assessed:
    """A candidate with what is known of it: estimated, then perhaps measured, and projected."""
    candidate: Candidate
    estimated_bytes: int
    collectives: list
    comm_s: float
    fits: bool | None = None  # None: cannot tell (no cap, or not measured where the estimate is near the cap)
    memory: dict = field(default_factory=dict)
    compute: dict | None = None  # the timing it takes its compute from
    projected: dict | None = None

    @property
    def key(self) -> tuple:
        return self.candidate.compute_key


@dataclass(frozen=True)
class Setup:
    """What one layout search needs beside its candidates."""
    model: str
    world_size: int
    block: int
    global_sequences: int
    shapes: list
    config: object
    base: object  # FsdpOptions
    cap: object | None  # concurrency.GpuCap
    links: Links
    device_type: str
    gpu_name: str | None
    output_dir: str
    max_timings: int
    init_device: str
    num_parameters: int
    held: dict = field(default_factory=dict, compare=False)  # estimated_bytes's, per layout and levers

    @property
    def tokens_per_step_per_gpu(self) -> float:
        return self.global_sequences * self.block / self.world_size


def assess(candidate: Candidate, setup: Setup) -> Assessed:
    """The memory model's estimate and the projected communication of one candidate; where the estimate is over
    the cap by more than ``EDGE``, it does not fit, and by how much is said."""
    estimate = estimated_bytes(candidate, setup.shapes, setup.config, setup.block, setup.base, setup.held)
    chosen = candidate.options(setup.base)
    collectives = step_collectives(setup.shapes, setup.config, candidate.degrees, chosen, candidate.batch,
                                   setup.block, candidate.microbatches)
    found = Assessed(candidate, estimate, collectives, sum(c.seconds(setup.links) for c in collectives))
    found.memory = {"estimated_gib": estimate / GIB}
    if setup.cap is not None and estimate > setup.cap.process_bytes * (1 + EDGE):
        found.fits = False
        found.memory["over_gib"] = (estimate - setup.cap.process_bytes) / GIB
        found.memory["how"] = "estimated (memory model), not run"
    elif setup.cap is not None and estimate < setup.cap.process_bytes * (1 - EDGE):
        found.fits = True
        found.memory["how"] = "estimated (memory model), well under the cap"
    return found


def prior_speed(found: Assessed, setup: Setup) -> float:
    """Tokens per second per GPU that orders the timings (a prior: never reported)."""
    c = found.candidate
    factor = AC_PRIOR[c.ac] * (COMPILE_PRIOR if c.compile else 1) * (FLOAT8_PRIOR if c.float8 else 1)
    flops = peak_flops(setup.gpu_name)
    rate = (PRIOR_MFU * flops if flops else PRIOR_FLOPS) * factor / model_flops_per_token(
        setup.num_parameters, setup.config, setup.block)
    return setup.tokens_per_step_per_gpu / (setup.tokens_per_step_per_gpu / rate + found.comm_s)


def timing_command(candidate: Candidate, setup: Setup, output_dir: str) -> list[str]:
    """main.py for one simulated rank of the candidate's layout, one microbatch a step, alone on the device."""
    one = Candidate(candidate.degrees, candidate.ac, candidate.loss, candidate.compile, candidate.float8,
                    candidate.batch, 1)
    return [sys.executable, "main.py", *main_flags(one, setup), "--simulate_world_size", str(setup.world_size),
            "--max_steps", str(TIMING_STEPS), "--concurrent_variants", "1", "--quiet", "--output_dir", output_dir,
            *(["--gpu_memory", f"{setup.cap.gib:g}"] if setup.cap else []),
            *(["--init_device", setup.init_device] if setup.device_type == "cuda" else ["--device", "cpu"])]


def main_flags(candidate: Candidate, setup: Setup) -> list[str]:
    """main.py's flags that train the candidate (its layout, levers, batch and accumulation)."""
    return ["--model", setup.model, "--variants", TRAINED, "--batch_size", str(candidate.batch), "--block_size",
            str(setup.block), *candidate.options(setup.base).flags()]


def run_timing(found: Assessed, setup: Setup, index: int) -> dict:
    """One timing: main.py's summary read back into the figures the ranking uses; an out-of-memory error (or
    any other failure) is kept with its words."""
    directory = os.path.join(setup.output_dir, "timings", f"t{index}")
    command = timing_command(found.candidate, setup, directory)
    proc = subprocess.run(command, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    record = {"candidate": found.candidate.name, "command": shlex.join(["python3", *command[1:]]),
              "exit_code": proc.returncode}
    entry = summary_entry(os.path.join(directory, "summary.json"), setup.world_size)
    if entry is None or entry.get("status") != "ok":
        why = (entry or {}).get("status") or (proc.stderr.strip().splitlines() or ["no summary"])[-1]
        return {**record, "fits": False if "out of memory" in why else None, "error": why[:300]}
    speed = entry.get("speed") or {}
    clean = speed.get("tokens_per_s_per_gpu") is not None
    return {**record, "fits": True, "clean": clean, "speed": speed,
            "microbatch_s": speed["median_step_time_s"] if clean else entry.get("median_step_time_s"),
            "peak_reserved_mib": entry["training_peak_reserved_mib"]["max"],
            "peak_allocated_mib": entry["training_peak_allocated_mib"]["max"]}


def summary_entry(path: str, world_size: int) -> dict | None:
    try:
        with open(path) as f:
            summary = json.load(f)
        return summary["simulated"][str(world_size)]["0"][TRAINED]
    except (OSError, ValueError, KeyError):
        return None


def take_timing(timing: dict, probed: Assessed, everyone: list[Assessed], setup: Setup) -> None:
    """A timing to every candidate of the same per-rank shapes: its compute, and its memory moved by what the
    memory model says each holds beside the probed candidate at one microbatch."""
    probed_one = estimated_bytes(Candidate(*_fields(probed.candidate)[:6], 1), setup.shapes, setup.config,
                                 setup.block, setup.base, setup.held)
    for found in (f for f in everyone if f.key == probed.key):
        found.compute = timing
        moved = found.estimated_bytes - probed_one
        if timing["fits"] is False and moved >= 0:
            found.fits, found.memory["how"] = False, f"out of memory where a like candidate ran: {timing['error']}"
        if not timing["fits"] or timing["peak_reserved_mib"] is None:  # a CPU run has no allocator peaks
            continue
        measured = timing["peak_reserved_mib"] * MIB + moved
        found.memory.update(measured_gib=measured / GIB, moved_gib=moved / GIB,
                            how="measured on rank 0 (a like candidate at one microbatch) + the memory model's "
                                "difference")
        if setup.cap is not None:
            found.fits = measured <= setup.cap.allocator_bytes


def _fields(c: Candidate) -> tuple:
    return c.degrees, c.ac, c.loss, c.compile, c.float8, c.batch, c.microbatches, c.sync_each_batch


def project(found: Assessed, setup: Setup) -> None:
    """Projected tokens per second per GPU from the measured compute of a microbatch times the microbatches,
    and the projected communication, by both rules."""
    timing = found.compute
    if not timing or not timing.get("fits") or not timing.get("microbatch_s"):
        return
    compute = timing["microbatch_s"] * found.candidate.microbatches
    tokens = setup.tokens_per_step_per_gpu
    found.projected = {"compute_s": compute, "compute_measured": True, "compute_clean": timing["clean"],
                       "comm_s": found.comm_s, "no_overlap_tokens_per_s": tokens / (compute + found.comm_s),
                       "full_overlap_tokens_per_s": tokens / max(compute, found.comm_s)}


def choose_and_time(found: list[Assessed], setup: Setup, say) -> list[dict]:
    """Time the candidates most likely to rank first (by ``prior_speed``, the least memory first among equals),
    one per per-rank shape (and one loss of each: the least memory's), until ``max_timings`` ran; each timing
    serves every candidate of its shape."""
    timings, timed = [], set()
    for each in sorted((f for f in found if f.fits is not False),
                       key=lambda f: (-prior_speed(f, setup), f.estimated_bytes)):
        if len(timings) >= setup.max_timings:
            break
        if without_loss(each.key) in timed or each.fits is False:
            continue  # the loss changes little of a step's time: another shape is timed first
        timed.add(without_loss(each.key))
        timing = run_timing(each, setup, len(timings))
        timings.append(timing)
        take_timing(timing, each, found, setup)
        say(f"[timing {len(timings)}/{setup.max_timings}] {each.candidate.name}: " + timing_said(timing))
    for each in found:
        project(each, setup)
    return timings


def without_loss(key: tuple) -> tuple:
    return key[:4] + key[5:]


def timing_said(timing: dict) -> str:
    if not timing["fits"]:
        return f"did not run through ({timing.get('error', '')[:120]})"
    clean = "" if timing["clean"] else " (beside other runs: not a clean speed)"
    peak = timing["peak_reserved_mib"]
    return f"{timing['microbatch_s']:.3f} s a microbatch measured{clean}" + \
        (f", {peak:,.0f} MiB reserved measured" if peak is not None else "")


def ranked(found: list[Assessed]) -> list[Assessed]:
    """The candidates that fit (or, without a cap, may) with a projection, fastest first by the no-overlap rule."""
    return sorted((f for f in found if f.fits is not False and f.projected),
                  key=lambda f: (-f.projected["no_overlap_tokens_per_s"], f.comm_s))


def record(found: Assessed, links: Links) -> dict:
    c = found.candidate
    return {"name": c.name, **c.degrees.as_dict(), "activation_checkpointing": c.ac, "loss": c.loss,
            "compile": c.compile, "float8": c.float8, "batch_size": c.batch, "microbatches": c.microbatches,
            "sync_each_batch": c.sync_each_batch, "fits": found.fits, "memory": found.memory,
            "projected_comm_s": found.comm_s,
            "collectives": [x.as_dict(links) for x in found.collectives] if found.projected else None,
            "timing": found.compute.get("candidate") if found.compute else None, "projected": found.projected}


def commands(winner: Candidate, setup: Setup) -> dict:
    """The exact command lines that train the winner: torchrun on the real nodes, the same on one GPU (a simulated
    rank, to check it first), and the accelerate config fields."""
    n, node = setup.world_size, setup.links.node_size
    flags = main_flags(winner, setup)
    if n <= node:
        launcher = ["torchrun", "--standalone", "--nproc_per_node", str(n)]
    else:
        launcher = ["torchrun", "--nnodes", str(math.ceil(n / node)), "--nproc_per_node", str(node),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", "HOST:29500"]
    check = ["python3", "main.py", *flags, "--simulate_world_size", str(n), "--max_steps", str(TIMING_STEPS),
             *(["--gpu_memory", f"{setup.cap.gib:g}"] if setup.cap else [])]
    return {"torchrun": shlex.join([*launcher, "main.py", *flags]), "one_gpu_check": shlex.join(check),
            "accelerate_config": accelerate_fields(winner, setup)}


def accelerate_fields(winner: Candidate, setup: Setup) -> dict:
    """The accelerate config that trains the winner under ``accelerate launch`` (main.py's flags beside it: the
    loss, and selective checkpointing, which accelerate's plugin has no field for)."""
    d, chosen = winner.degrees, winner.options(setup.base)
    fields = {"distributed_type": "FSDP", "num_machines": math.ceil(d.world_size / setup.links.node_size),
              "num_processes": d.world_size, "mixed_precision": "fp8" if winner.float8 else "bf16",
              "gradient_accumulation_steps": winner.microbatches,
              "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": chosen.reshard_after_forward,
                              "fsdp_activation_checkpointing": winner.ac == "full",
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
              "parallelism_config": {f"parallelism_config_{axis}_size": size for axis, size in
                                     (("dp_replicate", d.replicate), ("dp_shard", d.shard), ("cp", d.cp),
                                      ("tp", d.tp))}}
    if winner.compile:
        fields["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}
    if winner.float8:
        fields["fp8_config"] = {"backend": "AO"}
    return fields
