"""The set-up every entry script shares, before its first piece of work starts."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from fsdp2bench.cli import RankError, UserError, one_line, pick_device
from fsdp2bench.files import check_replaceable, is_ours, lock_output_dir, prepare_output_dir
from fsdp2bench.memory.accounting import model_bytes, param_shapes, parameter_count
from fsdp2bench.names import counted
from fsdp2bench.options.tuning import Tuning
from fsdp2bench.processes.isolation import (STORE_TIMEOUT, StoreKeys, StoreLost, catch_interrupts, launcher_env,
                                            set_first, wait_for_keys)
from fsdp2bench.processes.starting import start_child_server
from fsdp2bench.train.model import build_meta_model, check_units_own_their_parameters, layer_class_names, load_config


@dataclass
class Session:
    """This rank's place in the launch, the model's shape, and the launcher's store."""
    device: torch.device
    rank: int
    world_size: int
    config: object
    shapes: list  # (shape, bytes per element) of each unique parameter
    layer_classes: list[str]  # the transformer blocks to shard one by one
    store: dist.TCPStore
    run_id: str  # the same on every rank; in every file this launch writes

    @property
    def num_parameters(self) -> int:
        return parameter_count(self.shapes)

    @property
    def model_bytes(self) -> int:
        return model_bytes(self.shapes)


@dataclass(frozen=True)
class ModelFacts:
    """What the model is, checked as fully_shard and accelerate will see it, before any process starts."""
    name: str
    config: object
    shapes: list  # (shape, bytes per element) of each unique parameter
    layer_classes: list[str]  # the transformer blocks to shard one by one
    named_shapes: list  # (name, shape) of each unique parameter, as a checkpoint names it

    @property
    def num_parameters(self) -> int:
        return parameter_count(self.shapes)


def model_facts(model: str, seed: int, check_config: Callable[[object], None] = lambda config: None,
                tuning: Tuning = Tuning()) -> ModelFacts:
    """A causal LM whose blocks FSDP2 can shard one by one, each parameter in one unit, with the adapters ``tuning``
    asks for; refused in one line."""
    config = load_config(model)
    check_config(config)
    meta_model = build_meta_model(model, config, seed, tuning)
    layer_classes = layer_class_names(meta_model)
    check_units_own_their_parameters(model, meta_model, layer_classes)
    return ModelFacts(model, config, param_shapes(meta_model, config, layer_classes), layer_classes,
                      [(name, tuple(p.shape)) for name, p in meta_model.named_parameters()])


def open_session(facts: ModelFacts, device_choice: str, output_dir: str, summary_file: str) -> Session:
    """Meet the other ranks, once the command line and the model were checked (one line, before anything
    runs). ``summary_file`` is the file rank 0 will keep rewriting in ``output_dir``.

    From here on SIGINT and SIGTERM raise ``isolation.Interrupted`` in the main process (before the
    first file is written: an interrupt then still releases the output directory's lock).
    """
    catch_interrupts()
    device = pick_device(device_choice)
    rank, world_size = launcher_env()
    start_child_server(device.type)  # if the entry script has not: its imports overlap the set-up below
    prepare_output_dir(output_dir)
    run_id = new_run_id()  # rank 0's names the launch
    if rank == 0:
        lock_output_dir(output_dir)
        check_replaceable(os.path.join(output_dir, summary_file))
    store = meet_peers(rank, world_size)
    if rank == 0:  # last: a run refused before it has met its peers has moved nothing
        move_earlier_runs_aside(output_dir, run_id)
    return Session(device, rank, world_size, facts.config, facts.shapes, facts.layer_classes, store,
                   agree_on_run_id(store, rank, run_id))


EARLIER_RUNS = "earlier_runs"  # where a run moves the files of the runs before it in its directory


def new_run_id() -> str:
    """A launch's name: when and which process started it."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def move_earlier_runs_aside(output_dir: str, run_id: str) -> None:
    """A run owns its directory: every file of the benchmark's there (its mark), at the top or in a simulated
    world size's folder, is of an earlier run and goes to ``earlier_runs/<before this run>/``, said in one
    line, so that no figure or trace of another run is read as this one's. Files without the mark stay. All of
    them move or none: a move that fails (or a signal meanwhile) puts back those already moved."""
    found = earlier_files(output_dir)
    if not found:
        return
    aside = os.path.join(EARLIER_RUNS, f"before-{run_id}")
    moved: list[str] = []
    try:
        for relative in found:
            target = os.path.join(output_dir, aside, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(os.path.join(output_dir, relative), target)
            moved.append(relative)
    except BaseException as exc:
        put_back(output_dir, aside, moved)
        if not isinstance(exc, OSError):
            raise
        raise UserError(f"--output_dir {output_dir}: cannot move the earlier run's {found[len(moved)]} to {aside}/ "
                        f"({exc.strerror}); nothing was moved: move it away or choose another --output_dir") from None
    for folder in {os.path.dirname(r) for r in found if os.path.dirname(r)}:
        with contextlib.suppress(OSError):  # left where it holds files of another program
            os.rmdir(os.path.join(output_dir, folder))
    print(f"note: moved the {counted(len(found), 'file')} of earlier runs in {output_dir} to "
          f"{os.path.join(output_dir, aside)}/; this run writes its own in their place", flush=True)


def put_back(output_dir: str, aside: str, moved: list[str]) -> None:
    """Undo a move that stopped half-way: each file back where it was, the folders made for it removed where
    empty (``earlier_runs`` too, unless it holds the runs moved before)."""
    for relative in reversed(moved):
        with contextlib.suppress(OSError):
            os.rename(os.path.join(output_dir, aside, relative), os.path.join(output_dir, relative))
    for root, _, _ in sorted(os.walk(os.path.join(output_dir, aside)), key=lambda entry: -len(entry[0])):
        with contextlib.suppress(OSError):
            os.rmdir(root)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(output_dir, EARLIER_RUNS))


def earlier_files(output_dir: str) -> list[str]:
    """The benchmark's files in ``output_dir`` (relative paths): at its top and in its ``simulated_N<n>``
    folders, all judged before any is moved (a snapshot is judged by the trace beside it)."""
    def plain(path: str, kind: Callable[[str], bool]) -> bool:  # a link is its maker's, never moved
        return kind(path) and not os.path.islink(path)

    folders = ["", *sorted(f for f in os.listdir(output_dir)
                           if re.fullmatch(r"simulated_N\d+", f) and plain(os.path.join(output_dir, f), os.path.isdir))]
    found = [os.path.join(folder, name) for folder in folders for name in sorted(os.listdir(os.path.join(output_dir,
                                                                                                         folder)))]
    return [path for path in found if plain(os.path.join(output_dir, path), os.path.isfile)
            and is_ours(os.path.join(output_dir, path))]


PEER_WAIT_S = float(os.environ.get("FSDP2_BENCH_PEER_WAIT_S", 15))  # torchrun's ranks meet in well under 1 s


def meet_peers(rank: int, world_size: int) -> dist.TCPStore:
    """The launcher's store with every rank in it. A wait for ranks that never come (launcher
    variables set by hand) is bounded, and says what it waited for."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=PEER_WAIT_S)))
    except (dist.DistError, RuntimeError) as exc:
        raise RankError(f"rank {rank}: the {counted(world_size, 'rank')} of WORLD_SIZE={world_size} did not all "
                        f"meet at {where} within {PEER_WAIT_S:g} s ({one_line(exc)}); start every rank with the same "
                        f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun does), or raise FSDP2_BENCH_PEER_WAIT_S")
    store.set_timeout(STORE_TIMEOUT)  # from here on a wait is for work, not for a rank to appear
    return store


def agree_on_run_id(store: dist.TCPStore, rank: int, run_id: str) -> str:
    """Rank 0 names the launch (when it started, and its process), every rank reads the name: no rank
    writes into the directory before rank 0 has moved the earlier runs' files aside."""
    key = StoreKeys("run-id").prefix
    if rank == 0:
        store.set(key, run_id)
    wait_for_keys(store, [key])
    return store.get(key).decode()


def say_interrupted(session: Session, exc: BaseException, where: str) -> int:
    """One line, from rank 0 (every rank is told by the launcher); the exit code of an interrupt."""
    said = first_interrupt(session, str(exc)) if not isinstance(exc, StoreLost) else str(exc)
    if session.rank == 0:
        print(f"Interrupted ({said}){where}", file=sys.stderr)
    return 130


def first_interrupt(session: Session, own: str) -> str:
    """The launch's first signal, and the rank it reached where rank 0 got another: a signal to one rank ends
    that rank, and the launcher then sends SIGTERM to the others. Each rank posts its own (the first kept)
    before it leaves, so before the launcher signals the rest."""
    key = StoreKeys("first-interrupt").prefix
    try:
        set_first(session.store, key, f"{session.rank}|{own}")
        rank, first = session.store.get(key).decode().split("|", 1)
    except dist.DistError:  # the launcher's store is gone: this rank's own
        return own
    return first if first == own else f"{first} to rank {rank}"
