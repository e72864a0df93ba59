"""A probe: one simulated rank, in a fresh process, trained a few steps at one batch and block under
the memory cap; it fits when it completes. Before any probe, one shared process per answer (shared.py)
measures a ladder of values below the cap: its line aims the first probes. This module runs both kinds,
each as soon as its search wants it (search.Planner) and the GPU holds it beside the others.

A fresh probe holds little while it sets up (the process, the context, its shard of the model): it starts
as soon as that fits, then waits at a gate until the GPU has the room of its steps, so that the set-ups of
some overlap the steps of others, and until its search names its value: a search's next probe sets up while
the one before steps (``PlanQueue``). A probe that is expected to stay well under the cap (the line of its
search says so) is given the room of that expectation plus a margin, so that several run side by side on the GPU; one
that may reach the cap is given the whole cap. A probe that ran out of memory where the GPU itself was
full (torch's message says what was free) may have been crowded out, not capped: it is run again alone,
and only what it finds then counts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

import torch

from fsdp2bench.memory.accounting import expected_state
from fsdp2bench.memory.estimate import GpuCap, activation_bytes_per_token, variant_need
from fsdp2bench.names import MIB, PEAK_PHASES, phases
from fsdp2bench.options.fsdp import OPTION_SETS, FsdpOptions
from fsdp2bench.options.step import largest_block_per_token
from fsdp2bench.plan.room import GpuRoom, Probe, SharedProcess
from fsdp2bench.plan.search import Ladder, Outcome, Planner, Search
from fsdp2bench.plan.shared import AtValue, SharedJob, point_key, run_shared_process
from fsdp2bench.processes.isolation import STAND_DOWN, Piece, StoreKeys, gather_records, has_keys, run_queue
from fsdp2bench.report.summary import memory_summary
from fsdp2bench.run.session import Session
from fsdp2bench.train.runner import Job, TrainConfig, probe_process
from measure import HELD_AT_FAILURE

# How many of a step's largest block (the fp32 logits) a search's first aim leaves free under the limit: the
# middle of what the 1.5B model's edges left on one H200 (search.BLOCKS_FREE_BOUNDS; a plan's finished answers then aim
# the others of their option set with what they found).
BLOCKS_FREE = 0.7
BLOCK_STEP = 64  # tokens: a searched block is a multiple of it (a finer edge is not a length people train at)
BATCH, BLOCK, LAYOUT = "batch_size", "block_size", "layout"


@dataclass(frozen=True)
class Question:
    """One answer to find: the largest ``searched`` value for a variant, playing ``rank`` of a world
    of ``world_size`` under an option set, the other of batch and block held fixed."""
    option_set: str
    world_size: int
    rank: int
    variant: str
    searched: str  # BATCH or BLOCK
    fixed: int  # the block size while the batch is searched, the batch size while the block is
    # What the set's options are put over: the loop and the loss asked for, and the user's accelerate config.
    base: FsdpOptions = FsdpOptions()

    @property
    def options(self) -> FsdpOptions:
        return self.base.over(OPTION_SETS[self.option_set].changed())

    @property
    def unit(self) -> int:
        """Tokens per step of a searched block: ``BLOCK_STEP`` tokens, and a multiple of 2C under CP, whose load
        balancing cuts each sequence into 2C chunks (the search counts these steps; 1 for a batch)."""
        return block_step(self.options) if self.searched == BLOCK else 1

    def batch_and_block(self, value: int) -> tuple[int, int]:
        """The batch and block of the search's ``value`` (in ``unit`` steps)."""
        return (value, self.fixed) if self.searched == BATCH else (self.fixed, value * self.unit)

    def tokens_per_rank_per_step(self, value: int) -> int:
        batch, block = self.batch_and_block(value)
        return self.options.gradient_accumulation_steps * batch * block

    @property
    def title(self) -> str:
        """The answer's name: its set, N and variant, and the value held fixed."""
        return f"{self.option_set} N={self.world_size} {self.variant} {'L' if self.searched == BATCH else 'B'}={self.fixed}"

    def label(self, value: int) -> str:
        batch, block = self.batch_and_block(value)
        return f"{self.option_set} N={self.world_size} {self.variant} B={batch} L={block}"


def block_step(options: FsdpOptions) -> int:
    """The tokens a searched block moves by: ``BLOCK_STEP``, and a multiple of CP's 2C."""
    return math.lcm(BLOCK_STEP, options.layout.sequence_divisor)


def heaviest_rank(shapes, world_size: int, variant: str, options: FsdpOptions) -> int:
    """Rank 0, or the last rank where the sharding rule gives it more at a peak (it never does for
    torch's even chunks, but a model whose rows do not divide N can)."""
    def held(rank: int) -> int:
        return max(sum(expected_state(shapes, world_size, rank, variant, phase, options).values())
                   for phase in PEAK_PHASES if phase in phases(options.accumulates))
    return world_size - 1 if held(world_size - 1) > held(0) else 0


def search_for(question: Question, lower: int, upper: int, cap: GpuCap | None, config) -> Search:
    """A search aimed under the cap, at what the memory model says one more unit of the value adds
    (no aim on a CPU run: no cap, no allocator)."""
    if cap is None:
        return Search(lower, upper)
    # Per step of the value searched: its tokens times the other of batch and block; a cp rank holds 1/C of them.
    tokens = question.unit * question.fixed / question.options.layout.cp_size
    per_unit = activation_bytes_per_token(config, question.options) * tokens
    block = largest_block_per_token(question.options.step, config) * tokens
    return Search(lower, upper, cap.allocator_bytes / MIB, per_unit / MIB, block / MIB, BLOCKS_FREE)


def slow_first(options: FsdpOptions) -> tuple[bool, bool]:
    """Sets with CPU offload (AdamW on the host), then activation checkpointing (each block run twice) before the
    others: their steps take longest and their batches are larger, so their searches are a plan's longest
    chains (on one H200 under 24 GiB, `all` at N = 8 was the last answer, 30 s after any other set's)."""
    return not options.cpu_offload, not options.checkpoints


def leaders_of(questions: dict, searches: dict[object, Search], shapes) -> dict[object, tuple[object, int]]:
    """Each answer after the first of its option set, N and fixed value (another variant): that first answer, its
    leader, and the values it is expected to fit beyond the leader's edge (what the memory model says it holds
    less, over the search's slope). It needs no shared process: it starts at the leader's edge."""
    first: dict = {}
    leaders = {}
    for key, q in questions.items():
        cell = (q.option_set, q.world_size, q.searched, q.fixed)
        if first.setdefault(cell, key) == key:
            continue
        lead, slope = questions[first[cell]], searches[key].slope_mib
        held = {question: variant_need(shapes, question.world_size, question.variant, question.options, 0)
                for question in (lead, q)}
        leaders[key] = (first[cell], round((held[lead] - held[q]) / MIB / slope) if slope else 0)
    return leaders


@dataclass
class ProbeRunner:
    """Runs plan.py's shared processes and probes on this process's device (``run_plan``).
    ``inject_oom_above``: a test option, every value above it raises torch's out-of-memory error at once."""
    session: Session
    train: TrainConfig  # every probe's, less its options and injected failure
    tokens: torch.Tensor
    questions: dict
    searches: dict[object, Search]
    cap: GpuCap | None
    output_dir: str
    inject_oom_above: int | None = None
    leaders: dict[object, tuple[object, int]] = dataclasses.field(default_factory=dict)  # leaders_of
    probes: list[Probe] = dataclasses.field(default_factory=list)
    shared_processes: dict[object, SharedProcess] = dataclasses.field(default_factory=dict)
    t0: float = dataclasses.field(default_factory=time.monotonic)  # the plan's start, for each piece's start time
    stood_down: list[Probe] = dataclasses.field(default_factory=list)  # set up ahead, and no value came
    ahead_count: itertools.count = dataclasses.field(default_factory=itertools.count)
    gpu: GpuRoom = dataclasses.field(init=False)  # the room each piece is given and holds

    def __post_init__(self) -> None:
        self.gpu = GpuRoom(self.session, self.train, self.cap, self.questions, self.searches, self.leaders)

    def run_plan(self, planner: Planner, after: Callable[[], None]) -> None:
        """A shared process per answer that leads (the followers start at its edge), then the fresh probes the
        planner wants as each piece ends (``PlanQueue``); ``after()`` is told after each piece. The sets whose
        steps take longest start first (``slow_first``)."""
        queue = PlanQueue(self, planner, after)
        for key in sorted(self.searches, key=lambda key: slow_first(self.questions[key].options)):
            if key not in self.leaders:
                room = self.gpu.shared_room(key)
                queue.add(SharedProcess(question_key=key, question=self.questions[key], ladder=self.ladder(key, room),
                                        room=room))
        run_queue(queue.pieces, queue.next_piece, 0, self.session.store, self.session.device, queue.started,
                  queue.ended, queue.let_go)

    def shared_records(self) -> dict:
        """Each shared process as plan.json holds it, its start counted from the plan's."""
        return {key: shared.as_dict(self.t0) for key, shared in self.shared_processes.items()}

    def piece(self, item: Probe | SharedProcess) -> Piece:
        if isinstance(item, SharedProcess):
            job = self.shared_job(item)
            return Piece(run_shared_process, (job,), job.keys)
        job = self.job(item)
        return Piece(probe_process, (job,), job.keys, gated=job.gated)

    def took_probe(self, probe: Probe, job: Job, failure: str | None, beside: list) -> bool:
        """A probe's outcome, kept and said; False where it ran out of memory beside others that may have
        crowded it out (it is then run again alone)."""
        probe.result = probe_outcome(probe, job, failure, self.session, self.t0)
        if isinstance(probe.result, Outcome):
            probe.result.detail["ran_beside"] = len(beside)
        self.probes.append(probe)
        self.say(probe)
        return not self.gpu.crowded_out(probe, beside)

    # ----------------------------------------------------------------- the shared processes

    def ladder(self, key, room: int) -> Ladder:
        """The values of ``key``'s shared process, under its own allocator limit: ``room`` less the context."""
        search = self.searches[key]
        limit = (room - self.cap.context) / MIB if room else None
        return Ladder(search.lower, search.upper, limit, search.slope_mib, self.inject_oom_above,
                      search.block_mib * search.blocks_free)

    def shared_job(self, shared: SharedProcess) -> SharedJob:
        q, s = shared.question, self.session
        name = f"{q.option_set}_N{q.world_size}_{q.variant}_{'L' if q.searched == BATCH else 'B'}{q.fixed}_shared"
        directory = os.path.join(self.output_dir, "probes", name)
        os.makedirs(directory, exist_ok=True)
        limit = shared.room - self.cap.context if shared.room else self.train.allocator_limit
        train = dataclasses.replace(self.train, options=q.options, allocator_limit=limit)
        meta = {"run_id": s.run_id, "rank": q.rank, "world_size": q.world_size, "simulated": True,
                "shared": dataclasses.asdict(q)}
        no_batches = self.tokens[:0]  # the child makes each value's own
        return SharedJob(name=q.variant, train=train, device=s.device, config=s.config, batches=no_batches,
                         layer_classes=s.layer_classes, meta=meta, rank=q.rank, world_size=q.world_size,
                         keys=StoreKeys(f"probe/{name}"), output_dir=directory, simulated=True, question=q,
                         ladder=shared.ladder, tokens=self.tokens)

    def take_shared_process(self, shared: SharedProcess, job: SharedJob, failure: str | None) -> None:
        """What a shared process measured (its points are in the store even when it failed), given to its search:
        an out-of-memory error is the ladder's next value not fitting, in that process."""
        shared.ended_at = time.monotonic()
        store, i = self.session.store, 0
        while has_keys(store, [point_key(job, i)]):
            shared.points.append(json.loads(store.get(point_key(job, i))))
            i += 1
        shared.error = failure
        if failure is None:
            shared.setup_s = gather_records(store, job.keys, [job.rank])[0].get("setup_s")
        outcomes = [Outcome(p["value"], True, p["peak_allocated_mib"], {"kind": "shared", **p}) for p in shared.points]
        search = self.searches[shared.question_key]
        if failure is not None and "out of memory" in failure:
            above = shared.ladder.next_value([(p["value"], p["peak_allocated_mib"]) for p in shared.points])
            outcomes.append(Outcome(above, False, None, {"kind": "shared", "error": failure}))
        elif failure is not None:  # as a probe's: any failure but memory ends the answer with its reason
            search.stop(f"{shared.question.title} (its shared process): {failure}")
        search.take_shared_values(outcomes)
        self.shared_processes[shared.question_key] = shared
        values = ", ".join(f"{p['value']}: {p['peak_allocated_mib']:.0f} MiB" if p["peak_allocated_mib"] is not None
                           else str(p["value"]) for p in shared.points)
        print(f"[shared] {shared.question.title}: {values or 'nothing measured'}"
              + (f"; {failure}" if failure else ""), flush=True)

    # ----------------------------------------------------------------- running

    def job(self, probe: Probe) -> Job:
        """A fresh probe's process, its value named at its gate (``shared.AtValue``); its directory is named by
        the value, or, set up ahead of it, by its place until the value is known (``file_probe``)."""
        q, s = probe.question, self.session
        name = self.probe_name(probe) if probe.value is not None else \
            f"{q.option_set}_N{q.world_size}_{q.variant}_{'L' if q.searched == BATCH else 'B'}{q.fixed}_ahead" \
            f"{next(self.ahead_count)}"
        directory = os.path.join(self.output_dir, "probes", name)
        os.makedirs(directory, exist_ok=True)
        meta = {"run_id": s.run_id, "rank": q.rank, "world_size": q.world_size, "simulated": True,
                "probe": dataclasses.asdict(q)}
        return Job(name=q.variant, train=dataclasses.replace(self.train, options=q.options), device=s.device,
                   config=s.config, batches=self.tokens[:0], layer_classes=s.layer_classes, meta=meta, rank=q.rank,
                   world_size=q.world_size, keys=StoreKeys(f"probe/{name}"), output_dir=directory, simulated=True,
                   gated=True, at_go=AtValue(self.tokens, q, self.inject_oom_above))

    def probe_name(self, probe: Probe) -> str:
        q = probe.question
        batch, block = q.batch_and_block(probe.value)
        return f"{q.option_set}_N{q.world_size}_{q.variant}_B{batch}_L{block}" + ("_alone" if probe.alone else "")

    def file_probe(self, probe: Probe, job: Job, failure: str | None) -> None:
        """A probe set up ahead of its value, ended: its directory named by the value it ran at; stood down before
        it had one, removed (plan.json counts it)."""
        if probe.value is None:
            if failure is None:
                shutil.rmtree(job.output_dir, ignore_errors=True)
            return
        named = os.path.join(self.output_dir, "probes", self.probe_name(probe))
        if named != job.output_dir and not os.path.exists(named):
            os.rename(job.output_dir, named)

    def say(self, probe: Probe) -> None:
        result = probe.result
        if isinstance(result, str):
            what = f"FAILED: {result}"
        elif result.fits:
            what = "fits" + (f", {result.detail['peak_reserved_mib']:.0f} MiB reserved, {result.peak_mib:.0f} "
                             f"allocated" if result.peak_mib is not None else "")
        else:
            what = f"out of memory (after {result.detail.get('phase')})"
        alone = " (again, alone)" if probe.alone else ""
        print(f"[probe] {probe.question.label(probe.value)}{alone}: {what}", flush=True)


class Turn(IntEnum):
    """Where a piece waits in a plan's queue: a lower turn starts first."""
    ALONE = 0  # a probe run again alone, after it ran out of memory beside others: nothing starts before it
    NAMED = 1  # a probe whose value its search has named
    SHARED = 2  # an answer's shared process
    AHEAD = 3  # a probe set up ahead of its value


@dataclass
class PlanQueue:
    """A plan's pieces as ``run_queue`` starts them and lets them go, in the order of ``queue_order`` (``Turn``).

    While a probe steps, its search's next probe is set up beside it (unless either outcome ends the search),
    and so is a follower's first where the probe may end its leader's search; a leader's first is set up while
    its shared process runs. Each waits at its gate until the piece it awaits has ended: then its go names
    the value the search wants, or stands it down where the search wants none. A chain of probes so waits for
    one set-up, not one per link, and a probe set up ahead only ever waits on a piece that is running, so
    none waits for ever.

    A probe's life, each step stamped on it (``*_at``)::

        waiting --start--> setting up --at its gate (ready_at)--> held --let go (went_at)--> stepping --> ended
                                                             `--no value wanted--> stood down
        ended out of memory beside others --> a new probe of the same value, alone (Turn.ALONE)
    """
    runner: ProbeRunner
    planner: Planner
    after: Callable[[], None]
    items: list[Probe | SharedProcess] = dataclasses.field(default_factory=list)
    pieces: list[Piece | None] = dataclasses.field(default_factory=list)  # each made as it starts (``start``)
    waiting: list[int] = dataclasses.field(default_factory=list)  # not started, in the order they may start
    ahead: dict[object, int] = dataclasses.field(default_factory=dict)  # a search's probe set up ahead of its value

    def add(self, item: Probe | SharedProcess) -> int:
        self.items.append(item)
        self.pieces.append(None)
        self.enqueue(len(self.items) - 1)
        return len(self.items) - 1

    def enqueue(self, i: int) -> None:
        """Into the queue in its order (``queue_order``), after those of the same order."""
        order = self.queue_order(i)
        self.waiting.insert(next((j for j, w in enumerate(self.waiting) if self.queue_order(w) > order),
                                 len(self.waiting)), i)

    def queue_order(self, i: int) -> tuple:
        """A probe to run again alone, then probes with a value, shared processes, probes set up ahead; within
        each, the sets whose steps take longest first (``slow_first``: their searches are the longest chains)."""
        item = self.items[i]
        return (turn_of(item), *slow_first(item.question.options))

    def next_piece(self, running: list[int]) -> int | None:
        self.name_values()
        self.set_up_ahead(running)
        live = [self.items[r] for r in running]
        if any(isinstance(o, Probe) and o.alone for o in live):
            return None  # one run again alone has the GPU to itself
        alone = [i for i in self.waiting if isinstance(self.items[i], Probe) and self.items[i].alone]
        if alone:  # nothing else starts before it
            return None if live else self.start(alone[0])
        i = next((i for i in self.waiting if not live or self.runner.gpu.may_start(self.items[i], live)), None)
        return None if i is None else self.start(i)

    def start(self, i: int) -> int:
        """Out of the queue, its process made now: one dropped before it starts leaves no directory, and one
        named before it starts is filed by its value from the first."""
        self.waiting.remove(i)
        self.pieces[i] = self.runner.piece(self.items[i])
        return i

    def name_values(self) -> None:
        """Each value the planner wants now, to its search's probe set up ahead where there is one (it leaves the
        back of the queue if it has not started), else to a new probe."""
        for key, value in self.planner.wanted():
            i = self.ahead.pop(key, None)
            if i is None:
                self.add(Probe(question_key=key, question=self.runner.questions[key], value=value,
                               room=self.runner.gpu.probe_room(key, value),
                               setup_bytes=self.runner.gpu.setup_bytes(key)))
                continue
            self.items[i].value, self.items[i].room = value, self.runner.gpu.probe_room(key, value)
            if i in self.waiting:
                self.waiting.remove(i)
                self.enqueue(i)

    def set_up_ahead(self, running: list[int]) -> None:
        """A probe set up ahead for each search that awaits a running piece; one no longer awaited that has not
        started leaves the queue."""
        awaited = self.awaited(running)
        for key, i in [(key, i) for key, i in self.ahead.items() if key not in awaited and i in self.waiting]:
            self.waiting.remove(i)
            del self.ahead[key]
        runner = self.runner
        for key in awaited - set(self.ahead):
            room = runner.cap.process_bytes if runner.cap and runner.session.device.type == "cuda" else 0
            self.ahead[key] = self.add(Probe(question_key=key, question=runner.questions[key], value=None, room=room,
                                             setup_bytes=runner.gpu.setup_bytes(key), ahead=True))

    def awaited(self, running: list[int]) -> set:
        """The searches whose next probe may be wanted once a piece running now ends: a leader's while its shared
        process runs, and those a stepping probe may move (``moved_by``); none while a probe waits to run
        again alone."""
        items = [self.items[i] for i in [*running, *self.waiting]]
        if any(isinstance(o, Probe) and o.alone for o in items):
            return set()
        keys = set()
        for item in (self.items[r] for r in running):
            if isinstance(item, SharedProcess):
                keys.add(item.question_key)
            elif item.went_at is not None and item.value is not None:
                keys |= moved_by(item, self.runner.searches, self.runner.leaders)
        return {key for key in keys if not self.runner.searches[key].done}

    def started(self, i: int) -> None:
        self.items[i].started_at, self.items[i].ended_at = time.monotonic(), math.inf

    def let_go(self, i: int, held: str, running: list[int]) -> str | None:
        """A probe at its gate: its value once named and the GPU holds its room; stood down where it was set up
        ahead and its search awaits nothing now."""
        probe, runner = self.items[i], self.runner
        probe.ready_at = probe.ready_at or time.monotonic()
        probe.setup_bytes = int(held) + (runner.cap.context if runner.cap else 0)
        if probe.value is None:
            if probe.question_key in self.awaited(running):
                return None
            if self.ahead.get(probe.question_key) == i:
                del self.ahead[probe.question_key]
            return STAND_DOWN
        if not runner.gpu.may_go(probe, [self.items[r] for r in running]):
            return None
        probe.went_at = time.monotonic()
        return str(probe.value)

    def ended(self, i: int, failure: str | None) -> None:
        item, job, runner = self.items[i], self.pieces[i].args[0], self.runner
        item.ended_at = time.monotonic()
        if isinstance(item, SharedProcess):
            runner.take_shared_process(item, job, failure)
            self.planner.ready(item.question_key)
        elif item.value is None:
            self.end_ahead(i, item, job, failure)
        else:
            runner.file_probe(item, job, failure)
            if runner.took_probe(item, job, failure, [o for o in self.items if item.overlaps(o)]):
                self.planner.took(item.question_key, item.value, item.result)
            else:
                self.add(Probe(question_key=item.question_key, question=item.question, value=item.value,
                               room=runner.cap.process_bytes, alone=True, setup_bytes=item.setup_bytes))
        self.name_values()
        self.after()

    def end_ahead(self, i: int, probe: Probe, job: Job, failure: str | None) -> None:
        """A probe set up ahead that ended before a value came: stood down, or failed in its set-up. Out of memory
        there it was crowded out (no answer's); any other failure ends its search, if it still runs, with the
        reason, as a probe's would."""
        if self.ahead.get(probe.question_key) == i:
            del self.ahead[probe.question_key]
        self.runner.file_probe(probe, job, failure)
        self.runner.stood_down.append(probe)
        search = self.runner.searches[probe.question_key]
        if failure is not None and "out of memory" not in failure and not search.done:
            search.stop(f"{probe.question.title} (set up ahead): {failure}")


def turn_of(item: Probe | SharedProcess) -> Turn:
    if isinstance(item, SharedProcess):
        return Turn.SHARED
    return Turn.ALONE if item.alone else Turn.NAMED if item.value is not None else Turn.AHEAD


def moved_by(probe: Probe, searches: dict[object, Search], leaders: dict[object, tuple[object, int]]) -> set:
    """The searches whose next probe a stepping probe may call for: its own, unless either outcome ends it; the
    followers not yet started of a search it may end."""
    key = probe.question_key
    ends_if_fits, ends_if_not = searches[key].settled_by(probe.value)
    keys = set() if ends_if_fits and ends_if_not else {key}
    if ends_if_fits or ends_if_not:
        keys |= {f for f, (leader, _) in leaders.items() if leader == key and not searches[f].outcomes}
    return keys


def probe_outcome(probe: Probe, job: Job, failure: str | None, session: Session, t0: float) -> Outcome | str:
    """Fits, with its peaks; out of memory, with where it stood; or the other failure, as a string."""
    q, store = probe.question, session.store
    common = {"kind": "fresh", "attempt": int(probe.alone), "room_mib": probe.room / MIB,
              "started_s": probe.started_at - t0, "wall_s": probe.ended_at - probe.started_at,
              "set_up_s": probe.ready_at - probe.started_at if probe.ready_at is not None else None,
              "waited_s": probe.went_at - probe.ready_at if probe.went_at is not None else None,
              "set_up_mib": probe.setup_bytes / MIB,
              "set_up_ahead": probe.ahead}
    if failure is None:
        record, = gather_records(store, job.keys, [q.rank])
        summary = memory_summary(q.variant, [record], session.shapes, q.world_size, [q.rank],
                                        q.options, session.device.type)
        return Outcome(probe.value, True, summary["peak_allocated_mib"]["max"], {
            **common, "peak_reserved_mib": summary["peak_reserved_mib"]["max"],
            "peak_allocated_mib": summary["peak_allocated_mib"]["max"],
            "training_peak_reserved_mib": summary["training_peak_reserved_mib"]["max"],
            "training_peak_allocated_mib": summary["training_peak_allocated_mib"]["max"],
            "peak_rss_mib": summary["peak_rss_mib"]["max"], "median_step_time_s": summary["median_step_time_s"],
            "speed": summary["speed"],  # a probe beside another on the GPU has none: speed.not_measured says so
            "emulated": (summary.get("emulated") or [None])[0],  # --emulate_communication: each kind's calls, bytes, s
            "accounting_matches_expected": summary["accounting_matches_expected"],
            "state_bytes": summary["accounting"][0]["before_zero_grad"],  # the last step's, rank q.rank's
            **({"frozen_base": summary["frozen_base"][0],  # a LoRA base: its chunk, and no gradient or state
                "frozen_base_as_expected": summary["frozen_base_as_expected"]} if "frozen_base" in summary else {}),
            "kept_output_bytes": summary["kept_output_bytes"][0]["before_zero_grad"],
            "train_wall_s": record["wall_s"], "build_s": _event(record, "model_built").get("build_s")})
    if "out of memory" not in failure:
        return f"{q.label(probe.value)}: {failure}"
    where = {}
    if has_keys(store, [job.keys.record(q.rank)]):
        where = gather_records(store, job.keys, [q.rank])[0].get("failure", {})
    return Outcome(probe.value, False, where.get("peak_allocated_mib_so_far"), {
        **common, "error": failure, "phase": where.get("last_event"), "steps_done": where.get("steps_done"),
        **{k: where.get(k) for k in ("failed_allocation_mib", *HELD_AT_FAILURE)}})


def _event(record: dict, name: str) -> dict:
    return next((e for e in record["events"] if e["name"] == name), {})
