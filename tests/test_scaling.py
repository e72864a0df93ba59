"""Gradient accumulation and HSDP: real gloo runs at 2 ranks (accumulation each way) and at 4 (a
2 x 2 HSDP mesh), simulated ranks of an HSDP world through the matrix, and the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import TINY, VARIANTS, load, run_script

from fsdp2bench.cli import UserError
from fsdp2bench.options import fsdp as options
from fsdp2bench.report.matrix import NOT_OFFERED, fitting_sizes
from fsdp2bench.run import arguments
from fsdp2bench.train import data

INTENDED = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_fixed", "accelerate"]
UNFIXED = "torch_optimizer_before_fsdp_not_fixed"
# Two microbatches of one sequence: per step each rank sees the blocks the suite's batch of two holds.
ACCUMULATE = [*TINY, "--batch_size", "1", "--gradient_accumulation_steps", "2"]
BF16 = 2
# bf16 gradients summed in another order: reduce-scattered per microbatch and accumulated in fp32,
# or accumulated unsharded in bf16 and reduced once. The losses agree to this relative difference.
ACCUMULATION_TOLERANCE = 1e-2


def between(entry: dict, rank: int = 0) -> dict:
    return entry["accounting"][rank]["between_microbatches"]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory) -> dict[str, dict]:
    """One 2-rank run of every variant per way of accumulating: sync_each_batch false and true."""
    runs = {}
    for way in ("false", "true"):
        out = tmp_path_factory.mktemp(f"sync_each_batch_{way}")
        proc = run_script(["main.py", *ACCUMULATE, "--sync_each_batch", way, "--output_dir", str(out)])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "12 steps of 2 microbatches on 2 ranks" in proc.stdout
        runs[way] = load(out / "summary.json")
    return runs


def test_accumulation_trains_every_variant_and_counts_the_gradients_between_microbatches(accumulated):
    for way, summary in accumulated.items():
        assert all(c["ok"] for c in summary["checks"].values()), (way, summary["checks"])
        assert summary["meta"]["per_optimizer_step"] == {"microbatches": 2, "sequences_per_rank": 2,
                                                         "tokens_per_rank": 2 * 128, "sequences": 4,
                                                         "tokens": 4 * 128, "mesh": {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}}
        whole_in_bf16 = summary["meta"]["num_parameters"] * BF16
        for variant in VARIANTS:
            entry = summary["variants"][variant]
            assert entry["accounting_matches_expected"], (way, variant)
            for rank in (0, 1):
                held = between(entry, rank)
                if way == "false":  # every rank holds the whole model's gradient, unsharded, in bf16
                    assert held["unreduced_grad_bytes"] == whole_in_bf16, (variant, held)
                else:  # reduce-scattered after the first microbatch: the shards alone
                    assert held["unreduced_grad_bytes"] == 0 and held["grad_bytes"] == held["param_bytes"]
        assert between(summary["variants"][UNFIXED])["stale_param_bytes"] > 0
        assert summary["variants"][UNFIXED]["loss_drop"] <= 0.01  # still flat


def test_both_ways_and_one_batch_of_the_same_blocks_give_the_same_losses(accumulated, suite):
    """Bit-equal among the intended variants of a run; across the ways (and against the suite's one
    microbatch of two sequences, the same blocks) within ACCUMULATION_TOLERANCE: the reduction order."""
    whole_batch = load(suite[0] / "summary.json")["variants"][INTENDED[0]]["losses"]
    for summary in accumulated.values():
        assert set(summary["checks"]["intended_losses_match"]["max_relative_diff"].values()) == {0.0}
    no_sync, sync = (accumulated[w]["variants"][INTENDED[0]]["losses"] for w in ("false", "true"))
    for losses in (no_sync, sync):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, whole_batch)) <= ACCUMULATION_TOLERANCE
    assert max(abs(a - b) / abs(b) for a, b in zip(no_sync, sync)) <= ACCUMULATION_TOLERANCE
    assert no_sync[-1] < no_sync[0] and sync[-1] < sync[0]


def test_hsdp_on_2_x_2_ranks_shards_in_two_and_holds_back_the_all_reduce(tmp_path, accumulated):
    proc = run_script(["main.py", *ACCUMULATE, "--dp_replicate_size", "2", "--sync_each_batch", "true",
                       "--requires_all_reduce", "false", "--output_dir", str(tmp_path)], nproc=4, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    assert all(c["ok"] for c in summary["checks"].values()), summary["checks"]
    assert summary["meta"]["per_optimizer_step"]["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1}
    flat_two = accumulated["true"]["variants"][INTENDED[0]]["accounting"]
    for variant in VARIANTS:
        entry = summary["variants"][variant]
        assert entry["accounting_matches_expected"], variant
        # Ranks 0 and 2 (1 and 3) hold the same shard: the state of a flat world of two.
        assert [r["end_of_training"] for r in entry["accounting"]] == \
            [flat_two[0]["end_of_training"], flat_two[1]["end_of_training"]] * 2 or variant == UNFIXED
    torch_held = between(summary["variants"][INTENDED[0]])
    assert torch_held["grad_bytes"] == 0 and torch_held["unreduced_grad_bytes"] == torch_held["param_bytes"] // 2
    accelerate_held = between(summary["variants"]["accelerate"])  # no such option: it reduces every microbatch
    assert accelerate_held["unreduced_grad_bytes"] == 0 and accelerate_held["grad_bytes"] == torch_held["param_bytes"]


def test_the_matrix_measures_simulated_ranks_of_hsdp_worlds(tmp_path):
    sets = ["accumulate", "hsdp_accumulate", "hsdp_accumulate_sync", "hsdp_all_reduce_last"]
    proc = run_script(["matrix.py", "--option_sets", ",".join(sets), "--nproc_per_node", "0", "--simulate_world_size",
                       "4,16", "--sweep_steps", "2", "--output_dir", str(tmp_path), "--model", "tiny", "--device",
                       "cpu", "--quiet"], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Skipped: hsdp_accumulate: not simulated at N = 4 (its layout's sizes do not divide N)" in proc.stdout
    result = load(tmp_path / "matrix.json")
    assert {(r["option_set"], r["world_size"]) for r in result["rows"]} == \
        {("accumulate", 4), ("accumulate", 16), *((s, 16) for s in sets[1:])}
    assert all(r["status"] == "ok" and r["accounting_matches_expected"] for r in result["rows"])
    found = {f["option_set"]: f for f in result["findings"] if f["world_size"] == 16}
    # Reduce-scattering each microbatch saves the unsharded gradients at the step's peak state. Holding
    # back the all-reduce across replicas keeps bf16 shards instead of fp32 ones between microbatches,
    # but the state after the optimizer step (4P/S) is the same: nothing saved at the peak.
    assert found["hsdp_accumulate_sync"]["saved_against"]["option_set"] == "hsdp_accumulate"
    assert found["hsdp_accumulate_sync"]["saved_against"]["mib"][INTENDED[0]] > 0
    assert found["hsdp_all_reduce_last"]["saved_against"]["mib"][INTENDED[0]] == 0
    assert found["hsdp_all_reduce_last"]["accelerate"] == NOT_OFFERED
    assert "not offered" in proc.stdout
    rank0 = {s: load(tmp_path / s / "sweep" / "summary.json")["simulated"]["16"]["0"] for s in sets[2:]}
    reduced, held_back = (between(rank0[s][INTENDED[0]]) for s in sets[2:])
    assert held_back["grad_bytes"] == 0 and held_back["unreduced_grad_bytes"] * 2 == reduced["grad_bytes"] > 0
    assert between(rank0["hsdp_all_reduce_last"]["accelerate"]) == reduced  # it cannot hold the all-reduce back


def test_matrix_sets_run_only_where_their_shards_divide_n():
    assert fitting_sizes("hsdp", [1, 2, 8, 12, 32]) == [8, 32]
    assert fitting_sizes("accumulate", [1, 2, 3]) == [1, 2, 3]


@pytest.mark.parametrize("flags, world, message", [
    (["--dp_replicate_size", "3"], "4", "--dp_replicate_size 3 does not divide the world size 4"),
    (["--dp_shard_size", "8"], "4", "--dp_shard_size 8 does not divide the world size 4"),
    (["--dp_replicate_size", "2", "--dp_shard_size", "4"], "4", "--dp_replicate_size 2 x --dp_shard_size 4 is not"),
    (["--dp_shard_size", "3", "--simulate_world_size", "6,8"], "1", "--dp_shard_size 3 does not divide the world "
                                                                    "size 8"),
    (["--sync_each_batch", "true"], "1", "--sync_each_batch needs --gradient_accumulation_steps above 1"),
    (["--gradient_accumulation_steps", "2", "--sync_each_batch", "true", "--requires_all_reduce", "false"], "1",
     "--requires_all_reduce false needs HSDP"),
    (["--dp_replicate_size", "2", "--requires_all_reduce", "false"], "2", "--requires_all_reduce false needs HSDP"),
    (["--gradient_accumulation_steps", "0"], "1", "--gradient_accumulation_steps must be in [1, 65536], got 0"),
    (["--gradient_accumulation_steps", "60000", "--batch_size", "16", "--block_size", "2048", "--max_steps", "1"], "1",
     "1 step of 960000 x 2048 tokens on 1 rank would repeat the built-in text to 1,966,082,048 tokens, more than its 1,073,"),
])
def test_a_bad_combination_is_refused_in_one_line_before_anything_runs(monkeypatch, tmp_path, flags, world, message):
    for name, value in {"RANK": "0", "WORLD_SIZE": world, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": world,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():  # rank 0 of a launch of ``world``
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        arguments.validate(["--device", "cpu", "--model", "tiny", *flags, "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_option_the_installed_libraries_lack_is_refused(monkeypatch):
    import accelerate
    import accelerate.utils
    from torch.distributed.fsdp import FSDPModule

    third_way = options.OPTION_SETS["hsdp_all_reduce_last"]
    monkeypatch.delattr(FSDPModule, "set_requires_all_reduce")
    with pytest.raises(UserError, match="--requires_all_reduce: this torch's FSDPModule has no set_requires_all_reduce"):
        options.check(third_way)
    monkeypatch.delattr(accelerate, "ParallelismConfig")
    with pytest.raises(UserError, match="--dp_replicate_size/--dp_shard_size: accelerate .* has no ParallelismConfig"):
        options.check(options.OPTION_SETS["hsdp"])

    @dataclasses.dataclass
    class OlderPlugin:  # an accelerate before sync_each_batch
        num_steps: int = 1

    monkeypatch.setattr(accelerate.utils, "GradientAccumulationPlugin", OlderPlugin)
    with pytest.raises(UserError, match="GradientAccumulationPlugin has no sync_each_batch"):
        options.check(options.OPTION_SETS["accumulate"])
    options.check(options.OPTION_SETS["default"])  # nothing asked, nothing to refuse


def test_a_run_asking_more_than_the_builtin_text_trains_every_step_it_asks(tmp_path):
    """6 steps of 8 microbatches of 8 x 1024 tokens: 393,216, more than one pass of the built-in text."""
    steps, k, b, block = 6, 8, 8, 1024
    assert steps * k * b * block > data.BUILTIN_TOKENS
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--variants", INTENDED[0], "--batch_size",
                       str(b), "--gradient_accumulation_steps", str(k), "--block_size", str(block), "--max_steps",
                       str(steps), "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = load(tmp_path / "summary.json")
    assert summary["meta"]["steps_per_variant"] == steps and summary["meta"]["per_optimizer_step"]["tokens"] == 65536
    losses = summary["variants"][INTENDED[0]]["losses"]
    assert len(losses) == steps and all(math.isfinite(loss) and 5 < loss < 7 for loss in losses), losses


def test_the_builtin_text_is_repeated_end_to_end_only_where_one_pass_is_short():
    tokens = data.load_tokens(None, None, 509)
    n = tokens.numel()
    long = data.builtin_for_steps(tokens, 1024, 64, 1.0, 1, 6)  # 6 x 64 x 1024 tokens, and a block for the rounding
    assert long.numel() == 2 * n and torch.equal(long[n:], tokens) and 6 * 64 * 1024 + 1024 <= long.numel()
    assert torch.equal(data.builtin_for_steps(tokens, 128, 2, 1.0, 8, None), tokens)  # one pass holds it: as ever
    half = data.builtin_for_steps(tokens, 2048, 100, 0.5, 2, None)  # one step of 2 ranks, half of the blocks kept
    assert data.rank_batches(half, 2048, 100, 0.5, 1, 2, None).shape == (1, 100, 2048)
