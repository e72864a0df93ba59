"""loading.py on 2 gloo ranks with the ~100M-parameter preset: every mode, real files, real RSS."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import load, refusal, run_script

import loading

MODES = ["naive", "rank0_broadcast", "accelerate", "sharded_read", "shared_memory"]
TINY_CONFIG = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


# ``loaded`` (tests/conftest.py): one 2-rank run of every mode with the ~100M-parameter preset.


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


def test_rank0_broadcast_sharded_read_and_shared_memory_spare_rank1_half_the_model(loaded):
    out, _ = loaded
    summary = load(out / "loading_summary.json")
    half_model_mib = summary["model_bytes"] / 2 / 2**20
    naive = summary["modes"]["naive"]["ranks"][1]["peak_rss_mib"]
    for mode in ("rank0_broadcast", "sharded_read", "shared_memory"):
        assert summary["modes"][mode]["ranks"][1]["peak_rss_mib"] <= naive - half_model_mib, mode


def test_shared_memory_keeps_one_copy_per_node_filled_by_one_rank(loaded):
    out, _ = loaded
    summary = load(out / "loading_summary.json")
    shared = summary["modes"]["shared_memory"]
    tensors_mib = summary["model_bytes"] / 2 / 2**20  # a bf16 checkpoint: half the fp32 model
    assert tensors_mib <= shared["node_copy_mib"] <= tensors_mib * 1.01  # page-aligned tensors
    filled = [r for r in shared["ranks"] if r["filled_node_copy"]]
    other = [r for r in shared["ranks"] if not r["filled_node_copy"]]
    assert len(filled) == 1 and len(other) == 1


@pytest.mark.parametrize("shard_size, files", [("100KB", "pytorch_model.bin.index.json"), ("2GB", "pytorch_model.bin")])
def test_a_pytorch_model_bin_checkpoint_loads_exactly_in_every_mode(tmp_path, shard_size, files):
    """The format, not the size: the tiny model (about 260 KB in bf16), in shards of 100 KB or in one file."""
    modes = MODES if files.endswith("json") else ["sharded_read", "shared_memory", "naive"]
    proc = run_script(["loading.py", "--model", "tiny", "--device", "cpu", "--checkpoint_format", "bin",
                       "--checkpoint_shard_size", shard_size, "--modes", ",".join(modes),
                       "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "loading_summary.json")
    checkpoint = tmp_path / "checkpoint-tiny-bfloat16-bin"
    assert (checkpoint / files).is_file() and not list(checkpoint.glob("*.safetensors"))
    assert (len(list(checkpoint.glob("pytorch_model*.bin"))) > 1) == files.endswith("json")  # shards, or one file
    assert summary["checkpoint"]["format"] == "bin" and summary["checkpoint"]["dtype"] == "BF16"
    assert list(summary["modes"]) == modes
    assert all(m["status"] == "ok" and m["weights_match"] for m in summary["modes"].values())


def test_a_simulated_world_size_loads_rank0_alone_and_skips_the_modes_that_need_peers(tmp_path):
    proc = run_script(["loading.py", "--model", "small", "--device", "cpu", "--simulate_world_size", "2,8",
                       "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "loading_summary.json")
    assert summary["modes"] == {} and list(summary["simulated"]) == ["2", "8"]
    assert "GPU peak" not in proc.stdout  # a CPU run's table has no GPU column
    for n in ("2", "8"):
        by_mode = summary["simulated"][n]
        for mode in ("rank0_broadcast", "accelerate"):
            assert by_mode[mode]["status"].startswith("skipped: needs data from the other ranks")
        for mode in ("naive", "sharded_read", "shared_memory"):
            assert by_mode[mode]["status"] == "ok" and by_mode[mode]["weights_match"], (n, mode)
            assert load(tmp_path / f"simulated_N{n}" / f"loading_{mode}_memory_usage.json")["world_size"] == int(n)
    read = {n: summary["simulated"][n]["sharded_read"]["ranks"][0] for n in ("2", "8")}
    added = {n: r["peak_rss_mib"] - r["baseline_rss_mib"] for n, r in read.items()}
    assert added["8"] < added["2"]  # rank 0 of 8 reads a quarter of what rank 0 of 2 reads
    drawn = run_script(["visualize.py", "--dir", str(tmp_path)], nproc=None)
    assert drawn.returncode == 0 and (f"the loading traces of each N:\n    python3 visualize.py --dir "
                                      f"{tmp_path / 'simulated_N2'}\n    python3 visualize.py --dir "
                                      f"{tmp_path / 'simulated_N8'}\n") in drawn.stdout, drawn.stderr
    assert (tmp_path / "loading_vs_world_size.png").stat().st_size > 10_000
    drawn = run_script(["visualize.py", "--dir", str(tmp_path / "simulated_N8")], nproc=None)
    assert drawn.returncode == 0 and (tmp_path / "simulated_N8" / "loading_memory.png").stat().st_size > 10_000


def test_a_legacy_or_corrupt_bin_checkpoint_is_refused_in_one_line_before_any_file(tmp_path):
    """Asked of loading.py's checks in this process: a launch refused in one line by them is
    test_a_corrupt_or_truncated_checkpoint_is_refused_in_one_line."""
    import torch

    for name, write in (("legacy", lambda p: torch.save({"w": torch.zeros(2)}, p, _use_new_zipfile_serialization=False)),
                        ("corrupt", lambda p: p.write_bytes(b"PK\x03\x04 truncated"))):
        checkpoint = tmp_path / name
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text(json.dumps(TINY_CONFIG))
        write(checkpoint / "pytorch_model.bin")
        out = tmp_path / f"out-{name}"
        line = refusal(loading.validate, ["--checkpoint", str(checkpoint), "--device", "cpu", "--output_dir", str(out)])
        assert line is not None, name
        assert line.startswith(f"error: --checkpoint: {checkpoint / 'pytorch_model.bin'} is "), line
        assert ("legacy format" in line) == (name == "legacy") and not out.exists()


def test_a_written_checkpoint_is_timed_and_reused(loaded, tmp_path):
    out, _ = loaded
    summary = load(out / "loading_summary.json")
    ckpt = out / "checkpoint-small-bfloat16"
    assert summary["checkpoint"]["path"] == str(ckpt) and summary["checkpoint"]["write_s"] > 0
    assert (ckpt / "model.safetensors.index.json").is_file()  # 100MB files: a sharded checkpoint
    proc = run_script(["loading.py", "--device", "cpu", "--checkpoint", str(ckpt),  # config from the checkpoint
                       "--modes", "sharded_read", "--output_dir", str(tmp_path)], nproc=None)  # not about ranks
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
                                  "accelerate, sharded_read, shared_memory"


def test_a_repeated_mode_is_refused_in_one_line(tmp_path):
    """Asked of loading.py's checks in this process (the launch of test_unknown_mode_is_one_line is refused by them
    in the same way)."""
    assert refusal(loading.validate, ["--model", "small", "--device", "cpu", "--modes", "naive,naive",
                                      "--output_dir", str(tmp_path / "out")]) == "error: --modes: a mode is given twice"
    assert not (tmp_path / "out").exists()


def test_a_corrupt_or_truncated_checkpoint_is_refused_in_one_line(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(TINY_CONFIG))
    (checkpoint / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not a header")
    proc = run_script(["loading.py", "--checkpoint", str(checkpoint), "--device", "cpu",
                       "--output_dir", str(tmp_path / "out")], nproc=None)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(f"error: --checkpoint: {checkpoint / 'model.safetensors'} is not a "
                                          "readable safetensors file (")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_transformers_report_reproduction_prints_each_ranks_host_memory(loaded):
    out, _ = loaded
    proc = run_script(["examples/cpu_ram_efficient_loading.py", str(out / "checkpoint-small-bfloat16")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"]
    assert lines[0].endswith("expected: the weights") and lines[1].endswith("expected: nothing (meta tensors)")
    assert all("added" in line and "MiB on the host" in line for line in lines)
    usage = run_script(["examples/cpu_ram_efficient_loading.py"], nproc=None)
    assert usage.returncode == 1 and usage.stderr.strip().splitlines()[-1].startswith("usage: torchrun")


FORMATS = {"safetensors": ("model.safetensors", "model.safetensors.index.json"),
           "bin": ("pytorch_model.bin", "pytorch_model.bin.index.json")}


def write_state(state: dict, path, kind: str) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(state, str(path)) if kind == "safetensors" else torch.save(state, str(path))


@pytest.mark.parametrize("fault, message", [
    ("index names a missing shard", "names {dir}/gone.{ext}, which does not exist"),
    ("index is not JSON", "is not a readable index"),
    ("index misplaces a tensor", "the index puts {first} in {dir}/other.{ext}, but it is in {dir}/part.{ext}"),
    ("a tensor is missing", "no tensor {first}, which the model has"),
    ("a tensor has another shape", "{first} has shape (3, 3), the model's is"),
    ("a tensor is not floating point", "{first} is torch.int32, not a floating-point tensor"),
])
@pytest.mark.parametrize("kind", list(FORMATS))
def test_both_formats_are_checked_alike_before_any_mode_runs(tmp_path, kind, fault, message):
    """Index, shards, names, shapes against the model, dtypes: one line, exit 2, no mode run. Asked of loading.py's
    checks in this process, which a launch runs before anything else (the launches of
    test_a_corrupt_or_truncated_checkpoint_is_refused_in_one_line and test_unknown_mode_is_one_line end on them in
    one line and exit code 2)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_CONFIG))
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    first = next(iter(state))
    single, index = FORMATS[kind]
    ext = single.rsplit(".", 1)[1]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY_CONFIG))
    if fault.startswith("index"):
        write_state(state, ckpt / f"part.{ext}", kind)
        weight_map = {"index names a missing shard": dict.fromkeys(state, f"gone.{ext}"),
                      "index misplaces a tensor": {**dict.fromkeys(state, f"part.{ext}"), first: f"other.{ext}"}}
        if fault == "index misplaces a tensor":  # other.* exists, but part.* holds the tensor
            write_state({"unrelated": torch.zeros(1)}, ckpt / f"other.{ext}", kind)
        (ckpt / index).write_text("{not json" if fault == "index is not JSON" else json.dumps({"weight_map":
                                                                                              weight_map[fault]}))
    else:
        broken = {"a tensor is missing": {k: v for k, v in state.items() if k != first},
                  "a tensor has another shape": {**state, first: torch.zeros(3, 3)},
                  "a tensor is not floating point": {**state, first: torch.zeros(state[first].shape,
                                                                                 dtype=torch.int32)}}[fault]
        write_state(broken, ckpt / single, kind)
    out = tmp_path / "out"
    line = refusal(loading.validate, ["--checkpoint", str(ckpt), "--device", "cpu", "--output_dir", str(out)])
    assert line is not None and line.startswith("error: --checkpoint"), line
    assert message.format(dir=ckpt, ext=ext, first=first) in line, line
    assert not out.exists()


def test_a_run_without_a_model_on_the_cpu_says_its_own_model_and_time(tmp_path):
    """The first line of loading.py's default CPU run is about loading.py's run, not main.py's training run."""
    proc = run_script(["loading.py", "--device", "cpu", "--output_dir", str(tmp_path / "out")], nproc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("No --model given"), proc.stdout[:500]
    assert " ".join(proc.stdout.split()).startswith(  # one paragraph, folded at the console's width
        "No --model given and no GPU: loading.py loads the tiny model, a functional run of seconds (13 s with torchrun "
        "--nproc_per_node 2 on 2 cores). The real one on the CPU: add --model qwen2.5-1.5b.")
    assert "main.py" not in proc.stdout
    assert "GPU peak" not in proc.stdout  # a CPU run has no allocator: no column of n/a, no word of it
    assert (tmp_path / "out" / "loading_summary.json").exists()


def test_the_host_memory_each_mode_holds_is_counted_by_hand():
    """P = 1000 parameters, a bf16 checkpoint of 2000 bytes, N = 4 with 2 ranks on the node. On a CPU run each rank's fp32 shard
    (1000 bytes) is on the host: naive holds the whole fp32 model in each process, 2 x 4000, and the shards, 2000;
    broadcast and shared memory the checkpoint once, 2000, and the shards; accelerate one fp32 model; sharded
    reading the shards alone. On a GPU the shards are on the GPU."""
    from fsdp2bench.loading.modes import host_need, mode_host_bytes

    cpu = {m: mode_host_bytes(m, 4, 2, 1000, 2000, "cpu") for m in loading.MODES}
    assert cpu == {"naive": 10000, "rank0_broadcast": 4000, "accelerate": 6000, "sharded_read": 2000,
                   "shared_memory": 4000}
    gpu = {m: mode_host_bytes(m, 4, 2, 1000, 2000, "cuda") for m in loading.MODES}
    assert gpu == {"naive": 8000, "rank0_broadcast": 2000, "accelerate": 4000, "sharded_read": 0, "shared_memory": 2000}
    assert host_need(["sharded_read"], [4], 2, 1000, 2000, "cpu", True) == (4000, "writing the checkpoint (the model "
                                                                              "built in fp32 first)")
    assert host_need(["naive", "sharded_read"], [2, 8], 1, 1000, 2000, "cpu", False) == (6000, "naive at N = 2")


@pytest.mark.parametrize("argv, said", [
    (["--simulate_world_size", "8,32"], "naive at N = 8"),
    (["--simulate_world_size", "8", "--modes", "sharded_read"], "writing the checkpoint"),
])
def test_a_launch_the_host_cannot_hold_is_refused_with_the_figure_it_needs(argv, said, tmp_path, monkeypatch):
    """Before anything is built (the kernel would kill it minutes in): how much, for what, and what is there."""
    monkeypatch.setattr(loading, "host_memory_for_launch", lambda: 3 << 30)
    line = refusal(loading.validate, ["--model", "qwen2.5-1.5b", "--device", "cpu", "--output_dir",
                                      str(tmp_path / "out"), *argv])
    assert line is not None and line.startswith("error: --model qwen2.5-1.5b needs about ") and said in line, line
    assert "3.0 GiB are available" in line and not (tmp_path / "out").exists()
