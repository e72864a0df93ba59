"""``plan.py --find layout``: which layout and levers fit N GPUs of M GiB at a sequence length and global batch, and
which of them trains fastest, by a step whose communication is emulated on FSDP2's own schedule.

Every candidate (``candidates.py``) is first held against the memory model: those it puts well over the cap are
left out with how far over, before anything runs. Timings (``timing.py``: one simulated rank of a candidate's own
layout alone on the device, a few steps of one microbatch, each collective FSDP2 issues waiting its time on the
stream it is issued on: ``--emulate_communication``, every other step) measure, in one launch, its step with the
communication FSDP2 leaves exposed, its compute alone (the steps between), and rank 0's peak. The compute serves
every candidate of the same per-rank shapes (tp and cp sizes, local batch, levers), their memory the measured peak
moved by what the memory model says they hold more or less; every other candidate's compute is estimated from the
nearest timing's FLOP/s. A candidate's step is its compute plus the share of its communication left exposed: its own
timing's share where its layout and shapes ran, else the share the timed layouts of its shape (which axes are split)
left exposed, else that of every timed layout (*estimated*). Its communication is what the emulation counted where
its layout ran, else the projection over the link table (``traffic.py``); TP's and CP's collectives are projected and
add whole (the emulation waits them on the compute stream, so a timing's exposed share leaves them out). Beside it, two bounds: compute plus all the communication (no overlap) and the larger of the two (full
overlap). On a CPU nothing waits: the emulated step is compute plus the communication priced, no overlap, and said
so. Candidates rank by the step; the rows on top are timed until the first few are measured. Every figure is
labelled where it is written.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp2bench.memory.accounting import expected_state
from fsdp2bench.names import GIB
from fsdp2bench.options.layout import Degrees
from fsdp2bench.options.links import ALL_GATHER, DTENSOR, Links
from fsdp2bench.plan.layout.candidates import TRAINED, Candidate, estimated_bytes
from fsdp2bench.plan.layout.traffic import step_collectives
from fsdp2bench.train.throughput import model_flops_per_token, peak_flops

if TYPE_CHECKING:  # the types alone: the search runs in the planner's process, which never imports torch's models
    from transformers import PretrainedConfig

    from fsdp2bench.memory.accounting import ParamShape
    from fsdp2bench.memory.estimate import GpuCap
    from fsdp2bench.options.fsdp import FsdpOptions

# A timing emulates every other step and times the steps between as its compute alone: after the warm-up (steps 0
# and 1 under compile) ten steps leave four of each (2, 4, 6, 8 compute only; 3, 5, 7, 9 emulated), for a steady
# median of each half.
TIMING_STEPS = 10
EDGE = 0.2  # an estimate this far over the cap is left out; within it of the cap a candidate is probed
MOVED_MARGIN = 0.1  # a like candidate's measured peak, moved, this far under the limit needs no timing of its own
# For estimates only (the order of the first timings, and the ratio between a timed candidate's levers and an
# untimed one's): the speed of each lever relative to full checkpointing, from the Llama-3.1-8B shape on one H200
# (docs/levers.md; no checkpointing taken as a third faster than full, its recomputed forward), and an MFU to set
# compute beside communication before anything is timed.
AC_PRIOR = {"full": 1.0, "selective": 1.10, "none": 1.33}
COMPILE_PRIOR, FLOAT8_PRIOR, PRIOR_MFU, PRIOR_FLOPS = 1.18, 1.30, 0.4, 1e11


@dataclass
class Assessed:
    """A candidate with what is known of it: estimated, then perhaps measured and emulated."""
    candidate: Candidate
    estimated_bytes: int
    collectives: list
    comm_s: float
    fits: bool | None = None  # None: cannot tell (no cap, or not measured where the estimate is near the cap)
    memory: dict = field(default_factory=dict)
    compute: dict | None = None  # the timing of its per-rank shapes: its compute measured
    compute_own: bool = False  # that timing ran its own layout
    emulated: dict | None = None  # the timing of its own layout and shapes: its step with the communication emulated
    speed: dict | None = None  # its step and tokens/s, the bounds beside them, each figure labelled (``project``)
    failed: str | None = None  # a timing of its shapes failed other than by running out of memory
    out_of_memory: bool = False  # a timing of its shapes, holding no more than it, ran out of memory

    @property
    def key(self) -> tuple:
        return self.candidate.compute_key


@dataclass(frozen=True, kw_only=True)
class SearchInputs:
    """What one layout search needs beside its candidates."""
    model: str
    world_size: int
    block: int
    global_sequences: int
    shapes: list[ParamShape]
    config: PretrainedConfig
    base: FsdpOptions  # the loop and the fine-tuning every candidate trains with; the levers are each candidate's own
    cap: GpuCap | None
    links: Links
    device_type: str
    gpu_name: str | None
    output_dir: str
    max_timings: int
    init_device: str
    num_parameters: int
    links_given: str | None = None  # --links as main.py's --emulate_communication takes it (a file's absolute path)
    confirm: int = 3  # the ranked rows on top that the timings measure before the search ends
    time_budget_s: float = 420.0  # no timing starts after this long
    allow_known_failure: bool = False  # main.py's --allow_known_failure: a QLoRA storage known to fail, measured
    held: dict = field(default_factory=dict, compare=False)  # estimated_bytes's, per layout and levers

    @property
    def tokens_per_step_per_gpu(self) -> float:
        return self.global_sequences * self.block / self.world_size

    @property
    def flops_per_token(self) -> int:
        return model_flops_per_token(self.num_parameters, self.config, self.block)


def assess(candidate: Candidate, setup: SearchInputs) -> Assessed:
    """The memory model's estimate and the projected communication of one candidate, placed against the cap."""
    estimate = estimated_bytes(candidate, setup.shapes, setup.config, setup.block, setup.base, setup.held)
    chosen = candidate.options(setup.base)
    collectives = step_collectives(setup.shapes, setup.config, candidate.degrees, chosen, candidate.batch,
                                   setup.block, candidate.microbatches)
    row = Assessed(candidate, estimate, collectives, sum(c.seconds(setup.links) for c in collectives))
    row.memory = {"estimated_gib": estimate / GIB, "state_bytes": held_state(candidate, setup)}
    judge_by_estimate(row, setup, 1.0, "estimated (memory model)")
    return row


def held_state(candidate: Candidate, setup: SearchInputs) -> dict:
    """What the memory model says rank 0 holds once its optimizer has stepped, to the byte (the part of the
    estimate it claims exactly): its chunks of the parameters (a LoRA base frozen in bf16, a QLoRA base packed), and
    the gradients and optimizer state of those that train (the adapters alone under LoRA; low-bit where asked)."""
    key = ("state", candidate.degrees)
    if key not in setup.held:
        setup.held[key] = expected_state(setup.shapes, setup.world_size, 0, TRAINED, "before_zero_grad",
                                         candidate.options(setup.base))
    return setup.held[key]


def judge_by_estimate(row: Assessed, setup: SearchInputs, ratio: float, how: str) -> None:
    """Where an estimate (the memory model's, times ``ratio``) puts a candidate not yet measured: more than
    ``EDGE`` over the cap it does not fit, and by how much is said; more than ``EDGE`` under it fits; between, only
    a run decides."""
    if setup.cap is None:
        return
    estimate, cap = row.estimated_bytes * ratio, setup.cap.process_bytes
    row.memory.pop("over_gib", None)
    row.fits = False if estimate > cap * (1 + EDGE) else True if estimate < cap * (1 - EDGE) else None
    if row.fits is False:
        row.memory.update(over_gib=(estimate - cap) / GIB, how=f"{how}, not run")
    else:
        row.memory["how"] = f"{how}, {'well under' if row.fits else 'near'} the cap"


def calibrate(rows: list[Assessed], setup: SearchInputs, ratios: dict) -> None:
    """Each candidate not yet measured placed again by the memory model's estimate times the ratio a timing of the
    same levers measured (rank 0's peak over the estimate): the model knows no compile, float8 or fused loss, and
    ran high under them (the Llama-3.1-8B and Qwen2.5-7B shapes measured 62-73% of its estimate), which left out
    candidates that fit."""
    for f in rows:
        c = f.candidate
        ratio = ratios.get((c.ac, c.loss, c.compile, c.float8)) or ratios.get((c.ac, c.compile, c.float8))
        if ratio is None or "measured_gib" in f.memory or f.out_of_memory:
            continue
        f.memory["calibrated_gib"] = f.estimated_bytes * ratio / GIB
        judge_by_estimate(f, setup, ratio, f"estimated (memory model x {ratio:.2f}, measured under the same levers)")


def lever_factor(c: Candidate) -> float:
    return AC_PRIOR[c.ac] * (COMPILE_PRIOR if c.compile else 1) * (FLOAT8_PRIOR if c.float8 else 1)


def microbatch_flops(c: Candidate, setup: SearchInputs) -> float:
    """A rank's model FLOPs in one microbatch: its data rank's sequences, split over its cp and tp groups."""
    return c.batch * setup.block * setup.flops_per_token / (c.degrees.cp * c.degrees.tp)


def prior_speed(row: Assessed, setup: SearchInputs) -> float:
    """Tokens per second per GPU that orders the first timings (a prior: never reported)."""
    flops = peak_flops(setup.gpu_name)
    rate = (PRIOR_MFU * flops if flops else PRIOR_FLOPS) * lever_factor(row.candidate)
    compute = row.candidate.microbatches * microbatch_flops(row.candidate, setup) / rate
    return setup.tokens_per_step_per_gpu / (compute + row.comm_s)


def nearness(a: Candidate, b: Candidate) -> tuple:
    """How unlike two candidates' per-rank work is: levers and split first, then the local batch."""
    differ = (a.ac != b.ac) + (a.compile != b.compile) + (a.float8 != b.float8) + (a.loss != b.loss)
    return differ + (a.degrees.tp != b.degrees.tp) + (a.degrees.cp != b.degrees.cp), abs(math.log2(a.batch / b.batch))


def local_share(c: Candidate) -> float:
    """The share of the parameters (and so of the optimizer's work) a rank holds: FSDP2 shards over shard x cp."""
    return 1 / (c.degrees.shard * c.degrees.cp * c.degrees.tp)


def forward_backward_s(timing: dict) -> float:
    return timing["microbatch_s"] - (timing.get("optimizer_s") or 0.0)


def estimated_forward_backward(c: Candidate, references: list, setup: SearchInputs) -> tuple[float, dict] | None:
    """An untimed candidate's forward and backward: its FLOPs at the FLOP/s the nearest timing reached, scaled by
    the levers' prior ratio between the two (an estimate, labelled so; the confirm loop times the rows it puts on
    top)."""
    if not references:
        return None
    ref, timing = min(references, key=lambda r: nearness(c, r[0]))
    achieved = microbatch_flops(ref, setup) / forward_backward_s(timing)
    return microbatch_flops(c, setup) / (achieved * lever_factor(c) / lever_factor(ref)), timing


def project(row: Assessed, setup: SearchInputs, references: list) -> None:
    """Its step and tokens per second per GPU: K forwards and backwards and one optimizer step (measured on the
    candidate's shapes, else estimated; the optimizer's time scaled to the candidate's share of the parameters), and
    the communication's exposed share (``step_figures``), with the two bounds beside it."""
    row.speed = None
    timing = row.compute
    if row.failed or row.fits is False or (timing is not None and not timing.get("microbatch_s")):
        return
    if timing is None:
        estimate = estimated_forward_backward(row.candidate, references, setup)
        if estimate is None:
            return
        forward_backward, timing = estimate
    else:
        forward_backward = forward_backward_s(timing)
    optimizer = (timing.get("optimizer_s") or 0.0) * local_share(row.candidate) / timing["local_share"]
    compute = {"compute_s": forward_backward * row.candidate.microbatches + optimizer, "optimizer_s": optimizer,
               "compute_measured": row.compute is not None, "compute_clean": timing["clean"],
               "compute_from": timing["candidate"]}
    figures = step_figures(row, compute["compute_s"], setup, references)
    figures["labels"] = {"compute": compute_label(compute, row.compute_own), **figures["labels"]}
    row.speed = {**compute, **figures}


OWN = "its own timing"  # where a candidate's exposed share comes from when its layout and shapes ran emulated
CPU_STEP = "emulated on a CPU: compute + communication priced, no overlap (a CPU measures none)"


def step_figures(row: Assessed, compute_s: float, setup: SearchInputs, references: list) -> dict:
    """The step: compute + the exposed share of the communication the emulation sees + TP's and CP's (projected,
    whole: the emulation does not see them); beside it no overlap (compute + all of it) and full overlap (the
    larger of the two)."""
    other = sum(c.seconds(setup.links) for c in row.collectives if not c.emulated)
    if row.emulated:
        emulatable, comm_label = scaled_comm_s(row.emulated["emulated"]["per_step"], row.candidate), "emulated"
    else:
        emulatable, comm_label = row.comm_s - other, "projected"
    share, share_from = exposed_share(row, references)
    step, comm, tokens = compute_s + share * emulatable + other, emulatable + other, setup.tokens_per_step_per_gpu
    waited = share_from == OWN and row.emulated["emulated"]["waited_on_the_gpu"]
    step_label = "estimated" if share_from != OWN else "emulated" if waited else CPU_STEP
    return {"comm_s": comm, "comm_not_emulated_s": other, "exposed_share": share, "exposed_share_from": share_from,
            "step_s": step, "tokens_per_s": tokens / step, "no_overlap_tokens_per_s": tokens / (compute_s + comm),
            "full_overlap_tokens_per_s": tokens / max(compute_s, comm),
            "labels": {"communication": comm_label + (" (TP and CP projected)" if other else ""),
                       "step": step_label}}


def scaled_comm_s(per_step: dict, c: Candidate) -> float:
    """A timing's emulated communication (one microbatch a step) in a step of the candidate's K microbatches: the
    all-gathers each microbatch, the reductions once a step (each microbatch under sync_each_batch)."""
    reduced = c.microbatches if c.sync_each_batch else 1
    return sum(e["emulated_s"] * (c.microbatches if kind.startswith(ALL_GATHER) else reduced)
               for kind, e in per_step.items() if not kind.endswith(DTENSOR))  # TP's and CP's: projected


def layout_shape(degrees: Degrees) -> str:
    """Which axes a layout splits (R, S, C, T above 1): FSDP alone ``S``, HSDP ``RxS``, FSDP with TP ``SxT``."""
    sizes = (("R", degrees.replicate), ("S", degrees.shard), ("C", degrees.cp), ("T", degrees.tp))
    return "x".join(axis for axis, size in sizes if size > 1) or "one rank"


def exposure(timing: dict) -> tuple[float, float] | None:
    """(exposed, emulated) seconds of a clean timing's FSDP2 and HSDP communication: its emulated step less its
    compute and less DTensor's collectives (TP's, CP's: waited whole where they are issued)."""
    if not timing.get("clean") or "emulated" not in timing:
        return None
    emulated = timing["emulated"]
    exposed = emulated["step_s"] - timing["microbatch_s"] - emulated.get("dtensor_s", 0.0)
    return max(0.0, exposed), emulated["comm_s"]


def exposed_share(row: Assessed, references: list) -> tuple[float, str]:
    """The share of its communication a step leaves exposed, and whence: its own clean timing; else the timings of
    layouts of its shape (``layout_shape``), else of every layout, their exposed seconds over their emulated ones;
    else none (no overlap)."""
    own = exposure(row.emulated) if row.emulated else None
    if own is not None:
        return (min(1.0, own[0] / own[1]) if own[1] else 0.0), OWN
    shape = layout_shape(row.candidate.degrees)
    pools = (([t for c, t in references if layout_shape(c.degrees) == shape], f"the timed {shape} layouts"),
             ([t for _, t in references], "every timed layout"))
    for pool, said in pools:
        pairs = [pair for pair in map(exposure, pool) if pair is not None]
        emulated = sum(comm for _, comm in pairs)
        if emulated > 0:
            return min(1.0, sum(exposed for exposed, _ in pairs) / emulated), said
    return 1.0, "no timing emulated one: no overlap"


def compute_label(compute: dict, own: bool) -> str:
    if not compute["compute_measured"]:
        return "estimated"
    if not compute["compute_clean"]:
        return "measured beside other runs"
    return "measured" if own else "measured on a like layout"


def decided(row: Assessed, setup: SearchInputs) -> bool:
    """Measured enough to be named: its own layout and shapes timed cleanly with the communication emulated (a
    timing beside other runs has no clean speed and no optimizer time, and decides nothing) and, under a cap, its
    memory measured on its own layout or on a like one with room the memory model's difference cannot eat
    (``MOVED_MARGIN`` under the limit)."""
    s = row.speed
    if not s or not s["compute_measured"] or not s["compute_clean"] or s["exposed_share_from"] != OWN:
        return False
    if setup.cap is None:
        return True
    measured = row.memory.get("measured_gib")
    return row.fits is True and measured is not None and (
        row.memory.get("own_layout") or measured * GIB <= setup.cap.allocator_bytes * (1 - MOVED_MARGIN))


def ranked(rows: list[Assessed]) -> list[Assessed]:
    """Every candidate that fits (or may) with a step, fastest first."""
    return sorted((f for f in rows if f.fits is not False and f.speed),
                  key=lambda f: (-f.speed["tokens_per_s"], f.comm_s))


def winner_of(rows: list[Assessed], setup: SearchInputs) -> tuple[Assessed | None, int]:
    """The fastest decided candidate and its place in the ranking (rows above it rest on estimates)."""
    return next(((f, i) for i, f in enumerate(ranked(rows), 1) if decided(f, setup)), (None, 0))


def record(row: Assessed, links: Links) -> dict:
    c = row.candidate
    return {"name": c.name, **c.degrees.as_dict(), "activation_checkpointing": c.ac, "loss": c.loss,
            "compile": c.compile, "float8": c.float8, "batch_size": c.batch, "microbatches": c.microbatches,
            "sync_each_batch": c.sync_each_batch, "fits": row.fits, "memory": row.memory,
            "projected_comm_s": row.comm_s,
            "collectives": [x.as_dict(links) for x in row.collectives] if row.speed else None,
            "timing": row.compute.get("candidate") if row.compute else None,
            "emulated_timing": row.emulated.get("candidate") if row.emulated else None, "failed": row.failed,
            "speed": row.speed}


def main_flags(candidate: Candidate, setup: SearchInputs) -> list[str]:
    """main.py's flags that train the candidate (its layout, levers, batch and accumulation, and the search's
    fine-tuning), built on meta where the search's model is (too large to build whole anywhere)."""
    return ["--model", setup.model, "--variants", TRAINED, "--batch_size", str(candidate.batch), "--block_size",
            str(setup.block), *candidate.options(setup.base).flags(),
            *(["--allow_known_failure"] if setup.allow_known_failure else []),
            *(["--init_device", "meta"] if setup.init_device == "meta" else [])]


def emulation_flags(setup: SearchInputs) -> list[str]:
    """main.py's --emulate_communication over the search's own links (bare for the default ones)."""
    return ["--emulate_communication", *([setup.links_given] if setup.links_given else [])]


def commands(winner: Candidate, setup: SearchInputs) -> dict:
    """The exact command lines that train the winner: torchrun on the real nodes, the same on one GPU (a simulated
    rank, its communication emulated as the search's timings were, to check it first), and the accelerate config
    fields."""
    n, node = setup.world_size, setup.links.node_size
    flags = main_flags(winner, setup)
    if n <= node:
        launcher = ["torchrun", "--standalone", "--nproc_per_node", str(n)]
    else:
        launcher = ["torchrun", "--nnodes", str(math.ceil(n / node)), "--nproc_per_node", str(node),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", "HOST:29500"]
    steps = ["--max_steps", str(TIMING_STEPS)]  # the same steps on the nodes as in the check, so that they compare
    check = ["python3", "main.py", *flags, "--simulate_world_size", str(n), *steps, *emulation_flags(setup),
             *(setup.cap.flags() if setup.cap else [])]
    return {"torchrun": shlex.join([*launcher, "main.py", *flags, *steps]), "one_gpu_check": shlex.join(check),
            "accelerate_config": accelerate_fields(winner, setup)}


def accelerate_fields(winner: Candidate, setup: SearchInputs) -> dict:
    """The accelerate config that trains the winner under ``accelerate launch`` (main.py's flags beside it: the
    loss, selective checkpointing and the accumulation, which accelerate's config file has no field for; its
    loader refuses a key it does not know)."""
    d, chosen = winner.degrees, winner.options(setup.base)
    fields = {"distributed_type": "FSDP", "num_machines": math.ceil(d.world_size / setup.links.node_size),
              "num_processes": d.world_size, "mixed_precision": "fp8" if winner.float8 else "bf16",
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
