"""Reproduce transformers issue #43749, "FSDP_CPU_RAM_EFFICIENT_LOADING broken".

With accelerate's FSDP CPU-RAM-efficient loading switched on, only rank 0 should read the weights
into host memory; the other ranks should get an empty (meta) model. This script turns it on as
``accelerate launch`` does with ``fsdp_cpu_ram_efficient_loading: true``, calls ``from_pretrained``
on every rank, and prints what each rank added to its peak resident memory:

    torchrun --nproc_per_node 2 examples/cpu_ram_efficient_loading.py CHECKPOINT_DIR

CHECKPOINT_DIR is any local Hugging Face causal LM directory (``loading.py`` writes one, e.g.
``out/checkpoint-qwen2.5-1.5b-bfloat16``). It imports nothing from this project, so it can be
attached to a report as it is. ``loading.py --modes accelerate`` measures the same path inside
``accelerator.prepare`` (docs/loading.md).
"""

from __future__ import annotations

import os
import resource
import sys

import torch
import torch.distributed as dist


def peak_rss_mib() -> float:
    """The kernel's high-water mark of this process's resident memory, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: torchrun --nproc_per_node N examples/cpu_ram_efficient_loading.py CHECKPOINT_DIR")
    # What `accelerate launch` sets for an FSDP config with fsdp_cpu_ram_efficient_loading: true.
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    dist.init_process_group("gloo")
    from transformers import AutoModelForCausalLM

    before = peak_rss_mib()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    added = peak_rss_mib() - before
    params = list(model.parameters())
    fp32_mib = sum(p.numel() for p in params) * 4 / 2**20
    on_host = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu") / 2**20
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (dist.get_rank(), added, on_host))
    if dist.get_rank() == 0:
        print(f"model: {fp32_mib:.0f} MiB of fp32 parameters")
        for rank, added_mib, host_mib in rows:
            expected = "the weights" if rank == 0 else "nothing (meta tensors)"
            print(f"rank {rank}: from_pretrained added {added_mib:.0f} MiB to its peak RSS; its parameters hold "
                  f"{host_mib:.0f} MiB on the host; expected: {expected}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
