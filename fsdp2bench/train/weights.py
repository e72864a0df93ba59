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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

FLOAT32 = 4  # bytes
PAGE = mmap.PAGESIZE  # bytes; where a mapping may start
SMALL = 128 * 1024  # bytes; below this, glibc's malloc serves an allocation from its heap


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


def give_weights(model: nn.Module, weights: SharedWeights, draw, threads: int) -> str | None:
    """Give the model's parameters (on the meta device) the rank's weights, drawn first by
    ``draw(named_tensors)`` if no variant has: "drew" or "mapped"; None where the file cannot be
    used (the parameters are then untouched)."""
    named = list(model.named_parameters())
    if not named or any(p.dtype != torch.float32 or p.numel() == 0 for _, p in named):
        return None
    found = shared_tensors(weights, named, draw)
    if found is None:
        return None
    mapped, drew = found
    map_every_page(mapped, threads)
    # A small tensor would have come from the heap, packed with others, not from pages of its own.
    mapped = [t.clone() if t.numel() * FLOAT32 < SMALL else t for t in mapped]
    for (_, param), tensor in zip(named, mapped):  # the same objects: tied parameters stay tied
        torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))
    return "drew" if drew else "mapped"


def shared_tensors(weights: SharedWeights, named: list, fill) -> tuple[list[torch.Tensor], bool] | None:
    """The tensors of ``named`` (name, meta tensor) from the shared file, copy-on-write, filled first
    by ``fill(named_views)`` if no process has; and whether this one filled it. None where the file
    cannot be used."""
    spans = layout(named)
    size = spans[-1][0] + spans[-1][1]
    try:
        fd = os.open(weights.path, os.O_RDWR)
    except OSError:  # the launcher is gone, or /proc is not readable here
        return None
    try:
        with locked(fd):
            filled = os.fstat(fd).st_size != size  # a filler that died left size + 1 (fill_file)
            if filled:
                fill_file(fd, size, named, spans, fill)
        return [mapped_private(fd, span, t.shape, t.dtype) for (_, t), span in zip(named, spans)], filled
    except OSError:  # no memory to map it (ENOMEM)
        return None
    finally:
        os.close(fd)


def layout(named: list) -> list[tuple[int, int]]:
    """(offset, bytes) of each tensor in the file. Each starts on a page, so that each is mapped
    on its own and unmapped when it is freed, as its own allocation would be (``fully_shard`` frees
    them one by one)."""
    spans, offset = [], 0
    for _, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        spans.append((offset, nbytes))
        offset += -(-nbytes // PAGE) * PAGE
    return spans


def mapped_private(fd: int, span: tuple[int, int], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """One tensor's pages, copy-on-write."""
    offset, nbytes = span
    region = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, offset=offset)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


TOUCH_PIECE = 16_384  # pages read by one task: below torch's grain size, so each runs on its own thread only


def map_every_page(tensors: list[torch.Tensor], threads: int) -> None:
    """Read one number a page, on ``threads`` threads, so that every page is mapped now, as in a
    build that wrote them (0.1 s a GiB on one thread)."""
    strided = [t.view(-1)[::PAGE // FLOAT32] for t in tensors]
    pieces = [s[i:i + TOUCH_PIECE] for s in strided for i in range(0, s.numel(), TOUCH_PIECE)]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(torch.sum, pieces))


@contextlib.contextmanager
def locked(fd: int):
    """The rank's variants one at a time: a process that dies releases it."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def fill_file(fd: int, size: int, named: list, spans: list[tuple[int, int]], fill) -> None:
    """The tensors into the file. Its size says they are complete only once they are."""
    os.ftruncate(fd, size + 1)
    # A memfd has no size limit of its own (unlike /dev/shm), so its pages are simply taken as the
    # filling threads first write them, in parallel.
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    fill([(name, flat[offset:offset + nbytes].view(t.dtype).view(t.shape))
          for (name, t), (offset, nbytes) in zip(named, spans)])
    del flat  # the tensors that view the region, before it can close
    region.close()
    os.ftruncate(fd, size)
