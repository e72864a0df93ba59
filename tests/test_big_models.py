"""Models larger than a GPU or the host: the built-in shapes of the models people fine-tune (their parameter counts
as published), and --init_device meta, under which a rank never holds more than its shards."""

from __future__ import annotations

import math

import pytest
from conftest import load, refusal, run_script

from fsdp2bench.run import arguments
from fsdp2bench.run.session import model_facts


@pytest.mark.parametrize("name, billions", [
    ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55), ("qwen2.5-32b", 32.76), ("qwen2.5-72b", 72.71),
])
def test_a_built_in_shape_has_the_published_parameter_count(name, billions):
    """The model cards' counts (8.03 B, 70.55 B, 32.76 B, 72.71 B), from the shapes alone (built on meta)."""
    count = sum(math.prod(p.shape) for p in model_facts(name, 421).shapes)
    assert count / 1e9 == pytest.approx(billions, abs=0.005)


def test_a_model_built_on_meta_trains_from_its_shards_alone(tmp_path):
    """2 ranks: the model exists only as each rank's shards, drawn after sharding; its state is what the sharding
    rule says to the byte, the build says meta, and the loss falls."""
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--init_device", "meta", "--variants",
                       "torch_optimizer_after_fsdp", "--max_steps", "16", "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    v = summary["variants"]["torch_optimizer_after_fsdp"]
    assert v["accounting_matches_expected"] and summary["checks"]["intended_variants_trained"]["ok"]
    trace = load(tmp_path / "torch_optimizer_after_fsdp_memory_usage_rank1.json")
    built = next(e for e in trace["events"] if e["name"] == "model_built")
    assert built["build_device"] == "meta"


@pytest.mark.parametrize("variants", ["torch_optimizer_before_fsdp_fixed", "accelerate",
                                      "torch_optimizer_after_fsdp,torch_optimizer_before_fsdp_not_fixed"])
def test_a_variant_that_needs_the_whole_model_is_refused_under_meta(variants, tmp_path):
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--init_device", "meta", "--variants",
                                        variants, "--output_dir", str(tmp_path / "o")])
    assert line is not None and "--init_device meta: the model exists only as each rank's shards" in line
    assert "add --variants torch_optimizer_after_fsdp" in line
