"""Run one piece of work (a training variant, a loading mode) in a fresh process on every rank.

The main process of each rank starts a child per piece of work (see ``starting.child_context``), so
no allocator cache, host memory or broken communicator carries over from one piece to the
next, and a failure stays inside its piece. Several pieces may run at once, each with its own
children and keys. The children form their own process group on the launcher's store. An
"abort" key in that store tells every rank, within a second, that a peer failed or the run
was interrupted: each child then writes what it has and leaves, and the main processes go
on with the next piece.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing.connection
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from fsdp2bench.cli import Stopped, set_up_standard_streams
from fsdp2bench.names import TRACE_KEYS
from fsdp2bench.options.layout import Degrees, Meshes, build_meshes
from fsdp2bench.processes.first import handle_ending_signals
from fsdp2bench.processes.starting import check_launcher_env, child_context, one_rank_env, raise_on_ending_signals
from measure import OOM_HELD

STORE_TIMEOUT = timedelta(minutes=30)
POLL_S = 0.25
CAUSE_WAIT_S = 1.0
INTERRUPTED = "interrupted"  # the abort reason the main processes set on SIGINT / SIGTERM / SIGHUP
STAND_DOWN = "stand down"  # the go that ends a gated piece where it stands, its work no longer wanted
# After a peer fails or an interrupt, how long a child may take to write its partial results.
GRACE_S = 30.0


class StoreKeys:
    """Names of the launcher-store keys one piece of work uses; unique per launch and restart."""

    def __init__(self, name: str):
        launch = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.prefix = f"fsdp2bench/{launch}/{name}"
        self.abort = f"{self.prefix}/abort"
        self.ready, self.go = f"{self.prefix}/ready", f"{self.prefix}/go"  # a gated piece's (``wait_at_gate``)

    def status(self, rank: int) -> str:
        return f"{self.prefix}/status/{rank}"

    def record(self, rank: int) -> str:
        return f"{self.prefix}/record/{rank}"


def launcher_env() -> tuple[int, int]:
    """Rank and world size from torchrun / accelerate launch, checked; plain ``python`` is one rank."""
    one_rank_env()
    return check_launcher_env()


def set_first(store: dist.TCPStore, key: str, value: str) -> None:
    """Set ``key`` unless some rank already did: the first reason given is kept."""
    store.compare_set(key, "", value)


def connect_store() -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=STORE_TIMEOUT)


class Unsupported(Exception):
    """What the installed libraries cannot do (accelerate's TP or CP path at these releases): a finding of the
    run, reported as such, not a failure of it."""


UNSUPPORTED = "unsupported"


def unsupported_cause(reason: str | None) -> str | None:
    """What the libraries cannot do, from a piece's failure reason ("rank 1: unsupported: fails at ..."),
    or None where the reason is another failure (or there is none)."""
    found = re.fullmatch(rf"(rank \d+: )?{UNSUPPORTED}: (.*)", reason or "", re.DOTALL)
    return found.group(2) if found else None


def failed(reason: str | None) -> bool:
    """Whether a piece's outcome fails the run: a failure that is not the libraries' unsupported path."""
    return reason is not None and unsupported_cause(reason) is None


def status_of(reason: str | None) -> str:
    """A piece's status in summary.json: ok, unsupported: <what the libraries cannot do>, or failed: <reason>."""
    if reason is None:
        return "ok"
    cause = unsupported_cause(reason)
    return f"{UNSUPPORTED}: {cause}" if cause else f"failed: {reason}"


def describe(exc: BaseException) -> str:
    """One line for a failure; out-of-memory, a file that cannot be written (a full disk), and what the
    libraries cannot do, named as such."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, Unsupported):  # the libraries' whole sentence: it is the finding
        return f"{UNSUPPORTED}: {first}"
    first = first[:300]
    if isinstance(exc, torch.OutOfMemoryError):
        # Where the process list cut it short, the limit and what the process held (measure.held_at_failure)
        held = OOM_HELD.search(str(exc))
        return f"out of memory ({first}{' ... ' + held.group(0) if held and held.group(0) not in first else ''})"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"cannot write {exc.filename} ({exc.strerror})"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# --------------------------------------------------------------------------- main process side

class Interrupted(Stopped):
    """SIGINT, SIGTERM or SIGHUP reached this rank's main process."""


class StoreLost(Interrupted):
    """The launcher's store stopped answering (its agent was killed): handled like an interrupt."""


def _raise_interrupted(signum, _frame) -> None:
    # The shutdown that follows (partial results, summary.json) must not itself be interrupted:
    # a second Ctrl-C, the launcher's own SIGTERM or the terminal's SIGHUP is ignored, and says nothing more.
    handle_ending_signals(signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def catch_interrupts() -> None:
    raise_on_ending_signals(_raise_interrupted)
    end_with_parent()


def end_with_parent() -> None:
    """Linux: SIGTERM this process when its parent (the launcher) dies, so that a ``kill -9`` of
    torchrun leaves no orphan training on: the interrupt path then saves what it can."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the watcher threads of the children still notice
        return


PR_SET_PDEATHSIG = 1


def has_keys(store: dist.TCPStore, keys: list[str]) -> bool:
    """``store.check``, with a store that is gone reported as ``StoreLost``."""
    try:
        return store.check(keys)
    except dist.DistError as exc:
        raise StoreLost(f"the launcher's store is gone: {str(exc).splitlines()[0][:120]}") from None


_PIECES_RUN: set[str] = set()  # key prefixes of the pieces this process has started


@dataclass
class Piece:
    """One piece of work: ``target(*args)`` in a child on every rank, coordinated through ``keys``; a ``gated``
    one stops at its gate (``wait_at_gate``) until ``run_queue`` lets it go on."""
    target: Callable
    args: tuple
    keys: StoreKeys
    gated: bool = False


def run_isolated(pieces: list[Piece], rank: int, participants: Sequence[int], store: dist.TCPStore,
                 device: torch.device) -> list[str | None]:
    """Run every piece at once, each in its own child; per piece, None if it succeeded on every
    participating rank, else the first reason given. One piece's failure does not stop the others.

    ``participants`` are the launcher ranks that run these pieces: every rank for a training
    variant, this rank alone for a simulated rank (which needs no peer)."""
    _register(pieces)
    context = child_context(device.type)
    children = [context.Process(target=piece.target, args=piece.args) for piece in pieces]
    for child in children:
        start_holding_signals(child)
    try:
        running = list(zip(pieces, children))
        while running:
            running = [(p, c) for p, c in running if c.exitcode is None and not has_keys(store, [p.keys.abort])]
            if running:
                multiprocessing.connection.wait([c.sentinel for _, c in running], timeout=0.2)
    except Interrupted:
        _abort(pieces, store)
        raise
    finally:
        _reap(children)
    for piece, child in zip(pieces, children):
        _settle(piece, child, rank, store)
    failures = []
    for piece in pieces:
        wait_for_keys(store, [piece.keys.status(r) for r in participants])
        failures.append(_failure(piece, store))
    return failures


def run_queue(pieces: list[Piece], next_piece: Callable[[list[int]], int | None], rank: int, store: dist.TCPStore,
              device: torch.device, started: Callable[[int], None], ended: Callable[[int, str | None], None],
              let_go: Callable[[int, str, list[int]], str | None] = lambda i, held, running: "go") -> None:
    """Run pieces that need no peer, each in its own child, starting each that ``next_piece(running)`` names
    (an index into ``pieces``, which ``ended`` may extend) until it names none; ends when none runs and none
    is named. ``started(i)`` and ``ended(i, failure)`` are told as each piece starts and ends; a gated piece
    waiting at its gate is given the go ``let_go(i, what it said it holds, running)`` returns (None: not yet),
    asked in the order they started, before any new piece starts."""
    context = child_context(device.type)
    running: dict[int, object] = {}
    at_gate: list[int] = []  # gated pieces started and not yet let go, in the order they started
    try:
        while True:
            for i in [i for i in at_gate if has_keys(store, [pieces[i].keys.ready])]:
                if (go := let_go(i, store.get(pieces[i].keys.ready).decode(), list(running))) is not None:
                    store.set(pieces[i].keys.go, go)
                    at_gate.remove(i)
            while (i := next_piece(list(running))) is not None:
                _register([pieces[i]])
                running[i] = context.Process(target=pieces[i].target, args=pieces[i].args)
                start_holding_signals(running[i])
                at_gate += [i] if pieces[i].gated else []
                started(i)
            if not running:
                return
            multiprocessing.connection.wait([c.sentinel for c in running.values()], timeout=0.2)
            for i, child in list(running.items()):
                if child.exitcode is None and not has_keys(store, [pieces[i].keys.abort]):
                    continue
                _reap([child])
                _settle(pieces[i], child, rank, store)
                del running[i]
                at_gate = [j for j in at_gate if j != i]
                ended(i, _failure(pieces[i], store))
    except Interrupted:
        _abort([pieces[i] for i in running], store)
        _reap(list(running.values()))
        raise


# Held back from a forked child until it can report them (``run_child``): one that came in its first moments
# raised into multiprocessing's start-up (the handler is this process's), a traceback and no reason given.
HELD_AT_START = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def start_holding_signals(child) -> None:
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_AT_START)
    try:
        child.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _register(pieces: list[Piece]) -> None:
    for piece in pieces:  # a second piece on the same keys would read the first one's results
        if piece.keys.prefix in _PIECES_RUN:
            raise ValueError(f"{piece.keys.prefix}: ran already in this launch; every piece needs keys of its own")
        _PIECES_RUN.add(piece.keys.prefix)


def _abort(pieces: list[Piece], store: dist.TCPStore) -> None:
    for piece in pieces:
        try:
            set_first(store, piece.keys.abort, INTERRUPTED)
        except dist.DistError:  # no store: the children notice that themselves
            break


def _reap(children: list) -> None:
    """Every child ended: given ``GRACE_S`` to write what it has, then killed."""
    deadline = time.monotonic() + GRACE_S
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.exitcode is None:
            child.kill()
            child.join()


def _settle(piece: Piece, child, rank: int, store: dist.TCPStore) -> None:
    """This rank's part of a piece is done; a child that died without a word fails it."""
    if child.exitcode != 0:  # covers a process that died without a word (SIGKILL, OOM killer...)
        how = f"killed by {signal.Signals(-child.exitcode).name}" if child.exitcode < 0 else \
            f"exit code {child.exitcode}"
        set_first(store, piece.keys.abort, f"rank {rank}: process ended ({how})")
    store.set(piece.keys.status(rank), "done")


def _failure(piece: Piece, store: dist.TCPStore) -> str | None:
    return store.get(piece.keys.abort).decode() if store.check([piece.keys.abort]) else None


def wait_for_keys(store: dist.TCPStore, keys: list[str]) -> None:
    """Wait until every key exists, in short steps: ``store.wait`` blocks in C++, where a signal
    handler never runs, so a rank waiting on a peer could not be interrupted."""
    while not has_keys(store, keys):
        time.sleep(0.1)


def without_trace(data: dict) -> dict:
    """A child's result less the sampled lists: what travels through the store."""
    return {k: v for k, v in data.items() if k not in TRACE_KEYS}


def gather_records(store: dist.TCPStore, keys: StoreKeys, ranks: Sequence[int]) -> list[dict]:
    """What the children of a finished piece posted (``store.set(keys.record(rank), json)``)."""
    return [json.loads(store.get(keys.record(r))) for r in ranks]


def leave_together(store: dist.TCPStore, rank: int, world_size: int) -> None:
    """Rank 0 may host the store: it leaves last, so no rank loses the store mid-call."""
    prefix = StoreKeys("exit").prefix
    store.set(f"{prefix}/{rank}", "bye")
    if rank == 0:
        wait_for_keys(store, [f"{prefix}/{r}" for r in range(world_size)])


# --------------------------------------------------------------------------- child side

class Finisher:
    """Writes this rank's result once, from whichever thread gets there first, then leaves.

    ``write(status, extra)`` saves whatever the work has so far; ``extra`` holds the error.
    """

    def __init__(self, keys: StoreKeys, rank: int, write: Callable[[str, dict], None]):
        self.keys, self.rank, self._write = keys, rank, write
        # Two threads may race to write the result: the work on success, and the failure path (the
        # work's own exception, or the watcher seeing an abort). Whoever takes this first writes.
        self._writer = threading.Lock()
        self._finished = False

    def finish(self, extra: dict):
        """Success: write it, and from now on ignore a late abort. A write that fails (a full disk)
        is this rank's failure, given to the others as any other is."""
        self._writer.acquire()
        try:
            data = self._write("ok", extra)
        except OSError:
            self._writer.release()
            raise
        self._finished = True
        return data

    def _claim(self) -> bool:
        """Whether this thread writes a failure. If another thread is already writing one, wait
        here: it ends the process when done, and leaving first would cut its write short."""
        if self._writer.acquire(blocking=False):
            return True
        if not self._finished:
            self._writer.acquire()  # never returns: the writer holds it until os._exit
        return False

    def fail(self, error: str | None, store: dist.TCPStore) -> None:
        """Tell the other ranks (first reason wins), write the partial result, exit at once.

        ``error`` is this rank's own failure, or None when leaving because the abort key is set.
        """
        if not self._claim():
            return
        try:
            try:
                status = self._agreed_status(error, store)
            except dist.DistError:  # the launcher is gone: nobody to tell, nothing to wait for
                status, error = "interrupted", error or "the launcher's store is gone"
            data = self._write(status, {"error": error})
            if status != "interrupted" and isinstance(data, dict):  # how far it got, for rank 0's summary
                with contextlib.suppress(dist.DistError):
                    store.set(self.keys.record(self.rank), json.dumps(without_trace(data)))
        finally:
            os._exit(1)

    def _agreed_status(self, error: str | None, store: dist.TCPStore) -> str:
        """Give this rank's reason (the first one given wins) and read back the one that counts."""
        own = f"rank {self.rank}: {error}"
        if error is not None:
            # A peer that died makes our collectives fail at once, before its main process
            # can say why: give that first reason a moment to arrive.
            deadline = time.monotonic() + CAUSE_WAIT_S
            while not store.check([self.keys.abort]) and time.monotonic() < deadline:
                time.sleep(0.05)
            set_first(store, self.keys.abort, own)
        reason = store.get(self.keys.abort).decode()
        return "interrupted" if reason == INTERRUPTED else "failed" if reason == own else f"aborted: {reason}"

    def leave_alone(self, reason: str) -> None:
        """The launch is gone: write the partial result as interrupted, with no store, and exit."""
        if not self._claim():
            return
        try:
            self._write("interrupted", {"error": reason})
        finally:
            os._exit(1)


_signalled: list[str] = []  # the signal a child was sent, for its watcher thread


def _child_interrupted(signum, _frame) -> None:
    """A child's SIGTERM: raised in its main thread; where that thread swallows it (an exception raised inside
    a ``__del__`` is only printed), the watcher thread ends the child with it all the same."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _signalled.append(signal.Signals(signum).name)
    raise Interrupted(_signalled[0])


def _quiet_about_interrupts(unraisable) -> None:
    """Python prints the exceptions it drops (raised in a ``__del__``) with their stack: a signal's is said once,
    in one line, as the child's failure."""
    if not isinstance(unraisable.exc_value, Interrupted):
        sys.__unraisablehook__(unraisable)


def _watch_for_abort(finisher: Finisher, parent: int) -> None:
    """The main thread may be blocked in a collective that will never return (its peer is gone), so
    this thread itself writes the partial result and ends the process (``Finisher.fail``). It also
    ends a child whose launch is gone (its parent died, or the launcher's store stopped answering),
    and one sent a signal that its main thread did not act on: nobody could tell it to stop, and it
    would train on as an orphan."""
    store = connect_store()
    while True:
        if os.getppid() != parent:
            finisher.leave_alone("the launch's main process is gone")
        try:
            aborted = store.check([finisher.keys.abort])
        except dist.DistError:
            finisher.leave_alone("the launcher's store is gone")
        if aborted:
            finisher.fail(None, store)
        if _signalled:
            time.sleep(POLL_S)  # the main thread's own report first, where it makes one
            finisher.fail(describe(Interrupted(_signalled[0])), store)
        time.sleep(POLL_S)


_launcher_threads: int | None = None  # the launcher process's thread count before it kept to one


def launcher_keeps_to_one_thread() -> None:
    """The launcher process computes nothing heavy, and a parallel region there would hang every
    child forked from it in its own first one (GNU OpenMP does not survive a fork): so it keeps to
    one thread, and a child forked from it gets back the count the launcher had (``run_child``)."""
    global _launcher_threads
    _launcher_threads = torch.get_num_threads()
    torch.set_num_threads(1)


def run_child(finisher: Finisher, work: Callable[[dist.TCPStore], None]) -> None:
    """Body of every forked child: watch for aborts, do the work, report any failure."""
    set_up_standard_streams()  # a child of the fork server starts with streams of its own
    if _launcher_threads is not None:  # forked from the launcher, not from the fork server
        torch.set_num_threads(_launcher_threads)
    # accelerate warns in every process that finds it unset (and sets it): the count is already chosen.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    for signum in (signal.SIGINT, signal.SIGHUP):  # the main process decides what an interrupt means
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _child_interrupted)
    sys.unraisablehook = _quiet_about_interrupts
    store = connect_store()
    # A thread beside the work (the memory tracker) that fails ends the piece with its reason, as the
    # work's own exception would: never a traceback while the run goes on without it.
    threading.excepthook = lambda hook: finisher.fail(
        f"the {getattr(hook.thread, 'name', 'background')} thread failed: {describe(hook.exc_value)}", store)
    threading.Thread(target=_watch_for_abort, args=(finisher, os.getppid()), name="abort watcher",
                     daemon=True).start()
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_START)  # a SIGTERM held since the fork raises here
        work(store)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter shutdown under a watcher thread that sits in the store's C++ code
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
        if os.environ.get("FSDP2_BENCH_DEBUG"):
            import traceback

            traceback.print_exc()
        finisher.fail(describe(exc), store)
        os._exit(1)  # reached only if the result was already written as finished


def name_process(name: str) -> None:
    """The name ``ps`` and ``top`` show for this child (Linux; at most 15 characters), so that a plan's kinds of
    process can be told apart; elsewhere it keeps its own."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def wait_at_gate(store: dist.TCPStore, keys: StoreKeys, held: int) -> str:
    """A gated piece, set up: say what it holds (bytes), then wait for the parent's go and return it (an abort
    still ends it: the watcher thread sees to that)."""
    store.set(keys.ready, str(held))
    wait_for_keys(store, [keys.go])
    return store.get(keys.go).decode()


def init_group(device: torch.device, keys: StoreKeys, store: dist.TCPStore, rank: int, world_size: int,
               degrees: Degrees | None = None) -> Meshes | None:
    """This piece of work's own process group and, for ``degrees``, the meshes of that layout."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.PrefixStore(keys.prefix + "/pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)
    return build_meshes(device.type, degrees) if degrees is not None else None
