"""Communication emulated on a simulated rank (``--emulate_communication``).

Under the fake process group no collective moves data, so a simulated rank's step is compute only. Here each
collective the rank issues through ``torch.distributed`` (FSDP2's all-gathers and reduce-scatters, HSDP's
all-reduce, any other all-reduce or broadcast) first costs its time on the GPU, as a sleep enqueued on the stream
that is current where it is issued: FSDP2 issues its all-gathers on a stream of their own, ahead of the block that
needs them, and its reduce-scatters behind the backward, so the real schedule decides how much of that time the
compute hides, and the step's time is what FSDP2's overlap leaves. The time is ``Links.collective_s`` over the
group's own ranks (options/links.py). On a CPU nothing sleeps: the calls and bytes are counted, the seconds priced.

Not emulated: DTensor's functional collectives (TP's and CP's, gradient clipping's norms), which do not pass through
``torch.distributed``'s functions; real NCCL kernels' use of SMs, congestion and stragglers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from fsdp2bench.options.links import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER, Links


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


@dataclass
class Tally:
    """Each kind of collective the rank issued while emulating: calls, whole bytes, emulated seconds."""
    links: Links
    waited: bool  # the time was waited on the GPU; on a CPU it is only priced
    kinds: dict[str, dict] = field(default_factory=dict)

    def add(self, kind: str, group: int, whole: int, seconds: float) -> None:
        entry = self.kinds.setdefault(f"{kind} over {group}", {"calls": 0, "bytes": 0, "emulated_s": 0.0})
        entry["calls"] += 1
        entry["bytes"] += whole
        entry["emulated_s"] += seconds

    def per_step(self, steps: int) -> dict:
        """The tally over ``steps`` optimizer steps, each figure per step."""
        return {"links": vars(self.links), "steps": steps, "waited_on_the_gpu": self.waited,
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


def group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def emulating(original: Callable, kind: str, whole: Callable[[tuple, dict], int], tally: Tally,
              clock: float | None) -> Callable:
    """``original``, after its time on the current stream (``clock``: cycles per second; None on a CPU)."""
    def call(*args, **kwargs):
        ranks = group_ranks(kwargs.get("group"))
        size = whole(args, kwargs)
        seconds = tally.links.collective_s(kind, size, ranks)
        tally.add(kind, len(ranks), size, seconds)
        if clock is not None and seconds > 0:
            torch.cuda._sleep(int(seconds * clock))
        return original(*args, **kwargs)
    return call


@contextlib.contextmanager
def emulated(links: Links | None, device: torch.device) -> Iterator[Tally | None]:
    """While the block runs, every collective of ``PATCHED`` costs its time (nothing where ``links`` is None)."""
    if links is None:
        yield None
        return
    clock = cycles_per_second(device) if device.type == "cuda" else None
    tally = Tally(links, waited=clock is not None)
    originals = {name: getattr(dist, name) for name in PATCHED if hasattr(dist, name)}
    try:
        for name, original in originals.items():
            kind, whole = PATCHED[name]
            setattr(dist, name, emulating(original, kind, whole, tally, clock))
        yield tally
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
