"""Communication emulated on a simulated rank (``--emulate_communication``).

Under the fake process group no collective moves data, so a simulated rank's step is compute only. Here each
collective the rank issues first costs its time on the GPU, as a sleep enqueued on the stream that is current where
it is issued: FSDP2 issues its all-gathers on a stream of their own, ahead of the block that needs them, and its
reduce-scatters behind the backward, so the real schedule decides how much of that time the compute hides, and the
step's time is what FSDP2's overlap leaves. Two doors are watched: ``torch.distributed``'s functions (FSDP2's
all-gathers and reduce-scatters, HSDP's all-reduce, broadcasts) and DTensor's functional collectives (TP's and CP's
gathers, scatters, all-to-alls and ring sends, the all-reduce of a norm over sharded gradients), which go to the
backend through ``torch.distributed._functional_collectives`` instead. The time is ``Links.collective_s`` over the
group's own ranks (options/links.py). On a CPU nothing sleeps: the calls and bytes are counted, the seconds priced.

Every other step is emulated (``emulates``): the compute alone and the step with its communication are timed in one
process, the same allocator state and the same compiled graphs, which two launches (up to 6% apart on an H100, where
the exposed communication was about 1% of a step) cannot compare.

Not emulated: a functional collective inside a compiled graph runs from the graph, not through Python; it is counted
once when the graph is traced and marked ``traced_in_compiled_graph`` (TP or CP with --compile). Real NCCL kernels'
use of SMs, congestion and stragglers are not modelled.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fsdp2bench.options.links import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, DTENSOR, REDUCE_SCATTER, SEND,
                                      Links)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return kwargs[name] if name in kwargs else args[index]


# torch.distributed's function -> (the kind of ring it runs, the whole it moves: the gathered output, the
# reduce-scattered input, the all-reduced or broadcast tensor). FSDP2 calls the ``*_single`` forms from torch 2.12
# on, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before; a name this torch lacks is left alone.
PATCHED: dict[str, tuple[str, Callable[[tuple, dict], int]]] = {
    "all_gather_single": (ALL_GATHER, lambda a, k: _bytes(_arg(a, k, 0, "output_tensor"))),
    "all_gather_into_tensor": (ALL_GATHER, lambda a, k: _bytes(_arg(a, k, 0, "output_tensor"))),
    "reduce_scatter_single": (REDUCE_SCATTER, lambda a, k: _bytes(_arg(a, k, 1, "input"))),
    "reduce_scatter_tensor": (REDUCE_SCATTER, lambda a, k: _bytes(_arg(a, k, 1, "input"))),
    "all_reduce": (ALL_REDUCE, lambda a, k: _bytes(_arg(a, k, 0, "tensor"))),
    "all_gather": (ALL_GATHER, lambda a, k: sum(_bytes(t) for t in _arg(a, k, 0, "tensor_list"))),
    "reduce_scatter": (REDUCE_SCATTER, lambda a, k: sum(_bytes(t) for t in _arg(a, k, 1, "input_list"))),
    "broadcast": (BROADCAST, lambda a, k: _bytes(_arg(a, k, 0, "tensor"))),
}


# DTensor's functional collectives -> (kind, how many times its first argument the whole is: G for a gather,
# whose output is G inputs). Each takes its tensor first and a ``group`` (a group, its name, a mesh, a mesh and a
# dimension, or ranks).
FUNCTIONAL: dict[str, tuple[str, bool]] = {
    "all_gather_single": (ALL_GATHER, True), "all_gather_tensor": (ALL_GATHER, True),
    "reduce_scatter_single": (REDUCE_SCATTER, False), "reduce_scatter_tensor": (REDUCE_SCATTER, False),
    "all_reduce": (ALL_REDUCE, False), "broadcast": (BROADCAST, False),
    "all_to_all_single": (ALL_TO_ALL, False), "permute_tensor": (SEND, False),
}


def emulates(step: int) -> bool:
    """Whether ``step`` runs with its communication emulated: the odd ones. Step 0, warm-up in every run (the first
    allocations, FSDP2's lazy set-up, compiling), then runs without sleeps, and from step 2 on each compute-only
    step has an emulated one beside it."""
    return step % 2 == 1


@dataclass
class Tally:
    """Each kind of collective the rank issued in the steps it emulated: calls, whole bytes, emulated seconds."""
    links: Links
    waited: bool  # the time was waited on the GPU; on a CPU it is only priced
    kinds: dict[str, dict] = field(default_factory=dict)
    traced_in_compiled_graph: set[str] = field(default_factory=set)  # counted at tracing only: see the docstring
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
        return {"links": vars(self.links), "emulated_steps": steps, "waited_on_the_gpu": self.waited,
                "per_step": {kind: {k: v / steps for k, v in entry.items()} for kind, entry in self.kinds.items()},
                "emulated_s_per_step": sum(e["emulated_s"] for e in self.kinds.values()) / steps,
                "traced_in_compiled_graph": sorted(self.traced_in_compiled_graph)}


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


def group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def functional_ranks(group) -> list[int]:
    """The ranks of a functional collective's ``group``, in any of the forms it takes."""
    if isinstance(group, (list, tuple)) and group and all(isinstance(r, int) for r in group):
        return list(group)
    if isinstance(group, tuple):  # (mesh, dimension)
        mesh, dim = group
        return group_ranks(mesh.get_group(dim))
    if isinstance(group, str):
        return group_ranks(dist.distributed_c10d._resolve_process_group(group))
    return group_ranks(group.get_group() if hasattr(group, "get_group") else group)


def costed(kind: str, size: int, ranks: list[int], tally: Tally, clock: float | None, tag: str = "") -> None:
    """Tally one collective (its kind ``tag``ged) and, on a GPU, wait its time on the current stream; nothing in a
    step not emulated (which runs the same wrappers up to here, so that the two halves' host work is alike)."""
    if not tally.on:
        return
    seconds = tally.links.collective_s(kind, size, ranks)
    tally.add(kind, len(ranks), size, seconds, tag)
    if clock is not None and seconds > 0:
        torch.cuda._sleep(int(seconds * clock))


def emulating(original: Callable, kind: str, whole: Callable[[tuple, dict], int], tally: Tally,
              clock: float | None) -> Callable:
    """``original``, after its time on the current stream (``clock``: cycles per second; None on a CPU)."""
    def call(*args, **kwargs):
        costed(kind, whole(args, kwargs), group_ranks(kwargs.get("group")), tally, clock)
        return original(*args, **kwargs)
    return call


def emulating_functional(original: Callable, kind: str, gathers: bool, tally: Tally,
                         clock: float | None) -> Callable:
    """The same for a functional collective; inside a graph being compiled it is only noted (see the docstring)."""
    signature = inspect.signature(original)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        tensor, ranks = next(iter(bound.values())), functional_ranks(bound["group"])
        if torch.compiler.is_compiling() or torch._guards.detect_fake_mode(tensor) is not None:
            tally.traced_in_compiled_graph.add(kind)
        else:
            costed(kind, _bytes(tensor) * (len(ranks) if gathers else 1), ranks, tally, clock, DTENSOR)
        return original(*args, **kwargs)
    return call


def patched(module, name: str, wrapper: Callable) -> Callable:
    """Put ``wrapper`` in ``module.name``'s place and give back the original."""
    original = getattr(module, name)
    setattr(module, name, wrapper(original))
    return original


@contextlib.contextmanager
def emulated(links: Links | None, device: torch.device) -> Iterator[Tally | None]:
    """While the block runs, every collective of ``PATCHED`` costs its time (nothing where ``links`` is None)."""
    if links is None:
        yield None
        return
    clock = cycles_per_second(device) if device.type == "cuda" else None
    tally = Tally(links, waited=clock is not None)
    originals: list[tuple[object, str, Callable]] = []
    try:
        for name, (kind, whole) in PATCHED.items():
            if hasattr(dist, name):
                originals.append((dist, name, patched(dist, name, lambda f, k=kind, w=whole: emulating(
                    f, k, w, tally, clock))))
        for name, (kind, gathers) in FUNCTIONAL.items():
            if hasattr(funcol, name):
                originals.append((funcol, name, patched(funcol, name, lambda f, k=kind, g=gathers: (
                    emulating_functional(f, k, g, tally, clock)))))
        yield tally
    finally:
        for module, name, original in reversed(originals):
            setattr(module, name, original)
