"""What fits: the search for the largest batch (or block) that trains under a memory cap.

Pure logic, no torch: a ``Search`` proposes the values to probe next and takes back what each probe
found; ``run_searches`` drives many of them at once, a round at a time, through any probe runner
(plan.py's runs real simulated ranks; the tests give a function with a known edge).

The aim: a step's peak grows close to linearly with the batch beyond the state it holds anyway, so
the line through the largest value that fits, with the slope of the two largest (or the memory
model's estimate of a sequence's activations), says where the cap is crossed. The probes then confirm the edge from both
sides. Where the line is no help (no peaks on a CPU run, or it was wrong) the search doubles until a
value fails, then halves the gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable

from fsdp2bench.cli import say


@dataclass(frozen=True)
class Outcome:
    """What one probe found: it trained (``fits``), or ran out of memory; ``peak_mib`` is its peak
    allocated (at a failure, up to it), None where the device has no allocator."""
    value: int
    fits: bool
    peak_mib: float | None = None
    detail: dict = field(default_factory=dict, compare=False)  # the probe's own record, for plan.json


STEP_BACK = 0.85  # after the first aim fails, the next probe is this far from the largest fit to it


class Search:
    """The largest value in [lower, upper] whose probe fits, assuming a larger value never fits where a
    smaller one does not (near the cap the allocator's luck can break that: ``largest_fit``).

    ``limit_mib``: the allocator's limit; ``slope_mib``: the memory model's estimate of what one more
    unit of the searched value adds to a step's peak allocated; ``block_mib``: what it adds to the
    step's largest allocation (the logits). Near the cap a step fails once its peak leaves no free
    stretch of the largest block's size: the aim is a peak of the limit less ``block_share`` of that
    block. Without them the search doubles and halves.
    """

    def __init__(self, lower: int, upper: int, limit_mib: float | None = None, slope_mib: float | None = None,
                 block_mib: float = 0.0, block_share: float = 0.0):
        if not 1 <= lower <= upper:
            raise ValueError(f"a search needs 1 <= lower <= upper, got {lower}, {upper}")
        self.lower, self.upper, self.limit_mib, self.slope_mib = lower, upper, limit_mib, slope_mib
        self.block_mib, self.block_share = block_mib, block_share
        self.outcomes: list[Outcome] = []
        self.error: str | None = None  # a probe failed for a reason other than memory

    def target_mib(self, value: int) -> float:
        """The peak allocated aimed at for ``value``."""
        return self.limit_mib - self.block_share * self.block_mib * value

    def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def stop(self, error: str) -> None:
        self.error = error

    @property
    def smallest_failure(self) -> int | None:
        return min((o.value for o in self.outcomes if not o.fits), default=None)

    @property
    def largest_fit(self) -> int | None:
        """The largest value that fits below every failure. Near the cap the allocator's luck can let
        a value fit above one that failed (its blocks happened to pack); the edge is the first failure."""
        hi = self.smallest_failure
        return max((o.value for o in self.outcomes if o.fits and (hi is None or o.value < hi)), default=None)

    @property
    def fits_above_edge(self) -> list[int]:
        hi = self.smallest_failure
        return sorted(o.value for o in self.outcomes if o.fits and hi is not None and o.value > hi)

    @property
    def done(self) -> bool:
        lo, hi = self.largest_fit, self.smallest_failure
        return self.error is not None or hi == self.lower or lo == self.upper or \
            (lo is not None and hi is not None and hi == lo + 1)

    def next_values(self) -> list[int]:
        """The values to probe next (two where the aim is close: the edge's both sides at once); none
        once the edge is known. Each lies strictly between the largest fit and the smallest failure,
        so a search always ends."""
        if self.done:
            return []
        lo, hi = self.largest_fit, self.smallest_failure
        if lo is None:
            return [self.lower]
        ceiling = self.upper if hi is None else hi - 1
        guess, close = self.aim()
        failures = sum(1 for o in self.outcomes if not o.fits)
        if guess is not None and hi is not None and guess >= hi and failures == 1:
            # The first aim was too high, most often by a little: step back by as much, not by half.
            return [min(ceiling, max(lo + 1, lo + math.floor((hi - lo) * STEP_BACK)))]
        if guess is None or (hi is not None and guess >= hi):  # no line, or it was wrong above
            return [min(ceiling, 2 * lo) if hi is None else (lo + hi) // 2]
        if guess <= lo:  # the line puts the edge at the largest fit: its next value decides, unless
            return [min(ceiling, lo + self.step_up())]  # the fits went past the aim
        value = min(guess, ceiling)
        return [value, value + 1] if close and value + 1 <= ceiling else [value]

    def line(self) -> tuple[float, float, float] | None:
        """(value, peak, slope) of the line that aims: through the largest value that fits, with the
        slope between it and the next largest where that one is near it (further down, a step's peak
        is the optimizer's, not the activations', so the line bends), else the model's slope."""
        lo = self.largest_fit
        points = sorted((o.value, o.peak_mib) for o in self.outcomes
                        if o.fits and o.peak_mib is not None and lo is not None and o.value <= lo)
        if not points:
            return None
        x2, y2 = points[-1]
        if len(points) >= 2 and points[-2][0] >= x2 / 2 and points[-1][1] > points[-2][1]:
            (x1, y1) = points[-2]
            return x2, y2, (y2 - y1) / (x2 - x1)
        return (x2, y2, self.slope_mib) if self.slope_mib else None

    def step_up(self) -> int:
        """1, or where the largest fit already holds more than the aim (a cap whose largest blocks are
        small beside it lets a step use more of it), half the way to where the line meets the limit,
        or to the smallest failure."""
        x, y, slope = self.line()
        if y < self.target_mib(x):
            return 1
        hi = self.smallest_failure
        if hi is not None:
            return max(1, (hi - x) // 2)
        return max(1, math.floor((self.limit_mib - y) / slope) // 2)

    def aim(self) -> tuple[int | None, bool]:
        """The largest value the line keeps under the target, and whether it is close to the value the
        line starts from (then the line holds, and both sides of the edge are probed at once)."""
        line = self.line() if self.limit_mib is not None else None
        if line is None:
            return None, False
        x, y, slope = line  # the peak y + slope (v - x) meets the target at v:
        guess = math.floor((self.limit_mib - y + slope * x) / (slope + self.block_share * self.block_mib))
        return guess, abs(guess - x) <= max(2, x // 4)

    def predicted_peak(self, value: int) -> float | None:
        """The line's peak at ``value``: what a probe is expected to hold, so that probes that will
        stay well under the cap can share the GPU."""
        line = self.line()
        if line is None:
            return None
        x, y, slope = line
        return y + slope * (value - x)

    def answer(self) -> dict:
        """The largest value that fits and what happened just above it, for plan.json and the table."""
        lo, hi = self.largest_fit, self.smallest_failure
        above = next((o for o in self.outcomes if o.value == hi), None)
        best = next((o for o in self.outcomes if o.value == lo and o.fits), None)
        # Unfinished (interrupted), the edge is only known to lie in [at_least, below): no largest value.
        bounds = {} if self.done else {"at_least": lo, "below": hi}
        return {"largest": lo if self.done else None, **bounds, "finished": self.done, "fit": _said(best),
                "above": _said(above),
                "fits_above_edge": self.fits_above_edge,
                "at_upper_bound": lo == self.upper, "probes": len(self.outcomes), "error": self.error,
                "smallest_peak_mib": min((o.peak_mib for o in self.outcomes if o.peak_mib is not None), default=None)}


def _said(outcome: Outcome | None) -> dict | None:
    return None if outcome is None else {"value": outcome.value, "fits": outcome.fits, "peak_mib": outcome.peak_mib,
                                         **outcome.detail}


# A round's probes, (search key, value) each, and what each found; a key's probe that failed for a
# reason other than memory comes back as a string.
RoundRunner = Callable[[list[tuple[Hashable, int]]], dict[tuple[Hashable, int], "Outcome | str"]]


def edge_share(search: Search) -> float | None:
    """The share of its largest block that a finished search's edge left free: from the midpoint
    between its largest fit's peak and the line's peak one value above. None until both are known."""
    lo, hi, line = search.largest_fit, search.smallest_failure, search.line()
    if lo is None or hi != lo + 1 or line is None or not search.block_mib:
        return None
    x, y, slope = line
    return max(0.0, (search.limit_mib - y - slope / 2) / (search.block_mib * (lo + 0.5)))


def share_edges(searches: dict[Hashable, Search]) -> None:
    """Aim every unfinished search with the edges the finished ones found under the same cap: the
    median share of the largest block they left free."""
    shares = sorted(e for e in (edge_share(s) for s in searches.values() if s.done) if e is not None)
    if shares:
        for search in searches.values():
            if not search.done:
                search.block_share = shares[len(shares) // 2]


def run_searches(searches: dict[Hashable, Search], run_round: RoundRunner,
                 after_round: Callable[[int], None] = lambda rounds: None) -> int:
    """Every search to its end, the probes they want next run a round at a time (a runner may run a
    round's probes side by side), ``after_round(rounds so far)`` told after each; returns the rounds.
    Each round's finished searches aim the others (``share_edges``)."""
    rounds, pilot = 0, next(iter(searches), None)
    while True:
        # Until one search has found its edge (the first, the pilot), the others take only their
        # first probe: the edge the pilot finds aims them (``share_edges``).
        held = not any(s.done for s in searches.values())
        wanted = [(key, value) for key, search in searches.items()
                  if not (held and key != pilot and search.outcomes) for value in search.next_values()]
        if not wanted:
            return rounds
        rounds += 1
        for (key, value), found in run_round(wanted).items():
            if isinstance(found, str):
                searches[key].stop(found)
            else:
                searches[key].record(found)
        share_edges(searches)
        after_round(rounds)


# --------------------------------------------------------------------------- plan.json and the console

def plan_record(meta: dict, questions: dict, searches: dict[Hashable, Search], probes: list,
                interrupted: bool = False) -> dict:
    """plan.json: an answer per question with every probe it took, the counts, and the findings."""
    limit = (meta.get("gpu_memory") or {}).get("allocator_limit_mib")
    answers = [answer_of(questions[key], search, limit) for key, search in searches.items()]
    reruns = sum(1 for p in probes if p.attempt)
    meta = {**meta, "probes": len(probes), "probes_run_again_alone": reruns, "interrupted": interrupted,
            "probes_per_answer": len(probes) / len(answers) if answers else None}
    return {"meta": meta, "answers": answers, "findings": findings(answers, meta["variants"][0])}


def answer_of(question, search: Search, limit_mib: float | None) -> dict:
    """One answer of plan.json, its values in tokens or sequences (a search counts in ``question.unit`` steps)."""
    found = in_units(search.answer(), question.unit)
    largest, fit = found["largest"], found["fit"]
    reserved = (fit or {}).get("peak_reserved_mib")
    headroom = limit_mib - reserved if limit_mib is not None and reserved is not None else None
    return {**{k: getattr(question, k) for k in ("option_set", "world_size", "rank", "variant", "searched", "fixed")},
            **found, "headroom_mib": headroom,
            "tokens_per_rank_per_step": question.tokens_per_rank_per_step(largest // question.unit) if largest
            else None,
            "outcomes": [in_units(_said(o), question.unit) for o in sorted(search.outcomes, key=lambda o: o.value)]}


def in_units(found: dict | None, unit: int) -> dict | None:
    """A search's answer or outcome with its values times ``unit``."""
    if found is None or unit == 1:
        return found
    scaled = {k: None if found.get(k) is None else found[k] * unit for k in ("largest", "value", "at_least", "below")
              if k in found}
    scaled.update({k: in_units(found[k], unit) for k in ("fit", "above") if k in found})
    if "fits_above_edge" in found:
        scaled["fits_above_edge"] = [v * unit for v in found["fits_above_edge"]]
    return {**found, **scaled}


def findings(answers: list[dict], reference: str) -> list[str]:
    """Per N (and fixed value): the cheapest set that fits more tokens per step than the default, by its
    probe's time per token; or, where nothing fits, the smallest peak seen."""
    out = []
    for n, fixed in sorted({(a["world_size"], a["fixed"]) for a in answers}):
        cell = [a for a in answers if a["world_size"] == n and a["fixed"] == fixed and a["variant"] == reference]
        where = f"N = {n}{_fixed_said(cell[0] if cell else None)}"
        open_ = [a for a in cell if a["error"] or not a["finished"]]
        if open_:  # a comparison with an answer that failed or was cut short would rest on a bound
            out.append(f"{where}: no finding, {len(open_)} of {len(cell)} answers open ("
                       + ", ".join(f"{a['option_set']} {'failed' if a['error'] else 'interrupted'}" for a in open_)
                       + ")" + "".join(f"; {a['option_set']} fits {_fit_said(a)}" for a in cell
                                       if a not in open_ and a["largest"]) + ".")
            continue
        fitting_ones = [a for a in cell if a["largest"]]
        if cell and not fitting_ones:
            smallest = min((a for a in cell if a["smallest_peak_mib"] is not None),
                           key=lambda a: a["smallest_peak_mib"], default=None)
            seen = f"; the smallest peak allocated was {smallest['smallest_peak_mib']:.0f} MiB " \
                f"({smallest['option_set']})" \
                if smallest else ""
            out.append(f"{where}: 1 does not fit under any set{seen}.")
            continue
        default = next((a for a in cell if a["option_set"] == "default"), None)
        out.append(_cheapest_beyond(where, default, fitting_ones))
    return out


def _fixed_said(answer: dict | None) -> str:
    if answer is None:
        return ""
    return f", block {answer['fixed']}" if answer["searched"] == "batch_size" else f", batch {answer['fixed']}"


def _time_per_token(answer: dict) -> float | None:
    step = (answer["fit"] or {}).get("median_step_time_s")
    return step / answer["tokens_per_rank_per_step"] if step else None


def _cheapest_beyond(where: str, default: dict | None, fitting_ones: list[dict]) -> str:
    if default is None or not default["largest"]:
        best = max(fitting_ones, key=lambda a: a["tokens_per_rank_per_step"])
        return f"{where}: the default fits nothing; {best['option_set']} fits the most, {_fit_said(best)}."
    more = [a for a in fitting_ones if a["tokens_per_rank_per_step"] > default["tokens_per_rank_per_step"]
            and _time_per_token(a) is not None]
    said = f"{where}: the default fits {_fit_said(default)}"
    if not more:
        return f"{said}; no other set fits more."
    cheapest = min(more, key=_time_per_token)
    return (f"{said}; the cheapest set that fits more is {cheapest['option_set']}, {_fit_said(cheapest)}, at "
            f"{_time_per_token(cheapest) * 1e6:.1f} us per token in its probe (the default "
            f"{_time_per_token(default) * 1e6:.1f}; probes beside one another share the GPU, so these are rough)")


def _fit_said(answer: dict) -> str:
    name = "B" if answer["searched"] == "batch_size" else "L"
    return f"{answer['tokens_per_rank_per_step']:,} tokens per rank per step ({name} = {answer['largest']})"


def _above_said(answer: dict) -> str:
    above = answer["above"]
    if answer["error"]:
        return f"failed: {answer['error'][:40]}"
    if answer["at_upper_bound"]:
        return "the upper bound"
    if not answer["finished"]:
        return "interrupted" + (f": below {answer['below']}" if answer.get("below") else "")
    if above is None:
        return "-"
    failed = above.get("failed_allocation_mib")
    return f"{above['value']}: out of memory" + (f" ({failed:.0f} MiB failed)" if failed is not None else "")


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def print_plan(plan: dict) -> None:
    """A table per option set and N: the largest value, its tokens and peak, and what failed above it."""
    meta = plan["meta"]
    name = "B_max" if meta["find"] == "batch_size" else "L_max"
    print(f"\n{'option set':20} {'N':>5} {'variant':26} {name:>6} {'tokens':>9} {'resv MiB':>8} {'headroom':>8} "
          f"{'probes':>6}  above it")
    for a in plan["answers"]:
        fit = a["fit"] or {}
        largest = a["largest"] or (f">={a['at_least']}" if a.get("at_least") else "-")
        print(f"{a['option_set']:20} {a['world_size']:>5} {a['variant'][:26]:26} {largest:>6} "
              f"{_mib(a['tokens_per_rank_per_step']):>9} {_mib(fit.get('peak_reserved_mib')):>8} "
              f"{_mib(a['headroom_mib']):>8} {a['probes']:>6}  {_above_said(a)}")
    cap = meta.get("gpu_memory")
    said = f"resv: the probe's peak reserved at the largest value; headroom: the allocator's limit of " \
        f"{cap['allocator_limit_mib']:,.0f} MiB less it." if cap else "A CPU run: no allocator, no cap."
    say(f"tokens: per rank per optimizer step at the largest value. {said} {meta['probes']} probes "
        f"({meta['probes_per_answer']:.1f} per answer, {meta['probes_run_again_alone']} run again alone) in "
        f"{meta['rounds']} rounds; plan.json has each probe's phase and failed allocation.")
    for line in plan["findings"]:
        say(line)
