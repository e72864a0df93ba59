"""Communication emulated on a simulated rank (--emulate_communication): the link model's arithmetic for each group
shape, every collective the rank issues counted to the byte against the projection's own count, the labels, and
bad input in one line."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
from conftest import load, refusal, run_script

from fsdp2bench.options.fsdp import FsdpOptions
from fsdp2bench.cli import UserError
from fsdp2bench.options.links import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Links, checked_links,
                                          field_bounds, parse_links)
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


def test_a_functional_collectives_op_is_priced_by_its_whole_and_an_all_to_all_to_one_rank_as_a_send():
    """What the emulation's kernel at each functional collective's op counts, from the op's own arguments: a gather
    its input G times (a coalesced one, its inputs'), a reduction its input; an all-to-all its input, and one in
    which the rank sends to one rank only (a permute: CP's ring) a send of it."""
    import torch

    from fsdp2bench.options.links import ALL_TO_ALL, SEND
    from fsdp2bench.processes.emulation import functional_cost

    piece, other = torch.empty(32, dtype=torch.bfloat16), torch.empty(16, dtype=torch.float32)
    four = [0, 1, 2, 3]
    assert functional_cost(ALL_GATHER, [piece], (piece, 4, "3"), four) == (ALL_GATHER, 4 * 64)
    assert functional_cost(ALL_GATHER, [piece, other], ([piece, other], 4, "3"), four) == (ALL_GATHER, 4 * 128)
    assert functional_cost(REDUCE_SCATTER, [piece], (piece, "sum", 4, "3"), four) == (REDUCE_SCATTER, 64)
    assert functional_cost(ALL_TO_ALL, [piece], (piece, [8] * 4, [8] * 4, "3"), four) == (ALL_TO_ALL, 64)
    assert functional_cost(ALL_TO_ALL, [piece], (piece, [0, 0, 32, 0], [0, 32, 0, 0], "3"), four) == (SEND, 64)


def emulated_run(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "out"
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--simulate_world_size", "8", "--max_steps",
                       "5", "--variants", "torch_optimizer_after_fsdp", "--emulate_communication", "--output_dir",
                       str(out), *extra], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load(out / "summary.json"), " ".join(proc.stdout.split())


def test_every_collective_of_a_step_is_counted_to_the_byte_the_projection_counts(tmp_path):
    """HSDP of 2 replicas x 4 shards at N = 8, the tiny model (bf16 gathers and reductions): per step the root's
    and both blocks' parameters all-gathered over 4 (the blocks twice: resharded after forward), the gradients
    reduce-scattered over 4 and their shards all-reduced over the 2 replicas, byte for byte what the layout search's
    projection counts (plan/layout/traffic.py) from the parameter shapes, per emulated step (steps 1 and 3 of 5)."""
    from fsdp2bench.plan.layout.traffic import gathered_bytes
    from fsdp2bench.run.session import model_facts

    summary, said = emulated_run(tmp_path, "--dp_replicate_size", "2")
    entry = summary["simulated"]["8"]["0"]["torch_optimizer_after_fsdp"]
    emulated, = entry["emulated"]
    blocks, root, elements = gathered_bytes(tuple(model_facts("tiny", 421).shapes), 4, 1, False, 2)
    step = emulated["per_step"]
    assert emulated["emulated_steps"] == 2
    assert step["all_gather over 4"] == {"calls": 5, "bytes": 2 * blocks + root, "emulated_s": pytest.approx(
        5 * 3e-6 + 3 / 4 * (2 * blocks + root) / 450e9)}
    assert step["reduce_scatter over 4"]["bytes"] == 2 * elements and step["reduce_scatter over 4"]["calls"] == 3
    assert step["all_reduce over 2"]["bytes"] == 2 * elements // 4
    assert set(step) == {"all_gather over 4", "reduce_scatter over 4", "all_reduce over 2"}
    # Labelled: the speed on a CPU stays compute only (nothing waits there), the emulation says it only priced.
    assert entry["speed"]["compute_only"] and not entry["speed"]["emulated"] and not emulated["waited_on_the_gpu"]
    assert summary["meta"]["emulated_links"] == json.loads(json.dumps(vars(Links())))
    assert "Emulated a step, N = 8 rank 0 after: all_gather over 4: 5 calls" in said and "priced only" in said


@pytest.mark.parametrize("checkpointing, compiled", [("none", False), ("none", True), ("full", False),
                                                     ("selective", False)])
def test_tensor_parallel_collectives_are_counted_as_dtensor_issues_them_eager_or_compiled(tmp_path, checkpointing,
                                                                                          compiled):
    """TP 2 beside 4 shards: DTensor's functional all-reduces (each rowwise layer's output in forward, each colwise
    layer's input gradient in backward) pass through the emulation with the activations' bytes, as many as the
    layout search's projection prices, each once; FSDP2's gathers and reductions stay counted beside them. Under
    --compile the compiled blocks' graphs call the same collectives, and each emulated step counts them all, the
    same calls and bytes (the tracing that builds the graphs counts none). A block recomputed under full or
    selective checkpointing all-reduces its attention's output again, and the projection counts it."""
    from fsdp2bench.plan.layout.traffic import recomputed_blocks, tensor_parallel_all_reduces
    from fsdp2bench.run.session import model_facts

    summary, said = emulated_run(tmp_path, "--tp_size", "2", "--activation_checkpointing", checkpointing,
                                 *(("--compile", "--max_steps", "6") if compiled else ()))
    emulated, = summary["simulated"]["8"]["0"]["torch_optimizer_after_fsdp"]["emulated"]
    step, config = emulated["per_step"], model_facts("tiny", 421).config
    options = FsdpOptions(activation_checkpointing=checkpointing)
    calls = tensor_parallel_all_reduces(config, recomputed_blocks(config, options))
    activation = summary["meta"]["per_optimizer_step"]["tokens_per_rank"] * config.hidden_size * 2  # bf16
    # o and down forward; q, k, v, gate and up backward; o again in a recomputed forward
    assert calls == (7 if checkpointing == "none" else 8) * config.num_hidden_layers
    assert emulated["emulated_steps"] == (3 if compiled else 2)
    # Which steps were warm-up, emulated and compute only, said by number: under --compile step 1 is warm-up too.
    assert ("In one launch, steps 0 and 1 warm-up, compiling (left out); steps 3 and 5 emulated; steps 2 and 4 "
            "compute only: " if compiled else "In one launch, step 0 warm-up (left out); steps 1 and 3 emulated; "
            "steps 2 and 4 compute only: ") in said
    assert step["all_reduce over 2 (DTensor)"] == {"calls": calls, "bytes": calls * activation,
                                                   "emulated_s": pytest.approx(calls * (2e-6 + activation / 450e9))}
    assert step["all_gather over 4"]["calls"] == 5 and step["reduce_scatter over 4"]["calls"] == 3
    assert set(step) == {"all_gather over 4", "reduce_scatter over 4", "all_reduce over 2 (DTensor)"}
    assert f"all_reduce over 2 (DTensor): {calls} calls" in said


def test_one_launch_emulates_every_other_step_and_gives_both_figures_labelled(tmp_path):
    """Seven steps: 1, 3 and 5 emulated, 0, 2, 4 and 6 compute only, as each step's record says. The tally is of the
    three emulated steps (per step, the 5 all-gathers over 8 of one step); summary.json's speed.emulation holds the
    compute-only steps' median after warm-up (2, 4, 6) and the emulated steps' (1, 3, 5), each labelled; on a CPU
    nothing waits, so the run's own figures are its compute-only steps' and the exposure is not measured, said so.
    Under --tracker_overhead (speed.py's) the polling pauses in pairs of steps, so that neither half is all paused."""
    summary, said = emulated_run(tmp_path, "--max_steps", "7", "--tracker_overhead")
    entry = summary["simulated"]["8"]["0"]["torch_optimizer_after_fsdp"]
    steps = load(tmp_path / "out" / "simulated_N8" / "torch_optimizer_after_fsdp_memory_usage.json")["steps"]
    assert [s["communication_emulated"] for s in steps] == [False, True, False, True, False, True, False]
    assert [s["polling"] for s in steps] == [True, True, False, False, True, True, False]
    emulated, = entry["emulated"]
    assert emulated["emulated_steps"] == 3 and emulated["per_step"]["all_gather over 8"]["calls"] == 5
    figures = entry["speed"]["emulation"]
    assert set(figures) == {"steps", "waited_on_the_gpu", "compute_only", "emulated", "exposed"}
    for label, halves in (("compute_only", (2, 4, 6)), ("emulated", (1, 3, 5))):
        # A step timed while another suite run on this host was busy is left out (the host's other launches count).
        half, picked = figures[label], [i for i in halves if not steps[i]["runs_beside"]]
        assert (half["timed_steps"], half["shared_steps"]) == (len(picked), 3 - len(picked))
        if len(picked) < 2:
            assert "ran while another run was busy" in half["not_measured"]
            continue
        assert half["median_step_time_s"] == statistics.median(steps[i]["step_time_s"] for i in picked)
        assert half["tokens_per_s_per_gpu"] == pytest.approx(256 / half["median_step_time_s"])
    assert entry["speed"]["median_step_time_s"] == figures["compute_only"]["median_step_time_s"]
    assert entry["speed"]["compute_only"] and not figures["waited_on_the_gpu"]
    exposed = figures["exposed"]
    assert exposed["s"] is None and exposed["share"] is None and "a CPU waits for nothing" in exposed["not_measured"]
    assert exposed["emulated_s_per_step"] == emulated["emulated_s_per_step"] > 0
    assert ("In one launch, step 0 warm-up (left out); steps 1, 3 and 5 emulated; steps 2, 4 and 6 compute only: "
            "compute_only ") in said
    assert "; emulated (nothing waited) " in said and "exposed not measured (a CPU waits" in said
    if not any(steps[i]["runs_beside"] for i in (2, 4, 6)):  # else fewer than 3, as the loop above checks
        assert "(median of 3); emulated (nothing waited) " in said


def test_the_console_names_the_links_the_emulated_figures_assume_in_one_line_beside_them(tmp_path):
    """A links file of A100-like nodes of 4, its latencies its own: the line before the runs' emulated figures gives
    every one of them, as summary.json keeps them."""
    path = tmp_path / "a100.json"
    path.write_text(json.dumps({"node_size": 4, "within_gbps": 300, "across_gbps": 25, "latency_within_us": 2,
                                "latency_across_us": 10, "channels": 8}))
    summary, said = emulated_run(tmp_path, "--emulate_communication", str(path))
    assert summary["meta"]["emulated_links"] == {"node_size": 4, "within_gbps": 300, "across_gbps": 25,
                                                 "latency_within_us": 2, "latency_across_us": 10, "channels": 8}
    line = ("Emulated over 300 GB/s within a node of 4 and 25 GB/s across nodes (a NIC a GPU), a ring step 2 us within "
            "a node and 10 us across, 8 channels (the CTAs a collective holds on a GPU) (summary.json's "
            "meta.emulated_links; docs/links.md). Emulated a step, N = 8 rank 0 after: ")
    assert said.count("Emulated over ") == 1 and line in said, said


def test_on_a_gpu_the_exposed_communication_is_the_emulated_steps_median_less_the_compute_only_ones():
    """The arithmetic of a run whose emulated steps waited on the GPU (no GPU here: the step records as a GPU run
    writes them): compute-only steps of 0.100-0.104 s, emulated ones of 0.110-0.114 s, 0.05 s of communication a
    step; step 0 is warm-up. Exposed: 0.010 s, 20% of it; the run's own figures are the emulated steps', marked +."""
    from fsdp2bench.report.console import one_launch_said
    from fsdp2bench.train import throughput

    times = [0.5, 0.110, 0.100, 0.112, 0.102, 0.114, 0.104]
    steps = [{"step": i, "step_time_s": t, "optimizer_s": 0.01, "communication_emulated": i % 2 == 1}
             for i, t in enumerate(times)]
    tally = {"waited_on_the_gpu": True, "emulated_s_per_step": 0.05}
    speed = throughput.speed(steps, 1000.0, 6, "NVIDIA H100 80GB HBM3", False, True, tally)
    figures = speed["emulation"]
    assert figures["compute_only"]["median_step_time_s"] == 0.102 and figures["emulated"]["median_step_time_s"] == 0.112
    assert figures["exposed"]["s"] == pytest.approx(0.010) and figures["exposed"]["share"] == pytest.approx(0.2)
    assert speed["median_step_time_s"] == 0.112 and speed["emulated"] and not speed["compute_only"]
    assert throughput.rate_said(speed) == f"{1000 / 0.112:.0f}+"
    said = one_launch_said(figures)
    assert "compute_only 9804 tok/s, 0.1020 s a step (median of 3); emulated 8929 tok/s, 0.1120 s" in said
    assert "exposed +10.00 ms a step, 20% of the 50.00 ms emulated" in said


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("steps", [5, 6, 9, 12])
def test_a_figure_not_measured_for_shared_steps_counts_the_steps_its_median_was_to_be_taken_of(steps, emulated):
    """Every step after warm-up shared with another run but one: no median, and the reason counts the steps of the
    half it was to be taken of (compute-only, emulated) or of the run, never more clean steps than a median needs."""
    from fsdp2bench.train import throughput

    shared = set(range(1, steps - 1))  # all but the last step after warm-up
    records = [{"step": i, "step_time_s": 0.1, "optimizer_s": 0.01, "communication_emulated": emulated and i % 2 == 1,
                "runs_beside": int(i in shared)} for i in range(steps)]
    tally = {"waited_on_the_gpu": False, "emulated_s_per_step": 0.05} if emulated else None
    speed = throughput.speed(records, 1000.0, 6, None, False, True, tally)
    halves = {"": records[1:]} if not emulated else {
        kind: [r for r in records[1:] if r["communication_emulated"] == on]
        for kind, on in (("compute-only ", False), ("emulated ", True))}
    figures = [speed] if not emulated else [speed["emulation"]["compute_only"], speed["emulation"]["emulated"]]
    for (kind, half), figure in zip(halves.items(), figures):
        beside = sum(r["runs_beside"] for r in half)
        clean = len(half) - beside
        if clean >= throughput.MIN_TIMED_STEPS:
            assert figure["not_measured"] is None, (kind, figure)
            continue
        assert figure["not_measured"].startswith(f"{beside} of the {len(half)} {kind}steps after warm-up ran while "
                                                 f"another run was busy on the same device, leaving {clean} clean, "
                                                 f"fewer than the 2 a median needs"), figure["not_measured"]


@pytest.mark.parametrize("argv, message", [
    (["--max_steps", "4"], "4 steps leave 1 compute-only and 2 emulated steps after the warm-up (step 0); "
                           "emulating every other step, each needs 2: --max_steps 5 or more (and the data for them)"),
    (["--max_steps", "5", "--compile"], "5 steps leave 2 compute-only and 1 emulated step after the warm-up "
                                        "(steps 0 and 1, which compile); emulating every other step, each needs 2: "
                                        "--max_steps 6 or more (and the data for them)"),
])
def test_too_few_steps_to_time_both_halves_are_refused_before_anything_runs(argv, message, tmp_path):
    """main.py in one line and exit 2, and speed.py with the same line before it starts anything (its bare loop
    included). plan.py takes no step count: its timings' steps are tests/test_layout_search.py's to check."""
    import speed

    common = ["--model", "tiny", "--device", "cpu", "--simulate_world_size", "8", "--emulate_communication", *argv]
    proc = run_script(["main.py", *common, "--output_dir", str(tmp_path / "main")], nproc=None)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: --emulate_communication: {message}", proc.stderr
    assert not (tmp_path / "main").exists()
    line = refusal(speed.validate, ["--nproc_per_node", "1", "--bare_loop", "--output_dir", str(tmp_path / "speed"),
                                    "--", *common])
    assert line == f"error: --emulate_communication: {message}", line
    assert not (tmp_path / "speed").exists() and not (tmp_path / "speed_bare").exists()


RATE = "must be in [0.01, 100000] GB/s, got"


@pytest.mark.parametrize("argv, message", [
    (["--emulate_communication"], "--emulate_communication needs --simulate_world_size"),
    (["--simulate_world_size", "8", "--emulate_communication=-1,50"], f"within_gbps {RATE} -1.0"),
    (["--simulate_world_size", "8", "--emulate_communication", "-1,50"], f"within_gbps {RATE} -1.0"),
    (["--simulate_world_size", "8", "--emulate_communication", "0,50"], f"within_gbps {RATE} 0.0"),
    (["--simulate_world_size", "8", "--emulate_communication", "nan,50"], f"within_gbps {RATE} nan"),
    (["--simulate_world_size", "8", "--emulate_communication", "450,1e400"], f"across_gbps {RATE} inf"),
    (["--simulate_world_size", "8", "--emulate_communication", "1e-9,50"], f"within_gbps {RATE} 1e-09"),
    (["--simulate_world_size", "8", "--emulate_communication", "450,1e9"], f"across_gbps {RATE} 1000000000.0"),
    (["--simulate_world_size", "8", "--emulate_communication", "450"], "expected WITHIN,ACROSS"),
    (["--simulate_world_size", "8", "--emulate_communication", "/"], "/: a directory, not a file"),
    (["--simulate_world_size", "8", "--emulate_communication", "nothere.json"],
     "nothere.json: no such file or directory"),
    (["--simulate_world_size", "8", "--emulate_communication", "nothere"], "nothere: no such file or directory"),
])
def test_bad_links_are_one_line(argv, message, tmp_path):
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--output_dir", str(tmp_path / "o"),
                                        *argv])
    assert line is not None and message in line, line


@pytest.mark.parametrize("fields, message", [
    ({"node_size": 8, "within_gbps": -1, "across_gbps": 50}, f"within_gbps {RATE} -1"),
    ({"node_size": 8, "within_gbps": 450, "across_gbps": 0}, f"across_gbps {RATE} 0"),
    ({"node_size": 8, "within_gbps": float("nan"), "across_gbps": 50}, f"within_gbps {RATE} nan"),
    ({"node_size": 8, "within_gbps": 0.001, "across_gbps": 50}, f"within_gbps {RATE} 0.001"),
    ({"node_size": 8, "within_gbps": 450, "across_gbps": 10 ** 400}, f"across_gbps {RATE} 1000"),
    ({"node_size": 8, "within_gbps": 450, "across_gbps": 50, "latency_across_us": 1e300},
     "latency_across_us must be in [0, 1000000] us, got 1e+300"),
    ({"node_size": 8, "within_gbps": 450, "across_gbps": 50, "latency_within_us": -1},
     "latency_within_us must be in [0, 1000000] us, got -1"),
    ({"node_size": 8, "within_gbps": 450}, "no across_gbps"),
    ({"node_size": 0, "within_gbps": 450, "across_gbps": 50}, "node_size must be a whole number in [1, 1024], got 0"),
    ({"node_size": 4096, "within_gbps": 450, "across_gbps": 50}, "node_size must be a whole number in [1, 1024]"),
    ({"node_size": 8.5, "within_gbps": 450, "across_gbps": 50}, "node_size must be a whole number in [1, 1024]"),
    ({"node_size": True, "within_gbps": 450, "across_gbps": 50}, "node_size must be a whole number in [1, 1024]"),
    ({"node_size": 8, "within_gbps": 450, "across_gbps": 50, "rails": 4}, "not a JSON object"),
    ({"node_size": 3, "within_gbps": 450, "across_gbps": 50}, "nodes of 3 GPUs do not make up N = 8"),
    *(({"node_size": 8, "within_gbps": 450, "across_gbps": 50, "channels": bad}, "channels must be a whole number "
       "in [0, 64]") for bad in (-1, 65, 1.5, True, "16", None)),
])
def test_a_links_file_is_checked_field_by_field(fields, message, tmp_path):
    path = tmp_path / "links.json"
    path.write_text(json.dumps(fields))
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--output_dir", str(tmp_path / "o"),
                                        "--simulate_world_size", "8", "--emulate_communication", str(path)])
    assert line is not None and message in line, line


def test_the_bytes_a_ring_moves_into_each_rank():
    """What the held wait reads and writes: (G-1)/G of the whole for a gather or a scatter, twice that for an
    all-reduce, the whole for a send, nothing in a group of one."""
    from fsdp2bench.options.links import wire_bytes

    assert wire_bytes("all_gather", 800, 8) == 700 and wire_bytes("reduce_scatter", 800, 8) == 700
    assert wire_bytes("all_reduce", 800, 8) == 1400 and wire_bytes("send", 800, 8) == 800
    assert wire_bytes("all_reduce", 800, 1) == 0


def test_the_held_wait_moves_bytes_through_a_tensors_own_storage_as_words():
    """32-bit words where the size allows, bytes where it does not; nothing through a tensor that is not one block
    (the wait then only holds its CTAs)."""
    import torch

    from fsdp2bench.processes.hold import word_view

    words = word_view(torch.zeros(6, dtype=torch.bfloat16))
    assert words.dtype == torch.int32 and words.numel() == 3
    assert word_view(torch.zeros(3, dtype=torch.bfloat16)).dtype == torch.uint8
    assert word_view(torch.zeros(4, 4).t()) is None and word_view(torch.zeros(0)) is None


def test_every_field_of_the_links_has_bounds_its_default_keeps_and_a_value_beyond_them_is_refused():
    """Whatever fields Links has: a rate (GB/s) or a latency (us) by its name's unit, a count by its whole default;
    its default inside, and one just past either end refused naming the field, in a file as on the command line."""
    defaults = Links()
    assert checked_links(defaults, "--links") == defaults
    for field in dataclasses.fields(Links):
        low, high, _ = field_bounds(field)
        for beyond in (low - 1 if isinstance(field.default, int) else low - 1e-3, high * 2):
            bad = dataclasses.replace(defaults, **{field.name: beyond})
            with pytest.raises(UserError, match=f"^--links: {field.name} must be "):
                checked_links(bad, "--links")


def test_a_value_led_by_a_dash_is_refused_as_the_same_value_given_with_an_equals_sign(tmp_path):
    """``--emulate_communication -1,50`` (its value may be left out, and argparse reads a dash-led word as an
    option) gets the line ``--emulate_communication=-1,50`` gets, exit 2, nothing written."""
    common = ["main.py", "--model", "tiny", "--device", "cpu", "--simulate_world_size", "8"]
    spaced = run_script([*common, "--output_dir", str(tmp_path / "a"), "--emulate_communication", "-1,50"], nproc=None)
    joined = run_script([*common, "--output_dir", str(tmp_path / "b"), "--emulate_communication=-1,50"], nproc=None)
    line = f"error: --emulate_communication -1,50: within_gbps {RATE} -1.0"
    for proc in (spaced, joined):
        assert proc.returncode == 2 and proc.stderr.strip() == line and not proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_dash_led_word_that_begins_an_option_stays_that_option(tmp_path):
    """``--emulate_communication --simulate_w 8``: the bare flag (the default links), then argparse's abbreviation of
    --simulate_world_size, never the links ``--simulate_w``."""
    checked = arguments.validate(["--model", "tiny", "--device", "cpu", "--output_dir", str(tmp_path / "o"),
                                  "--max_steps", "5", "--emulate_communication", "--simulate_w", "8"])
    assert checked.links == Links() and checked.args.simulate_world_size == "8"
