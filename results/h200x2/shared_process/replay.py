"""Where the upstream's last MiB comes from: the four variants replayed in ONE process per rank.

The upstream runs its variants one after the other in one process, in the order fixed, not fixed,
after, accelerate; this project gives each its own process. This replay uses the project's own
variants (utils.py) and step (runner.TrainStep), in the upstream's order and in one process, and
after each variant lists the device memory still allocated once every object of it is gone, with
the stack that allocated each block (the memory snapshot). Beside the allocator's peak of allocated
bytes (whole blocks, the figure both benchmarks report) it reads the peak of requested bytes (what
the tensors asked for). Run it from the repository root, with all four variants in one process or
one of them alone:

    torchrun --nproc_per_node 2 results/h200x2/shared_process/replay.py OUT.json STEPS [VARIANT,...]
"""

from __future__ import annotations

import gc
import json
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import utils  # noqa: E402
from fsdp2bench.data import load_tokens, rank_batches  # noqa: E402
from fsdp2bench.model import build_model, layer_class_names, load_config  # noqa: E402
from fsdp2bench.names import MIB  # noqa: E402
from fsdp2bench.runner import TrainStep, deterministic  # noqa: E402

UPSTREAM_ORDER = ["torch_optimizer_before_fsdp_fixed", "torch_optimizer_before_fsdp_not_fixed",
                  "torch_optimizer_after_fsdp", "accelerate"]


def live_blocks() -> list[dict]:
    """Every allocated block, with the frames (file:line function) that allocated it."""
    blocks = []
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                          for f in block.get("frames", [])]
                blocks.append({"bytes": block["size"], "frames": [f for f in frames if ".py:" in f][:12]})
    return blocks


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    order = sys.argv[3].split(",") if len(sys.argv) > 3 else UPSTREAM_ORDER
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    deterministic(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    dist.init_process_group("nccl", device_id=device)
    mesh = init_device_mesh("cuda", (world,))
    config = load_config("qwen2.5-1.5b")
    batches = rank_batches(load_tokens(None, None, config.vocab_size), 128, 2, 1.0, rank, world, steps)
    results = []
    for name in order:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model, _ = build_model(config, torch.device("cpu"), 421, max(1, len(os.sched_getaffinity(0)) // world))
        layers = layer_class_names(model)
        prep = utils.VARIANTS[name](model, utils.Context(device, mesh, 3e-5, layers, lambda *a, **k: None))
        del model
        step = TrainStep(prep)
        losses = [step(batch.to(device)).item() for batch in batches]
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        requested_peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
        del prep, step
        gc.collect()
        torch.cuda.synchronize()
        left = live_blocks()
        results.append({"variant": name, "allocated_before_mib": before / MIB, "peak_allocated_mib": peak / MIB,
                        "peak_requested_mib": requested_peak / MIB,
                        "peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
                        "allocated_after_mib": torch.cuda.memory_allocated() / MIB,
                        "last_loss": losses[-1], "blocks_left": left})
        if rank == 0:
            print(f"{name}: before {before / MIB:.1f} MiB, peak {peak / MIB:.3f} MiB (requested "
                  f"{requested_peak / MIB:.3f} MiB), left "
                  f"{sum(b['bytes'] for b in left) / MIB:.3f} MiB in {len(left)} blocks", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": steps, "world_size": world, "versions": {"torch": torch.__version__},
                       "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
