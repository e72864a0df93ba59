"""Turn every rank's records into summary.json, the end-of-run checks and the console table."""

from __future__ import annotations

import math
import statistics

from fsdp2bench.memory import snapshots
from fsdp2bench.train import throughput
from fsdp2bench.cli import say
from fsdp2bench.processes.isolation import UNSUPPORTED
from fsdp2bench.options.layout import AXES
from fsdp2bench.memory.accounting import (PROJECTION_WORLD_SIZES, expected_device_bytes, expected_gathered_block_bytes,
                                          expected_setup, expected_state, projection, unfixed_costs_more_from)
from fsdp2bench.options.step import MODEL, UPSTREAM
from fsdp2bench.names import (INTENDED, MIB, MICROBATCH_PHASE, PEAK_PHASES, PHASES, STATE_KEYS, UNFIXED, phases,
                              size_said, state_bytes, step_peak_state)
from fsdp2bench.options.fsdp import FsdpOptions
# Losses are compared step by step. On CPU the intended variants are bit-identical; on GPUs
# accelerate groups its parameters differently, which may change bf16 rounding a little.
LOSS_TOLERANCE = {"cpu": 0.0, "cuda": 1e-2}  # relative
# Whether a loss fell is read against the spread of the loss over the run's batches: a drop counts when
# it exceeds this many standard errors of the drop a model that never changes would show on them.
STANDARD_ERRORS = 3
# The fewest steps that tell a trend from the spread: two per quarter, and a line fitted with 6 left over.
MIN_STEPS = 8
PHASE_EVENTS = {"model_built": "build", "optimizer_created": "optimizer", "sharded": "shard"}


def loss_drop(losses: list[float]) -> float:
    """Relative fall from the mean of the first quarter of steps to the mean of the last quarter."""
    window = max(1, len(losses) // 4)
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    return (first - last) / first


def _residual_squares(losses: list[float]) -> tuple[float, int]:
    """Sum of squared residuals of the losses about their least-squares line, and its degrees of freedom:
    the spread of the loss over the batches, with the variant's own trend taken out."""
    n = len(losses)
    mean_x, mean_y = (n - 1) / 2, sum(losses) / n
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(losses)) / sxx
    return sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in enumerate(losses)), n - 2


def drop_threshold(series: list[list[float]]) -> dict | None:
    """The run's own bar for "the loss fell": STANDARD_ERRORS standard errors of the drop (first quarter's
    mean against the last's, relative) that the batches alone would give, from the residual spread pooled
    over the variants' loss series. None where the run has too few steps to tell (MIN_STEPS)."""
    n = len(series[0]) if series else 0
    if n < MIN_STEPS:
        return None
    squares = [_residual_squares(losses) for losses in series]
    spread = math.sqrt(sum(s for s, _ in squares) / sum(dof for _, dof in squares))
    window = max(1, n // 4)
    first = min(sum(losses[:window]) / window for losses in series)
    return {"threshold": STANDARD_ERRORS * spread * math.sqrt(2 / window) / first, "loss_spread": spread,
            "steps": n}


def steps_to_show(drop: float, bar: dict) -> int:
    """About how many steps would lift ``drop`` above the bar, were the loss to go on falling at its pace:
    the drop grows with the steps, the bar shrinks as one over the root of a quarter's steps."""
    n = bar["steps"]
    if drop <= 0:
        return 2 * n
    return math.ceil(n * (bar["threshold"] / drop) ** (2 / 3)) + 1


def _across(values: list) -> dict:
    present = [v for v in values if v is not None]
    return {"per_rank": values, "max": max(present) if present else None}


def _phase_peaks(record: dict) -> dict:
    """Allocator peak of each phase on one rank: build, optimizer, shard, first step, steady steps."""
    peaks = {PHASE_EVENTS[e["name"]]: e["peak_allocated_mib"] for e in record["events"] if e["name"] in PHASE_EVENTS}
    steps = [s["peak_allocated_mib"] for s in record["steps"]]
    peaks["first_step"] = steps[0] if steps else None
    steady = [p for p in steps[1:] if p is not None]
    peaks["steady_steps"] = max(steady) if steady else None
    return peaks


def _by_phase(per_phase: dict, counted: tuple[str, ...] = PHASES) -> dict:
    """End-of-training keys on top, every phase counted nested beside them."""
    return {**{k: per_phase["end_of_training"][k] for k in STATE_KEYS},
            **{phase: {k: per_phase[phase][k] for k in STATE_KEYS} for phase in counted}}


def _training_peak(record: dict, key: str) -> float | None:
    """The allocator's peak over the optimizer steps alone (the counters are reset when training starts)."""
    values = [s[key] for s in record["steps"] if s[key] is not None]
    return max(values) if values else None


def _beyond_state(record: dict) -> float | None:
    """MiB allocated at the training peak beyond the state counted at the step peak: activations,
    FSDP2's gathered parameters and communication buffers, allocator rounding."""
    peak = _training_peak(record, "peak_allocated_mib")
    return None if peak is None else peak - record["accounting"]["before_zero_grad"]["device_bytes"] / MIB


def memory_summary(name: str, per_rank: list[dict], shapes, world_size: int, ranks: list[int],
                   options: FsdpOptions, device_type: str, built_on: str = "cpu") -> dict:
    """Memory figures of one variant from the records of ``ranks`` (of a world of ``world_size``), its
    model built on ``built_on``."""
    counted, steps = phases(options.accumulates), len(per_rank[0]["steps"])
    setup = expected_setup(options, shapes)
    gathered = [r.get("gathered_block_bytes") for r in per_rank]
    expected_gathered = [expected_gathered_block_bytes(shapes, world_size, rank, options) for rank in ranks]
    accounting = [_by_phase(r["accounting"], counted) for r in per_rank]
    expected = [_by_phase({ph: expected_state(shapes, world_size, rank, name, ph, options, steps) for ph in counted},
                          counted) for rank in ranks]
    on_device = [{ph: r["accounting"][ph]["device_bytes"] for ph in counted} for r in per_rank]
    expected_on_device = [{ph: expected_device_bytes(shapes, world_size, rank, name, ph, options, device_type, steps,
                                                     built_on) for ph in counted} for rank in ranks]
    kept = [{ph: r["accounting"][ph].get("kept_output_bytes", 0) for ph in counted} for r in per_rank]
    expected_kept = [{ph: 0 if ph == "end_of_setup" else r.get("expected_kept_output_bytes", 0) for ph in counted}
                     for r in per_rank]
    residual = [None if r["steps"][-1]["allocated_mib"] is None else
                r["steps"][-1]["allocated_mib"] - r["accounting"]["end_of_training"]["device_bytes"] / MIB
                for r in per_rank]
    return {
        "status": "ok",
        "steps": len(per_rank[0]["steps"]),
        "peak_allocated_mib": _across([r["counter_peaks"]["peak_allocated_mib"] for r in per_rank]),
        "peak_reserved_mib": _across([r["counter_peaks"]["peak_reserved_mib"] for r in per_rank]),
        "training_peak_allocated_mib": _across([_training_peak(r, "peak_allocated_mib") for r in per_rank]),
        "training_peak_reserved_mib": _across([_training_peak(r, "peak_reserved_mib") for r in per_rank]),
        "training_peak_beyond_state_mib": _across([_beyond_state(r) for r in per_rank]),
        "polled_peak_allocated_mib": _across([r["polled_peaks"]["peak_allocated_mib"] for r in per_rank]),
        "polled_peak_reserved_mib": _across([r["polled_peaks"]["peak_reserved_mib"] for r in per_rank]),
        "peak_rss_mib": _across([r["polled_peaks"]["peak_rss_mib"] for r in per_rank]),
        "phase_peak_allocated_mib": [_phase_peaks(r) for r in per_rank],
        "allocator": [r["allocator"] for r in per_rank],
        "accounting": accounting,
        "expected": expected,
        "device_bytes": on_device,
        "expected_device_bytes": expected_on_device,
        "kept_output_bytes": kept,
        "expected_kept_output_bytes": expected_kept,
        "gathered_block_bytes": gathered,
        "expected_gathered_block_bytes": expected_gathered,
        "accounting_matches_expected": accounting == expected and on_device == expected_on_device
        and kept == expected_kept and all(g in (None, e) for g, e in zip(gathered, expected_gathered)),
        "applied": [r["applied"] for r in per_rank],
        "applied_matches_options": all({k: r["applied"][k] for k in setup} == setup for r in per_rank),
        "steady_allocated_minus_state_mib": _across(residual),
        **({"peak_tensors": [r["peak_tensors"] for r in per_rank]} if "peak_tensors" in per_rank[0] else {}),
        "wall_s": max(r["wall_s"] for r in per_rank),
        "median_step_time_s": statistics.median(s["step_time_s"] for s in per_rank[0]["steps"]),
        **speed_summary([r["speed"] for r in per_rank]),
    }


def speed_summary(per_rank: list[dict]) -> dict:
    """Every rank's speed figures, and the run's: its slowest rank's (the ranks wait for one another)."""
    unmeasured = [f for f in per_rank if f["tokens_per_s_per_gpu"] is None]
    slowest = unmeasured[0] if unmeasured else min(per_rank, key=lambda f: f["tokens_per_s_per_gpu"])
    return {"speed": slowest, "speed_per_rank": per_rank}


def variant_summary(name: str, per_rank: list[dict], shapes, options: FsdpOptions, device_type: str,
                    built_on: str = "cpu") -> dict:
    """Combine every rank's record of one variant of a real run into its summary entry."""
    losses = [s["loss"] for s in per_rank[0]["steps"]]
    entry = memory_summary(name, per_rank, shapes, len(per_rank), list(range(len(per_rank))), options, device_type,
                           built_on)
    return {**entry, "losses": losses, "final_loss": losses[-1], "loss_drop": loss_drop(losses),
            "tracker_overhead_ratio": tracker_overhead(per_rank[0]["steps"])}


def tracker_overhead(steps: list[dict]) -> float | None:
    """Median step time with polling over without, from a run that alternated the two (step 0 left out)."""
    timed = {True: [], False: []}
    for s in steps[1:]:
        timed[s["polling"]].append(s["step_time_s"])
    if not timed[True] or not timed[False]:
        return None
    return statistics.median(timed[True]) / statistics.median(timed[False])


def state_projection(shapes, names: list[str], sizes: list[int] = PROJECTION_WORLD_SIZES,
                     options: FsdpOptions = FsdpOptions()) -> dict:
    """The sharding rule's per-rank state of each variant at each world size the run's layout fits, and where
    the lines cross."""
    table = projection(shapes, names, sizes, options)
    reference = next((n for n in INTENDED if n in names), None)
    crossover = unfixed_costs_more_from(shapes, reference, options) if reference and UNFIXED in names else None
    return {"per_rank_state_bytes": table,
            "unfixed_costs_more_from_world_size": crossover[0] if crossover else None,
            "state_bytes_there": crossover[1] if crossover else None,
            "reference": reference}


def _worst_rank(entry: dict, phase: str) -> dict:
    """The state counted at ``phase`` on the rank that held the most, per key."""
    return max((rank[phase] for rank in entry["accounting"]), key=state_bytes)


def _held_state(entry: dict, phase: str) -> int:
    """State bytes counted at ``phase``, on the rank that held the most."""
    return state_bytes(_worst_rank(entry, phase))


def _held_at_step_peak(entry: dict) -> int:
    """State bytes at the larger of a step's two peaks: after its optimizer step, or between microbatches."""
    return state_bytes(step_peak_state(entry))


def projection_summary(shapes, variants: dict, world_size: int, options: FsdpOptions) -> dict:
    measured = {name: {phase: _held_state(v, phase) for phase in ("end_of_training", "before_zero_grad")}
                for name, v in variants.items() if v.get("status") == "ok"}
    return {**state_projection(shapes, list(variants), options=options),
            "measured": {"world_size": world_size, "per_rank_state_bytes": measured}}


def first_non_finite(losses: list) -> int | None:
    return next((i for i, loss in enumerate(losses) if loss is None or not math.isfinite(loss)), None)


def run_checks(variants: dict, device_type: str) -> dict:
    """The upstream's equality check, plus: every loss is a number, the intended variants train,
    the state bytes are what FSDP2's rule predicts, and the unfixed variant does not train."""
    checks = {}
    ok = {n: v for n, v in variants.items() if v.get("status") == "ok"}
    non_finite = {n: first_non_finite(v["losses"]) for n, v in ok.items() if first_non_finite(v["losses"]) is not None}
    if ok:  # NaN compares false with everything, so without this a diverged run would pass the others
        checks["losses_finite"] = {"ok": not non_finite, "first_non_finite_step": non_finite}
    ran = [n for n in INTENDED if n in ok]
    if len(ran) >= 2:
        tol = LOSS_TOLERANCE[device_type]
        ref = variants[ran[0]]["losses"]
        diffs = {n: None if non_finite else max(abs(a - b) / abs(b) for a, b in zip(variants[n]["losses"], ref))
                 for n in ran[1:]}
        checks["intended_losses_match"] = {"ok": not non_finite and all(d <= tol for d in diffs.values()),
                                           "reference": ran[0], "relative_tolerance": tol, "max_relative_diff": diffs}
    for check, field in (("accounting_matches_expected", "accounting_matches_expected"),
                         ("options_applied", "applied_matches_options")):
        counted = {n: v[field] for n, v in ok.items()}
        if counted:
            checks[check] = {"ok": all(counted.values()), "mismatched": [n for n, good in counted.items() if not good]}
    checks.update(training_checks(ok, ran, non_finite))
    return checks


def training_checks(ok: dict, ran: list[str], non_finite: dict) -> dict:
    """Did the intended variants train, and did the unfixed one not? Both read a drop against one bar
    (``drop_threshold``), so no drop passes both; where the run cannot tell (too few steps, or no intended
    variant's loss fell beyond the spread of its batches), each says so and how many steps would."""
    steps = min((v["steps"] for v in ok.values()), default=0)
    bar = drop_threshold([v["losses"] for n, v in ok.items() if n not in non_finite])
    checks = {}
    if ran:
        checks["intended_variants_trained"] = _trained_check({n: ok[n]["loss_drop"] for n in ran}, bar, steps,
                                                             any(n in non_finite for n in ran))
    if UNFIXED in ok:
        checks["unfixed_did_not_train"] = _not_trained_check(ok[UNFIXED]["loss_drop"], bar, steps,
                                                             UNFIXED in non_finite,
                                                             checks.get("intended_variants_trained"))
    return checks


def _too_few_steps(steps: int) -> str:
    return (f"{steps} step(s) cannot tell a falling loss from the spread of the loss over the batches; it needs at "
            f"least {MIN_STEPS} steps")


def _trained_check(drops: dict, bar: dict | None, steps: int, diverged: bool) -> dict:
    if diverged:
        return {"ok": False, "loss_drop": drops, "reason": "a loss is not a number"}
    if bar is None:
        return {"ok": None, "loss_drop": drops, "skipped": _too_few_steps(steps)}
    found = {"loss_drop": drops, **bar}
    if all(d > bar["threshold"] for d in drops.values()):
        return {"ok": True, **found}
    if any(d < -bar["threshold"] for d in drops.values()):
        return {"ok": False, **found, "reason": "the loss rose beyond the spread of its batches"}
    slowest = min(drops.values())
    return {"ok": None, **found, "skipped": f"the loss fell {slowest:.2%}, within the spread of its batches "
                                            f"(the bar is {bar['threshold']:.2%}); about {steps_to_show(slowest, bar)} "
                                            "steps would show it"}


def _not_trained_check(drop: float, bar: dict | None, steps: int, diverged: bool, trained: dict | None) -> dict:
    """The unfixed variant's drop at most the bar: it did not train. Said only where the run could have
    shown training (the intended variants' loss fell beyond the bar), or where no intended variant ran."""
    if diverged:
        return {"ok": False, "loss_drop": drop, "reason": "a loss is not a number"}
    if bar is None:
        return {"ok": None, "loss_drop": drop, "skipped": _too_few_steps(steps)}
    found = {"loss_drop": drop, **bar}
    if drop > bar["threshold"]:
        return {"ok": False, **found, "reason": "its loss fell beyond the spread of its batches"}
    if trained is not None and trained["ok"] is not True:
        return {"ok": None, **found, "skipped": "the intended variants' loss did not fall beyond the spread of the "
                                                "batches either, so a loss that stays is no evidence here"}
    return {"ok": True, **found}


# --------------------------------------------------------------------------- console

def _fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / MIB:.1f}"


# The console table, at most 120 columns: (title, width, cell, needs an allocator). The rest of each
# figure (steps, first loss, polled peaks, what is allocated beyond the state) is in summary.json.
TABLE_COLUMNS = [
    ("final", 7, lambda v: f"{v['final_loss']:.4f}", False),
    ("drop", 6, lambda v: f"{v['loss_drop']:.1%}", False),
    ("alloc", 8, lambda v: _fmt(v["peak_allocated_mib"]["max"]), True),
    ("resv", 6, lambda v: _fmt(v["peak_reserved_mib"]["max"], ".0f"), True),
    ("RSS", 6, lambda v: _fmt(v["peak_rss_mib"]["max"], ".0f"), False),
    ("params", 7, lambda v: _mib(_worst_rank(v, "end_of_training")["param_bytes"]), False),
    ("grads", 7, lambda v: _mib(_worst_rank(v, "end_of_training")["grad_bytes"]), False),
    ("optim", 7, lambda v: _mib(_worst_rank(v, "end_of_training")["optimizer_state_bytes"]), False),
    ("stale", 7, lambda v: _mib(_worst_rank(v, "end_of_training")["stale_param_bytes"]), False),
    ("tok/s", 6, lambda v: throughput.rate_said(v.get("speed")), False),
    ("MFU", 5, lambda v: throughput.mfu_said(v.get("speed")), False),
]
NAME_WIDTH = 37  # the longest run name


def print_table(summary: dict) -> None:
    world, gpu = summary["meta"]["world_size"], summary["meta"]["device"] == "cuda"
    columns = [c for c in TABLE_COLUMNS if gpu or not c[3]]
    print(f"\nResults over {world} rank(s); memory columns are the maximum over ranks.")
    header = f"{'variant':{NAME_WIDTH}} " + " ".join(f"{title:>{width}}" for title, width, _, _ in columns)
    print(header)
    print("-" * len(header))
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            print(f"{name:{NAME_WIDTH}} {v['status'][:80]}{how_far(v.get('failure', []))}")
            continue
        print(f"{name:{NAME_WIDTH}} " + " ".join(f"{cell(v):>{width}}" for _, width, cell, _ in columns))
    print(("MiB. alloc: the CUDA allocator's own peak; resv: its peak reserved; " if gpu else "MiB. ") +
          "RSS: the process's host memory (polled).\n"
          "     Held by one rank after the last step: params (local shards), grads, optim (AdamW state), stale (tensors\n"
          "     the optimizer holds that the model no longer uses). drop: fall of the loss from the first to the last\n"
          "     quarter of steps. summary.json has every figure per rank, the polled peaks and the phases.")
    say(speed_said(summary, [v for v in summary["variants"].values() if v["status"] == "ok"]), indent="     ")
    say(step_said(summary))
    for sentence in explanations(summary):
        say(sentence)
    print_checks(summary["checks"])


def speed_said(summary: dict, entries: list[dict]) -> str:
    """What tok/s and MFU are, against which peak, and why a figure is missing; the compile time where one ran."""
    figures = [v["speed"] for v in entries if v.get("speed")]  # a summary written before speeds were: none
    if not figures:
        return ""
    first = figures[0]
    warm = "steps 0 and 1, which compile" if first["warmup_steps"] == 2 else "step 0"
    gpu = summary["meta"].get("gpu_name")
    peak = (f"{gpu}'s dense bf16 peak, {first['peak_bf16_tflops']:.0f} TFLOP/s (float8 included)"
            if first["peak_bf16_tflops"] else f"no peak FLOP/s known for {gpu}" if gpu else "none on the CPU")
    flops = f"{first['model_flops_per_token'] / 1e9:.3g}"
    line = (f"tok/s: tokens per second per GPU over the median step after warm-up ({warm}); MFU: {flops} GFLOP of "
            f"model FLOPs per token (docs/levers.md) against {peak}.")
    if any(f["compute_only"] for f in figures):
        line += " *: compute only (a simulated rank: no communication happens)."
    missing = next((f["not_measured"] for f in figures if f["not_measured"]), None)
    if missing:
        line += f" n/a: {missing}."
    compiled = [f["compile_s"] for f in figures if f["compile_s"] is not None]
    if compiled:
        line += f" Compiling took {min(compiled):.1f}-{max(compiled):.1f} s a run (warm-up beyond its median steps)."
    return line


def unfixed_loss_said(drop: float) -> str:
    """The unfixed variant's loss between its first and last quarter of steps: a change there is the batches'."""
    said = f"{abs(drop):.1%} from the first to the last quarter of steps"
    if f"{abs(drop):.1%}" == "0.0%":
        return f"its loss did not move, {said}"
    return f"its loss {'fell' if drop > 0 else 'rose'} {said} only because the batches differ"


def step_said(summary: dict) -> str:
    """The loop and the loss every variant trained with, and what the loop kept of the outputs (the same for
    every variant and N; summaries written before they existed: the upstream's)."""
    meta = summary["meta"]
    loop, loss = meta.get("loop", UPSTREAM), meta.get("loss", MODEL)
    kept = [phases["before_zero_grad"] for _, e in run_entries(summary) if e.get("kept_output_bytes")
            for phases in e["kept_output_bytes"]]
    held = f": {size_said(max(kept))} a rank" if kept and max(kept) else ""
    said = f"the outputs kept until the next forward{held}" if loop == UPSTREAM else "the loss alone kept"
    return f"Step: loop {loop} ({said}), loss {loss}."


def how_far(failure: list[dict]) -> str:
    """"; it reached step 3 (training_started), peak 139519 MiB, 896 MiB more asked" from the failing rank."""
    own = next((f for f in failure if f["status"] == "failed"), None)
    if own is None:
        return ""
    peak = own.get("peak_allocated_mib_so_far")
    asked = own.get("failed_allocation_mib")
    return (f"\n{'':38} rank {own['rank']} reached step {own['steps_done']} ({own['last_event']})"
            + (f", peak {peak:.0f} MiB allocated" if peak is not None else "")
            + (f", then asked for {asked:.0f} MiB more" if asked else ""))


ACCELERATE, TORCH = "accelerate", INTENDED[0]
COMPARED_PEAKS = ("peak_allocated_mib", "peak_reserved_mib", "training_peak_allocated_mib",
                  "training_peak_reserved_mib", "peak_rss_mib")


def accelerate_vs_torch(entries: dict) -> dict | None:
    """accelerate against the intended torch variant, on the rank that held the most: each peak's
    difference in MiB, and which side holds what (the state counted at the step peak, its bytes on
    the device, and the measured memory beyond it)."""
    acc, ref = entries.get(ACCELERATE, {}), entries.get(TORCH, {})
    if acc.get("status") != "ok" or ref.get("status") != "ok":
        return None
    diffs = {k: None if acc[k]["max"] is None or ref[k]["max"] is None else acc[k]["max"] - ref[k]["max"]
             for k in COMPARED_PEAKS}
    holds = {name: {"state_bytes": _held_at_step_peak(e),
                    "device_bytes": max(r[phase] for r in e["device_bytes"] for phase in PEAK_PHASES if phase in r),
                    "beyond_state_mib": e["training_peak_beyond_state_mib"]["max"]}
             for name, e in ((ACCELERATE, acc), (TORCH, ref))}
    found = {"reference": TORCH, "difference_mib": diffs, "holds_at_step_peak": holds}
    if "peak_tensors" in acc and "peak_tensors" in ref:  # --save_memory_snapshot: the tensors that differ
        found["peak_tensors_difference"] = snapshots.difference(_at_highest_peak(acc), _at_highest_peak(ref),
                                                                ACCELERATE, TORCH)
    return found


def _at_highest_peak(entry: dict) -> dict:
    """The replayed peak of the rank whose allocator peaked highest in training."""
    peaks = [p if p is not None else -1 for p in entry["training_peak_allocated_mib"]["per_rank"]]
    return entry["peak_tensors"][peaks.index(max(peaks))]


def compared_sentence(found: dict | None) -> str | None:
    """accelerate against torch in one sentence, from ``accelerate_vs_torch``."""
    if not found:
        return None
    diff = found["difference_mib"]["training_peak_allocated_mib"]
    acc, ref = found["holds_at_step_peak"][ACCELERATE], found["holds_at_step_peak"][TORCH]
    state = "the same state" if acc["state_bytes"] == ref["state_bytes"] else \
        f"{(acc['state_bytes'] - ref['state_bytes']) / MIB:+.1f} MiB of state"
    peak = "no allocator counters on CPU" if diff is None else f"{diff:+.1f} MiB of training peak allocated"
    tensors = "".join(f"; at its peak accelerate holds {row['difference_mib']:+.1f} MiB of {row['tensor']} "
                      f"(allocated at {row['site']})" for row in found.get("peak_tensors_difference", [])[:3])
    return (f"accelerate against {TORCH}: {peak}; {state} at the step peak (params, grads, AdamW, stale), "
            f"so a difference is in what a step holds beyond it (gathered parameters, activations, buffers)"
            f"{tensors}.")


def explanations(summary: dict) -> list[str]:
    """Plain sentences for the numbers that matter most."""
    out = [f"{name} {cause}; the other variants ran (what the installed libraries cannot do is a finding of this "
           f"run, not its failure)." for name, cause in unsupported_findings(run_entries(summary)).items()]
    out += [s for s in [compared_sentence(summary.get("accelerate_vs_torch")), uneven_ranks_sentence(summary)] if s]
    unfixed = summary["variants"].get(UNFIXED)
    if unfixed and unfixed["status"] == "ok":
        rank0 = unfixed["accounting"][0]
        intended = [v["loss_drop"] for n, v in summary["variants"].items()
                    if n in INTENDED and v.get("status") == "ok" and v.get("loss_drop") is not None]
        beside = f"; the intended variants' fell {max(intended):.1%} on the same batches" if intended else ""
        out.append(f"{UNFIXED}: its optimizer still holds {size_said(rank0['stale_param_bytes'])} of full parameters "
                   f"per rank that the model no longer uses; they never get gradients, so AdamW never creates "
                   f"state ({size_said(rank0['optimizer_state_bytes'])}) and the model's weights never change "
                   f"({unfixed_loss_said(unfixed['loss_drop'])}{beside}); zero_grad() never reaches the model's "
                   f"sharded parameters, so their "
                   f"{size_said(rank0['grad_bytes'])} of gradients are never cleared.")
    out += accumulation_sentences(summary)
    proj = summary.get("projection") or {}
    n = proj.get("unfixed_costs_more_from_world_size")
    if n is not None:
        there = proj.get("state_bytes_there") or {name: cell["before_zero_grad"]  # a summary of before the exact N
                                                  for name, cell in proj["per_rank_state_bytes"][str(n)].items()}
        out.append(f"At the step peak the unfixed variant's state (P + 2P/N) exceeds the intended one's (4P/N) "
                   f"from N = {n} ranks on: {size_said(there[UNFIXED])} vs {size_said(there[proj['reference']])} per rank "
                   f"there (the sharding rule at every N; projection in summary.json).")
    return out


def uneven_ranks_sentence(summary: dict) -> str | None:
    """Where the ranks hold different parameter bytes (FSDP2's padding, TP's uneven splits), which holds what:
    the table's memory columns are the heaviest rank's."""
    entry = next((v for n, v in summary["variants"].items() if n in INTENDED and v.get("status") == "ok"), None)
    held = [rank["end_of_training"]["param_bytes"] for rank in entry["accounting"]] if entry else []
    if len(set(held)) < 2:
        return None
    heaviest = held.index(max(held))
    return ("The ranks hold different parameter bytes (FSDP2 pads the last shard; TP splits a dim that its ranks do "
            "not divide evenly): " + ", ".join(f"rank {r} {size_said(b)}" for r, b in enumerate(held[:8]))
            + (", ..." if len(held) > 8 else "") + f"; rank {heaviest} holds the most.")


def accumulation_sentences(summary: dict) -> list[str]:
    """What a step of K microbatches is, and what each variant held between two of them."""
    step = summary["meta"].get("per_optimizer_step") or {}
    if step.get("microbatches", 1) == 1:
        return []
    mesh = step.get("mesh") or {}
    layout = " x ".join(f"{mesh[axis]} {axis}" for axis in AXES if mesh.get(axis, 1) > 1 and axis != "dp_shard")
    out = [f"One optimizer step: {step['microbatches']} microbatches, {step['sequences_per_rank']} sequences and "
           f"{step['tokens_per_rank']} tokens per rank, {step.get('tokens', 'n/a')} tokens in all"
           + (f", on {mesh['dp_shard']} dp_shard x {layout}" if layout else "") + "."]
    held = {name: _worst_rank(v, MICROBATCH_PHASE) for name, v in summary["variants"].items()
            if v.get("status") == "ok" and MICROBATCH_PHASE in v["accounting"][0]}
    if held:
        out.append("Between two microbatches of the last step (before its optimizer step) each rank held gradients "
                   "not yet reduced: " + "; ".join(f"{name} {size_said(h['unreduced_grad_bytes'])} unreduced, "
                                                    f"{size_said(h['grad_bytes'])} sharded" for name, h in held.items())
                   + ".")
    return out


# --------------------------------------------------------------------------- simulated world sizes

SKIPPED = {"ok": None, "skipped": "simulated world size: no collective moves data under a fake process group, "
                                  "so losses mean nothing"}


def simulated_entries(simulated: dict):
    """(N, rank, variant, entry) for every run of a sweep, as summary.json nests them."""
    for n, by_rank in simulated.items():
        for rank, by_variant in by_rank.items():
            for name, entry in by_variant.items():
                yield int(n), int(rank), name, entry


def sweep_checks(simulated: dict) -> dict:
    """Only the accounting can be checked; the convergence checks are reported as skipped."""
    ran = [(n, r, name, e) for n, r, name, e in simulated_entries(simulated) if e["status"] == "ok"]
    checks = {}
    if ran:
        for check, field in (("accounting_matches_expected", "accounting_matches_expected"),
                             ("options_applied", "applied_matches_options")):
            mismatched = [f"{name} (N={n}, rank {r})" for n, r, name, e in ran if not e[field]]
            checks[check] = {"ok": not mismatched, "mismatched": mismatched}
    checks["intended_losses_match"] = dict(SKIPPED)
    checks["unfixed_did_not_train"] = dict(SKIPPED)
    return checks


def _worst_per_world_size(simulated: dict, figure) -> dict[int, dict[str, float]]:
    """{N: {variant: the highest figure(entry) over the ranks played}} over the runs that finished."""
    table: dict[int, dict[str, float]] = {}
    for n, _, name, entry in simulated_entries(simulated):
        value = figure(entry) if entry["status"] == "ok" else None
        if value is not None:
            table.setdefault(n, {})[name] = max(value, table.get(n, {}).get(name, value))
    return table


MEASURED_FIGURES = {  # key in summary.json -> (how to read it off an entry, what it is in words)
    "training_peak_allocated": (lambda e: e["training_peak_allocated_mib"]["max"], "peak allocated in training"),
    "state_at_step_peak": (_held_at_step_peak, "state held at the step peak"),
}


def compared_sizes(simulated: dict, figure) -> list[tuple[int, dict[str, float]]]:
    """(N, {variant: figure}) at each simulated N where the unfixed variant and an intended one both finished with
    the figure: the only places where the two can be compared."""
    return [(n, row) for n, row in sorted(_worst_per_world_size(simulated, figure).items())
            if UNFIXED in row and any(v in row for v in INTENDED)]


def measured_crossover(simulated: dict) -> dict:
    """Per measured figure, the smallest simulated N at which the unfixed variant's exceeds that of
    every intended variant that ran there (None where it never does). A figure is left out where no N has both
    the unfixed variant and an intended one finished (accelerate where the libraries cannot is not compared), or
    where the device cannot measure it (no allocator on CPU)."""
    found = {}
    for key, (figure, _) in MEASURED_FIGURES.items():
        compared = compared_sizes(simulated, figure)
        if compared:
            found[key] = next((n for n, row in compared
                               if row[UNFIXED] > max(row[v] for v in INTENDED if v in row)), None)
    return found


def print_sweep_table(summary: dict) -> None:
    sim = summary["meta"]["simulated"]
    say(f"\nSimulated world sizes ({summary['meta']['model']}): one process played each rank shown, on a fake "
        f"process group (real allocations, no communication); {sim['steps']} steps per run. "
        f"{step_said(summary)}")
    header = (f"{'N':>4} {'rank':>4} {'variant':{NAME_WIDTH}} {'train':>8} {'resv':>6} {'tok/s':>8} {'MFU':>6} "
              f"{'params':>7} {'grads':>7} {'optim':>7} {'stale':>7} {'beyond':>7}")
    print(header)
    print("-" * len(header))
    for n, rank, name, v in simulated_entries(summary["simulated"]):
        if v["status"] != "ok":
            print(f"{n:>4} {rank:>4} {name:38} {v['status']}")
            continue
        state = v["accounting"][0]["before_zero_grad"]
        speed = v.get("speed")
        print(f"{n:>4} {rank:>4} {name:{NAME_WIDTH}} {_fmt(v['training_peak_allocated_mib']['max']):>8} "
              f"{_fmt(v['peak_reserved_mib']['max'], '.0f'):>6} {throughput.rate_said(speed):>8} "
              f"{throughput.mfu_said(speed):>6} {_mib(state['param_bytes']):>7} {_mib(state['grad_bytes']):>7} "
              f"{_mib(state['optimizer_state_bytes']):>7} {_mib(state['stale_param_bytes']):>7} "
              f"{_fmt(v['training_peak_beyond_state_mib']['max']):>7}")
    say("MiB: train = the allocator's peak over the optimizer steps (summary.json has the whole run's, building the "
        "model included); resv = reserved by the caching allocator, the set-up's cache given back before the "
        "first step. Then the state held at the step peak (after the last optimizer step): params, grads, optim "
        "(AdamW state), stale (the optimizer's old full parameters); beyond = train minus that state (activations, "
        "gathered parameters, buffers, the outputs the loop keeps). The check accounting_matches_expected compares "
        "every byte of the state, at every moment, with the FSDP2 sharding rule.", indent="     ")
    say(speed_said(summary, [v for *_, v in simulated_entries(summary["simulated"]) if v["status"] == "ok"]),
        indent="     ")
    crossover = summary["simulation_findings"]["unfixed_exceeds_intended_from_world_size"]
    exact = (summary.get("projection") or {}).get("unfixed_costs_more_from_world_size")
    rule = f"; by the sharding rule from N = {exact} on" if exact else ""
    for key, n in crossover.items():
        sizes = ", ".join(str(size) for size, _ in compared_sizes(summary["simulated"], MEASURED_FIGURES[key][0]))
        said = f"first at N = {n} of the simulated {sizes}" if n is not None else f"at none of the simulated {sizes}"
        say(f"The unfixed variant's {MEASURED_FIGURES[key][1]} exceeds every intended variant's {said}{rule}.")
    print_checks(summary["checks"])


def print_checks(checks: dict) -> None:
    """One paragraph per check: its verdict, why where it did not pass, and its figures rounded."""
    for key, check in checks.items():
        verdict = "SKIPPED" if check["ok"] is None else "PASS" if check["ok"] else "FAIL"
        why = check.get("skipped") or check.get("reason")
        figures = ", ".join(f"{k}={figure_said(v)}" for k, v in check.items() if k not in ("ok", "skipped", "reason"))
        say(f"check {key}: {verdict}{f': {why}' if why else ''}{f' ({figures})' if figures else ''}", indent="  ")


def figure_said(value) -> str:
    """A check's figure for the console: numbers to 4 significant digits, mappings as name value pairs."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {figure_said(v)}" for k, v in value.items()) + "}" if value else "none"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(figure_said(v) for v in value) + "]" if value else "none"
    return str(value)


def run_entries(summary: dict) -> list[tuple[str, dict]]:
    """(label, entry) of every variant of a run, or of every run of a sweep."""
    if summary.get("simulated"):
        return [(f"{name} (N={n}, rank {rank})", e) for n, rank, name, e in simulated_entries(summary["simulated"])]
    return list(summary.get("variants", {}).items())


def failed_status(status: str) -> bool:
    """A variant's status that fails the run: anything but ok and what the libraries cannot do."""
    return status != "ok" and not status.startswith(f"{UNSUPPORTED}: ")


def unsupported_findings(entries: list[tuple[str, dict]]) -> dict[str, str]:
    """{variant: what the installed libraries cannot do}: the runs whose set-up accelerate or transformers
    refused at these releases (utils.accelerate_fsdp2)."""
    return {label: e["status"][len(UNSUPPORTED) + 2:] for label, e in entries
            if e["status"].startswith(f"{UNSUPPORTED}: ")}


def reruns_said(entries: list[tuple[str, dict]]) -> str | None:
    """The runs that ran out of memory beside others and were run again alone: their figures are of that run."""
    again = [label for label, e in entries if e.get("rerun_alone_after")]
    if not again:
        return None
    return (f"Run again alone after running out of memory beside others (summary.json: rerun_alone_after): "
            f"{', '.join(again)}; what each reports is of its run alone.")


def why_failed(entries: list[tuple[str, dict]], checks: dict) -> str | None:
    """The run's failure in one line: the variants that did not finish, then the checks that failed."""
    parts = []
    failed = [(label, e["status"][:120]) for label, e in entries if failed_status(e["status"])]
    if failed and not any(e["status"] == "ok" for _, e in entries):
        parts.append(f"no variant finished ({'; '.join(f'{label}: {status}' for label, status in failed)})")
    elif failed:
        parts.append("; ".join(f"{label}: {status}" for label, status in failed))
    bad = [key for key, c in checks.items() if c["ok"] is False]
    if bad:
        parts.append("check" + ("s " if len(bad) > 1 else " ") + ", ".join(
            f"{key} ({checks[key]['reason']})" if checks[key].get("reason") else key for key in bad) + " failed")
    return "; ".join(parts) or None
