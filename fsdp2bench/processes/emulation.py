"""Communication emulated on a simulated rank (``--emulate_communication``).

Under the fake process group no collective moves data, so a simulated rank's step is compute only. Here each
collective the rank issues first costs its time on the GPU, as a kernel enqueued on the stream that is current where
it is issued, which holds SMs and moves the bytes the rank would receive as NCCL's kernel does (hold.py): FSDP2
issues its all-gathers on a stream of their own, ahead of the block that needs them, and its reduce-scatters behind
the backward, so the real schedule decides how much of that time the compute hides, and the
step's time is what FSDP2's overlap leaves. Two doors are watched, one per kind of caller: ``torch.distributed``'s
functions (FSDP2's all-gathers and reduce-scatters, HSDP's all-reduce, broadcasts), and the ops of DTensor's
functional collectives (``torch.ops._c10d_functional``: TP's and CP's gathers, scatters, all-to-alls and ring
sends, the all-reduce of a norm over sharded gradients). The second door is a kernel of each op at the dispatcher's
ADInplaceOrView key, which every call of the op on real tensors passes before its backend's kernel: a call from
Python (eager DTensor) and a call from a compiled graph's generated code alike, each once; the tracing that builds
a graph passes it with fake tensors, and is not counted. The time is ``Links.collective_s`` over the group's own
ranks (options/links.py). On a CPU nothing waits: the calls and bytes are counted, the seconds priced.

Every other step is emulated (``emulates``): the compute alone and the step with its communication are timed in one
process, the same allocator state and the same compiled graphs, which two launches (up to 6% apart on an H100, where
the exposed communication was about 1% of a step) cannot compare.

Not emulated: congestion and stragglers; NCCL's protocol work beyond one read and one write of each byte received;
the point-to-point functional ops (pipelining's, which no layout of the suite issues).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from fsdp2bench.options.links import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, DTENSOR, REDUCE_SCATTER, SEND,
                                      Links, wire_bytes)
from fsdp2bench.processes.hold import BLOCK, THREADS, held, hold_kernel, word_view


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return kwargs[name] if name in kwargs else args[index]


# torch.distributed's function -> (the kind of ring it runs, the tensors whose bytes make the whole it moves: the
# gathered output, the reduce-scattered input, the all-reduced or broadcast tensor). FSDP2 calls the ``*_single``
# forms from torch 2.12 on, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before; a name this torch lacks
# is left alone.
PATCHED: dict[str, tuple[str, Callable[[tuple, dict], list[torch.Tensor]]]] = {
    "all_gather_single": (ALL_GATHER, lambda a, k: [_arg(a, k, 0, "output_tensor")]),
    "all_gather_into_tensor": (ALL_GATHER, lambda a, k: [_arg(a, k, 0, "output_tensor")]),
    "reduce_scatter_single": (REDUCE_SCATTER, lambda a, k: [_arg(a, k, 1, "input")]),
    "reduce_scatter_tensor": (REDUCE_SCATTER, lambda a, k: [_arg(a, k, 1, "input")]),
    "all_reduce": (ALL_REDUCE, lambda a, k: [_arg(a, k, 0, "tensor")]),
    "all_gather": (ALL_GATHER, lambda a, k: list(_arg(a, k, 0, "tensor_list"))),
    "reduce_scatter": (REDUCE_SCATTER, lambda a, k: list(_arg(a, k, 1, "input_list"))),
    "broadcast": (BROADCAST, lambda a, k: [_arg(a, k, 0, "tensor")]),
}


# The ops of DTensor's functional collectives -> the kind of ring each runs. Each takes its tensor (or list of
# tensors) first and its group (a name, or the group) last; the whole a gather moves is its input G times, the
# others' their input. An op this torch lacks is left alone (no one can call it).
FUNCTIONAL: dict[str, str] = {
    **dict.fromkeys(("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
                    ALL_GATHER),
    **dict.fromkeys(("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"),
                    REDUCE_SCATTER),
    **dict.fromkeys(("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"), ALL_REDUCE),
    **dict.fromkeys(("broadcast", "broadcast_"), BROADCAST),
    "all_to_all_single": ALL_TO_ALL,
}


def emulates(step: int) -> bool:
    """Whether ``step`` runs with its communication emulated: the odd ones. Step 0, warm-up in every run (the first
    allocations, FSDP2's lazy set-up, compiling), then runs without sleeps, and from step 2 on each compute-only
    step has an emulated one beside it."""
    return step % 2 == 1


@dataclass
class Wait:
    """How a collective's seconds pass on the GPU: ``channels`` CTAs held and its bytes moved (hold.py), or, where
    Triton is absent or the links ask for no channels, ``torch.cuda._sleep`` at ``clock`` cycles a second."""
    clock: float
    channels: int
    kernel: Callable | None
    scratch: torch.Tensor | None = None  # a word the kernel points at where the collective has no tensor to move

    def describe(self) -> str:
        if self.kernel is None:
            return "a sleep of one thread (takes no SMs and no memory bandwidth from the compute)"
        return (f"{self.channels} CTAs of {THREADS} threads held for its time, reading and writing back the bytes the "
                "rank receives (SMs and memory bandwidth taken from the compute beside it, as NCCL's kernel takes "
                "them)")

    def __call__(self, seconds: float, buffer: torch.Tensor | None, wire: float) -> None:
        if self.kernel is None:
            torch.cuda._sleep(int(seconds * self.clock))
        else:
            words = word_view(buffer) if buffer is not None else None
            if words is None:
                words, wire = self.scratch, 0
            held(self.kernel, seconds, self.channels, words, int(wire))


@dataclass
class Tally:
    """Each kind of collective the rank issued in the steps it emulated: calls, whole bytes, emulated seconds."""
    links: Links
    wait: Wait | None  # how the time is waited on the GPU; None on a CPU, where it is only priced
    kinds: dict[str, dict] = field(default_factory=dict)
    on: bool = False  # the step running is emulated: its collectives wait and are counted (``step_starts``)
    steps: int = 0  # the steps emulated so far

    def step_starts(self, step: int) -> bool:
        """Before each step: the switch set for it (``emulates``); whether it is emulated."""
        self.on = emulates(step)
        self.steps += self.on
        return self.on

    def add(self, kind: str, group: int, whole: int, seconds: float, tag: str = "") -> None:
        entry = self.kinds.setdefault(f"{kind} over {group}{tag}", {"calls": 0, "bytes": 0, "emulated_s": 0.0})
        entry["calls"] += 1
        entry["bytes"] += whole
        entry["emulated_s"] += seconds

    def per_step(self) -> dict:
        """The tally over the steps emulated, each figure per emulated step."""
        steps = self.steps
        return {"links": vars(self.links), "emulated_steps": steps, "waited_on_the_gpu": self.wait is not None,
                "waited_as": self.wait.describe() if self.wait else None,
                "per_step": {kind: {k: v / steps for k, v in entry.items()} for kind, entry in self.kinds.items()},
                "emulated_s_per_step": sum(e["emulated_s"] for e in self.kinds.values()) / steps}


def cycles_per_second(device: torch.device) -> float:
    """The GPU's clock as ``torch.cuda._sleep`` counts it, timed on the device (its rated clock is not what it
    runs at under load)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)  # the first call's launch is slower
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000)


def gpu_wait(links: Links, device: torch.device) -> Wait:
    """The wait for this GPU, its kernel compiled and run once here, before any step is timed."""
    kernel = hold_kernel() if links.channels else None
    wait = Wait(cycles_per_second(device), links.channels, kernel, torch.zeros(1, dtype=torch.int32, device=device))
    if kernel is not None:
        with torch.cuda.device(device):
            for odd in (0, 1):  # 32-bit words, and bytes (a tensor whose size is not a multiple of 4)
                wait(1e-4, torch.zeros(4 * BLOCK + odd, dtype=torch.uint8, device=device), 4 * BLOCK)
            torch.cuda.synchronize(device)
    return wait


def group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def named_group_ranks(group) -> list[int]:
    """The ranks of a functional collective's group, as its op takes it: the group's name, or the group."""
    return group_ranks(dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group)


def functional_cost(kind: str, tensors: list[torch.Tensor], args: tuple, ranks: list[int]) -> tuple[str, int]:
    """The kind and whole of a functional collective's op called with ``args`` (its ``tensors`` first). An
    all-to-all in which this rank sends to one rank only (its input splits all 0 but one: a permute's, CP's ring)
    is that send."""
    whole = sum(_bytes(t) for t in tensors) * (len(ranks) if kind == ALL_GATHER else 1)
    if kind == ALL_TO_ALL and sum(1 for split in args[2] if split) == 1:
        return SEND, whole
    return kind, whole


def costed(kind: str, tensors: list[torch.Tensor], size: int, ranks: list[int], tally: Tally, tag: str = "") -> None:
    """Tally one collective (its kind ``tag``ged) of ``size`` bytes over ``tensors`` and, on a GPU, wait its time
    on the current stream; nothing in a step not emulated (which runs the same wrappers up to here, so that the two
    halves' host work is alike)."""
    if not tally.on:
        return
    seconds = tally.links.collective_s(kind, size, ranks)
    tally.add(kind, len(ranks), size, seconds, tag)
    if tally.wait is not None and seconds > 0:
        buffer = max(tensors, key=_bytes, default=None)
        tally.wait(seconds, None if buffer is None or is_fake(buffer) else buffer, wire_bytes(kind, size, len(ranks)))


def emulating(original: Callable, kind: str, tensors: Callable[[tuple, dict], list[torch.Tensor]],
              tally: Tally) -> Callable:
    """``original``, after its time on the current stream."""
    def call(*args, **kwargs):
        moved = tensors(args, kwargs)
        costed(kind, moved, sum(_bytes(t) for t in moved), group_ranks(kwargs.get("group")), tally)
        return original(*args, **kwargs)
    return call


def emulating_op(op, kind: str, tally: Tally) -> Callable:
    """``op``'s kernel at the ADInplaceOrView key: its time on the current stream, then the op past this key, run
    below it as torch's own kernels at this key run theirs. A call on fake tensors (a graph being traced) is not
    counted."""
    def kernel(keyset, *args, **kwargs):
        tensors = list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
        if tensors and not is_fake(tensors[0]):
            ranks = named_group_ranks(args[-1])
            kind_of, whole = functional_cost(kind, tensors, args, ranks)
            costed(kind_of, tensors, whole, ranks, tally, DTENSOR)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)
    return kernel


def patched(module, name: str, wrapper: Callable) -> Callable:
    """Put ``wrapper`` in ``module.name``'s place and give back the original."""
    original = getattr(module, name)
    setattr(module, name, wrapper(original))
    return original


@contextlib.contextmanager
def emulated(links: Links | None, device: torch.device) -> Iterator[Tally | None]:
    """While the block runs, every collective of ``PATCHED`` and ``FUNCTIONAL`` costs its time (nothing where
    ``links`` is None)."""
    if links is None:
        yield None
        return
    tally = Tally(links, gpu_wait(links, device) if device.type == "cuda" else None)
    originals: list[tuple[str, Callable]] = []
    ops = torch.library.Library("_c10d_functional", "IMPL")  # its kernels go when it is destroyed
    try:
        for name, (kind, tensors) in PATCHED.items():
            if hasattr(dist, name):
                originals.append((name, patched(dist, name, lambda f, k=kind, t=tensors: emulating(f, k, t, tally))))
        for name, kind in FUNCTIONAL.items():
            if hasattr(torch.ops._c10d_functional, name):
                op = getattr(torch.ops._c10d_functional, name).default
                ops.impl(name, emulating_op(op, kind, tally), "ADInplaceOrView", with_keyset=True)
        yield tally
    finally:
        ops._destroy()
        for name, original in reversed(originals):
            setattr(dist, name, original)
