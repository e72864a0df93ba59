"""Which tensors are alive at a variant's memory peak, named, from the allocator's own history.

With ``--save_memory_snapshot`` each variant records every allocation of its process (size, address,
Python stack). Replaying that history finds the moment the live bytes peak and the blocks alive then.
A block is named by the parameter whose size it has (whole or sharded, fp32 or bf16, as FSDP2 holds
them: a gathered bf16 weight is the size of the whole weight in bf16) and by where it was allocated.
Two variants' peaks compared this way say which tensor one of them holds and the other does not.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from fsdp2bench.memory.accounting import local_tensor
from fsdp2bench.names import MIB

BLOCK_ROUNDING = 512  # the caching allocator rounds every request up to a multiple of this
TOP_GROUPS = 25
# Frames inside these are plumbing; the site of an allocation is the innermost frame outside them,
# unless it is in FSDP2 or the optimizer, which are what allocate the tensors that matter here.
PLUMBING = ("/torch/nn/modules/", "/torch/autograd/", "/torch/_tensor.py", "/torch/utils/", "/torch/_ops.py",
            "/torch/_compile.py", "/torch/_dynamo/", "/torch/distributed/tensor/", "/torch/amp/", "<")
INTERESTING = ("/torch/distributed/fsdp/", "/torch/optim/")


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK_ROUNDING) * BLOCK_ROUNDING


def parameter_sizes(model: nn.Module) -> dict[int, list[str]]:
    """Block size -> the parameters a block of that size may be: each one's local shard as held, and
    the whole parameter in fp32 and in bf16 (gathered for compute, or its gradient)."""
    sizes: dict[int, set[str]] = defaultdict(set)
    for name, param in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "").replace("._offload_wrapped_module", "")
        local = local_tensor(param)
        sizes[rounded(local.numel() * local.element_size())].add(f"{name} (local shard, {_dtype(local.dtype)})")
        for dtype in (torch.float32, torch.bfloat16):
            sizes[rounded(param.numel() * dtype.itemsize)].add(f"{name} (whole, {_dtype(dtype)})")
    return {size: sorted(names) for size, names in sizes.items()}


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def site(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost frame that is not torch's plumbing."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in INTERESTING) or not any(part in name for part in PLUMBING):
            return f"{_short(name)}:{frame.get('line')} {frame.get('name')}"
    return "unknown"


def _short(path: str) -> str:
    for root in ("/site-packages/", "/dist-packages/"):
        if root in path:
            return path.split(root, 1)[1]
    return path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1] if "/" in path else path


def live_at_peak(events: list[dict]) -> tuple[int, dict[int, dict]]:
    """Replay the history: (peak live bytes, the blocks alive at that moment by address)."""
    live: dict[int, dict] = {}
    total = peak = peak_index = 0
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, peak_index = total, i
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    alive: dict[int, dict] = {}
    for event in events[:peak_index + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_requested":
            alive.pop(event["addr"], None)
    return peak, alive


def peak_tensors(snapshot: dict, sizes: dict[int, list[str]], device: int, max_entries: int) -> dict:
    """The blocks alive at the peak of the recorded history, grouped by (name, site), largest first."""
    events = snapshot["device_traces"][device]
    peak, alive = live_at_peak(events)
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for event in alive.values():
        names = sizes.get(event["size"])
        label = " or ".join(names) if names else f"unnamed {event['size'] / MIB:.1f} MiB block"
        groups[(label, site(event.get("frames", [])))].append(event["size"])
    ordered = sorted(groups.items(), key=lambda item: -sum(item[1]))
    return {"peak_mib": peak / MIB, "events": len(events),
            # A full buffer has dropped its oldest events: blocks allocated before them are missing.
            "history_complete": len(events) < max_entries,
            "groups": [{"tensor": label, "site": where, "blocks": len(found), "mib": sum(found) / MIB}
                       for (label, where), found in ordered[:TOP_GROUPS]],
            "other_mib": sum(sum(found) for _, found in ordered[TOP_GROUPS:]) / MIB}


def difference(a: dict, b: dict, a_name: str, b_name: str) -> list[dict]:
    """Per (tensor, site): MiB alive at ``a``'s peak minus ``b``'s, the groups that differ, largest first."""
    def by_key(found: dict) -> dict[tuple[str, str], float]:
        return {(g["tensor"], g["site"]): g["mib"] for g in found["groups"]}

    ma, mb = by_key(a), by_key(b)
    rows = [{"tensor": t, "site": s, f"{a_name}_mib": ma.get((t, s), 0.0), f"{b_name}_mib": mb.get((t, s), 0.0),
             "difference_mib": ma.get((t, s), 0.0) - mb.get((t, s), 0.0)} for t, s in set(ma) | set(mb)]
    return sorted((r for r in rows if r["difference_mib"]), key=lambda r: (-abs(r["difference_mib"]), r["tensor"]))
