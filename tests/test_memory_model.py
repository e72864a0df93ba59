"""Per-rank state accounting against FSDP2's sharding rule, on real gloo runs at N=2 and N=4."""

from __future__ import annotations

from conftest import ROOT, VARIANTS, load, run_script

from fsdp2bench.memory_model import expected_state, projection, unfixed_costs_more_from

INTENDED = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_fixed", "accelerate"]
UNFIXED = "torch_optimizer_before_fsdp_not_fixed"
KEYS = ["param_bytes", "grad_bytes", "optimizer_state_bytes", "stale_param_bytes"]


def test_sharding_rule_pads_every_rank_to_the_ceil_chunk():
    shapes = [((5, 3), 4), ((7,), 4)]  # 5 rows over 2 ranks: chunks of 3 and 2, both stored as 3
    r0 = expected_state(shapes, 2, 0, "torch_optimizer_after_fsdp", "end_of_training")
    r1 = expected_state(shapes, 2, 1, "torch_optimizer_after_fsdp", "end_of_training")
    assert r0["param_bytes"] == r1["param_bytes"] == (3 * 3 + 4) * 4
    assert r0["optimizer_state_bytes"] == 2 * (3 * 3 + 4) * 4 + 2 * 4
    assert r1["optimizer_state_bytes"] == 2 * (2 * 3 + 3) * 4 + 2 * 4
    assert r0["grad_bytes"] == r0["stale_param_bytes"] == 0
    unfixed = expected_state(shapes, 2, 1, UNFIXED, "end_of_training")
    assert unfixed == {"param_bytes": 52, "grad_bytes": 52, "optimizer_state_bytes": 0,
                       "stale_param_bytes": (15 + 7) * 4, "unreduced_grad_bytes": 0}


def test_projection_finds_where_the_unfixed_variant_starts_costing_more():
    shapes = [((1024, 1024), 4)]
    table = projection(shapes, [INTENDED[0], UNFIXED])
    p = 1024 * 1024 * 4
    step = 4  # AdamW's step counter
    assert table["2"][UNFIXED]["before_zero_grad"] == 2 * p
    assert table["2"][INTENDED[0]]["before_zero_grad"] == 2 * p + step
    assert table["8"][UNFIXED]["end_of_training"] == p + 2 * p // 8
    assert table["8"][INTENDED[0]]["end_of_training"] == 3 * p // 8 + step
    # P + 2P/N against 4P/N: more from N = 3 on, which no power of two of the projection can say.
    n, held = unfixed_costs_more_from(shapes, INTENDED[0])
    assert n == 3 and "3" not in table
    rows = -(-1024 // 3)  # each rank's chunk of the 1024 rows, padded to the largest
    assert held[UNFIXED] == p + 2 * rows * 1024 * 4 and held[INTENDED[0]] == 4 * rows * 1024 * 4 + step


def check_accounting(summary: dict, world_size: int) -> None:
    n_params = summary["meta"]["num_parameters"]
    for name in VARIANTS:
        v = summary["variants"][name]
        assert len(v["accounting"]) == world_size
        assert v["accounting"] == v["expected"], name
        assert v["accounting_matches_expected"] is True
        total_params = sum(r["param_bytes"] for r in v["accounting"])
        assert total_params >= n_params * 4  # local shards cover the model, padding included
        assert all(r["end_of_setup"]["optimizer_state_bytes"] == 0 for r in v["accounting"])  # AdamW is lazy
    for name in INTENDED:
        ranks = summary["variants"][name]["accounting"]
        assert all(r["grad_bytes"] == 0 and r["stale_param_bytes"] == 0 for r in ranks)
        assert all(r["before_zero_grad"]["grad_bytes"] == r["param_bytes"] for r in ranks)
        # AdamW: two fp32 moments over the unpadded shards (= the whole model once) + a step per tensor per rank.
        moments = sum(r["optimizer_state_bytes"] for r in ranks) - 2 * n_params * 4
        assert 0 < moments < 1000 * world_size and moments % (4 * world_size) == 0
    unfixed = summary["variants"][UNFIXED]["accounting"]
    for r in unfixed:
        assert r["stale_param_bytes"] == n_params * 4  # the whole unsharded model, on every rank
        assert r["optimizer_state_bytes"] == 0
        assert r["grad_bytes"] == r["param_bytes"]  # never cleared
        assert r["end_of_setup"]["stale_param_bytes"] == n_params * 4
    assert summary["checks"]["accounting_matches_expected"]["ok"] is True


def test_accounting_equals_expectation_at_two_ranks(suite):
    out, proc = suite
    summary = load(out / "summary.json")
    check_accounting(summary, 2)
    assert "its optimizer still holds" in proc.stdout and "never cleared" in proc.stdout
    proj = summary["projection"]
    assert proj["unfixed_costs_more_from_world_size"] == 3  # exact: the sharding rule at every N
    assert "from N = 3 ranks on" in proc.stdout
    assert set(proj["per_rank_state_bytes"]) == {"1", "2", "4", "8", "16", "32", "64", "128"}
    measured = proj["measured"]["per_rank_state_bytes"]
    for name in VARIANTS:
        assert measured[name]["end_of_training"] == proj["per_rank_state_bytes"]["2"][name]["end_of_training"]


def test_accounting_equals_expectation_at_four_ranks(tmp_path):
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--max_steps", "2", "--learning_rate", "1e-3",
                       "--output_dir", str(tmp_path)], nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    assert summary["meta"]["world_size"] == 4
    check_accounting(summary, 4)


def test_the_gpu_estimate_covers_every_reserved_peak_measured_on_one_h200():
    """``--concurrent_variants auto`` plans with ``concurrency.variant_need``: for every row that the
    committed H200 matrices measured (two shapes, every option set, the TP and CP sets of the 7B one, N = 1
    to 128) it is at least the
    reserved peak, so that variants side by side never squeeze one another; and for the default 1.5B
    run at N = 1 it lets four variants share the 140 GiB GPU, as their measured peaks do."""
    from fsdp2bench.concurrency import variant_need
    from fsdp2bench.names import GIB, MIB
    from fsdp2bench.options import OPTION_SETS
    from fsdp2bench.session import model_facts

    short = []
    for folder, model in (("matrix_1.5b", "qwen2.5-1.5b"), ("matrix_7b", "qwen2.5-7b"), ("parallel_7b", "qwen2.5-7b")):
        facts = model_facts(model, 421)
        logits = 4 * 2 * 128 * facts.config.vocab_size  # the matrices' batch 2 x block 128
        rows = [r for r in load(ROOT / "results" / "h200" / folder / "matrix.json")["rows"] if r["status"] == "ok"]
        assert len(rows) >= 40
        for row in rows:
            need = variant_need(facts.shapes, row["world_size"], row["variant"], OPTION_SETS[row["option_set"]],
                                logits)
            if need < row["peak_reserved_mib"] * MIB:
                short.append((model, row["option_set"], row["world_size"], row["variant"]))
        if model == "qwen2.5-1.5b":
            default = max(variant_need(facts.shapes, 1, v, OPTION_SETS["default"], logits) for v in VARIANTS)
            assert 4 * default <= 140 * GIB
    assert short == []
