"""The data every variant trains on: built-in text or a local file, cut into the same batches for all."""

from __future__ import annotations

import math
import os
import random

import torch

from fsdp2bench.cli import UserError, from_hub
from fsdp2bench.names import counted

_SUBJECTS = ["the miller", "a sailor", "the old queen", "my brother", "the clerk", "a fox", "the weaver", "our host"]
_VERBS = ["carried", "counted", "sold", "hid", "found", "painted", "mended", "lost"]
_OBJECTS = ["barrels of salt", "red lanterns", "silver spoons", "bolts of wool", "letters", "stones", "candles"]
_PLACES = ["by the river", "in the market", "at the gate", "under the bridge", "before dawn", "in the hall"]


def builtin_text(min_bytes: int) -> str:
    """Deterministic English-like prose with simple regularities a model picks up within a few steps."""
    rng = random.Random(0)
    lines, size = [], 0
    while size < min_bytes:
        count = rng.randint(2, 40)
        line = (f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {count} {rng.choice(_OBJECTS)} "
                f"{rng.choice(_PLACES)}, and {count + 1} more the next day.\n")
        lines.append(line)
        size += len(line)
    return "".join(lines)


# One pass over the built-in data is 160 steps at batch 2, block 128 on 8 ranks.
BUILTIN_TOKENS = 160 * 2 * 128 * 8


def load_tokens(dataset: str | None, tokenizer: str | None, vocab_size: int) -> torch.Tensor:
    """Token ids of the built-in text or of a local file: its bytes as they are (one byte each in
    memory: ``rank_batches`` widens only the batches it keeps), unless a tokenizer is given (tokenized
    a piece at a time, int64). Ids the model's embedding cannot hold are refused here, not as an
    IndexError mid-run."""
    raw = bytearray(builtin_text(BUILTIN_TOKENS).encode("utf-8")[:BUILTIN_TOKENS]) if dataset is None else \
        read_bytes(dataset)
    if tokenizer is None:
        ids = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        source = "--dataset's bytes" if dataset else "the built-in text's bytes"
    else:
        tok = load_tokenizer(tokenizer)
        if len(tok) > vocab_size:
            raise UserError(f"--tokenizer {tokenizer}: its vocabulary has {len(tok)} tokens, the model's "
                            f"{vocab_size}")
        ids = tokenize_in_pieces(tok, raw)
        source = f"--tokenizer {tokenizer}"
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise UserError(f"{source} give token ids up to {int(ids.max())}, but the model's vocabulary has "
                        f"{vocab_size} tokens")
    return ids


TOKENIZE_PIECE = 1 << 20  # bytes of text tokenized at a time: its Python lists are the transient cost


def tokenize_in_pieces(tok, raw: bytearray) -> torch.Tensor:
    """The text's token ids, tokenized a piece of about ``TOKENIZE_PIECE`` bytes at a time, each cut at
    a line's end (so that no word is split), as one int64 tensor."""
    pieces, start = [], 0
    while start < len(raw):
        stop = min(len(raw), start + TOKENIZE_PIECE)
        if stop < len(raw):
            newline = raw.find(b"\n", stop)
            stop = len(raw) if newline < 0 else newline + 1
        text = raw[start:stop].decode("utf-8", errors="replace")
        pieces.append(torch.tensor(tok(text)["input_ids"], dtype=torch.long))
        start = stop
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)


def read_bytes(dataset: str) -> bytearray:
    """The file's bytes, read into one buffer of their size."""
    try:
        with open(dataset, "rb") as f:
            buffer = bytearray(os.fstat(f.fileno()).st_size)
            read = f.readinto(buffer)
        return buffer[:read] if read < len(buffer) else buffer
    except OSError as exc:
        raise UserError(f"--dataset {dataset}: cannot read it ({exc.strerror})") from None


def load_tokenizer(tokenizer: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(tokenizer):
        return from_hub(AutoTokenizer.from_pretrained, tokenizer, "--tokenizer", "not a local directory",
                        "tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(tokenizer)
    except Exception as exc:
        raise UserError(f"--tokenizer {tokenizer}: cannot load it ({type(exc).__name__})") from None


# The built-in text is repeated at most to this many tokens: every rank keeps its share of them as int64 batches.
MAX_BUILTIN_TOKENS = 1 << 30


def repeated(tokens: torch.Tensor, need: int) -> torch.Tensor:
    """``tokens`` repeated end to end as often as it takes to hold ``need`` of them (once where they already do)."""
    return tokens.repeat(max(1, math.ceil(need / max(1, tokens.numel()))))


def builtin_for_steps(tokens: torch.Tensor, block_size: int, sequences: int, fraction: float, world_size: int,
                      max_steps: int | None) -> torch.Tensor:
    """The built-in text's tokens, repeated as often as the steps asked need: ``max_steps`` steps of ``sequences``
    blocks on each of ``world_size`` ranks (without it, one pass, and at least one step), so that any step of
    any block, batch and accumulation exists. A run that fits one pass trains on the same tokens as ever."""
    blocks = math.ceil((max_steps or 1) * world_size * sequences / fraction) + 1  # + 1: the fraction's rounding
    need = blocks * block_size
    if need > MAX_BUILTIN_TOKENS:
        kept = f" (--dataset_fraction {fraction:g} keeps that share of them)" if fraction < 1 else ""
        raise UserError(f"{counted(max_steps or 1, 'step')} of {sequences} x {block_size} tokens on "
                        f"{counted(world_size, 'rank')} "
                        f"would repeat the built-in text to {need:,} tokens{kept}, more than its "
                        f"{MAX_BUILTIN_TOKENS:,} (each rank keeps its share as int64): give fewer --max_steps"
                        f"{', a larger --dataset_fraction' if kept else ''}, or a --dataset")
    return repeated(tokens, need)


def rank_batches(tokens: torch.Tensor, block_size: int, batch_size: int, fraction: float,
                 rank: int, world_size: int, max_steps: int | None, microbatches: int = 1) -> torch.Tensor:
    """Cut tokens into blocks, keep ``fraction`` of them, deal them round-robin to ranks, batch them:
    (steps, K x B, block), each step its ``microbatches`` microbatches of ``batch_size`` blocks one after
    the other (so K microbatches of B see the blocks that one batch of K x B would).

    Every rank gets the same number of batches, in a fixed order, so all variants see identical data.
    One tensor, not one per step: a child of the fork server receives each tensor's storage as a file
    descriptor of its own, and Python passes at most 252 (1280 steps failed with "too many fds").
    """
    n_blocks = int(tokens.numel() // block_size * fraction)
    per_step = batch_size * microbatches
    steps = n_blocks // (world_size * per_step)
    if max_steps is not None:
        steps = min(steps, max_steps)
    if steps == 0:
        raise UserError(f"--block_size {block_size}, --batch_size {batch_size}, --gradient_accumulation_steps "
                        f"{microbatches}, --dataset_fraction {fraction:g}: the dataset gives "
                        f"{counted(n_blocks, 'block')}, too few for one step on {counted(world_size, 'rank')}")
    blocks = tokens[: n_blocks * block_size].view(n_blocks, block_size)
    mine = blocks[rank::world_size]
    # An int64 copy of the batches kept alone: the rest of the data is freed with ``tokens``.
    return mine[:steps * per_step].to(torch.long).view(steps, per_step, block_size)
