"""The layout search's candidates: every way to train a model on N ranks at a global batch that the model and this
machine admit, and what the memory model says each holds on rank 0, before anything runs.

A candidate is a layout of N (replicate x shard x cp x tp, ``layout.Degrees``), the levers (activation
checkpointing none / selective / full, the loss, compile, float8) and the local batch with the gradient
accumulation that reaches the global batch, reduce-scattered once a step or after each microbatch. No torch at
module level.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2bench.cli import UserError
from fsdp2bench.memory.estimate import step_bytes, variant_need
from fsdp2bench.options.fsdp import AC_MODES, FULL_AC, NO_AC, SELECTIVE_AC, FsdpOptions, check_tuning
from fsdp2bench.options.layout import Degrees, Layout, check_context_parallel, check_tensor_parallel
from fsdp2bench.options.step import CHUNKED, LIGER, LOSSES, MODEL
from fsdp2bench.options.tuning import Tuning

TRAINED = "torch_optimizer_after_fsdp"  # the variant a layout search plans and its commands train
COMPILE, FLOAT8 = "compile", "float8"
LEVER_NAMES = (*AC_MODES, *LOSSES, COMPILE, FLOAT8)


@dataclass(frozen=True)
class Levers:
    """The levers searched: each checkpointing mode and loss named, and compile and float8 each off and, where
    named, on."""
    ac: tuple[str, ...] = (NO_AC, SELECTIVE_AC, FULL_AC)
    losses: tuple[str, ...] = (MODEL, CHUNKED, LIGER)
    compile: tuple[bool, ...] = (False, True)
    float8: tuple[bool, ...] = (False, True)


def parse_levers(text: str) -> Levers:
    """``--levers``: a comma-separated subset of ``LEVER_NAMES``; a group none of whose names is given keeps its
    first (no checkpointing, the model's loss, compile and float8 off)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in LEVER_NAMES]
    if unknown or not names:
        raise UserError(f"--levers {text!r}: unknown lever {unknown[0] if unknown else '(none given)'}; choose from "
                        f"{', '.join(LEVER_NAMES)}")
    return Levers(ac=tuple(m for m in AC_MODES if m in names) or (NO_AC,),
                  losses=tuple(loss for loss in LOSSES if loss in names) or (MODEL,),
                  compile=(False, True) if COMPILE in names else (False,),
                  float8=(False, True) if FLOAT8 in names else (False,))


@dataclass(frozen=True)
class Candidate:
    """One way to train: a layout, the levers, and the local batch x microbatches a data rank trains a step."""
    degrees: Degrees
    ac: str
    loss: str
    compile: bool
    float8: bool
    batch: int
    microbatches: int
    sync_each_batch: bool = False

    def options(self, base: FsdpOptions) -> FsdpOptions:
        """``base`` (the loop, the user's config) with this candidate's layout and levers."""
        d = self.degrees
        layout = Layout(dp_replicate_size=d.replicate if d.replicate > 1 else None, cp_size=d.cp, tp_size=d.tp)
        return base.over({"activation_checkpointing": self.ac, "compile": self.compile, "float8": self.float8,
                          "gradient_accumulation_steps": self.microbatches, "sync_each_batch": self.sync_each_batch,
                          "loss": self.loss, **{f: getattr(layout, f) for f in ("dp_replicate_size", "cp_size",
                                                                                 "tp_size")}})

    @property
    def compute_key(self) -> tuple:
        """What a rank's compute per microbatch depends on: its own shapes and levers, not how the other ranks
        split into replicas and shards, nor how many microbatches make a step."""
        return self.degrees.tp, self.degrees.cp, self.batch, self.ac, self.loss, self.compile, self.float8

    @property
    def name(self) -> str:
        d = self.degrees
        levers = [f"ac={self.ac}", f"loss={self.loss}"] + [n for n, on in ((COMPILE, self.compile),
                                                                            (FLOAT8, self.float8)) if on]
        sync = " sync" if self.sync_each_batch else ""
        return f"R{d.replicate}xS{d.shard}xC{d.cp}xT{d.tp} B{self.batch}x{self.microbatches}{sync} " + " ".join(levers)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts_of(world_size: int, config, block: int, device_type: str,
               tuning: Tuning = Tuning()) -> tuple[list[Degrees], list[str]]:
    """Every R x S x C x T = N the model admits at this sequence length on this device with this fine-tuning, and
    why each tp or cp size it does not admit is left out."""
    admitted, notes = [], []
    for tp in divisors(world_size):
        if (why := size_refusal(lambda: tp_check(config, tp, tuning))) is not None:
            notes.append(f"tp {tp}: {why}")
            continue
        for cp in divisors(world_size // tp):
            if (why := cp_refusal(config, cp, block, device_type)) is not None:
                notes.append(f"cp {cp} (tp {tp}): {why}")
                continue
            data = world_size // (tp * cp)
            admitted += [Degrees(replicate=r, shard=data // r, cp=cp, tp=tp) for r in divisors(data)]
    return admitted, notes


def tp_check(config, tp: int, tuning: Tuning) -> None:
    """TP of ``tp`` ranks: the model's heads must split, and adapters are not measured under TP (fsdp.check_tuning)."""
    if tp > 1:
        check_tensor_parallel(config, tp)
        check_tuning(FsdpOptions(layout=Layout(tp_size=tp), tuning=tuning))


def size_refusal(check) -> str | None:
    try:
        check()
    except UserError as exc:
        return str(exc)
    return None


def cp_refusal(config, cp: int, block: int, device_type: str) -> str | None:
    if cp == 1:
        return None
    if device_type != "cuda":
        return "context parallelism does not run on the CPU"
    return size_refusal(lambda: check_context_parallel(config, cp, block))


def admits_float8(degrees: Degrees, compiled: bool, levers: Levers) -> bool:
    """float8 not under TP, and not without compile where compile is searched too (eager, its casts cost more than
    it saves: levers.FLOAT8_EAGER); asked alone (float8 in --levers, compile not), it is timed as asked."""
    return degrees.tp == 1 and (compiled or True not in levers.compile)


def candidates_of(layouts: list[Degrees], levers: Levers, global_sequences: int, device_type: str) -> list[Candidate]:
    """Each layout whose data ranks divide the global batch, with every lever combination it admits (float8 not
    under TP, nor without compile beside it; liger not on the CPU) and every local batch that divides a data
    rank's share of the global batch; under accumulation each way of reducing its gradients."""
    out = []
    for degrees in layouts:
        if global_sequences % degrees.data_ranks:
            continue
        share = global_sequences // degrees.data_ranks
        for ac in levers.ac:
            for loss in (loss for loss in levers.losses if loss != LIGER or device_type == "cuda"):
                for compiled in levers.compile:
                    for float8 in (f for f in levers.float8 if not f or admits_float8(degrees, compiled, levers)):
                        for batch in divisors(share):
                            out += [Candidate(degrees, ac, loss, compiled, float8, batch, share // batch, sync)
                                    for sync in ((False, True) if share // batch > 1 else (False,))]
    return out


def estimated_bytes(candidate: Candidate, shapes, config, block: int, base: FsdpOptions,
                    held: dict | None = None) -> int:
    """What the memory model and the planner's activation rule say rank 0 reserves at its step peak (state
    byte-exact; the rest an estimate calibrated on one H200: ``estimate.variant_need``). ``held`` keeps what
    the tokens do not change, per layout and levers: tens of thousands of candidates share a few thousand."""
    chosen = candidate.options(base)
    c = candidate
    key = (c.degrees, c.ac, c.loss, c.compile, c.float8, c.microbatches > 1, c.sync_each_batch)
    held = {} if held is None else held
    if key not in held:
        held[key] = variant_need(shapes, c.degrees.world_size, TRAINED, chosen, 0)
    return held[key] + step_bytes(c.batch, block, config, chosen)
