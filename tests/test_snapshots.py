"""Naming the tensors alive at a memory peak, from an allocator history (snapshots.py).

The history here is written by hand in the allocator's own format, so that the replay's answer is
known exactly; a GPU run records the real one with ``--save_memory_snapshot``.
"""

from __future__ import annotations

from torch import nn

from fsdp2bench.memory import snapshots
from fsdp2bench.names import MIB

FSDP_FRAME = {"filename": "/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "line": 7,
              "name": "alloc_all_gather_outputs"}
PLUMBING_FRAME = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}
MODEL_FRAME = {"filename": "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py", "line": 9, "name": "forward"}


def alloc(addr: int, size: int, frames: list[dict]) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr: int) -> dict:
    return {"action": "free_requested", "addr": addr, "size": 0, "frames": []}


def history(extra: list[dict]) -> dict:
    return {"device_traces": [[alloc(1, 32256, [PLUMBING_FRAME, MODEL_FRAME]), *extra, free(1)]]}


def test_the_peak_is_found_and_its_blocks_are_named_by_parameter_and_site():
    model = nn.Embedding(1000, 8)  # 32000 bytes in fp32 (32256 once rounded), 16000 in bf16 (16384)
    sizes = snapshots.parameter_sizes(model)
    assert sizes[32256] == ["weight (local shard, float32)", "weight (whole, float32)"]
    assert sizes[16384] == ["weight (whole, bfloat16)"]
    events = [alloc(2, 16384, [PLUMBING_FRAME, FSDP_FRAME, MODEL_FRAME]), alloc(3, 1024, [MODEL_FRAME]),
              free(3), free(2), alloc(4, 512, [MODEL_FRAME])]
    found = snapshots.peak_tensors(history(events), sizes, device=0, max_entries=100)
    assert found["peak_mib"] == (32256 + 16384 + 1024) / MIB
    assert found["history_complete"] is True
    groups = {(g["tensor"], g["site"]): g["mib"] for g in found["groups"]}
    assert groups == {
        ("weight (local shard, float32) or weight (whole, float32)",
         "transformers/models/qwen2/modeling_qwen2.py:9 forward"): 32256 / MIB,
        ("weight (whole, bfloat16)", "torch/distributed/fsdp/_fully_shard/_fsdp_param.py:7 alloc_all_gather_outputs"):
            16384 / MIB,
        ("unnamed 0.0 MiB block", "transformers/models/qwen2/modeling_qwen2.py:9 forward"): 1024 / MIB}


def test_a_full_history_says_it_may_have_lost_its_oldest_blocks():
    found = snapshots.peak_tensors(history([]), {}, device=0, max_entries=2)
    assert found["history_complete"] is False


def test_two_peaks_differ_by_the_tensor_only_one_of_them_holds():
    sizes = snapshots.parameter_sizes(nn.Embedding(1000, 8))
    gathered = alloc(2, 16384, [FSDP_FRAME])
    with_it = snapshots.peak_tensors(history([gathered]), sizes, 0, 100)
    without = snapshots.peak_tensors(history([]), sizes, 0, 100)
    rows = snapshots.difference(without, with_it, "accelerate", "torch")
    assert rows == [{"tensor": "weight (whole, bfloat16)",
                     "site": "torch/distributed/fsdp/_fully_shard/_fsdp_param.py:7 alloc_all_gather_outputs",
                     "accelerate_mib": 0.0, "torch_mib": 16384 / MIB, "difference_mib": -16384 / MIB}]
    assert snapshots.difference(with_it, with_it, "accelerate", "torch") == []
