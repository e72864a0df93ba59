"""Turn every rank's records into summary.json and its end-of-run checks (console.py says them)."""

from __future__ import annotations

import math
import statistics

from fsdp2bench.memory import snapshots
from fsdp2bench.memory.accounting import (PROJECTION_WORLD_SIZES, expected_device_bytes, expected_frozen_bytes,
                                          expected_gathered_block_bytes, expected_moments_kept, expected_setup,
                                          expected_state, projection, unfixed_costs_more_from)
from fsdp2bench.names import (INTENDED, MIB, PEAK_PHASES, PHASES, STATE_KEYS, UNFIXED, counted, phases,
                              state_bytes, step_peak_state)
from fsdp2bench.options.fsdp import FsdpOptions
from fsdp2bench.processes.isolation import UNSUPPORTED

# Losses are compared step by step. On CPU the intended variants are bit-identical; on GPUs
# accelerate groups its parameters differently, which may change bf16 rounding a little. Compiled, the variants
# run different kernels on either device (torch's blocks are compiled one by one, accelerate's by its own regional
# compilation, which fuses and orders them otherwise): a tiny model on 2 CPU ranks then differed by one bf16 step
# in 8 of 640 steps.
LOSS_TOLERANCE = {"cpu": 0.0, "cuda": 1e-2}  # relative
KERNELS_DIFFER_TOLERANCE = 1e-2


def loss_tolerance(device_type: str, options: FsdpOptions) -> tuple[float, str]:
    """The relative difference the intended variants' losses may show, and why."""
    if options.compile or options.float8:
        return KERNELS_DIFFER_TOLERANCE, "compiled or float8: the variants run different kernels"
    if device_type == "cpu":
        return LOSS_TOLERANCE["cpu"], "the same kernels on the CPU: bit-identical"
    return LOSS_TOLERANCE["cuda"], "accelerate groups its parameters otherwise: bf16 rounding may differ"
# Whether a loss fell is read against the spread of the loss over the run's batches: a drop counts when
# it exceeds this many standard errors of the drop a model that never changes would show on them.
STANDARD_ERRORS = 3
# The fewest steps that tell a trend from the spread: two per quarter, and a line fitted with 6 left over.
MIN_STEPS = 8
PHASE_EVENTS = {"model_built": "build", "optimizer_created": "optimizer", "sharded": "shard"}


def loss_drop(losses: list[float]) -> float:
    """Relative fall from the mean of the first quarter of steps to the mean of the last quarter (NaN from a first
    quarter of zero losses: no fall to measure)."""
    window = max(1, len(losses) // 4)
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    return (first - last) / first if first else math.nan


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
        **frozen_base(per_rank, shapes, world_size, ranks, options, counted),
        **low_bit_moments(name, per_rank, shapes, world_size, ranks, options),
        **({"peak_tensors": [r["peak_tensors"] for r in per_rank]} if "peak_tensors" in per_rank[0] else {}),
        **({"emulated": [r["emulated"] for r in per_rank]} if per_rank[0].get("emulated") else {}),
        **({"graph_breaks": [r["graph_breaks"] for r in per_rank]} if per_rank[0].get("graph_breaks") is not None
           else {}),
        "wall_s": max(r["wall_s"] for r in per_rank),
        "median_step_time_s": statistics.median(s["step_time_s"] for s in per_rank[0]["steps"]),
        **speed_summary([r["speed"] for r in per_rank]),
    }


def frozen_base(per_rank: list[dict], shapes, world_size: int, ranks: list[int], options: FsdpOptions,
                counted: tuple[str, ...]) -> dict:
    """What the frozen parameters (a LoRA base) held on each rank, against the sharding rule: their chunk after
    training, and the most gradient and optimizer state they had at any moment counted (none expected). Nothing
    where the model has no frozen parameter."""
    expected = [expected_frozen_bytes(shapes, world_size, rank, options) for rank in ranks]
    if not expected[0]["frozen_full_bytes"]:
        return {}
    held = [{"frozen_param_bytes": r["accounting"]["end_of_training"]["frozen_param_bytes"],
             **{k: max(r["accounting"][phase][k] for phase in counted) for k in ("frozen_grad_bytes",
                                                                                 "frozen_state_bytes")}}
            for r in per_rank]
    statistics = [r["accounting"]["end_of_training"].get("four_bit_statistics_bytes", 0) for r in per_rank]
    return {"frozen_base": held, "expected_frozen_base": expected,
            "frozen_base_as_expected": all(h == {k: e[k] for k in h} for h, e in zip(held, expected)),
            **({"four_bit_statistics_bytes": statistics} if any(statistics) else {})}


def low_bit_moments(name: str, per_rank: list[dict], shapes, world_size: int, ranks: list[int],
                    options: FsdpOptions) -> dict:
    """Under a torchao optimizer, how many trained parameters' moments it quantized on each rank and how many it
    left in full precision, with their elements and state bytes, against torchao's rule. Nothing under another."""
    if "low_bit_moments" not in per_rank[0]:
        return {}
    held = [r["low_bit_moments"] for r in per_rank]
    expected = [expected_moments_kept(shapes, world_size, rank, name, options) for rank in ranks]
    return {"low_bit_moments": held, "expected_low_bit_moments": expected,
            "low_bit_moments_as_expected": held == expected}


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


def worst_rank(entry: dict, phase: str) -> dict:
    """The state counted at ``phase`` on the rank that held the most, per key."""
    return max((rank[phase] for rank in entry["accounting"]), key=state_bytes)


def _held_state(entry: dict, phase: str) -> int:
    """State bytes counted at ``phase``, on the rank that held the most."""
    return state_bytes(worst_rank(entry, phase))


def _held_at_step_peak(entry: dict) -> int:
    """State bytes at the larger of a step's two peaks: after its optimizer step, or between microbatches."""
    return state_bytes(step_peak_state(entry))


def projection_summary(shapes, variants: dict, world_size: int, options: FsdpOptions) -> dict:
    measured = {name: {phase: _held_state(v, phase) for phase in ("end_of_training", "before_zero_grad")}
                for name, v in variants.items() if v.get("status") == "ok"}
    return {**state_projection(shapes, list(variants), options=options),
            "measured": {"world_size": world_size, "per_rank_state_bytes": measured}}


def first_non_finite(losses: list) -> int | None:
    """The first step whose loss is not a positive number: NaN or infinite, or zero or less, which a causal LM's
    cross entropy never is where the forward computed anything (QLoRA's uint8 storage under FSDP2 trains silently at
    loss 0: accelerate#3983)."""
    return next((i for i, loss in enumerate(losses) if loss is None or not math.isfinite(loss) or loss <= 0), None)


def run_checks(variants: dict, device_type: str, options: FsdpOptions = FsdpOptions()) -> dict:
    """The upstream's equality check, plus: every loss is a number, the intended variants train,
    the state bytes are what FSDP2's rule predicts, and the unfixed variant does not train."""
    checks = {}
    ok = {n: v for n, v in variants.items() if v.get("status") == "ok"}
    non_finite = {n: first_non_finite(v["losses"]) for n, v in ok.items() if first_non_finite(v["losses"]) is not None}
    if ok:  # NaN compares false with everything, so without this a diverged run would pass the others
        checks["losses_finite"] = {"ok": not non_finite, "first_non_finite_step": non_finite}
    ran = [n for n in INTENDED if n in ok]
    if len(ran) >= 2:
        tol, why = loss_tolerance(device_type, options)
        ref = variants[ran[0]]["losses"]
        diffs = {n: None if non_finite else max(abs(a - b) / abs(b) for a, b in zip(variants[n]["losses"], ref))
                 for n in ran[1:]}
        checks["intended_losses_match"] = {"ok": not non_finite and all(d <= tol for d in diffs.values()),
                                           "reference": ran[0], "relative_tolerance": tol, "tolerance_why": why,
                                           "max_relative_diff": diffs}
    for check, field in CHECKED_FIELDS:
        counted = {n: v[field] for n, v in ok.items() if field in v}
        if counted:
            checks[check] = {"ok": all(counted.values()), "mismatched": [n for n, good in counted.items() if not good]}
    checks.update(training_checks(ok, ran, non_finite))
    return checks


# (check, the field of each variant's entry it reads): the third only where the model has frozen parameters, the
# last under a torchao optimizer.
CHECKED_FIELDS = (("accounting_matches_expected", "accounting_matches_expected"),
                  ("options_applied", "applied_matches_options"),
                  ("frozen_base_sharded", "frozen_base_as_expected"),
                  ("low_bit_moments_by_torchaos_rule", "low_bit_moments_as_expected"))


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


NOT_A_LOSS = "a loss is not a positive number"


def _too_few_steps(steps: int) -> str:
    return (f"{counted(steps, 'step')} cannot tell a falling loss from the spread of the loss over the batches; it "
            f"needs at least {MIN_STEPS} steps")


def _trained_check(drops: dict, bar: dict | None, steps: int, diverged: bool) -> dict:
    if diverged:
        return {"ok": False, "loss_drop": drops, "reason": NOT_A_LOSS}
    if bar is None:
        return {"ok": None, "loss_drop": drops, "skipped": _too_few_steps(steps)}
    found = {"loss_drop": drops, **bar}
    if all(d > bar["threshold"] for d in drops.values()):
        return {"ok": True, **found}
    if any(d < -bar["threshold"] for d in drops.values()):
        return {"ok": False, **found, "reason": "the loss rose beyond the spread of its batches"}
    slowest = min(drops.values())
    moved, shown = (f"fell {slowest:.2%}", "would show it") if slowest >= 0 else \
        (f"rose {-slowest:.2%}", "would show whether it falls")
    return {"ok": None, **found, "skipped": f"the loss {moved}, within the spread of its batches "
                                            f"(the bar is {bar['threshold']:.2%}); about {steps_to_show(slowest, bar)} "
                                            f"steps {shown}"}


def _not_trained_check(drop: float, bar: dict | None, steps: int, diverged: bool, trained: dict | None) -> dict:
    """The unfixed variant's drop at most the bar: it did not train. Said only where the run could have
    shown training (the intended variants' loss fell beyond the bar), or where no intended variant ran."""
    if diverged:
        return {"ok": False, "loss_drop": drop, "reason": NOT_A_LOSS}
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
    for check, field in CHECKED_FIELDS:
        counted = [(n, r, name, e[field]) for n, r, name, e in ran if field in e]
        if counted:
            checks[check] = {"ok": all(good for *_, good in counted),
                             "mismatched": [f"{name} (N={n}, rank {r})" for n, r, name, good in counted if not good]}
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
