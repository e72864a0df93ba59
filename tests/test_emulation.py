"""Communication emulated on a simulated rank (--emulate_communication): the link model's arithmetic for each group
shape, every collective the rank issues counted to the byte against the projection's own count, the labels, and
bad input in one line."""

from __future__ import annotations

import json

import pytest
from conftest import load, refusal, run_script

from fsdp2bench.options.links import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Links, parse_links
from fsdp2bench.run import arguments

LINKS = Links()  # 8 GPUs a node, NVLink 450 GB/s, a 50 GB/s NIC a GPU, 1 us a step within a node, 5 across


@pytest.mark.parametrize("ranks, gbps", [
    (range(8), 450.0),  # FSDP over one node: NVLink
    (range(64), 400.0),  # FSDP over 8 whole nodes: 8 rails of 50 GB/s, under NVLink's 450
    (range(0, 64, 8), 50.0),  # HSDP's replicas, one GPU a node: one NIC
    (range(0, 64, 2), 200.0),  # FSDP beside TP 2 over 8 nodes: 4 members a node, 4 rails
    (range(0, 16, 8), 50.0),  # CP 2 across two nodes of TP 8: one member a node
    (range(4), 450.0),  # TP inside a node
])
def test_a_group_moves_across_nodes_on_one_nic_per_member_in_a_node(ranks, gbps):
    assert LINKS.group_gbps(list(ranks)) == gbps


def test_a_ring_collective_costs_its_share_of_the_whole_plus_a_latency_a_step():
    """All-gather of 64 MB over 64 ranks of 8 whole nodes: 63/64 x 64e6 B at 400 GB/s, and 63 steps of 5 us;
    all-reduce twice both; one rank alone: nothing."""
    whole, ranks = 64_000_000, list(range(64))
    gather = 63 / 64 * whole / 400e9 + 63 * 5e-6
    assert LINKS.collective_s(ALL_GATHER, whole, ranks) == pytest.approx(gather)
    assert LINKS.collective_s(REDUCE_SCATTER, whole, ranks) == pytest.approx(gather)
    assert LINKS.collective_s(ALL_REDUCE, whole, ranks) == pytest.approx(2 * gather)
    assert LINKS.collective_s(ALL_GATHER, whole, list(range(8))) == pytest.approx(7 / 8 * whole / 450e9 + 7e-6)
    assert LINKS.collective_s(ALL_GATHER, whole, [3]) == 0.0
    a100 = parse_links("300,25")  # A100 nodes, 200 Gb/s a GPU: 4 of a node's GPUs in a group, 4 rails
    assert a100.group_gbps(list(range(0, 32, 2))) == 100.0


def emulated_run(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "out"
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--simulate_world_size", "8", "--max_steps",
                       "4", "--variants", "torch_optimizer_after_fsdp", "--emulate_communication", "--output_dir",
                       str(out), *extra], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load(out / "summary.json"), " ".join(proc.stdout.split())


def test_every_collective_of_a_step_is_counted_to_the_byte_the_projection_counts(tmp_path):
    """HSDP of 2 replicas x 4 shards at N = 8, the tiny model (bf16 gathers and reductions): per step the root's
    and both blocks' parameters all-gathered over 4 (the blocks twice: resharded after forward), the gradients
    reduce-scattered over 4 and their shards all-reduced over the 2 replicas, byte for byte what the layout search's
    projection counts (plan/layout/traffic.py) from the parameter shapes."""
    from fsdp2bench.plan.layout.traffic import gathered_bytes
    from fsdp2bench.run.session import model_facts

    summary, said = emulated_run(tmp_path, "--dp_replicate_size", "2")
    entry = summary["simulated"]["8"]["0"]["torch_optimizer_after_fsdp"]
    emulated, = entry["emulated"]
    blocks, root, elements = gathered_bytes(tuple(model_facts("tiny", 421).shapes), 4, 1, False, 2)
    step = emulated["per_step"]
    assert step["all_gather over 4"] == {"calls": 5, "bytes": 2 * blocks + root, "emulated_s": pytest.approx(
        5 * 3e-6 + 3 / 4 * (2 * blocks + root) / 450e9)}
    assert step["reduce_scatter over 4"]["bytes"] == 2 * elements and step["reduce_scatter over 4"]["calls"] == 3
    assert step["all_reduce over 2"]["bytes"] == 2 * elements // 4
    assert set(step) == {"all_gather over 4", "reduce_scatter over 4", "all_reduce over 2"}
    # Labelled: the speed on a CPU stays compute only (nothing waits there), the emulation says it only priced.
    assert entry["speed"]["compute_only"] and not entry["speed"]["emulated"] and not emulated["waited_on_the_gpu"]
    assert summary["meta"]["emulated_links"] == json.loads(json.dumps(vars(Links())))
    assert "Emulated a step, N = 8 rank 0 after: all_gather over 4 5 calls" in said and "priced only" in said


def test_tensor_parallel_collectives_are_counted_as_dtensor_issues_them(tmp_path):
    """TP 2 beside 4 shards: DTensor's functional all-reduces (each rowwise layer's output in forward, each colwise
    layer's input gradient in backward) pass through the emulation with the activations' bytes, as many as the
    layout search's projection prices; FSDP2's gathers and reductions stay counted beside them."""
    from fsdp2bench.plan.layout.traffic import tensor_parallel_all_reduces
    from fsdp2bench.run.session import model_facts

    summary, said = emulated_run(tmp_path, "--tp_size", "2")
    emulated, = summary["simulated"]["8"]["0"]["torch_optimizer_after_fsdp"]["emulated"]
    step, config = emulated["per_step"], model_facts("tiny", 421).config
    calls = tensor_parallel_all_reduces(config, full_ac=False)
    activation = summary["meta"]["per_optimizer_step"]["tokens_per_rank"] * config.hidden_size * 2  # bf16
    assert calls == 7 * config.num_hidden_layers  # o and down forward; q, k, v, gate and up backward
    assert step["all_reduce over 2 (DTensor)"] == {"calls": calls, "bytes": calls * activation,
                                         "emulated_s": pytest.approx(calls * (2e-6 + activation / 450e9))}  # 2 steps
    assert {"all_gather over 4", "reduce_scatter over 4"} <= set(step) and emulated["traced_in_compiled_graph"] == []
    assert "all_reduce over 2 (DTensor) 14 calls" in said


@pytest.mark.parametrize("argv, message", [
    (["--emulate_communication"], "--emulate_communication needs --simulate_world_size"),
    (["--simulate_world_size", "8", "--emulate_communication=-1,50"], "each GB/s a positive number"),
    (["--simulate_world_size", "8", "--emulate_communication", "0,50"], "each GB/s a positive number"),
    (["--simulate_world_size", "8", "--emulate_communication", "nan,50"], "each GB/s a positive number"),
    (["--simulate_world_size", "8", "--emulate_communication", "450"], "expected WITHIN,ACROSS"),
    (["--simulate_world_size", "8", "--emulate_communication", "/"], "not a regular file"),
])
def test_bad_links_are_one_line(argv, message, tmp_path):
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--output_dir", str(tmp_path / "o"),
                                        *argv])
    assert line is not None and message in line, line


@pytest.mark.parametrize("fields, message", [
    ({"node_size": 8, "within_gbps": -1, "across_gbps": 50}, "each GB/s a positive number"),
    ({"node_size": 8, "within_gbps": 450, "across_gbps": 0}, "each GB/s a positive number"),
    ({"node_size": 8, "within_gbps": float("nan"), "across_gbps": 50}, "each GB/s a positive number"),
    ({"node_size": 8, "within_gbps": 450}, "no across_gbps"),
    ({"node_size": 0, "within_gbps": 450, "across_gbps": 50}, "node_size must be a positive integer"),
    ({"node_size": 8, "within_gbps": 450, "across_gbps": 50, "rails": 4}, "not a JSON object"),
    ({"node_size": 3, "within_gbps": 450, "across_gbps": 50}, "nodes of 3 GPUs do not make up N = 8"),
])
def test_a_links_file_is_checked_field_by_field(fields, message, tmp_path):
    path = tmp_path / "links.json"
    path.write_text(json.dumps(fields))
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--output_dir", str(tmp_path / "o"),
                                        "--simulate_world_size", "8", "--emulate_communication", str(path)])
    assert line is not None and message in line, line
