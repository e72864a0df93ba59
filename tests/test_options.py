"""FSDP2 options: every option set at N=2 real (gloo, tiny), and the matrix that runs them."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time

import pytest
from conftest import TINY, VARIANTS, load, refusal, run_script, start_script

from fsdp2bench.cli import UserError
from fsdp2bench.memory.accounting import STEP_BYTES, expected_device_bytes, expected_state
from fsdp2bench.options import fsdp as options

INTENDED = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_fixed", "accelerate"]
UNFIXED = "torch_optimizer_before_fsdp_not_fixed"
# The plugin's option sets (accumulation and HSDP have their own tests, test_scaling.py).
PLUGIN_SETS = options.PLUGIN_SETS


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every plugin option set, each a full suite at 2 real ranks, through matrix.py."""
    out = tmp_path_factory.mktemp("matrix")
    proc = run_script(["matrix.py", "--nproc_per_node", "2", "--option_sets", ",".join(PLUGIN_SETS), "--output_dir",
                       str(out), *TINY, "--quiet"], nproc=None, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_every_option_set_trains_the_intended_variants_alike_and_counts_every_byte(matrix):
    out, proc = matrix
    result = load(out / "matrix.json")
    assert result["meta"]["option_sets"] == PLUGIN_SETS
    assert len(result["rows"]) == len(PLUGIN_SETS) * len(VARIANTS)
    for name in PLUGIN_SETS:
        chosen = options.OPTION_SETS[name]
        summary = load(out / name / "summary.json")
        assert summary["meta"]["fsdp_options"] == dataclasses.asdict(chosen)
        checks = summary["checks"]
        assert all(c["ok"] for c in checks.values()), (name, checks)
        assert set(checks["intended_losses_match"]["max_relative_diff"].values()) == {0.0}, name  # bit-equal
        for variant in VARIANTS:
            entry = summary["variants"][variant]
            assert entry["accounting_matches_expected"], (name, variant)
            assert entry["device_bytes"] == entry["expected_device_bytes"] == [{p: 0 for p in entry["device_bytes"][0]}] * 2
        assert summary["variants"][UNFIXED]["loss_drop"] <= 0.01
        holds = summary["accelerate_vs_torch"]["holds_at_step_peak"]
        assert holds["accelerate"]["state_bytes"] == holds[INTENDED[0]]["state_bytes"] > 0, name
    assert "every launch passed its checks; 28 of 28 rows ok" in proc.stdout
    for row in result["rows"]:  # each row's speed: 11 steps after warm-up; real ranks, so not compute only
        speed = row["speed"]
        assert speed["compute_only"] is False and speed["timed_steps"] + speed["shared_steps"] == 11, row
        if speed["timed_steps"] < 2:  # steps taken beside another run are not timed: then no figure, and why
            assert speed["tokens_per_s_per_gpu"] is None and "another run was busy" in speed["not_measured"], row
        else:
            assert speed["tokens_per_s_per_gpu"] > 0, row


def test_the_default_set_is_todays_run_and_the_options_reach_the_model(matrix, suite):
    out, _ = matrix
    today = load(suite[0] / "summary.json")["variants"]
    runs = {name: load(out / name / "summary.json")["variants"] for name in PLUGIN_SETS}
    for variant in VARIANTS:
        assert runs["default"][variant]["losses"] == today[variant]["losses"]
        assert runs["default"][variant]["accounting"] == today[variant]["accounting"]
    losses = {name: run[INTENDED[0]]["losses"] for name, run in runs.items()}
    # Checkpointing recomputes the same forward and resharding changes no value: same losses.
    assert losses["ac"] == losses["ac_offload"] == losses["no_reshard"] == losses["default"]
    # fp32 gradient reduction without autocast computes differently: the policy was applied.
    assert losses["mp_policy"] != losses["default"] and losses["all"] == losses["mp_policy"]


def test_each_launch_trains_only_after_the_one_before_it_has_ended(matrix):
    """matrix.py starts the next launch while one trains; it waits, set up, for its turn."""
    out, _ = matrix
    timelines = [load(out / name / "summary.json")["meta"]["timeline"] for name in PLUGIN_SETS]
    for before, after in zip(timelines, timelines[1:]):
        assert after["process_created"] < before["variants_finished"]  # started ahead of its turn
        assert after["turn_came"] >= before["variants_finished"]  # trained after


def test_a_launch_waiting_for_its_turn_writes_nothing_and_ends_as_told(tmp_path):
    gate, out = tmp_path / "gate", tmp_path / "out"
    launch = ["main.py", "--model", "tiny", "--device", "cpu", "--max_steps", "2", "--output_dir", str(out)]
    proc = start_script(launch, nproc=None, FSDP2_BENCH_START_GATE=f"{os.getpid()}:{gate}")
    time.sleep(10)  # long enough to have reached the gate; it must not run before its turn
    assert proc.poll() is None and not out.exists()
    gate.write_text("cancelled")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and not out.exists(), stdout + stderr
    gate.unlink()
    dead = subprocess.Popen(["true"])
    dead.wait()
    proc = run_script(launch, nproc=None, FSDP2_BENCH_START_GATE=f"{dead.pid}:{gate}")
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [f"error: matrix.py (process {dead.pid}), which started this launch "
                                                f"ahead of its turn, is gone"]


def test_the_matrix_is_drawn_and_each_sets_command_draws_it(matrix):
    out, proc = matrix
    assert proc.stdout.rstrip().endswith(f"draw it with:\n    python3 visualize.py --dir {out}")
    proc = run_script(["visualize.py", "--dir", str(out)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    assert (out / "matrix.png").stat().st_size > 10_000
    hints = [line.strip() for line in proc.stdout.splitlines() if line.startswith("    python3 visualize.py")]
    assert hints == [f"python3 visualize.py --dir {out / name}" for name in PLUGIN_SETS]  # no sweeps: none of them
    assert run_script(hints[0].split()[1:], nproc=None).returncode == 0


def test_a_matrix_with_a_sweep_has_a_row_per_simulated_world_size(tmp_path):
    proc = run_script(["matrix.py", "--option_sets", "cpu_offload", "--nproc_per_node", "0",
                       "--simulate_world_size", "2,4", "--sweep_steps", "2", "--output_dir", str(tmp_path),
                       "--model", "tiny", "--device", "cpu", "--quiet"], nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = load(tmp_path / "matrix.json")
    assert {(r["world_size"], r["simulated"]) for r in result["rows"]} == {(2, True), (4, True)}
    assert all(r["status"] == "ok" and r["accounting_matches_expected"] for r in result["rows"])
    at4 = next(f for f in result["findings"] if f["world_size"] == 4)
    assert at4["stale_optimizer_extra_mib"] > 0  # P + 2P/N against 4P/N (state, on CPU) from N = 3


@pytest.mark.parametrize("signum, nproc", [(signal.SIGINT, "1"), (signal.SIGTERM, "2")])
def test_an_interrupted_matrix_stops_and_keeps_what_finished(tmp_path, signum, nproc):
    """SIGINT or SIGTERM to matrix.py alone: it tells the launch (torchrun's too), keeps what finished, and
    says so in one line, with no stack from any process."""
    proc = start_script(["matrix.py", "--model", "tiny", "--device", "cpu", "--max_steps", "400", "--option_sets",
                         "default,ac", "--nproc_per_node", nproc, "--output_dir", str(tmp_path)], nproc=None)
    for line in proc.stdout:
        if line.startswith("[torch_optimizer_after_fsdp]"):
            break
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("Interrupted; the option sets that ran are in"), stderr
    assert "Traceback" not in stderr and "File \"" not in stderr, stderr
    rows = load(tmp_path / "matrix.json")["rows"]
    assert {r["option_set"] for r in rows} == {"default"} and rows[0]["status"] == "interrupted"
    assert not (tmp_path / "ac").exists()


@pytest.mark.parametrize("flags, message", [
    (["--cpu_offload"], "--cpu_offload is set by matrix.py for each launch"),
    (["--activation_checkpointing"], "--activation_checkpointing is set by matrix.py for each launch"),
    (["--option_sets", "default,fast"], "--option_sets: unknown option set(s) fast"),
    (["--option_sets", "ac,ac"], "an option set is given twice"),
    (["--nproc_per_node", "-1"], "--nproc_per_node must be in [0, 4096], got -1"),
    (["--nproc_per_node", "0"], "--nproc_per_node 0 runs only the sweeps: give --simulate_world_size"),
    (["--sweep_steps", "0", "--simulate_world_size", "2"], "--sweep_steps must be in [1, 10000000], got 0"),
    (["--simulate_world_size", "2,x"], "expected comma-separated integers, got 'x'"),
    (["--batch_size", "0"], "--batch_size must be a positive integer"),
    (["--option_sets", "hsdp", "--nproc_per_node", "3"],
     "nothing to run: hsdp: no real run on 3 ranks (its layout's sizes do not divide it)"),
])
def test_a_bad_matrix_command_gets_one_line_before_any_launch(tmp_path, flags, message):
    """The first launched for real; the others asked of matrix.py's checks (matrix.check) in this process, which
    its launch runs before anything else."""
    import matrix

    out = tmp_path / "out"
    argv = ["--model", "tiny", "--device", "cpu", *flags, "--output_dir", str(out)]
    if flags == ["--cpu_offload"]:
        proc = run_script(["matrix.py", *argv], nproc=None, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
    else:
        lines = [refusal(lambda a: matrix.check(*matrix.parse_args(a)), argv)]
    assert len(lines) == 1 and lines[0] is not None and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists()


def test_an_option_the_installed_accelerate_lacks_is_refused(monkeypatch):
    import accelerate

    @dataclasses.dataclass
    class OlderPlugin:  # an accelerate before activation_checkpointing_offload
        activation_checkpointing: bool = False

    monkeypatch.setattr(accelerate, "FullyShardedDataParallelPlugin", OlderPlugin)
    with pytest.raises(UserError, match="--activation_checkpointing_offload: accelerate .* has no such FSDP plugin"):
        options.check(options.OPTION_SETS["ac_offload"])
    options.check(options.OPTION_SETS["default"])  # nothing changed, nothing to refuse


def test_on_a_gpu_cpu_offload_leaves_only_the_stale_parameters_there():
    shapes = [((6, 4), 4), ((4,), 4)]
    offload = options.FsdpOptions(cpu_offload=True)
    for variant in (*INTENDED, UNFIXED):
        for phase in ("end_of_setup", "before_zero_grad", "end_of_training"):
            state = expected_state(shapes, 2, 0, variant, phase)
            on_gpu = expected_device_bytes(shapes, 2, 0, variant, phase, options.FsdpOptions(), "cuda")
            steps = STEP_BYTES * len(shapes) if state["optimizer_state_bytes"] else 0
            assert on_gpu == sum(state.values()) - steps  # AdamW's step counters stay on the host
            assert expected_device_bytes(shapes, 2, 0, variant, phase, offload, "cuda") == state["stale_param_bytes"]
            assert expected_device_bytes(shapes, 2, 0, variant, phase, offload, "cpu") == 0
    assert expected_device_bytes(shapes, 2, 0, UNFIXED, "end_of_training", offload, "cuda") == (24 + 4) * 4
