"""A collective's time held on the GPU the way NCCL's kernel holds it: CTAs that occupy SMs and move bytes.

A real NCCL ring kernel runs one CTA per channel for as long as the collective lasts, polling its peers, and reads
and writes the bytes that cross the wire through the GPU's memory; the compute beside it loses those SMs and that
memory bandwidth. ``torch.cuda._sleep`` (one thread) takes neither. Here ``channels`` programs of 512 threads each
spin on the GPU's global timer for the collective's time and, paced evenly over it, read and write back in place
the bytes the rank would receive: the collective's own tensor, wrapped round where the wire moves more than it
holds (values unchanged: each word is stored as it was read). Triton (shipped with torch's CUDA builds) compiles
it; where Triton is absent the emulation sleeps instead and says so.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

THREADS = 512  # a CTA of NCCL's simple protocol: its default NCCL_NTHREADS
BLOCK = 2048  # 32-bit words one program reads and writes per paced chunk (8 KiB)


@functools.cache
def hold_kernel() -> Callable | None:
    """The Triton kernel, compiled on first use; None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def now_ns():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    # Not specialised on its arguments' values or alignment: one compiled kernel per word size, compiled before the
    # steps are timed (each new specialisation would compile in the middle of a timed step).
    @triton.jit(do_not_specialize=["words", "n_words", "chunks", "duration_ns"])
    def hold(words, n_words, chunks, duration_ns, CHANNELS: tl.constexpr, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        start = now_ns()
        mine = (chunks - program + CHANNELS - 1) // CHANNELS  # chunks program, program + CHANNELS, ...
        pace = duration_ns // tl.maximum(mine, 1)
        k = 0
        while k < mine:
            due = start + k * pace
            now = now_ns()
            while now < due:
                now = now_ns()
            chunk = (program + k * CHANNELS).to(tl.int64)
            offsets = (chunk * BLOCK + tl.arange(0, BLOCK)) % n_words
            tl.store(words + offsets, tl.load(words + offsets))
            k += 1
        now = now_ns()
        while now - start < duration_ns:
            now = now_ns()

    return hold


def word_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s storage as 32-bit words (bytes where its size is not a multiple of 4); None where it is not one
    contiguous block or is empty."""
    if tensor.numel() == 0 or not tensor.is_contiguous():
        return None
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.view(torch.int32) if flat.numel() % 4 == 0 else flat


def held(kernel: Callable, seconds: float, channels: int, words: torch.Tensor, wire_bytes: int) -> None:
    """Enqueue ``kernel`` on the current stream: ``channels`` CTAs for ``seconds``, moving ``wire_bytes`` through
    ``words`` (``word_view``'s), wrapped round them."""
    chunks = -(-wire_bytes // (BLOCK * words.element_size()))
    kernel[(channels,)](words, words.numel(), chunks, int(seconds * 1e9), CHANNELS=channels, BLOCK=BLOCK,
                        num_warps=THREADS // 32)
