"""Measure one rank of a world of N ranks with a single process: ``--simulate_world_size``.

torch's "fake" process-group backend accepts every collective and moves no data, while every
tensor is real and comes from the real allocator: the model, FSDP2's sharded parameters and its
all-gather and reduce-scatter buffers, gradients, AdamW state, activations. So one process can
play rank R of a world of N and its memory at N is measured, not estimated; its losses mean
nothing (parameters are never really gathered). A sweep is a list of (N, rank, variant) runs,
each in a fresh process as usual; they need no peers, so the launch's processes share them out.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from fsdp2bench.cli import UserError
from fsdp2bench.memory.accounting import expected_state
from fsdp2bench.names import phases, simulated_dir_name
from fsdp2bench.options.fsdp import FsdpOptions
from fsdp2bench.options.layout import Degrees, Meshes, build_meshes
from fsdp2bench.processes.isolation import (INTERRUPTED, Interrupted, Piece, StoreKeys, failed, run_queue, status_of,
                                            wait_for_keys)

FAKE_GROUP_MODULE = "torch.testing._internal.distributed.fake_pg"
DEFAULT_STEPS = 10  # memory settles after the first optimizer step; losses mean nothing here
LAST = "last"
NOT_RUN = "not run"  # a run the sweep never started (interrupted before its turn)


@dataclass(frozen=True)
class SimulatedRun:
    """One variant, playing rank ``rank`` of a world of ``world_size``; ``alone``: its second attempt, with the
    GPU to itself, after it ran out of memory beside other runs."""
    world_size: int
    rank: int
    variant: str
    alone: bool = False

    @property
    def label(self) -> str:
        return f"simulated N={self.world_size}, rank {self.rank}"

    @property
    def keys(self) -> StoreKeys:
        return StoreKeys(f"simulated/N{self.world_size}/r{self.rank}/{self.variant}" + ("/alone" if self.alone else ""))

    @property
    def first(self) -> SimulatedRun:
        """The run as planned: the keys its outcome is posted under, whichever attempt ended it."""
        return dataclasses.replace(self, alone=False)


def world_size_dir(output_dir: str, world_size: int) -> str:
    """Traces of every rank played at N go to ``<output_dir>/simulated_N<N>/``, named as in a real run."""
    return os.path.join(output_dir, simulated_dir_name(world_size))


# --------------------------------------------------------------------------- command line

def _integers(text: str, flag: str, allow_last: bool = False) -> list:
    values = []
    for part in (p.strip() for p in text.split(",")):
        if allow_last and part == LAST:
            values.append(LAST)
            continue
        try:
            values.append(int(part))
        except ValueError:
            wanted = "integers or 'last'" if allow_last else "integers"
            raise UserError(f"{flag}: expected comma-separated {wanted}, got {part!r}") from None
    if len(set(values)) != len(values):
        raise UserError(f"{flag}: a value is given twice")
    return values


MAX_WORLD_SIZE = 1 << 16  # the device mesh of a simulated rank lists every rank


def parse_world_sizes(text: str, flag: str = "--simulate_world_size") -> list[int]:
    """The world sizes of a sweep, smallest first."""
    sizes = _integers(text, flag)
    if any(n < 1 for n in sizes):
        raise UserError(f"{flag}: every N must be at least 1, got {text}")
    if max(sizes) > MAX_WORLD_SIZE:
        raise UserError(f"{flag}: N = {max(sizes)} is more than the {MAX_WORLD_SIZE} ranks a "
                        "simulated run can play")
    return sorted(sizes)


def parse_ranks(text: str, world_sizes: list[int]) -> list:
    """Integer ranks must lie in [0, N) for every N; ``last`` is N - 1."""
    ranks = _integers(text, "--simulate_rank", allow_last=True)
    for rank in ranks:
        if rank != LAST and not 0 <= rank < min(world_sizes):
            raise UserError(f"--simulate_rank {rank}: outside [0, N) for N = {min(world_sizes)}")
    return ranks


def check_fake_group_available() -> None:
    try:
        __import__(FAKE_GROUP_MODULE)
    except ImportError:
        raise UserError(f"--simulate_world_size needs torch's fake process group ({FAKE_GROUP_MODULE}), "
                        f"which torch {torch.__version__} lacks") from None


# --------------------------------------------------------------------------- plan

def _state(shapes, world_size: int, rank: int, variants: list[str], options: FsdpOptions) -> list:
    return [expected_state(shapes, world_size, rank, v, phase, options)
            for v in variants for phase in phases(options.accumulates)]


def plan(world_sizes: list[int], ranks: list, variants: list[str], shapes,
         options: FsdpOptions = FsdpOptions()) -> tuple[list[SimulatedRun], list[str]]:
    """Every (N, rank, variant) to run, and a note for each ``last`` rank left out because the
    sharding rule gives it exactly the bytes of a rank already played (it would measure the same)."""
    runs, notes = [], []
    for n in world_sizes:
        played: list[int] = []
        for spec in ranks:
            rank = n - 1 if spec == LAST else spec
            if rank in played:
                continue
            if spec == LAST and any(_state(shapes, n, rank, variants, options) == _state(shapes, n, r, variants, options)
                                    for r in played):
                notes.append(f"N={n}: rank {rank} holds the same bytes as rank {played[0]}; not played")
                continue
            played.append(rank)
            runs.extend(SimulatedRun(n, rank, v) for v in variants)
    return runs, notes


# --------------------------------------------------------------------------- child side

def init_simulated_group(device: torch.device, rank: int, world_size: int,
                         degrees: Degrees | None = None) -> Meshes | None:
    """A fake process group of ``world_size`` ranks in which this process is ``rank``, and, for
    ``degrees``, the meshes of that layout (up to 4-D: replicas, shards, context and tensor groups)."""
    fake_pg = __import__(FAKE_GROUP_MODULE, fromlist=["FakeStore"])  # importing registers the backend
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    return build_meshes(device.type, degrees) if degrees is not None else None


# --------------------------------------------------------------------------- main process side

def _outcome_key(run: SimulatedRun) -> str:
    return f"{run.first.keys.prefix}/outcome"


def _rerun_key(run: SimulatedRun) -> str:
    return f"{run.first.keys.prefix}/rerun_alone_after"


def out_of_memory(failure: str | None) -> bool:
    return failure is not None and "out of memory" in failure


@dataclass
class Share:
    """One launch process's share of a sweep as it runs: ``items[i]`` is what piece ``i`` plays (a run run
    again alone is appended), ``crowded`` the pieces that had another beside them at some moment."""
    items: list[SimulatedRun]
    together: Callable[[list[SimulatedRun]], bool]
    waiting: list[int] = dataclasses.field(default_factory=list)
    crowded: set[int] = dataclasses.field(default_factory=set)

    def next_piece(self, running: list[int]) -> int | None:
        """The next run in order where it fits beside those going; a run again alone waits until none runs, and
        none starts beside it."""
        if not self.waiting:
            return None
        i = self.waiting[0]
        if running and (self.items[i].alone or any(self.items[j].alone for j in running)
                        or not self.together([self.items[j] for j in running] + [self.items[i]])):
            return None
        self.waiting.pop(0)
        if running:
            self.crowded |= {*running, i}
        return i

    def again_alone(self, i: int, failure: str | None) -> SimulatedRun | None:
        """The run to play again, first of those waiting, where piece ``i`` ran out of memory beside another."""
        run = self.items[i]
        if run.alone or i not in self.crowded or not out_of_memory(failure):
            return None
        self.items.append(dataclasses.replace(run, alone=True))
        self.waiting.insert(0, len(self.items) - 1)
        return self.items[-1]


def run_share(runs: list[SimulatedRun], make_job: Callable[[SimulatedRun], object], target: Callable,
              rank: int, world_size: int, store: dist.TCPStore, device: torch.device,
              together: Callable[[list[SimulatedRun]], bool]) -> bool:
    """Run this launch process's share of the sweep (every ``world_size``-th run), each alone in a fresh
    process, the next as soon as it can run ``together`` with those going; post each outcome ("ok" or the
    failure) as it ends. A run that ran out of memory beside others is run again alone before its outcome is
    posted, and says so. True if any of them failed."""
    share = Share(runs[rank::world_size], together)
    share.waiting = list(range(len(share.items)))
    pieces = [Piece(target, (make_job(r),), r.keys) for r in share.items]
    outcomes: dict[SimulatedRun, str | None] = {}
    begun: set[SimulatedRun] = set()

    def started(i: int) -> None:  # each line one write: the other launch processes print theirs at once
        run = share.items[i]
        begun.add(run.first)
        print(f"[process {rank}] {run.variant} ({run.label}){' again, alone' if run.alone else ''}\n", end="",
              flush=True)

    def ended(i: int, failure: str | None) -> None:
        run, again = share.items[i], share.again_alone(i, failure)
        if again is not None:
            pieces.append(Piece(target, (make_job(again),), again.keys))
            store.set(_rerun_key(run), failure)
            print(f"[process {rank}] {run.variant} ({run.label}) ran out of memory beside other runs; run again "
                  f"alone before it is reported ({failure})\n", end="", flush=True)
            return
        outcomes[run.first] = failure
        store.set(_outcome_key(run), "ok" if failure is None else failure)
        if failure:
            said = f"FAILED: {failure}" if failed(failure) else status_of(failure)
            print(f"[process {rank}] {run.variant} ({run.label}) {said}\n", end="", flush=True)

    try:
        run_queue(pieces, share.next_piece, rank, store, device, started, ended)
    except Interrupted:
        for r in runs[rank::world_size]:  # so that rank 0 need not wait for runs that will never end
            if r not in outcomes:
                store.set(_outcome_key(r), INTERRUPTED if r in begun else NOT_RUN)
        raise
    return any(failed(failure) for failure in outcomes.values())


def statuses(runs: list[SimulatedRun], store: dist.TCPStore) -> dict[SimulatedRun, str]:
    """Each run's status as summary.json gives it: ok, failed: <reason>, interrupted, or not run."""
    found = {r: store.get(_outcome_key(r)).decode() if store.check([_outcome_key(r)]) else None for r in runs}
    return {r: NOT_RUN if o is None else o if o in ("ok", INTERRUPTED, NOT_RUN) else status_of(o)
            for r, o in found.items()}


def reruns(runs: list[SimulatedRun], store: dist.TCPStore) -> dict[SimulatedRun, str]:
    """The runs that were run again alone, and the failure beside others that made it so."""
    return {r: store.get(_rerun_key(r)).decode() for r in runs if store.check([_rerun_key(r)])}


def wait_for_sweep(runs: list[SimulatedRun], store: dist.TCPStore) -> None:
    """Until every process has posted the outcome of every run of its share."""
    wait_for_keys(store, [_outcome_key(r) for r in runs])
