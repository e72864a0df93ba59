"""plan.py --find layout: the candidates of N, the pruning, the projection's bytes for the tiny model, the ranking,
the refusals, and one CPU search whose winner's command lines run as given."""

from __future__ import annotations

import json
import shlex

import pytest
from conftest import load, refusal, run_script

import plan
from fsdp2bench import arguments, layout_search
from fsdp2bench.candidates import Candidate, Levers, candidates_of, layouts_of, parse_levers
from fsdp2bench.cli import UserError
from fsdp2bench.concurrency import GpuCap
from fsdp2bench.layout import Degrees
from fsdp2bench.names import GIB, MIB
from fsdp2bench.options import FsdpOptions
from fsdp2bench.session import model_facts
from fsdp2bench.traffic import Links, parse_links, step_collectives

TINY = model_facts("tiny", 421)  # hidden 64, MLP 170, 2 blocks, 4 heads, 2 key/value heads, vocabulary 509, tied


def test_every_layout_of_n_the_model_admits_and_none_it_does_not():
    """tiny's 2 key/value heads admit tp 1 and 2; on a GPU every cp that divides the rest (128 % 2C == 0)."""
    on_gpu, _ = layouts_of(8, TINY.config, 128, "cuda")
    expected = {(r, 8 // (t * c * r), c, t) for t in (1, 2) for c in (1, 2, 4, 8) if 8 % (t * c) == 0
                for r in (1, 2, 4, 8) if (8 // (t * c)) % r == 0}
    assert {(d.replicate, d.shard, d.cp, d.tp) for d in on_gpu} == expected and len(on_gpu) == 16
    on_cpu, notes = layouts_of(8, TINY.config, 128, "cpu")
    assert {(d.replicate, d.shard, d.cp, d.tp) for d in on_cpu} == {x for x in expected if x[2] == 1}
    assert any(n.startswith("tp 4: --tp_size 4 does not divide the model's 2 key/value heads") for n in notes)
    assert any(n.startswith("cp 2 (tp 1): context parallelism does not run on the CPU") for n in notes)


def test_candidates_reach_the_global_batch_with_every_lever_each_layout_admits():
    layouts, _ = layouts_of(4, TINY.config, 128, "cpu")  # 4 flat or replicated, and tp 2 over 2 data ranks
    found = candidates_of(layouts, parse_levers("none,full,model,chunked"), 6, "cpu")
    assert {c.degrees.data_ranks for c in found} == {2}  # 6 sequences: 4 data ranks leave a remainder
    assert all(c.batch * c.microbatches * c.degrees.data_ranks == 6 for c in found)
    # per layout (R2xS1xT2, R1xS2xT2): 2 checkpointing modes x 2 losses x (B3x1, B1x3 once a step or each microbatch)
    assert len(found) == 2 * 2 * 2 * 3
    float8 = candidates_of(layouts_of(4, TINY.config, 128, "cpu")[0], Levers(float8=(False, True)), 4, "cuda")
    assert not any(c.float8 and c.degrees.tp > 1 for c in float8) and any(c.float8 for c in float8)


def test_the_memory_model_prunes_what_cannot_fit_and_says_by_how_much():
    setup = setup_of(GpuCap(2.0, 140 * GIB, 300 * MIB))
    small, large = (Candidate(Degrees(replicate=1, shard=8), "none", "model", False, False, b, 1) for b in (1, 4096))
    assert layout_search.assess(small, setup).fits is True
    pruned = layout_search.assess(large, setup)
    estimate = layout_search.estimated_bytes(large, TINY.shapes, TINY.config, 128, FsdpOptions())
    assert pruned.fits is False and estimate > 1.2 * 2 * GIB
    assert pruned.memory["over_gib"] == pytest.approx((estimate - 2 * GIB) / GIB)


def setup_of(cap=None, links=Links()) -> layout_search.Setup:
    return layout_search.Setup("tiny", 8, 128, 16, TINY.shapes, TINY.config, FsdpOptions(), cap, links, "cpu", None,
                               "unused", 2, "cpu", 123008)


def test_the_projections_bytes_are_the_tiny_models_counted_by_hand():
    """bf16 all-gathers, bf16 reduction (autocast). A block's padded elements over 8 shards: q 4096 + 64, k and v
    2048 + 32 each, o 4096, gate and up 22 x 8 rows x 64 = 11264 each, down 10880, two norms 128: 45952, twice;
    the root: the embedding's 64 x 8 rows x 64 = 32768 and the final norm 64: 32832."""
    flat = {c.name: c.bytes for c in step_collectives(TINY.shapes, TINY.config, Degrees(replicate=1, shard=8),
                                                      FsdpOptions(), 1, 128, 2)}
    blocks, root = 2 * 45952 * 2, 32832 * 2
    assert flat == {"FSDP all-gather of parameters": 7 * (2 * blocks + root) * 2 // 8,  # forward and backward, x2
                    "FSDP reduce-scatter of gradients": 7 * (2 * 45952 + 32832) * 2 // 8}  # once a step
    hsdp = {c.name: c for c in step_collectives(TINY.shapes, TINY.config, Degrees(replicate=2, shard=4),
                                                FsdpOptions(), 1, 128, 1)}
    # Over 4 shards gate and up pad to 172 rows, the embedding to 512: 123712 elements, a quarter a shard
    assert hsdp["HSDP all-reduce across replicas"].bytes == 2 * (123712 // 4 * 2) // 2
    assert hsdp["HSDP all-reduce across replicas"].span == 8 and hsdp["FSDP all-gather of parameters"].span == 4
    tp = {c.name: c.bytes for c in step_collectives(TINY.shapes, TINY.config, Degrees(replicate=1, shard=4, tp=2),
                                                    FsdpOptions(), 2, 128, 1)}
    assert tp["TP all-reduce of block outputs"] == 2 * 2 * 128 * 64 * 2 // 2 * 4 * 2  # 4 a block, 2 blocks
    links = Links(node_size=4, within_gbps=100.0, across_gbps=10.0)
    assert hsdp["HSDP all-reduce across replicas"].seconds(links) == 123712 // 4 * 2 / 10e9
    assert parse_links("100,10") == Links(within_gbps=100.0, across_gbps=10.0)


def test_the_ranking_takes_compute_plus_communication_and_leaves_out_what_does_not_fit():
    setup = setup_of()
    found = []
    for batch, microbatch_s, fits in ((1, 0.10, True), (2, 0.15, True), (4, 0.20, False)):
        each = layout_search.assess(Candidate(Degrees(replicate=1, shard=8), "none", "model", False, False, batch,
                                              16 // 8 // batch), setup)
        each.comm_s, each.fits = 0.05, fits
        each.compute = {"fits": True, "microbatch_s": microbatch_s, "clean": True}
        layout_search.project(each, setup)
        found.append(each)
    assert found[0].projected["no_overlap_tokens_per_s"] == pytest.approx(2 * 128 / (2 * 0.10 + 0.05))
    assert found[0].projected["full_overlap_tokens_per_s"] == pytest.approx(2 * 128 / 0.20)
    assert [f.candidate.batch for f in layout_search.ranked(found)] == [2, 1]  # 0.20 s a step beats 0.25; 4 out


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "4,8"], "--world_size 4,8: the layout search plans one value"),
    (["--world_size", "4", "--global_batch", "5"], "no layout of N = 4 splits it evenly"),
    (["--world_size", "4", "--global_batch", "4", "--levers", "none,turbo"], "unknown lever turbo"),
    (["--world_size", "4", "--global_batch_tokens", "1000"], "not a whole number of --block_size 128 sequences"),
    (["--world_size", "4"], "needs one of --global_batch"),
    (["--world_size", "4", "--global_batch", "4", "--levers", "float8"], "--levers float8: --float8 needs a GPU"),
])
def test_bad_input_is_one_line_before_anything_runs(argv, message, tmp_path):
    said = refusal(plan.validate, ["--find", "layout", "--device", "cpu", "--output_dir", str(tmp_path / "o"), *argv])
    assert said is not None and message in said, said
    assert not (tmp_path / "o").exists()


def test_a_cpu_search_cannot_tell_what_fits_ranks_by_measured_compute_and_its_commands_run(tmp_path):
    out = tmp_path / "search"
    proc = run_script(["plan.py", "--find", "layout", "--device", "cpu", "--world_size", "4", "--block_size", "64",
                       "--global_batch", "4", "--levers", "none,model", "--max_timings", "1", "--output_dir",
                       str(out)], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert "a CPU run: no cap, so it cannot tell what fits" in said and "compute measured" in said
    result = load(out / "plan.json")
    assert result["meta"]["timings"] == 1 and all(c["fits"] is None for c in result["candidates"])
    ranked = [c for c in result["candidates"] if c["projected"]]
    assert ranked and all(c["projected"]["compute_measured"] for c in ranked)
    winner = result["winner"]["commands"]
    check = shlex.split(winner["one_gpu_check"])
    ran = run_script([*check[1:], "--device", "cpu", "--output_dir", str(tmp_path / "check")], nproc=None)
    assert ran.returncode == 0, ran.stderr[-2000:]
    torchrun = shlex.split(winner["torchrun"])
    main_args = torchrun[torchrun.index("main.py") + 1:]
    assert arguments.validate([*main_args, "--device", "cpu", "--output_dir", str(tmp_path / "real")], 4)
    assert json.loads((out / "accelerate_config.json").read_text())["num_processes"] == 4
    drawn = run_script(["visualize.py", "--dir", str(out)], nproc=None)
    assert drawn.returncode == 0 and (out / "layout.png").stat().st_size > 10_000, drawn.stderr
