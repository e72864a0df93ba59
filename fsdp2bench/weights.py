"""The initial weights of a CPU build, drawn once per rank and mapped by every variant it runs.

Every variant starts from the same weights (one seed), and drawing them is most of a CPU build:
for the 1.5B model, eight processes drawing 1.5 B numbers each into fresh pages took 3-7 s on
2x H200. So each rank's launcher process holds one anonymous in-memory file (a memfd, alive as
long as that process, so nothing is left behind whatever ends the run). The first variant to
need the weights draws them into it under a lock; every variant then maps it copy-on-write and
points its parameters at it. RSS counts those pages in every process that maps them, as it
counts a copy of its own, and a variant that wrote to its CPU parameters would get private pages
(none does). Where the file cannot be used, a variant draws its own: the weights are the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from dataclasses import dataclass

import torch
from torch import nn

FLOAT32 = 4  # bytes
PAGE_FLOATS = 1024  # float32 numbers in a 4 KiB page


@dataclass(frozen=True)
class SharedWeights:
    """A rank's file, as its children reach it: the launcher process's descriptor, under /proc."""
    pid: int
    fd: int

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


def create() -> SharedWeights | None:
    """In the launcher's process, before its variants start: the file, empty; None without memfd."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    return SharedWeights(os.getpid(), os.memfd_create("fsdp2bench-weights"))


def place(model: nn.Module, weights: SharedWeights, draw) -> str | None:
    """Point the model's parameters at the rank's weights, drawn first by ``draw(named_tensors)``
    if no variant has: "drew" or "mapped"; None where the file cannot be used."""
    named = list(model.named_parameters())
    if not named or any(p.dtype != torch.float32 for _, p in named):
        return None
    size = sum(p.numel() for _, p in named) * FLOAT32
    try:
        fd = os.open(weights.path, os.O_RDWR)
    except OSError:  # the launcher is gone, or /proc is not readable here
        return None
    try:
        with locked(fd):
            drew = os.fstat(fd).st_size != size  # a drawer that died left size + 1 (draw_into)
            if drew:
                draw_into(fd, size, named, draw)
        flat = torch.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE), dtype=torch.float32)
    except OSError:  # no memory to map it (ENOMEM)
        return None
    finally:
        os.close(fd)
    flat[::PAGE_FLOATS].sum()  # map every page now, as a build that wrote them would have
    with torch.no_grad():
        for (_, param), view in zip(named, views(flat, named)):
            param.data = view
    return "drew" if drew else "mapped"


@contextlib.contextmanager
def locked(fd: int):
    """The rank's variants one at a time: a process that dies releases it."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def draw_into(fd: int, size: int, named: list, draw) -> None:
    """The weights into the file. Its size says they are complete only once they are."""
    os.ftruncate(fd, size + 1)
    # A memfd has no size limit of its own (unlike /dev/shm), so its pages are simply taken as the
    # drawing threads first write them, in parallel.
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    flat = torch.frombuffer(region, dtype=torch.float32)
    draw([(name, view) for (name, _), view in zip(named, views(flat, named))])
    del flat  # the tensors that view the region, before it can close
    region.close()
    os.ftruncate(fd, size)


def views(flat: torch.Tensor, named: list) -> list[torch.Tensor]:
    """Each parameter's slice of the file, in ``named_parameters`` order."""
    out, offset = [], 0
    for _, param in named:
        out.append(flat[offset:offset + param.numel()].view(param.shape))
        offset += param.numel()
    return out
