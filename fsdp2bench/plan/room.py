"""Room on the GPU and the host for a plan's pieces: what each shared process and fresh probe is given, what it
holds at each stage, whether one may start or go on to its steps beside the others, and whether one that ran out
of memory was crowded out rather than capped (probes.py runs them; the module docstring there says why)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp2bench.run.concurrency import host_memory_for_launch

from fsdp2bench.memory.accounting import built_bytes, expected_device_bytes
from fsdp2bench.memory.estimate import GpuCap, host_bytes, step_bytes, variant_need
from fsdp2bench.names import MIB
from fsdp2bench.plan.search import SHARED_LIMIT, SHARED_MOST_MIB, Ladder, Outcome, Search
from measure import failed_allocation_mib, gpu_free_mib

if TYPE_CHECKING:
    from fsdp2bench.plan.probes import Question
    from fsdp2bench.run.session import Session
    from fsdp2bench.train.runner import TrainConfig

ROOM_MARGIN = 1.15  # on the line's peak, for a probe that runs beside others on the GPU
# Near the cap the allocator reserved up to 28% above the allocated peak (one H200, 80 GiB): a probe whose line
# puts it within that of the cap is given the whole cap, not the line's room.
NEAR_CAP_RESERVED = 1.3
SETUP_MARGIN, SETUP_SLACK_MIB = 1.5, 512  # on the memory model's state of a probe before its steps
WAITING_AT_LEAST = 2  # fresh probes set up and waiting at their gates, at least (a set-up takes about as long as the steps)
PHYSICAL_SLACK_MIB = 512  # free on the GPU beyond a refused allocation that says the cap refused it, not the GPU


@dataclass(kw_only=True)
class Probe:
    question_key: object
    question: Question
    value: int | None  # None until its search names it: a probe set up ahead, whose go will carry it
    room: int  # bytes of GPU it was given for its steps beside others (0 on a CPU run)
    alone: bool = False  # run again with the GPU to itself, after it ran out of memory beside others
    started_at: float = 0.0
    ended_at: float = 0.0
    result: Outcome | str | None = None
    setup_bytes: int = 0  # bytes of GPU it holds before its steps: estimated, then what it said at its gate
    ready_at: float | None = None  # when its parent saw it at its gate
    went_at: float | None = None  # when its parent let it go on to its steps
    ahead: bool = False  # started before its value was known (``PlanQueue``)

    def overlaps(self, other: Probe | SharedProcess) -> bool:
        return other is not self and self.started_at < other.ended_at and other.started_at < self.ended_at


@dataclass(kw_only=True)
class SharedProcess:
    """One answer's shared process (shared.py): the values it measured, and how it ended."""
    question_key: object
    question: Question
    ladder: Ladder
    room: int  # bytes of GPU it was given (its allocator limit and the context; 0 on a CPU run)
    started_at: float = 0.0
    ended_at: float = 0.0
    points: list[dict] = dataclasses.field(default_factory=list)
    error: str | None = None  # its out-of-memory error (the value after its points) or another failure
    setup_s: float | None = None

    overlaps = Probe.overlaps

    def as_dict(self, t0: float) -> dict:
        return {"room_mib": self.room / MIB, "started_s": self.started_at - t0,
                "wall_s": self.ended_at - self.started_at,
                "setup_s": self.setup_s,
                "values": [p["value"] for p in self.points], "error": self.error}


@dataclass
class GpuRoom:
    """The GPU and host accounting of one plan (no torch: the session's device and the memory model say it)."""
    session: Session
    train: TrainConfig
    cap: GpuCap | None
    questions: dict
    searches: dict[object, Search]
    leaders: dict[object, tuple[object, int]]

    def shared_room(self, key) -> int:
        """A shared process's allocator limit is ``SHARED_LIMIT`` of a probe's (at most ``SHARED_MOST_MIB``), or
        what the memory model says its first value needs where that is more (the state of a rank of a small world);
        its room is that and the context."""
        if self.cap is None or self.session.device.type != "cuda":
            return 0
        question, search = self.questions[key], self.searches[key]
        first = variant_need(self.session.shapes, question.world_size, question.variant, question.options,
                             step_bytes(*question.batch_and_block(search.lower), self.session.config,
                                        question.options))
        usual = min(self.cap.allocator_bytes * SHARED_LIMIT, SHARED_MOST_MIB * MIB)
        limit = max(int(usual), first - self.cap.context)
        return min(self.cap.allocator_bytes, limit) + self.cap.context

    def probe_room(self, key, value: int) -> int:
        """Bytes of GPU a probe is given: the cap, or less where its search expects it to stay well
        under (the line's peak with a margin, its leader's for a follower, or the calibrated estimate for a first
        probe)."""
        if self.cap is None or self.session.device.type != "cuda":
            return 0
        question, search = self.questions[key], self.searches[key]
        predicted = search.predicted_peak(value)
        if predicted is None and key in self.leaders:  # a follower: its probes are near its leader's edge
            predicted = self.searches[self.leaders[key][0]].predicted_peak(value)
        if predicted is not None:
            near_cap = predicted * MIB * NEAR_CAP_RESERVED + self.cap.context >= self.cap.process_bytes
            expected = self.cap.process_bytes if near_cap else int(predicted * MIB * ROOM_MARGIN) + self.cap.context
        else:
            expected = variant_need(self.session.shapes, question.world_size, question.variant, question.options,
                                    step_bytes(*question.batch_and_block(value), self.session.config,
                                               question.options))
        return min(self.cap.process_bytes, expected)

    def setup_bytes(self, key) -> int:
        """Bytes of GPU a fresh probe holds before its steps, as the memory model has it with a margin (its
        sharded parameters, the model itself while it is built there, the context): what it says at its gate
        replaces it."""
        if self.cap is None or self.session.device.type != "cuda":
            return 0
        q, shapes = self.questions[key], self.session.shapes
        state = expected_device_bytes(shapes, q.world_size, q.rank, q.variant, "end_of_setup", q.options, "cuda")
        built = int(built_bytes(shapes) * 1.2) if self.train.init_device == "cuda" else 0
        return max(built, int(state * SETUP_MARGIN)) + SETUP_SLACK_MIB * MIB + self.cap.context

    @staticmethod
    def holding(item: Probe | SharedProcess) -> int:
        """What a piece may hold on the GPU now: a fresh probe before its go its set-up, after it its room."""
        return item.room if isinstance(item, SharedProcess) or item.went_at is not None else item.setup_bytes

    def may_start(self, item: Probe | SharedProcess, live: list[Probe | SharedProcess]) -> bool:
        """Whether ``item`` can start beside the pieces ``live``: the GPU holds its set-up (a shared process's
        whole room), the host its process, and the fresh probes set up and waiting could all go on to their
        steps, one at a time, once the others have ended (so that none waits for ever); as many wait as
        could step at once on the whole GPU, or ``WAITING_AT_LEAST`` where that is fewer."""
        if self.session.device.type != "cuda" or self.cap is None:
            # A CPU run: one piece at a time (beside one another they would only split the cores), and beside
            # it the probe set up ahead of its value where the host holds both
            return isinstance(item, Probe) and item.value is None and len(live) == 1 and self.host_holds(item, live)
        held = sum(self.holding(o) for o in live)
        gpu = held + self.holding(item) <= self.cap.total
        if isinstance(item, Probe):
            pending = [o for o in live if isinstance(o, Probe) and o.went_at is None] + [item]
            gpu = gpu and sum(o.setup_bytes for o in pending) \
                + max(o.room - o.setup_bytes for o in pending) <= self.cap.total \
                and (len(pending) <= WAITING_AT_LEAST or sum(o.room for o in pending) <= self.cap.total)
        return gpu and self.host_holds(item, live) and len(live) < self.train.build_threads

    def host_holds(self, item: Probe | SharedProcess, live: list[Probe | SharedProcess]) -> bool:
        """Whether the host holds ``item``'s process beside the pieces ``live`` (each counted as large)."""
        host = (len(live) + 1) * host_bytes(self.session.shapes, item.question.world_size, [item.question.variant],
                                            self.train.init_device, item.question.options, self.session.device.type)
        return host <= host_memory_for_launch()

    def may_go(self, probe: Probe, live: list[Probe | SharedProcess]) -> bool:
        """Whether a probe at its gate can go on to its steps: the GPU holds its room beside what the others
        hold (one run again alone started with the GPU to itself)."""
        if self.session.device.type != "cuda" or self.cap is None:
            # one steps at a time
            return not any(isinstance(o, SharedProcess) or o.went_at is not None for o in live if o is not probe)
        if probe.alone:
            return True
        return sum(self.holding(o) for o in live if o is not probe) + probe.room <= self.cap.total

    def crowded_out(self, probe: Probe, beside: list[Probe | SharedProcess]) -> bool:
        """Ran out of memory beside others where it may have found the GPU full before its cap: torch's message
        says the GPU had less free than the allocation (more free: its own limit refused it); without that
        figure, its room was less than the cap, or a probe beside it may have held more than its own room."""
        if not isinstance(probe.result, Outcome) or probe.result.fits or probe.alone:
            return False
        error = probe.result.detail.get("error", "")
        free, tried = gpu_free_mib(error), failed_allocation_mib(error)
        if free is not None and tried is not None:
            return free < tried + PHYSICAL_SLACK_MIB
        if not beside or (self.cap and (len(beside) + 1) * self.cap.process_bytes <= self.cap.total):
            return False  # each held to its cap, they could not all reach it and fill the GPU
        return not self.kept_to_room(probe) or not all(self.kept_to_room(o) for o in beside)

    def kept_to_room(self, probe: Probe | SharedProcess) -> bool:
        if self.cap is None or isinstance(probe, SharedProcess):
            return True  # a shared process's allocator limit is its room
        if probe.room >= self.cap.process_bytes:
            return True  # the cap itself holds it there
        result = probe.result
        return isinstance(result, Outcome) and result.fits and result.detail.get("peak_reserved_mib") is not None and \
            result.detail["peak_reserved_mib"] * MIB + self.cap.context <= probe.room
