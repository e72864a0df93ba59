"""Run names, keys of the files and units, and counts said with their nouns, shared by the benchmark and the plots (no
torch here)."""

from __future__ import annotations

MIB = 1024 * 1024
GIB = 1024 * MIB

# The upstream's run names, in its order.
VARIANTS = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_not_fixed",
            "torch_optimizer_before_fsdp_fixed", "accelerate"]
INTENDED = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_fixed", "accelerate"]
UNFIXED = "torch_optimizer_before_fsdp_not_fixed"
ACCELERATE = "accelerate"
# What the figures call them (docs/output.md has the key): the optimizer made after fully_shard, before it
# and left stale, before it and fixed, and accelerate's prepare().
SHORT_NAMES = {"torch_optimizer_after_fsdp": "after", "torch_optimizer_before_fsdp_not_fixed": "before, stale",
               "torch_optimizer_before_fsdp_fixed": "before, fixed", "accelerate": "accelerate"}


def short_name(name: str) -> str:
    return SHORT_NAMES.get(name, name)

# The upstream's per-rank trace: four lists of equal length, one entry per sample.
TRACE_KEYS = ("timestamps", "allocated_memory", "reserved_memory", "virtual_memory")
# What the memory model counts, and when.
STATE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "stale_param_bytes", "unreduced_grad_bytes")
PHASES = ("end_of_setup", "before_zero_grad", "end_of_training")
MICROBATCH_PHASE = "between_microbatches"  # with gradient accumulation only
PEAK_PHASES = ("before_zero_grad", MICROBATCH_PHASE)  # where the state of a step is at its largest


def state_bytes(held: dict) -> int:
    """The state counted at one moment, in bytes; summaries written before a key existed count it as 0."""
    return sum(held.get(k, 0) for k in STATE_KEYS)


def step_peak_state(entry: dict) -> dict:
    """A summary entry's state at the step peak, per key: the rank and moment (after the optimizer step,
    or between microbatches under accumulation) that held the most."""
    held = [rank[phase] for rank in entry["accounting"] for phase in PEAK_PHASES if phase in rank]
    worst = max(held, key=state_bytes)
    return {k: worst.get(k, 0) for k in STATE_KEYS}


def phases(accumulates: bool) -> tuple[str, ...]:
    """The moments at which a variant's state is counted."""
    return PHASES + (MICROBATCH_PHASE,) if accumulates else PHASES


def rank_file(name: str, suffix: str, rank: int) -> str:
    """Rank 0 keeps the upstream file name; rank r adds ``_rank<r>``."""
    stem, ext = suffix.rsplit(".", 1)
    return f"{name}_{stem}{'' if rank == 0 else f'_rank{rank}'}.{ext}"


def simulated_dir_name(world_size: int) -> str:
    """Where a sweep puts the traces of every rank it played at world size N."""
    return f"simulated_N{world_size}"


def size_unit(max_bytes: float) -> tuple[float, str]:
    """The unit that suits the largest value: GiB from 1 GiB, MiB from 1 MiB, else KiB."""
    for divisor, name in ((GIB, "GiB"), (MIB, "MiB")):
        if max_bytes >= divisor:
            return divisor, name
    return 1024, "KiB"


def size_said(n_bytes: float, digits: int = 2) -> str:
    """A size in the unit that fits it ("1.50 GiB", "382 MiB", "96.50 KiB", "0 bytes")."""
    if n_bytes < 1024:
        return f"{n_bytes:.0f} bytes"
    divisor, unit = size_unit(n_bytes)
    return f"{n_bytes / divisor:.{digits}f} {unit}"


def seconds_said(seconds: float) -> str:
    """A time in the unit that fits it ("1.234 s", "8.75 ms", "12.3 us")."""
    if seconds >= 0.1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def counted(n: float, noun: str, plural: str | None = None) -> str:
    """A count with its noun in the number it takes ("1 answer", "0 answers", "2 shared processes", "1.5 calls");
    ``plural`` where the noun does not take -s or -es."""
    number = f"{n:g}" if isinstance(n, float) else str(n)
    if n == 1:
        return f"{number} {noun}"
    return f"{number} {plural or noun + ('es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's')}"


def listed(items: list[str], shown: int) -> str:
    """The first ``shown`` items for a sentence, with "..." after them where some are left out."""
    return ", ".join(items[:shown]) + (", ..." if len(items) > shown else "")


def ranks_said(figures: list[str], shown: int) -> str:
    """One figure per rank (0, 1, ...) for a sentence, the first ``shown`` of them, saying which ranks they are and,
    where some are left out, of how many: "ranks 0-3 of 8: a, b, c, d, ...", "ranks 0-1: a, b", "rank 0: a"."""
    kept = min(shown, len(figures))
    span = "rank 0" if kept == 1 else f"ranks 0-{kept - 1}"
    return f"{span}{f' of {len(figures)}' if len(figures) > kept else ''}: {listed(figures, shown)}"
