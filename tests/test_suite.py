"""The benchmark's contract, checked on a real 2-rank gloo run of the tiny model."""

from __future__ import annotations

import math

import pytest

from conftest import TINY, VARIANTS, load, run_script

TRACE_KEYS = ["timestamps", "allocated_memory", "reserved_memory", "virtual_memory"]
STEP_KEYS = {"step", "loss", "step_time_s", "peak_allocated_mib", "peak_reserved_mib", "rss_mib"}
EVENTS = ["model_built", "optimizer_created", "sharded", "training_started", "training_finished"]
INTENDED = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_fixed", "accelerate"]
UNFIXED = "torch_optimizer_before_fsdp_not_fixed"


def traces(out, name):
    return [load(out / f"{name}_memory_usage.json"), load(out / f"{name}_memory_usage_rank1.json")]


def test_every_rank_writes_every_variant(suite):
    out, _ = suite
    for name in VARIANTS:
        assert (out / f"{name}_memory_usage.json").is_file()
        assert (out / f"{name}_memory_usage_rank1.json").is_file()
    assert (out / "summary.json").is_file()
    assert not list(out.glob("*.tmp*")), "a temporary file was left behind"
    assert not list(out.glob("*.pkl")), "no snapshot without --save_memory_snapshot"


def test_trace_schema_keeps_upstream_keys_and_adds_steps_events_meta(suite):
    out, _ = suite
    for name in VARIANTS:
        for rank, trace in enumerate(traces(out, name)):
            lengths = {len(trace[k]) for k in TRACE_KEYS}
            assert len(lengths) == 1 and lengths.pop() > 0
            assert trace["timestamps"] == sorted(trace["timestamps"])
            # CPU: no allocator, so null rather than invented numbers; RSS is real.
            assert all(v is None for v in trace["allocated_memory"] + trace["reserved_memory"])
            assert all(v > 50 for v in trace["virtual_memory"])
            assert [s["step"] for s in trace["steps"]] == list(range(12))
            for s in trace["steps"]:
                assert STEP_KEYS <= set(s)
                assert math.isfinite(s["loss"]) and s["step_time_s"] > 0 and s["rss_mib"] > 50
                assert s["peak_allocated_mib"] is None and s["peak_reserved_mib"] is None
            names = [e["name"] for e in trace["events"]]
            assert [n for n in names if n in EVENTS] == sorted(set(names) & set(EVENTS), key=names.index)
            assert set(EVENTS) <= set(names)
            assert names[-1] == "training_finished"
            assert trace["status"] == "ok"
            meta = trace["meta"]
            assert meta["rank"] == rank and meta["world_size"] == 2 and meta["device"] == "cpu"
            assert meta["model"] == "tiny" and meta["num_parameters"] > 0
            assert {"torch", "accelerate", "transformers"} <= set(meta["versions"])
            assert meta["args"]["learning_rate"] == 1e-3


def test_optimizer_is_created_where_each_variant_says(suite):
    out, _ = suite
    order = {name: [e["name"] for e in traces(out, name)[0]["events"]] for name in VARIANTS}
    assert order["torch_optimizer_after_fsdp"].index("sharded") < \
        order["torch_optimizer_after_fsdp"].index("optimizer_created")
    for name in (UNFIXED, "torch_optimizer_before_fsdp_fixed", "accelerate"):
        assert order[name].index("optimizer_created") < order[name].index("sharded")


def test_each_rank_draws_the_weights_once_and_its_other_variants_map_them(suite):
    out, _ = suite
    for rank in (0, 1):
        built = [next(e for e in traces(out, name)[rank]["events"] if e["name"] == "model_built") for name in VARIANTS]
        assert [e["weights"] for e in built] == ["drew", "mapped", "mapped", "mapped"]
        assert all(e["build_device"] == "cpu" for e in built)


def test_intended_variants_have_bit_equal_losses_on_every_rank(suite):
    out, _ = suite
    for rank in (0, 1):
        losses = {n: [s["loss"] for s in traces(out, n)[rank]["steps"]] for n in INTENDED}
        assert losses["torch_optimizer_after_fsdp"] == losses["torch_optimizer_before_fsdp_fixed"]
        assert losses["torch_optimizer_after_fsdp"] == losses["accelerate"]
    # Ranks see different batches, so their losses differ.
    assert [s["loss"] for s in traces(out, INTENDED[0])[0]["steps"]] != \
        [s["loss"] for s in traces(out, INTENDED[0])[1]["steps"]]


def test_intended_variants_learn_and_the_unfixed_one_does_not(suite):
    out, _ = suite
    summary = load(out / "summary.json")
    for name in INTENDED:
        losses = summary["variants"][name]["losses"]
        assert losses[-1] < 0.85 * losses[0], (name, losses)
    unfixed = summary["variants"][UNFIXED]["losses"]
    after = summary["variants"]["torch_optimizer_after_fsdp"]["losses"]
    assert unfixed[0] == after[0]  # same initial weights and first batch
    assert max(unfixed) - min(unfixed) < 0.05 * unfixed[0], unfixed
    assert abs(summary["variants"][UNFIXED]["loss_drop"]) < 0.01


def test_summary_records_every_variant_and_passes_its_checks(suite):
    out, proc = suite
    summary = load(out / "summary.json")
    assert summary["meta"]["world_size"] == 2
    assert list(summary["variants"]) == VARIANTS
    for name, v in summary["variants"].items():
        assert v["status"] == "ok" and v["steps"] == 12 and len(v["losses"]) == 12
        assert v["final_loss"] == v["losses"][-1]
        assert v["losses"] == [s["loss"] for s in traces(out, name)[0]["steps"]]
        assert len(v["peak_rss_mib"]["per_rank"]) == 2
        assert v["peak_rss_mib"]["max"] == max(v["peak_rss_mib"]["per_rank"])
        assert v["peak_allocated_mib"] == {"per_rank": [None, None], "max": None}
        assert v["wall_s"] > 0
    checks = summary["checks"]
    assert checks["intended_losses_match"]["ok"] is True
    assert checks["intended_losses_match"]["max_relative_diff"] == {
        "torch_optimizer_before_fsdp_fixed": 0.0, "accelerate": 0.0}
    assert checks["unfixed_did_not_train"]["ok"] is True
    assert "functional run" in proc.stdout
    for name in VARIANTS:
        assert name in proc.stdout
    assert "check intended_losses_match: PASS" in proc.stdout


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One run of plain python (no launcher), two variants in the order given, 3 steps, with --quiet."""
    out = tmp_path_factory.mktemp("single_process")
    # Without torchrun nothing sets OMP_NUM_THREADS=1: the children forked on CPU must not inherit
    # an OpenMP pool of the launcher process (they used to hang in their first matrix multiply).
    proc = run_script(["main.py", *TINY, "--max_steps", "3", "--variants",
                       "torch_optimizer_before_fsdp_fixed,torch_optimizer_after_fsdp", "--quiet",
                       "--output_dir", str(out)], nproc=None, timeout=240, OMP_NUM_THREADS="2")
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_single_process_run_without_launcher(single_process):
    tmp_path, _ = single_process
    summary = load(tmp_path / "summary.json")
    assert summary["meta"]["world_size"] == 1
    # Run in the order given on the command line.
    assert list(summary["variants"]) == ["torch_optimizer_before_fsdp_fixed", "torch_optimizer_after_fsdp"]
    assert not list(tmp_path.glob("*_rank1.json"))


def test_local_text_file_is_tokenized_offline(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 400)
    proc = run_script(["main.py", *TINY, "--max_steps", "4", "--variants", "torch_optimizer_after_fsdp",
                       "--dataset", str(text), "--block_size", "64", "--output_dir", str(tmp_path / "o")],
                      nproc=None)  # about the data, not the ranks
    assert proc.returncode == 0, proc.stderr
    assert load(tmp_path / "o" / "summary.json")["variants"]["torch_optimizer_after_fsdp"]["steps"] == 4


def test_dataset_fraction_limits_one_pass(tmp_path):
    # 1 rank x batch 2 x block 128: the built-in data (2560 blocks) gives 1280 steps; 1% of it, 25 blocks, 12.
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--dataset_fraction", "0.01",
                       "--variants", "torch_optimizer_after_fsdp", "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    assert load(tmp_path / "summary.json")["variants"]["torch_optimizer_after_fsdp"]["steps"] == 12


def test_progress_lines_on_a_log_and_none_with_quiet(suite, single_process):
    _, proc = suite  # its stdout is a pipe, as in CI or a cluster log: plain lines, no carriage returns
    for name in VARIANTS:
        assert f"[{name}] step 1/12: loss " in proc.stdout and f"[{name}] step 12/12: loss " in proc.stdout
    assert "\r" not in proc.stdout and "s left" in proc.stdout
    assert "draw the plots with:\n    python3 visualize.py --dir " in proc.stdout
    _, quiet = single_process  # --quiet
    assert " step 1/3" not in quiet.stdout and "Results over 1 rank;" in quiet.stdout


def test_without_a_gpu_and_without_model_the_tiny_model_is_chosen_and_said(suite, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_script(["main.py", "--max_steps", "2", "--learning_rate", "1e-3", "--variants", VARIANTS[0],
                       "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stdout.split())
    assert "No --model given and no GPU: main.py takes the tiny model, a functional run of a few minutes on 2 cores " \
           "(measured and dated: docs/results-overview.md)" in said  # the figure has one home, the page
    # A CPU run's console speaks of ranks, not GPUs (tok/s per GPU was said of 2 CPU ranks).
    assert "per rank over the median step" in said and "per GPU" not in said
    assert load(tmp_path / "summary.json")["meta"]["model"] == "tiny"
    assert "No --model given" not in suite[1].stdout  # an explicit --model is kept, without the line


WRAPS_ANOTHER_BLOCK = ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: "
                       "TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")


@pytest.mark.parametrize("argv, said", [
    # refused once the model's TP plan was tried on it (transformers' model code imported: torchao's with it)
    (["main.py", "--tp_size", "2", "--simulate_world_size", "2", "--loss", "liger"], "error: --loss liger needs a GPU"),
    (["main.py", "--model", "tiny", "--tp_size", "2", "--simulate_world_size", "2", "--loss", "liger"],
     "error: --loss liger needs a GPU"),
    # refused by the last of main.py's checks
    (["main.py", "--simulate_world_size", "8", "--emulate_communication", "--max_steps", "4"],
     "error: --emulate_communication: 4 steps leave"),
    # refused once the model was built
    (["loading.py", "--config_file", "{config}"], "error: fsdp2.yaml: fsdp_transformer_layer_cls_to_wrap"),
])
def test_a_refusal_without_model_on_the_cpu_is_its_one_line_alone(argv, said, tmp_path):
    """No word of the default model, nor what importing torchao logs, before the line of a refused run: the notice
    comes once the command line is accepted (test_without_a_gpu_and_without_model_the_tiny_model_is_chosen_and_said)."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(WRAPS_ANOTHER_BLOCK)
    proc = run_script([a.format(config=config) for a in argv] + ["--device", "cpu", "--output_dir",
                                                                  str(tmp_path / "out")], nproc=None)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said), proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, driver, expected", [
    (["--device", "cpu"], True, "cpu"),
    (["--model", "tiny", "--device=cuda"], False, "cuda"),
    (["--model", "tiny"], True, "cuda"),
    (["--model", "tiny"], False, "cpu"),
])
def test_the_device_is_told_before_torch_is_imported(monkeypatch, argv, driver, expected):
    """The entry scripts start the fork server before their imports (fsdp2bench/processes/starting.py): from
    --device, or for "auto" from the NVIDIA driver's device file."""
    import os

    from fsdp2bench.processes.starting import likely_device_type

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(os.path, "exists", lambda path: driver and path == "/dev/nvidiactl")
    assert likely_device_type(argv) == expected


def test_the_results_table_fits_120_columns_on_cpu_and_on_a_gpu(suite, capsys):
    """The CPU run's table leaves out the allocator's columns; a GPU run's (the committed one-H200
    summary, drawn again) has them, and both fit a 120-column terminal."""
    import json
    from pathlib import Path

    from fsdp2bench.report.console import print_table

    def table(stdout: str) -> list[str]:
        lines = stdout.split("Results over", 1)[1].splitlines()
        return lines[1:lines.index(next(line for line in lines if line.startswith("MiB")))]

    cpu = table(suite[1].stdout)
    assert "alloc" not in cpu[0] and "RSS" in cpu[0]
    gpu_summary = json.loads((Path(__file__).parent.parent / "results/h200/matrix_1.5b/default/summary.json").read_text())
    print_table(gpu_summary)
    gpu = table(capsys.readouterr().out)
    assert "alloc" in gpu[0] and "29586.2" in "\n".join(gpu)
    assert len(cpu) == len(gpu) == 2 + len(VARIANTS)
    assert max(len(line) for line in cpu + gpu) <= 120


def test_the_accelerate_variant_alone_computes_without_autocast_and_the_docs_say_so(suite):
    """accelerate 1.11-1.15's FSDP2 path gives the model the bf16 policy and no autocast wrapper; the torch variants
    wrap the forward as the upstream does. Read back from every rank's prepared model, and said where the variants
    are compared, with what it measured."""
    from conftest import ROOT

    out, _ = suite
    variants = load(out / "summary.json")["variants"]
    assert {name: {rank["autocast"] for rank in v["applied"]} for name, v in variants.items()} == \
        {**{name: {True} for name in VARIANTS[:3]}, "accelerate": {False}}
    for page in ("variants.md", "fsdp-options.md"):
        said = " ".join((ROOT / "docs" / page).read_text().split())
        assert "without autocast" in said and "90 MiB less allocated" in said and "1.3-2.3% shorter" in said, page
