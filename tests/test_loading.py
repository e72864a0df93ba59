"""loading.py on 2 gloo ranks with the ~100M-parameter preset: every mode, real files, real RSS."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import load, run_script

MODES = ["naive", "rank0_broadcast", "accelerate", "sharded_read"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    out = tmp_path_factory.mktemp("loading")
    proc = run_script(["loading.py", "--model", "small", "--device", "cpu", "--checkpoint_shard_size", "100MB",
                       "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return out, proc


def test_every_mode_loads_the_checkpoint_exactly_on_every_rank(loaded):
    out, proc = loaded
    summary = load(out / "loading_summary.json")
    assert summary["world_size"] == 2 and summary["checkpoint"]["dtype"] == "BF16"
    assert 95e6 * 4 < summary["model_bytes"] < 115e6 * 4  # about 100M fp32 parameters
    assert list(summary["modes"]) == MODES
    for mode in MODES:
        m = summary["modes"][mode]
        assert m["status"] == "ok" and m["weights_match"] is True
        assert [r["weights_match"] for r in m["ranks"]] == [True, True]
        for r in m["ranks"]:
            assert r["peak_rss_mib"] > r["baseline_rss_mib"] > 50
            assert r["load_time_s"] > 0 and r["peak_allocated_mib"] is None  # CPU: no allocator
        assert m["host_ram_sum_mib"] == pytest.approx(sum(r["peak_rss_mib"] for r in m["ranks"]))
        for rank in (0, 1):
            name = f"loading_{mode}_memory_usage{'' if rank == 0 else '_rank1'}.json"
            assert load(out / name)["status"] == "ok"
    for mode in MODES:
        assert mode in proc.stdout


def test_rank0_broadcast_and_sharded_read_spare_rank1_half_the_model(loaded):
    out, _ = loaded
    summary = load(out / "loading_summary.json")
    half_model_mib = summary["model_bytes"] / 2 / 2**20
    naive = summary["modes"]["naive"]["ranks"][1]["peak_rss_mib"]
    for mode in ("rank0_broadcast", "sharded_read"):
        assert summary["modes"][mode]["ranks"][1]["peak_rss_mib"] <= naive - half_model_mib, mode


def test_a_written_checkpoint_is_timed_and_reused(loaded, tmp_path):
    out, _ = loaded
    summary = load(out / "loading_summary.json")
    ckpt = out / "checkpoint-small-bfloat16"
    assert summary["checkpoint"]["path"] == str(ckpt) and summary["checkpoint"]["write_s"] > 0
    assert (ckpt / "model.safetensors.index.json").is_file()  # 100MB files: a sharded checkpoint
    proc = run_script(["loading.py", "--device", "cpu", "--checkpoint", str(ckpt),  # config from the checkpoint
                       "--modes", "sharded_read", "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = load(tmp_path / "loading_summary.json")
    assert again["checkpoint"]["write_s"] is None and list(again["modes"]) == ["sharded_read"]
    assert again["model"] == str(ckpt) and again["model_bytes"] == summary["model_bytes"]
    assert again["modes"]["sharded_read"]["weights_match"] is True


def test_visualize_draws_the_loading_plot(loaded, tmp_path):
    out, _ = loaded
    work = tmp_path / "out"
    work.mkdir()
    for path in out.glob("loading_*.json"):
        shutil.copy(path, work)
    proc = run_script(["visualize.py", "--dir", str(work)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    assert (work / "loading_memory.png").stat().st_size > 10_000
    assert not (work / "loss.png").exists()


def test_unknown_mode_is_one_line(tmp_path):
    proc = run_script(["loading.py", "--model", "small", "--device", "cpu", "--modes", "naive,magic",
                       "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --modes: unknown mode(s) magic; choose from naive, rank0_broadcast, " \
                                  "accelerate, sharded_read"


def test_a_repeated_mode_is_refused_in_one_line(tmp_path):
    proc = run_script(["loading.py", "--model", "small", "--device", "cpu", "--modes", "naive,naive",
                       "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --modes: a mode is given twice"


def test_a_corrupt_or_truncated_checkpoint_is_refused_in_one_line(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}))
    (checkpoint / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not a header")
    proc = run_script(["loading.py", "--checkpoint", str(checkpoint), "--device", "cpu",
                       "--output_dir", str(tmp_path / "out")], nproc=None)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(f"error: --checkpoint: {checkpoint / 'model.safetensors'} is not a "
                                          "readable safetensors file (")
    assert len(proc.stderr.strip().splitlines()) == 1
