"""What fits: the search for the largest batch (or block) that trains under a memory cap.

Pure logic, no torch: a ``Ladder`` chooses the values one shared process measures; a ``Search`` proposes
the values to probe next in fresh processes and takes back what each found; a ``Planner`` says which
probes of many searches may start now (plan.py starts each as soon as it may; ``run_searches``, the tests'
driver, runs them a round at a time through a function with a known edge).

The aim: a step's peak grows close to linearly with the batch beyond the state it holds anyway, so
the line through the shared process's values (or the largest fresh fit, with their slope, or the memory
model's estimate of a sequence's activations) says where the cap is crossed, less some of the step's
largest block. The probes then confirm the edge from both sides. Where the line is no help (no peaks on
a CPU run, or it was wrong) the search doubles until a value fails, then halves the gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable



@dataclass(frozen=True)
class Outcome:
    """What one probe found: it trained (``fits``), or ran out of memory; ``peak_mib`` is its peak
    allocated (at a failure, up to it), None where the device has no allocator."""
    value: int
    fits: bool
    peak_mib: float | None = None
    detail: dict = field(default_factory=dict, compare=False)  # the probe's own record, for plan.json


# How many of a step's largest block a search's edge leaves free (``Search.blocks_free``), within these bounds: on one
# H200 the 1.5B model's edges left 0.4-1.5 of it under 24 GiB (the default set at N = 8 about 1.4, at N = 64 about
# 0.7, the sets with activation checkpointing 0.45-0.75) and the default set at N = 8 about 1.5 under 80 GiB.
BLOCKS_FREE_BOUNDS = (0.35, 1.7)
# A shared process runs under its own allocator limit, SHARED_LIMIT of the probes' (or more where the memory
# model says its first value needs it). After the lower bound its values aim at these fractions of the way from
# that value's peak to SHARED_TOP of its own limit (room for a slope that is wrong by 10%): far enough up that
# the blocks' activations, not the optimizer's transients, make the slope between the last two.
SHARED_LIMIT, SHARED_TOP, SHARED_TARGETS = 0.7, 0.9, (0.4, 1.0)
# ... and at most this many MiB: under a large cap the activations outweigh the transients well below it, and
# six shared processes fit on one 140 GiB GPU where two of 0.7 of 80 GiB would.
SHARED_MOST_MIB = 20 * 1024
# A slope between two values where the smaller is below this fraction of the larger is bent by the optimizer's
# transients (large beside a small batch's activations): the model's estimate aims instead.
SHARED_NEAR = 0.25
# Failures in a row after which a search steps down on its own (``Search.stepped_down``), the line's aim set aside.
MISSES = 4
FAR_STEP = 0.1  # of the way from a failure far beyond the shared values back towards them
# A fresh fit at least this many times the shared process's largest value takes its slope from the two.
FAR_BEYOND = 2
SHARED_DOUBLINGS = 6  # without peaks (a CPU run) a shared process doubles from the lower bound this often


@dataclass(frozen=True)
class Ladder:
    """The values one shared process measures, each chosen from the peaks of those before it (no torch: the
    child calls ``next_value``). Always upward, so the first out-of-memory error ends the ladder.

    A value's peak on the line, plus ``free_mib`` a unit of the step's largest block (what the probes leave
    free: ``Search.aim``), meets its target: a step needs that block whole, and a ladder aimed at the peak alone
    ran out of memory at its third value under checkpointing with offload (3.5 GiB of logits asked, 1.8 GiB
    cached apart), leaving no slope for those sets' line."""
    lower: int
    upper: int
    limit_mib: float | None  # the shared process's own allocator limit (None on a CPU run: no peaks, it doubles)
    slope_mib: float | None  # the memory model's estimate of what one unit adds
    inject_oom_above: int | None = None
    free_mib: float = 0.0

    def next_value(self, points: list[tuple[int, float | None]]) -> int | None:
        """The next value after ``points`` (value, peak allocated), or None once the ladder is done."""
        if not points:
            return self.lower
        x, y = points[-1]
        if self.limit_mib is None or y is None:
            return min(self.upper, 2 * x) if len(points) <= SHARED_DOUBLINGS and x < self.upper else None
        if len(points) > len(SHARED_TARGETS):
            return None
        slope = _slope(points, SHARED_NEAR) or self.slope_mib
        first = points[0][1]
        target = first + SHARED_TARGETS[len(points) - 1] * (SHARED_TOP * self.limit_mib - first)
        if not slope or y >= target:
            return None
        value = min(self.upper, _meets(target, x, y, slope, self.free_mib))
        return value if value > x else None


class SearchState:
    """What a search knows: the bounds, the limit and the memory model's figures it aims with, its fresh probes'
    outcomes and its shared process's values, and the edge they put where (``largest_fit``, ``smallest_failure``).
    A larger value is assumed never to fit where a smaller one does not (near the cap the allocator's luck can
    break that: ``largest_fit``)."""

    def __init__(self, lower: int, upper: int, limit_mib: float | None = None, slope_mib: float | None = None,
                 block_mib: float = 0.0, blocks_free: float = 0.0):
        if not 1 <= lower <= upper:
            raise ValueError(f"a search needs 1 <= lower <= upper, got {lower}, {upper}")
        self.lower, self.upper, self.limit_mib, self.slope_mib = lower, upper, limit_mib, slope_mib
        self.block_mib, self.blocks_free = block_mib, blocks_free
        self.outcomes: list[Outcome] = []
        self.shared_values: list[Outcome] = []  # measured in one shared process: they aim the probes, never decide
        self.error: str | None = None  # a probe failed for a reason other than memory
        self.learned = False  # blocks_free is what finished searches left free (aim_with_edges), not the prior
        self.first_learned = False  # the first probe was aimed with learned blocks_free
        self.seed: int | None = None  # where a search like this one found its edge (``follow``)

    def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def take_shared_values(self, outcomes: list[Outcome]) -> None:
        """A shared process's values: their line aims the first probes, and where it has no peaks (a CPU run),
        the edge it met in its own process is where the probes start."""
        self.shared_values = sorted(outcomes, key=lambda o: o.value)

    def follow(self, edge: int) -> None:
        """Search outward from ``edge``, where a search like this one (another variant, the same set and N) found
        its own (``seeded_value``)."""
        self.seed = min(self.upper, max(self.lower, edge))

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

    def settled_by(self, value: int) -> tuple[bool, bool]:
        """Whether the search ends once ``value`` is known to fit, and once it is known not to."""
        ends = []
        for fits in (True, False):
            self.outcomes.append(Outcome(value, fits))
            ends.append(self.done)
            self.outcomes.pop()
        return ends[0], ends[1]

    def answer(self) -> dict:
        """The largest value that fits and what happened just above it, for plan.json and the table."""
        lo, hi = self.largest_fit, self.smallest_failure
        above = next((o for o in self.outcomes if o.value == hi), None)
        best = next((o for o in self.outcomes if o.value == lo and o.fits), None)
        # Unfinished (interrupted), the edge is only known to lie in [at_least, below): no largest value.
        bounds = {} if self.done else {"at_least": lo, "below": hi}
        return {"largest": lo if self.done else None, **bounds, "finished": self.done, "fit": outcome_said(best),
                "above": outcome_said(above),
                "fits_above_edge": self.fits_above_edge,
                "at_upper_bound": lo == self.upper, "probes": len(self.outcomes), "error": self.error,
                "started_at": self.seed,
                "smallest_peak_mib": min((o.peak_mib for o in self.outcomes if o.peak_mib is not None), default=None)}


class Search(SearchState):
    """The largest value in [lower, upper] whose probe fits: where each next probe goes.

    ``limit_mib``: the allocator's limit; ``slope_mib``: the memory model's estimate of what one more
    unit of the searched value adds to a step's peak allocated; ``block_mib``: what it adds to the
    step's largest allocation (the logits; under a chunked or fused loss the MLP's widest activation). Near the
    cap a step fails once its peak leaves no free stretch of the largest block's size: the first aim is a peak of
    the limit less ``blocks_free`` of that block, and each probe after it bounds that number (``blocks_free_bounds``).
    Without them the search doubles and halves; ``follow`` starts it at another search's edge instead.
    """

    def blocks_free_bounds(self) -> tuple[float, float]:
        """The blocks free this search's own probes allow, within ``BLOCKS_FREE_BOUNDS``: a value that fit left at most
        what its peak left free, one that failed at least what the line leaves free there."""
        low, high = BLOCKS_FREE_BOUNDS
        if not self.block_mib:
            return low, high
        for o in self.outcomes:
            peak = o.peak_mib if o.fits else self.predicted_peak(o.value)
            if peak is None:
                continue
            free = (self.limit_mib - peak) / (self.block_mib * o.value)
            low, high = (low, min(high, free)) if o.fits else (max(low, free), high)
        return low, high

    def next_values(self) -> list[int]:
        """The value to probe next (the edge's both sides at once only where a shared process without peaks met
        it one value wide); none once the edge is known. Each lies strictly between the largest fit and the
        smallest failure, so a search always ends."""
        if self.done:
            return []
        lo, hi = self.largest_fit, self.smallest_failure
        if self.seed is not None:
            value = self.seeded_value(lo, hi)
        elif self.limit_mib is not None and self.line() is not None:
            value = self.aimed_value(lo, hi)
        else:
            return self.unaimed_values(lo, hi)
        bottom, top = self.lower if lo is None else lo + 1, self.upper if hi is None else hi - 1
        return [min(top, max(bottom, value))]

    def seeded_value(self, lo: int | None, hi: int | None) -> int:
        """One above the seed (a follower's edge lies at its seed or one above: either is then found in two
        probes), then steps of 1 outward from that pair, another of 1, then twice as far each time; once bracketed,
        halves."""
        if lo is None and hi is None:
            return self.seed + 1
        if lo is not None and hi is not None:
            return (lo + hi) // 2
        return lo + max(1, lo - self.seed - 1) if hi is None else hi - max(1, self.seed - hi)

    def aimed_value(self, lo: int | None, hi: int | None) -> int:
        """The line's edge at the blocks free the search starts from; after one probe aimed by other searches' edges
        (most often off by one) the value beside it, after one aimed by the prior the edge at the blocks free they have
        left since; then the middle of the blocks free its probes still allow, unless the line keeps missing
        (``stepped_down``)."""
        if not self.outcomes:
            self.first_learned = self.learned
            return self.aim(self.blocks_free)
        if len(self.outcomes) == 1 and self.learned:
            return (lo + 1 if lo is not None else hi - 1) if self.first_learned else self.aim(self.blocks_free)
        if (value := self.stepped_down(lo, hi)) is not None:
            return value
        low, high = self.blocks_free_bounds()
        if low >= high:  # the allocator's packing broke the line's order: halve the bracket
            return lo + 1 if hi is None else self.floor(lo, hi) + (hi - self.floor(lo, hi)) // 2
        return self.aim(math.sqrt(low * high))

    def stepped_down(self, lo: int | None, hi: int | None) -> int | None:
        """Where failures show the line misses the edge by more than its blocks free correct, a step down of its own.
        Before any fit, a failure far beyond the shared process's values (a long sequence: its slope, measured
        far below, was 9% low at 8192 tokens) steps ``FAR_STEP`` of the way back towards them, so that the next
        probe likely fits and its peak gives the slope where the edge is; after ``MISSES`` failures in a row,
        twice as far down as the last step (it walked down one value a probe, 13 probes for one answer); never
        below the middle of what is left above the largest fit. None while the line still aims."""
        if hi is None or self.outcomes[-1].fits:
            return None
        floor = self.floor(lo, hi)
        middle = floor + (hi - floor) // 2
        if lo is None and hi >= FAR_BEYOND * floor:
            return max(middle, hi - math.ceil(FAR_STEP * (hi - floor)))
        last = self.outcomes[-MISSES:]
        if len(last) < MISSES or any(o.fits for o in last) or last[-2].value <= last[-1].value:
            return None
        return max(middle, hi - 2 * (last[-2].value - last[-1].value))

    def floor(self, lo: int | None, hi: int) -> int:
        """The largest value known to fit below ``hi``: a fresh fit, else the shared process's largest value (its
        peaks are not a fresh run's, but they lie far under the cap), else the lower bound."""
        return lo if lo is not None else max((o.value for o in self.shared_values if o.fits and o.value < hi),
                                             default=self.lower)

    def unaimed_values(self, lo: int | None, hi: int | None) -> list[int]:
        """Without a line (no peaks: a CPU run): into the edge a shared process met, halving; else doubling from
        the lower bound until a value fails, then halving."""
        shared_lo, shared_hi = self.shared_edge()
        if lo is not None:
            if hi is None and shared_hi is not None and shared_hi > lo:  # up to where a shared process failed
                return [min(self.upper, lo + max(1, (shared_hi - lo) // 2))]
            return [min(self.upper, 2 * lo) if hi is None else (lo + hi) // 2]
        top = hi if hi is not None else shared_hi
        bottom = shared_lo if shared_lo is not None and (top is None or shared_lo < top) else None
        if top is None:
            return [bottom or self.lower]
        if bottom is None:
            return [max(self.lower, top // 2)]
        if top - bottom == 1:
            return [bottom] if hi is not None else [bottom, top]
        return [(bottom + top) // 2]

    def shared_edge(self) -> tuple[int | None, int | None]:
        """The largest value a shared process measured and the value it ran out of memory at, if it did."""
        return (max((o.value for o in self.shared_values if o.fits), default=None),
                min((o.value for o in self.shared_values if not o.fits), default=None))

    def line(self) -> tuple[float, float, float] | None:
        """(value, peak, slope) of the line that aims: through the largest value that fits, with the
        slope between it and the next largest where that one is near it (further down, a step's peak
        is the optimizer's, not the activations', so the line bends), else the model's; the shared process's
        slope before both, or the slope from that value to a fresh fit far beyond it. Before a probe fits, the line
        starts at the shared process's largest value."""
        lo, hi = self.largest_fit, self.smallest_failure
        points = sorted((o.value, o.peak_mib) for o in self.outcomes
                        if o.fits and o.peak_mib is not None and lo is not None and o.value <= lo)
        shared = [(o.value, o.peak_mib) for o in self.shared_values
                  if o.fits and o.peak_mib is not None and (hi is None or o.value < hi)]
        x2, y2 = (points or shared or [(None, None)])[-1]
        if x2 is None:
            return None
        # The shared process's values lie far apart: their slope is the surest, unless a fresh fit lies far beyond
        # them (a long sequence's edge: the slope there is the one measured across the gap, where the shared values'
        # own slope says activations already make their peaks; a single shared value at N = 1 is the optimizer's
        # transients, not the line); two probes' (often adjacent) only where there is neither.
        own = _slope(shared, SHARED_NEAR)
        far = [shared[-1], points[-1]] if own and points and points[-1][0] >= FAR_BEYOND * shared[-1][0] else []
        slope = _slope(far, 0.0) or own or _slope(points, 0.5) or self.slope_mib
        return (x2, y2, slope) if slope else None

    def aim(self, blocks_free: float) -> int:
        """The largest value whose peak on the line leaves ``blocks_free`` of its largest block free under the limit."""
        x, y, slope = self.line()
        return _meets(self.limit_mib, x, y, slope, blocks_free * self.block_mib)

    def predicted_peak(self, value: int) -> float | None:
        """The line's peak at ``value``: what a probe is expected to hold, so that probes that will
        stay well under the cap can run side by side on the GPU."""
        line = self.line()
        if line is None:
            return None
        x, y, slope = line
        return y + slope * (value - x)


def _meets(target: float, x: int, y: float, slope: float, free_per_unit: float) -> int:
    """The largest value v whose peak on the line through (x, y), y + slope (v - x), plus ``free_per_unit`` v
    left free for the step's largest block, stays within ``target``: the shared process's ladder and the probes
    aim alike."""
    return math.floor((target - y + slope * x) / (slope + free_per_unit))


def _slope(points: list[tuple[int, float]], near: float) -> float | None:
    """The slope between the two largest values, where the second is at least ``near`` of the largest and the
    peak grew; else None."""
    if len(points) < 2:
        return None
    (x1, y1), (x2, y2) = points[-2:]
    return (y2 - y1) / (x2 - x1) if x2 > x1 and x1 >= near * x2 and y2 > y1 else None


def outcome_said(outcome: Outcome | None) -> dict | None:
    return None if outcome is None else {"value": outcome.value, "fits": outcome.fits, "peak_mib": outcome.peak_mib,
                                         **outcome.detail}


# A round's probes, (search key, value) each, and the result of each; a key's probe that failed for a
# reason other than memory comes back as a string.
RoundRunner = Callable[[list[tuple[Hashable, int]]], dict[tuple[Hashable, int], "Outcome | str"]]


class Planner:
    """Which probes may start now, as the ones before them end: a search proposes its next value once none
    of its own is out; one in ``unready`` waits until its shared process has ended, and a follower
    (``leaders``: key -> (its leader's key, the values it is expected to fit beyond it)) until its leader has
    found its edge, where it starts (``Search.follow``). Each outcome's finished searches aim the others of
    their ``group`` (``aim_with_edges``)."""

    def __init__(self, searches: dict[Hashable, Search], group: Callable[[Hashable], Hashable] = lambda key: None,
                 unready: set | None = None, leaders: dict[Hashable, tuple[Hashable, int]] | None = None):
        self.searches, self.group = searches, group
        self.unready = set(unready or ())
        self.leaders = dict(leaders or {})
        self.out: set[tuple[Hashable, int]] = set()

    def ready(self, key: Hashable) -> None:
        self.unready.discard(key)

    def wanted(self) -> list[tuple[Hashable, int]]:
        """The probes to start now; each is out until ``took`` hears of it."""
        self.seed_followers()
        busy = {key for key, _ in self.out}
        new = [(key, value) for key, search in self.searches.items()
               if key not in busy and key not in self.unready
               and (key not in self.leaders or self.searches[self.leaders[key][0]].done)
               for value in search.next_values()]
        self.out.update(new)
        return new

    def seed_followers(self) -> None:
        """A follower whose leader has found its edge starts there, moved by what it holds less (or more); where
        the leader failed for another reason, it searches on its own, aimed by the leader's shared process."""
        for key, (leader, shift) in self.leaders.items():
            search, led = self.searches[key], self.searches[leader]
            if not led.done or search.seed is not None or search.outcomes or search.shared_values:
                continue
            if led.error is None:
                search.follow((led.largest_fit or led.lower) + shift)
            else:
                search.take_shared_values(led.shared_values)

    def took(self, key: Hashable, value: int, result: Outcome | str) -> None:
        self.out.discard((key, value))
        if isinstance(result, str):
            self.searches[key].stop(result)
        else:
            self.searches[key].record(result)
        aim_with_edges(self.searches, self.group)


def edge_blocks_free(search: Search) -> float | None:
    """How many of its largest block a finished search's edge left free: from the midpoint
    between its largest fit's peak and the line's peak one value above. None until both are known."""
    lo, hi, line = search.largest_fit, search.smallest_failure, search.line()
    if lo is None or hi != lo + 1 or line is None or not search.block_mib:
        return None
    x, y, slope = line
    return max(0.0, (search.limit_mib - y - slope / 2) / (search.block_mib * (lo + 0.5)))


def aim_with_edges(searches: dict[Hashable, Search], group: Callable[[Hashable], Hashable] = lambda key: None) -> None:
    """Aim every unfinished search with the edges the finished ones found under the same cap: the
    median of the largest blocks they left free, among those of its own group where there are any
    (one option set leaves much the same at every N and variant, another set not)."""
    blocks_free_by_group: dict[Hashable, list[float]] = {}
    for key, search in searches.items():
        if search.done and (free := edge_blocks_free(search)) is not None:
            blocks_free_by_group.setdefault(group(key), []).append(free)
    every = sorted(f for frees in blocks_free_by_group.values() for f in frees)
    for key, search in searches.items():
        frees = sorted(blocks_free_by_group.get(group(key), every))
        if frees and not search.done:
            search.blocks_free, search.learned = frees[len(frees) // 2], True


def run_searches(searches: dict[Hashable, Search], run_round: RoundRunner,
                 group: Callable[[Hashable], Hashable] = lambda key: None,
                 leaders: dict[Hashable, tuple[Hashable, int]] | None = None) -> int:
    """Every search to its end, a ``Planner``'s probes run a round at a time (the tests' driver; plan.py
    starts each probe as soon as the planner wants it); returns the rounds."""
    planner, rounds = Planner(searches, group, leaders=leaders), 0
    while wanted := planner.wanted():
        rounds += 1
        for (key, value), result in run_round(wanted).items():
            planner.took(key, value, result)
    return rounds


