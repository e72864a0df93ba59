"""Tensor and context parallelism beside FSDP2: real TP on gloo ranks for every variant, the layout's
arithmetic byte for byte, simulated ranks of R x S x T meshes, the matrix's TP and CP sets, and every
refusal. CP itself does not run on the CPU (it is refused there, and measured on the GPU: results/)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re

import accelerate
import pytest
import torch
import transformers
from conftest import TINY, load, refusal, run_script

from fsdp2bench.cli import UserError
from fsdp2bench.memory.accounting import ParamShape, expected_device_bytes, expected_state
from fsdp2bench.names import INTENDED, UNFIXED, state_bytes, step_peak_state
from fsdp2bench.options import fsdp
from fsdp2bench.options.layout import Degrees, Layout
from fsdp2bench.run import arguments
from fsdp2bench.train.model import load_config

TORCH_INTENDED = [v for v in INTENDED if v != "accelerate"]
# A loss under TP and one without it differ only by the order of their sums (a rowwise layer adds the
# partial products of its tp ranks, one matrix product adds them in one go), rounded to bf16 the same
# way: allowed one bf16 step (2^-7 relative). On these runs they came out equal.
BF16_STEP = 2 ** -7
UNSUPPORTED = f"unsupported: fails at accelerate {accelerate.__version__} + transformers {transformers.__version__}: "


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The TP and CP sets through matrix.py: real runs on 2 gloo ranks and simulated ranks of N = 4, 8."""
    out = tmp_path_factory.mktemp("parallel")
    proc = run_script(["matrix.py", "--nproc_per_node", "2", "--option_sets", "tp2,tp4,cp2,tp2_cp2",
                       "--simulate_world_size", "4,8", "--output_dir", str(out), *TINY, "--quiet"], nproc=None,
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """FSDP2 alone on one rank: the batches a world of 2 tp ranks trains on."""
    out = tmp_path_factory.mktemp("one_rank")
    proc = run_script(["main.py", *TINY, "--variants", ",".join(TORCH_INTENDED), "--output_dir", str(out)],
                      nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return load(out / "summary.json")


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= BF16_STEP * abs(y) for x, y in zip(a, b))


def test_tp_on_two_ranks_trains_as_fsdp_alone_and_counts_every_byte(matrix, one_rank):
    out, _ = matrix
    summary = load(out / "tp2" / "summary.json")
    assert summary["meta"]["per_optimizer_step"]["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    variants = summary["variants"]
    for name in TORCH_INTENDED:
        assert close(variants[name]["losses"], one_rank["variants"][name]["losses"]), name
    for name in [*TORCH_INTENDED, UNFIXED]:
        assert variants[name]["status"] == "ok" and variants[name]["accounting_matches_expected"], name
    checks = summary["checks"]
    assert checks["intended_variants_trained"]["ok"] is True and checks["unfixed_did_not_train"]["ok"] is True
    assert checks["accounting_matches_expected"]["ok"] is True
    # TP splits the blocks' Linear layers over the 2 ranks; FSDP2 has one rank to shard over, so the
    # rest (embeddings, norms) is held whole.
    held, whole = variants[TORCH_INTENDED[0]]["accounting"][0]["param_bytes"], summary["meta"]["num_parameters"] * 4
    assert whole / 2 < held < whole


def test_accelerate_under_tp_is_a_finding_with_its_releases_and_the_run_goes_on(matrix):
    out, proc = matrix
    for name in ("tp2", "tp2/sweep"):
        summary = load(out / name / "summary.json")
        found = summary["unsupported"]
        assert found and all(cause.startswith(UNSUPPORTED[len("unsupported: "):]) for cause in found.values()), found
    assert load(out / "tp2" / "summary.json")["variants"]["accelerate"]["status"].startswith(UNSUPPORTED)
    if not hasattr(importlib.import_module("transformers.integrations.tensor_parallel"), "ReplicateParallel"):
        # Every pair of the tested range, where the layout leaves FSDP ranks to shard over (T < N): the
        # name prepare() imports, asked before a model is built.
        found = load(out / "tp2" / "sweep" / "summary.json")["unsupported"].values()
        assert all("cannot import name 'ReplicateParallel'" in c and "asked before transformers builds" in c
                   for c in found), found
    assert f"accelerate fails at accelerate {accelerate.__version__} + transformers {transformers.__version__}" in \
        proc.stdout.replace("\n", " ")
    rows = [r for r in load(out / "matrix.json")["rows"] if r["variant"] == "accelerate"]
    assert rows and all(r["status"].startswith(UNSUPPORTED) for r in rows)


def test_a_planned_embedding_splits_with_its_tied_head_and_the_ranks_holding_more_are_named(tmp_path, one_rank):
    """transformers 5.17 adds embed_tokens: embedding_rowwise to a tied model's plan: its 509 rows split 255 / 254,
    the head with them."""
    config = load_config("tiny")
    fields = {**config.to_dict(), "base_model_tp_plan": {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(fields))
    proc = run_script(["main.py", *TINY, "--model", str(tmp_path / "model"), "--tp_size", "2", "--variants",
                       ",".join([*TORCH_INTENDED, UNFIXED]), "--output_dir", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = load(tmp_path / "out" / "summary.json")
    for name in TORCH_INTENDED:
        assert close(summary["variants"][name]["losses"], one_rank["variants"][name]["losses"]), name
    assert all(v["accounting_matches_expected"] for v in summary["variants"].values())
    held = [rank["end_of_training"]["param_bytes"] for rank in summary["variants"][TORCH_INTENDED[0]]["accounting"]]
    assert held[0] - held[1] == 64 * 4  # one row of the embedding more
    assert "The ranks hold different parameter bytes" in proc.stdout and "rank 0 holds the most" in proc.stdout


def test_tp_with_fsdp_on_four_ranks_trains_as_fsdp_on_two(tmp_path, suite):
    """S = 2 x T = 2: each pair of tp ranks trains on the batches one rank of a flat 2-rank run takes."""
    proc = run_script(["main.py", *TINY, "--tp_size", "2", "--variants", ",".join([*TORCH_INTENDED, UNFIXED]),
                       "--output_dir", str(tmp_path)], nproc=4, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary, flat = load(tmp_path / "summary.json"), load(suite[0] / "summary.json")
    assert summary["meta"]["per_optimizer_step"]["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    for name in TORCH_INTENDED:
        assert close(summary["variants"][name]["losses"], flat["variants"][name]["losses"]), name
    assert all(v["accounting_matches_expected"] for v in summary["variants"].values())
    assert summary["checks"]["unfixed_did_not_train"]["ok"] is True


def test_the_matrix_runs_the_tp_sets_where_they_fit_and_names_what_it_skips(matrix):
    out, proc = matrix
    result = load(out / "matrix.json")
    skipped = result["meta"]["skipped"]
    assert any(s.startswith("cp2: not run (--cp_size 2: context parallelism does not run on the CPU") for s in skipped)
    assert any(s.startswith("tp2_cp2: not run (--cp_size 2") for s in skipped)
    assert any(s.startswith("tp4: not run (--tp_size 4 does not divide the model's 2 key/value heads") for s in skipped)
    assert "Skipped: cp2: not run" in proc.stdout
    sets = {(r["option_set"], r["world_size"], r["simulated"]) for r in result["rows"]}
    assert sets == {("tp2", 2, False), ("tp2", 4, True), ("tp2", 8, True)}
    for r in result["rows"]:
        if r["variant"] != "accelerate":
            assert r["status"] == "ok" and r["accounting_matches_expected"], r


def test_a_simulated_rank_of_a_three_axis_mesh_holds_what_the_layout_says(tmp_path):
    """R = 2 x S = 2 x T = 2 on a fake group, the first and the last rank."""
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--simulate_world_size", "8",
                       "--simulate_rank", "0,last", "--tp_size", "2", "--dp_shard_size", "2",
                       "--variants", ",".join([*TORCH_INTENDED, UNFIXED]), "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = load(tmp_path / "summary.json")["simulated"]["8"]
    assert set(runs) == {"0", "7"}
    for rank, by_variant in runs.items():
        for name, entry in by_variant.items():
            assert entry["status"] == "ok" and entry["accounting_matches_expected"], (rank, name)


# --------------------------------------------------------------------------- the arithmetic

def test_a_rank_sits_on_each_axis_with_tp_innermost():
    degrees = Layout(dp_replicate_size=2, tp_size=2, cp_size=2).at(16)
    assert degrees == Degrees(replicate=2, shard=2, cp=2, tp=2)
    assert degrees.coordinates(13) == {"dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 1}  # 13 = 0b1101
    assert (degrees.fsdp_index(13), degrees.fsdp_degree, degrees.data_rank(13), degrees.data_ranks) == (2, 4, 3, 4)
    assert degrees.mesh_axes() == (("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2))
    assert Layout().at(8).mesh_axes() == (("dp_shard",), (8,))  # today's 1-D mesh
    assert Layout(tp_size=8).at(8).mesh_axes() == (("dp_shard", "tp"), (1, 8))


def test_tp_then_fsdp_shards_each_parameter_byte_for_byte():
    """A colwise (8, 6) and a rowwise (6, 8) weight and a 5-element norm, fp32, at S = 2 x T = 2."""
    shapes = [ParamShape((8, 6), 4, 0), ParamShape((6, 8), 4, 1), ParamShape((5,), 4, None)]
    tp = fsdp.FsdpOptions(layout=Layout(tp_size=2))
    # Rank 0: the colwise weight's 4 rows of tp rank 0, FSDP's first 2 of them (48 bytes); the rowwise
    # one's 6 x 4 block, its first 3 rows (48); the norm's first 3 of 5 (12, the padded size of both halves).
    first = expected_state(shapes, 4, 0, INTENDED[0], "end_of_training", tp)
    assert first == {"param_bytes": 108, "grad_bytes": 0, "optimizer_state_bytes": 2 * 108 + 3 * 4,
                     "stale_param_bytes": 0, "unreduced_grad_bytes": 0}
    last = expected_state(shapes, 4, 3, INTENDED[0], "before_zero_grad", tp)
    assert last == {"param_bytes": 108, "grad_bytes": 108, "optimizer_state_bytes": 2 * (48 + 48 + 8) + 3 * 4,
                    "stale_param_bytes": 0, "unreduced_grad_bytes": 0}
    # The stale optimizer holds every full parameter; built on the host, the two TP splits replaced stay there.
    unfixed = expected_state(shapes, 4, 0, UNFIXED, "end_of_training", tp)
    assert unfixed["stale_param_bytes"] == (48 + 48 + 5) * 4
    on_gpu = expected_device_bytes(shapes, 4, 0, UNFIXED, "end_of_training", tp, "cuda", built_on="cpu")
    assert on_gpu == unfixed["param_bytes"] + unfixed["grad_bytes"] + 5 * 4
    assert expected_device_bytes(shapes, 4, 0, UNFIXED, "end_of_training", tp, "cuda", built_on="cuda") == \
        sum(unfixed.values())
    # Between two microbatches without sync_each_batch: the whole bf16 gradient of the rank's tp part.
    accumulating = dataclasses.replace(tp, gradient_accumulation_steps=2)
    between = expected_state(shapes, 4, 0, INTENDED[0], "between_microbatches", accumulating)
    assert between["unreduced_grad_bytes"] == (4 * 6 + 6 * 4 + 5) * 2


def test_cp_shards_the_state_over_shards_times_cp_ranks():
    shapes = [ParamShape((9, 4), 4, 0), ParamShape((7,), 4, None)]
    for rank in range(8):
        for phase in ("end_of_training", "before_zero_grad"):
            flat = expected_state(shapes, 8, rank, INTENDED[0], phase)
            assert expected_state(shapes, 8, rank, INTENDED[0], phase,
                                  fsdp.FsdpOptions(layout=Layout(cp_size=2))) == flat
            assert expected_state(shapes, 8, rank, INTENDED[0], phase,
                                  fsdp.FsdpOptions(layout=Layout(cp_size=8))) == flat


# --------------------------------------------------------------------------- refusals

REFUSED = [
    (["--simulate_world_size", "6", "--tp_size", "4"], "--cp_size 1 x --tp_size 4 = 4 does not divide the world size 6"),
    (["--tp_size", "2"], "--cp_size 1 x --tp_size 2 = 2 does not divide the world size 1"),
    (["--simulate_world_size", "8", "--tp_size", "4"],
     "--tp_size 4 does not divide the model's 2 key/value heads (num_key_value_heads)"),
    (["--simulate_world_size", "8", "--tp_size", "2", "--dp_shard_size", "3"],
     "--dp_shard_size 3 does not divide the 4 data-parallel ranks (world size 8 / 2)"),
    (["--simulate_world_size", "2", "--cp_size", "2"],
     f"--cp_size 2: context parallelism does not run on the CPU with torch {torch.__version__}"),
    (["--cp_comm_strategy", "alltoall"], "--cp_comm_strategy needs --cp_size above 1"),
    (["--tp_size", "0"], "--tp_size must be in [1, 65536], got 0"),
]


@pytest.mark.parametrize("flags, message", REFUSED)
def test_a_layout_that_cannot_run_is_refused_in_one_line_before_anything_runs(tmp_path, flags, message):
    with pytest.raises(UserError) as refused:
        arguments.validate(["--model", "tiny", "--device", "cpu", *flags, "--output_dir", str(tmp_path / "out")])
    assert str(refused.value).startswith(message), str(refused.value)
    assert not (tmp_path / "out").exists()


def test_what_the_model_and_the_sequence_must_allow_is_refused():
    config = load_config("tiny")
    with pytest.raises(UserError, match=re.escape("--block_size 130: --cp_size 4 cuts each sequence into 8 chunks")):
        Layout(cp_size=4).check_model(config, 130)
    Layout(cp_size=4).check_model(config, 128)
    config._attn_implementation = "eager"
    with pytest.raises(UserError, match="this model's attention is 'eager', not 'sdpa'"):
        Layout(cp_size=2).check_model(config, 128)
    config.base_model_tp_plan = None
    with pytest.raises(UserError, match=re.escape("the qwen2 config has no tensor-parallel plan (base_model_tp_plan)")):
        Layout(tp_size=2).check_model(config, 128)
    config.base_model_tp_plan = {"layers.*.mlp.up_proj": "colwise_gather_output"}
    with pytest.raises(UserError, match="plan uses colwise_gather_output; the torch variants apply colwise and rowwise"):
        Layout(tp_size=2).check_model(config, 128)


def test_a_torch_or_accelerate_without_the_api_is_refused(monkeypatch):
    @dataclasses.dataclass
    class OldParallelismConfig:
        dp_replicate_size: int = 1
        dp_shard_size: int = 1

    monkeypatch.setattr(accelerate, "ParallelismConfig", OldParallelismConfig)
    with pytest.raises(UserError, match=f"--tp_size: accelerate {accelerate.__version__} has no "
                                        "ParallelismConfig.tp_size"):
        fsdp.check_parallel_libraries(Layout(tp_size=2))
    monkeypatch.delattr(torch.distributed.tensor.parallel, "parallelize_module")
    with pytest.raises(UserError, match="--tp_size: torch .* has no torch.distributed.tensor.parallel.parallelize_module"):
        fsdp.check_parallel_libraries(Layout(tp_size=2))


@pytest.mark.parametrize("plan, words", [
    ("colwise", 'base_model_tp_plan must map module patterns to styles ({"layers.*.mlp.up_proj": "colwise", ...}), '
                'got "colwise"'),
    (["layers.*.mlp.up_proj"], "base_model_tp_plan must map module patterns to styles"),
    ({"layers.*.mlp.up_proj": 1}, "base_model_tp_plan must map module patterns to styles"),
    ({"model.layers.*.mlp.up_proj": "colwise"}, 'base_model_tp_plan entry "model.layers.*.mlp.up_proj" matches no '
                                                 'module of the model (e.g. "layers.*.self_attn.q_proj")'),
    ({"norm": "colwise"}, 'base_model_tp_plan entry "norm": "colwise" splits Linear modules, and norm is a'),
    ({"layers.*.self_attn.q_proj": "colwise"}, 'base_model_tp_plan entry "layers.*.self_attn.q_proj" splits '
                                               'layers.0.self_attn without what it feeds or is fed by'),
    ({"layers.*.mlp.down_proj": "rowwise"}, 'base_model_tp_plan entry "layers.*.mlp.down_proj" splits layers.0.mlp '
                                            'without what it feeds or is fed by'),
    ({"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise"},
     'base_model_tp_plan entries "layers.*.mlp.gate_proj", "layers.*.mlp.up_proj" split layers.0.mlp without'),
])
def test_a_tp_plan_that_cannot_split_the_model_is_refused_naming_the_file_and_the_entry(tmp_path, plan, words):
    """A plan of the wrong kind, an entry that splits nothing or a module it cannot split, or entries whose
    split shapes do not line up with what they feed: one line naming config.json and the entry, before anything
    runs (they gave a traceback, ran splitting nothing, or failed inside a matmul). The first plan launched for
    real; the others asked of main.py's checks in this process, which its launch runs before anything else."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**load_config("tiny").to_dict(), "base_model_tp_plan": plan}))
    argv = [*TINY, "--model", str(model), "--simulate_world_size", "2", "--tp_size", "2",
            "--output_dir", str(tmp_path / "out")]
    if plan == "colwise":
        proc = run_script(["main.py", *argv], nproc=None)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
    else:
        lines = [refusal(arguments.validate, argv)]
    assert len(lines) == 1 and lines[0] is not None, lines
    assert lines[0].startswith(f"error: --tp_size 2: {model / 'config.json'}: {words}"), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [["--dp_replicate_size", "2"], ["--tp_size", "2"]])
def test_a_layout_accelerate_refuses_is_one_finding_whole_whatever_the_layout(tmp_path, flags):
    """No rank left for FSDP to shard over: accelerate's own check refuses its ParallelismConfig, under HSDP as
    under TP; the same status, its whole sentence, and the exit code of a run whose other variants ran."""
    out = tmp_path / "out"
    proc = run_script(["main.py", *TINY, "--max_steps", "2", *flags, "--variants", f"{TORCH_INTENDED[0]},accelerate",
                       "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = load(out / "summary.json")["variants"]["accelerate"]["status"]
    assert status.startswith(UNSUPPORTED + "ValueError: FSDP is enabled but the parallelism config has no dimension")
    assert status.endswith("or leave ranks for FSDP to use by lowering `tp_size`.")
    said = proc.stdout.replace("\n", " ")
    assert "by lowering `tp_size`.; the other variants ran" in said and "FAILED" not in proc.stderr


def test_the_projection_and_the_findings_follow_the_layout_and_the_variants_that_ran(matrix):
    """Under tp2 the sharding rule cuts each planned weight by TP first: the projection at the run's N is what
    the ranks counted, it has no N that T does not divide, and the sweep's finding compares the unfixed
    variant with the intended variants that ran (accelerate did not)."""
    out, _ = matrix
    summary = load(out / "tp2" / "summary.json")
    projection = summary["projection"]
    measured = projection["measured"]["per_rank_state_bytes"]
    for name in [*TORCH_INTENDED, UNFIXED]:
        assert projection["per_rank_state_bytes"]["2"][name] == measured[name], name
    assert "1" not in projection["per_rank_state_bytes"] and projection["unfixed_costs_more_from_world_size"] % 2 == 0
    sweep = load(out / "tp2" / "sweep" / "summary.json")
    found = sweep["simulation_findings"]["unfixed_exceeds_intended_from_world_size"]["state_at_step_peak"]
    rows = {n: {name: e for name, e in by_rank["0"].items()} for n, by_rank in sweep["simulated"].items()}
    assert all(rows[n]["accelerate"]["status"].startswith("unsupported") for n in rows)
    assert found == min(int(n) for n, row in rows.items() if state_bytes(step_peak_state(row[UNFIXED])) >
                        max(state_bytes(step_peak_state(row[v])) for v in TORCH_INTENDED))
