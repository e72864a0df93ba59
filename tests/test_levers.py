"""The levers (fsdp2bench/options/levers.py) on every variant, and the speed figures beside every peak
(fsdp2bench/train/throughput.py): selective and every-K checkpointing and per-block compilation train all four variants
with the state counted to the byte and the intended variants' losses equal; each is read back from the prepared
models; a step timed beside another run is no speed figure; float8 is refused where it cannot run; an accelerate
config's dynamo and fp8 fields become the levers."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from conftest import VARIANTS, load, refusal, run_script
from fsdp2bench.cli import UserError
from fsdp2bench.options import accelerate_config, levers
from fsdp2bench.run import arguments
from fsdp2bench.train.throughput import model_flops_per_token, peak_flops

RUN = ["main.py", "--model", "tiny", "--device", "cpu", "--quiet"]
INTENDED = [v for v in VARIANTS if v != "torch_optimizer_before_fsdp_not_fixed"]


def entries(out) -> dict:
    return load(out / "summary.json")["variants"]


def assert_exact_and_equal(variants: dict) -> None:
    """Every variant finished with its state counted to the byte (the first block's gathered bytes included) and
    the intended variants' losses bit-equal (the CPU's bf16 runs are deterministic)."""
    assert all(v["status"] == "ok" for v in variants.values()), variants
    for name, v in variants.items():
        assert v["accounting_matches_expected"], name
        assert v["gathered_block_bytes"] == v["expected_gathered_block_bytes"] and v["gathered_block_bytes"][0] > 0
    assert len({tuple(variants[n]["losses"]) for n in INTENDED}) == 1


def test_selective_checkpointing_and_compile_train_every_variant_exactly(tmp_path):
    """2 ranks, every block checkpointed op by op and compiled by inductor (C++ on the CPU): each variant's blocks
    read back as such, the losses equal, and the speed measured after the two compiling steps."""
    proc = run_script([*RUN, "--max_steps", "4", "--activation_checkpointing", "selective", "--compile",
                       "--output_dir", str(tmp_path)], timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    variants = entries(tmp_path)
    assert_exact_and_equal(variants)
    for name, v in variants.items():
        applied = v["applied"][0]
        assert (applied["activation_checkpointing"], applied["compiled"]) == ("selective", "blocks"), name
        assert v["applied_matches_options"]
        speed = v["speed"]  # steps timed beside another run on this machine (none in CI) are left out
        assert speed["warmup_steps"] == 2 and speed["timed_steps"] + speed["shared_steps"] == 2
        assert speed["mfu"] is None and not speed["compute_only"] and speed["tokens_per_step_per_gpu"] == 2 * 128
        if not speed["shared_steps"]:
            assert speed["tokens_per_s_per_gpu"] > 0 and speed["compile_s"] is not None
    # accelerate's plugin knows no selective checkpointing: the suite wraps its model before prepare(), and says so.
    assert variants["accelerate"]["applied"][0]["checkpointing_by"] == "the suite, before prepare"
    # accelerate's regional compilation compiles the small modules around the blocks too; the torch variants do not.
    assert variants["accelerate"]["applied"][0]["compiled_outside_blocks"]
    assert not variants["torch_optimizer_after_fsdp"]["applied"][0]["compiled_outside_blocks"]
    if any(v["speed"]["compile_s"] is not None for v in variants.values()):
        assert "Compiling took" in " ".join(proc.stdout.split())
    # The order of the levers, read back: the torch variants shard the compiled checkpointed block (torchtitan's
    # order, FSDP2's hooks outside the graph); accelerate checkpoints, compiles the wrapper in place, then shards the
    # block inside it, so FSDP2's hooks sit inside the compiled checkpoint and dynamo breaks there.
    torch_nesting = variants["torch_optimizer_after_fsdp"]["applied"][0]["block_nesting"]
    assert torch_nesting == ["fully_shard", "compiled", "checkpointed", "Qwen2DecoderLayer"]
    assert variants["torch_optimizer_after_fsdp"]["graph_breaks"] == [0, 0]
    nesting = variants["accelerate"]["applied"][0]["block_nesting"]
    assert nesting[0] == "compiled" and "checkpointed" in nesting
    assert nesting[-2:] == ["fully_shard", "Qwen2DecoderLayer"]
    assert min(variants["accelerate"]["graph_breaks"]) >= 1
    said = " ".join(proc.stdout.split())
    assert "accelerate: " in said and "FSDP2's hooks run inside the compiled call" in said


def test_every_kth_block_and_a_step_beside_another_run(tmp_path):
    """Every 2nd block checkpointed whole, the variants two at a time on one CPU: the wrapping read back from all
    four, and each step timed while the other run was busy left out of the speed, which says why."""
    proc = run_script([*RUN, "--max_steps", "12", "--activation_checkpointing", "full", "--ac_every", "2",
                       "--concurrent_variants", "2", "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    variants = entries(tmp_path)
    assert_exact_and_equal(variants)
    for name, v in variants.items():
        assert (v["applied"][0]["activation_checkpointing"], v["applied"][0]["ac_every"]) == ("full", 2), name
        speed, steps = v["speed"], load(tmp_path / f"{name}_memory_usage.json")["steps"]
        beside = [s["runs_beside"] > 0 for s in steps[speed["warmup_steps"]:]]
        assert (speed["shared_steps"], speed["timed_steps"]) == (sum(beside), len(beside) - sum(beside)), name
        if speed["timed_steps"] < 2:
            assert speed["tokens_per_s_per_gpu"] is None and "another run was busy" in speed["not_measured"]
    # The pairs start together, so some steps ran beside the other run (how many depends on the machine's load:
    # under load one run of a pair may set up while the other trains, so not every run need share one).
    assert any(variants[name]["speed"]["shared_steps"] > 0 for name in VARIANTS), variants


def test_a_bare_loop_beside_the_suite_on_a_simulated_rank(tmp_path):
    """speed.py --bare_loop times the same work bare, then the suite: both medians and the suite's cost per step in
    speed.json; the simulated rank's figures are compute only, and marked so on the console."""
    out = tmp_path / "run"
    proc = run_script(["speed.py", "--nproc_per_node", "1", "--bare_loop", "--output_dir", str(out), "--",
                       "--model", "tiny", "--device", "cpu", "--max_steps", "4", "--simulate_world_size", "4",
                       "--variants", "torch_optimizer_after_fsdp"], nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "speed.json") as f:
        bare = json.load(f)["bare_loop"]
    assert bare["run"] == "N=4 rank 0 torch_optimizer_after_fsdp" and bare["world_size"] == 4
    speed = load(out / "summary.json")["simulated"]["4"]["0"]["torch_optimizer_after_fsdp"]["speed"]
    assert speed["compute_only"] and bare["bare_median_step_s"] > 0
    if not speed["shared_steps"]:  # none in CI; a run beside it on this machine leaves the suite no speed
        assert speed["tokens_per_s_per_gpu"] > 0 and bare["suite_median_step_s"] == speed["median_step_time_s"]
        assert bare["suite_cost_per_step"] == bare["suite_median_step_s"] / bare["bare_median_step_s"] - 1
        assert "compute only" in " ".join(proc.stdout.split())


@pytest.mark.parametrize("argv, said", [
    (["--float8"], "--float8 needs a GPU of compute capability 8.9 or more"),
    (["--float8", "--mixed_precision_policy", "fp32"], "--float8 with --mixed_precision_policy fp32"),
    (["--float8", "--simulate_world_size", "2", "--tp_size", "2"], "--float8 with --tp_size 2"),
    (["--ac_every", "2"], "--ac_every 2 needs --activation_checkpointing full"),
    (["--activation_checkpointing", "selective", "--ac_every", "3"], "--ac_every 3 needs --activation_checkpointing"),
    (["--activation_checkpointing", "full", "--ac_every", "3"], "--ac_every 3: this model has 2 blocks"),
    (["--activation_checkpointing", "selective", "--activation_checkpointing_offload"],
     "--activation_checkpointing_offload needs --activation_checkpointing full"),
    (["--activation_checkpointing", "partial"], "--activation_checkpointing: expected one of none, full, selective"),
    (["--compile", "maybe"], "--compile: expected true or false"),
])
def test_a_lever_that_cannot_run_is_refused_in_one_line(tmp_path, argv, said):
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--output_dir", str(tmp_path), *argv])
    assert line is not None and said in line, line


COMPILE_ON_CPU = "--compile on the CPU: inductor builds C++ there, and "


@pytest.mark.parametrize("cxx, said", [
    ("/nothere/g++", "CXX='/nothere/g++' names no C++ compiler that runs"),
    ("false", "CXX='false' names no C++ compiler that runs"),  # there, but it is no compiler
    ("", "CXX='' names no C++ compiler that runs"),
])
def test_compile_on_the_cpu_takes_the_compiler_cxx_names_and_refuses_one_that_does_not_run(tmp_path, cxx, said):
    """CXX, as inductor and torch's C++ extensions take it, not the PATH's g++: one line naming it, exit 2."""
    proc = run_script([*RUN, "--compile", "--output_dir", str(tmp_path / "out")], nproc=None, CXX=cxx)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {COMPILE_ON_CPU}{said}", proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to name")
def test_a_working_compiler_named_by_cxx_is_taken_and_without_cxx_inductors_default_on_the_path(tmp_path,
                                                                                              monkeypatch):
    argv = ["--model", "tiny", "--device", "cpu", "--compile", "--output_dir", str(tmp_path / "out")]
    monkeypatch.setenv("CXX", shutil.which("g++"))
    assert refusal(arguments.validate, argv) is None
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ there
    assert refusal(arguments.validate, argv) == f"error: {COMPILE_ON_CPU}no C++ compiler: g++ is not on the PATH " \
                                                "(or set CXX to one)"


def test_float8_on_an_older_gpu_or_without_torchao_is_refused(monkeypatch):
    monkeypatch.setattr(levers, "gpu_capability", lambda: (8, 0))
    with pytest.raises(UserError, match="compute capability 8.9 or more.*this one has 8.0"):
        levers.check_float8("cuda")
    monkeypatch.setattr(levers, "gpu_capability", lambda: (9, 0))
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(UserError, match="torchao cannot be imported.*pip install -r requirements-float8.txt"):
        levers.check_float8("cuda")


def test_an_accelerate_config_compiles_as_the_suite_does_or_is_refused_by_field():
    """accelerate's regional compilation with inductor is --compile; another backend, whole-model compilation or
    another mode is refused naming the field; fp8 through torchao is --float8, another backend refused."""
    regional = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "True",
                "ACCELERATE_DYNAMO_MODE": "default", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False"}
    assert accelerate_config.lever_values(regional, "f.yaml") == {"compile": True}
    assert accelerate_config.lever_values({"ACCELERATE_DYNAMO_BACKEND": "NO"}, "f.yaml") == {}
    for key, value, said in (("ACCELERATE_DYNAMO_BACKEND", "EAGER", "dynamo_backend EAGER"),
                             ("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False",
                              "dynamo_use_regional_compilation False"),
                             ("ACCELERATE_DYNAMO_MODE", "max-autotune", "dynamo_mode max-autotune")):
        with pytest.raises(UserError, match=f"f.yaml: dynamo_config {said}"):
            accelerate_config.lever_values({**regional, key: value}, "f.yaml")
    fp8 = {"ACCELERATE_MIXED_PRECISION": "fp8"}
    assert accelerate_config.lever_values({**fp8, "ACCELERATE_FP8_BACKEND": "AO"}, "f.yaml") == {"float8": True}
    with pytest.raises(UserError, match="f.yaml: fp8_config backend TE: the suite measures float8 through torchao"):
        accelerate_config.lever_values({**fp8, "ACCELERATE_FP8_BACKEND": "TE"}, "f.yaml")


def test_a_config_file_with_dynamo_and_fp8_reaches_the_levers(tmp_path):
    """Read through accelerate's own loader: the dynamo_config sets --compile (its source the file); fp8 sets
    --float8, which this CPU then refuses naming the file's field (or, without torchao, the field is refused)."""
    import yaml

    base = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy":
                                                        "TRANSFORMER_BASED_WRAP"}}
    path = tmp_path / "fsdp2.yaml"
    path.write_text(yaml.safe_dump({**base, "dynamo_config": {"dynamo_backend": "INDUCTOR",
                                                              "dynamo_use_regional_compilation": True}}))
    checked = arguments.validate(["--model", "tiny", "--device", "cpu", "--config_file", str(path), "--output_dir",
                                  str(tmp_path / "out")])
    assert checked.fsdp_options.compile and checked.args.option_sources["compile"] == "config"
    path.write_text(yaml.safe_dump({**base, "mixed_precision": "fp8"}))
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--config_file", str(path),
                                        "--output_dir", str(tmp_path / "out")])
    said = "--float8 is fsdp2.yaml mixed_precision" if importlib.util.find_spec("torchao") else \
        "fsdp2.yaml: mixed_precision fp8 needs torchao"
    assert line is not None and said in line, line


def test_model_flops_and_peaks_follow_the_stated_rule():
    """6 x the matmul parameters (the head once, tied or not) + 12 x layers x heads x head dim x sequence; the
    peak by device name, none for an unknown one."""
    class Config:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, head_dim = 1000, 64, 2, 4, 16
        tie_word_embeddings = False

    untied = model_flops_per_token(200_000, Config, 128)
    assert untied == 6 * (200_000 - 1000 * 64) + 12 * 2 * 4 * 16 * 128
    Config.tie_word_embeddings = True
    assert model_flops_per_token(200_000, Config, 128) == untied + 6 * 1000 * 64
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("Some New GPU") is None and peak_flops(None) is None
