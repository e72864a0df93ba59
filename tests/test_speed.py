"""speed.py: the record docs/performance.md is made from."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, TINY, VARIANTS, child_running, load, refusal, run_script, start_script

import speed


def test_speed_json_splits_the_launch_and_every_variant(tmp_path):
    out, record = tmp_path / "run", tmp_path / "speed.json"
    proc = run_script(["speed.py", "--nproc_per_node", "2", "--json", str(record), "--output_dir", str(out),
                       "--baseline", str(ROOT), "--",
                       "--model", "tiny", "--device", "cpu", "--max_steps", "6", "--concurrent_variants", "4"],
                      nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    speed = load(record)
    assert speed["steps_per_variant"] == 6 and speed["world_size"] == 2 and speed["concurrent_variants"] == 4
    assert speed["speedup_vs_upstream"] is None  # not the upstream's configuration: no comparison
    launch = speed["launch_phases"]
    assert list(launch) == ["launcher_start_s", "imports_s", "setup_s", "variants_s", "report_and_exit_s"]
    assert all(v >= 0 for v in launch.values())  # the timeline is in order, within the measured launch
    assert set(speed["phases"]) == set(speed["median_step_time_s"]) == set(VARIANTS)
    for phases in speed["phases"].values():
        assert list(phases) == ["child_start_s", "group_start_s", "build_s", "optimizer_and_shard_s", "steps_s",
                                "teardown_and_wait_s"]
        assert all(v >= 0 for v in phases.values())
    # polling paused on every other step, so the ratio compares steps of the same run
    steps = load(out / "accelerate_memory_usage.json")["steps"]
    assert [s["polling"] for s in steps] == [True, False] * 3
    assert speed["tracker_overhead_ratio"] > 0
    # the same tree as its own baseline: the same work, so the same losses (a CPU run has no allocator peaks)
    same = speed["baseline"]["same_work"]
    assert same["runs_compared"] == 4 and same["runs_only_in_one"] == []
    assert same["losses_bit_equal"] is True and same["peaks_equal"] is None
    assert speed["wall_ratio_to_baseline"] > 0


def test_speed_times_a_simulated_sweep_against_a_baseline(tmp_path):
    out, record = tmp_path / "sweep", tmp_path / "speed.json"
    proc = run_script(["speed.py", "--nproc_per_node", "1", "--json", str(record), "--output_dir", str(out),
                       "--baseline", str(ROOT), "--", "--model", "tiny", "--device", "cpu", "--max_steps", "2",
                       "--simulate_world_size", "2,4"], nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    speed = load(record)
    runs = [f"N={n} rank 0 {v}" for n in (2, 4) for v in VARIANTS]
    assert sorted(speed["median_step_time_s"]) == sorted(speed["peak_reserved_mib"]) == sorted(runs)
    assert speed["phases"] == {} and speed["speedup_vs_upstream"] is None  # a simulated rank has no process phases
    same = speed["baseline"]["same_work"]
    assert same["runs_compared"] == 8 and sorted(same["peak_differences_mib"]) == sorted(runs)
    assert same["losses_bit_equal"] is None  # a fake process group's losses are not compared
    assert ("against the baseline: 8 runs, peaks: no allocator peaks to compare (a CPU run has none), losses: none "
            "recorded to compare (a simulated rank records none)") in proc.stdout, proc.stdout


def speed_training(tmp_path):
    """speed.py timing a long run, left running once that run trains: (process, its output dir, its record)."""
    out, record = tmp_path / "run", tmp_path / "speed.json"
    proc = start_script(["speed.py", "--nproc_per_node", "1", "--json", str(record), "--output_dir", str(out), "--",
                         *TINY, "--max_steps", "400", "--variants", "torch_optimizer_after_fsdp"], nproc=None)
    for line in proc.stdout:
        if line.startswith("[torch_optimizer_after_fsdp]"):
            break
    time.sleep(2)
    return proc, out, record


def test_an_interrupt_ends_speed_in_one_line_and_keeps_what_the_run_wrote(tmp_path):
    proc, out, record = speed_training(tmp_path)
    speed = psutil.Process(proc.pid)
    for p in [speed, *speed.children(recursive=True)]:  # Ctrl-C at a terminal reaches the whole group
        p.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == f"Interrupted; what the runs wrote is in {out}; {record} was not written"
    assert load(out / "summary.json")["variants"]["torch_optimizer_after_fsdp"]["status"] == "interrupted"
    assert not record.exists()
    assert "Traceback" not in stderr and "torchrun: stopped by SIGINT" in stderr, stderr  # no launcher's stack


def test_a_signal_to_the_timed_launch_alone_ends_speed_in_one_line_without_a_stack(tmp_path):
    """SIGTERM to the launch speed.py times, not to speed.py: the run stops unfinished, and speed.py says so
    (it read a timeline without its end and stopped on a KeyError before)."""
    proc, out, record = speed_training(tmp_path)
    psutil.Process(proc.pid).children()[0].send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: the timed run was interrupted (exit code 1")
    assert f"what it wrote is in {out}/; {record} was not written" in stderr
    assert (out / "summary.json").exists() and not record.exists()


def test_a_baseline_that_did_other_work_gives_no_ratio(tmp_path):
    """A tree whose main.py runs and writes nothing (or another configuration): refused, not recorded."""
    tree, record = tmp_path / "tree", tmp_path / "speed.json"
    tree.mkdir()
    (tree / "main.py").write_text("print('not the benchmark')\n")
    proc = run_script(["speed.py", "--nproc_per_node", "1", "--json", str(record), "--output_dir",
                       str(tmp_path / "run"), "--baseline", str(tree), "--", *TINY, "--max_steps", "2",
                       "--variants", VARIANTS[0]], nproc=None)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --baseline {tree}: its run wrote no readable {tmp_path}/run_baseline/summary.json; the timed run "
        "was not started and no ratio is recorded")
    assert not record.exists() and not (tmp_path / "run").exists()


def test_main_options_are_checked_at_the_launchs_own_world_size(tmp_path):
    """main.py's options are checked as the timed launch's rank 0 will check them, at --nproc_per_node ranks:
    TP over 2 ranks runs under speed.py as under torchrun, and is refused where 2 does not divide the ranks."""
    out, record = tmp_path / "run", tmp_path / "speed.json"
    tp = ["--", *TINY, "--max_steps", "2", "--variants", VARIANTS[0], "--tp_size", "2"]
    proc = run_script(["speed.py", "--nproc_per_node", "2", "--output_dir", str(out), *tp], nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # without --json, the record is the run's, in its output directory: none is left in the checkout
    assert load(out / "speed.json")["world_size"] == 2 and load(out / "summary.json")["meta"]["world_size"] == 2
    assert not (ROOT / "speed.json").exists()
    for nproc in ("1", "3"):  # asked of speed.py's checks in this process, which its launch runs first
        line = refusal(speed.validate, ["--nproc_per_node", nproc, "--json", str(record), "--output_dir",
                                        str(tmp_path / f"run{nproc}"), *tp])
        assert line == f"error: --cp_size 1 x --tp_size 2 = 2 does not divide the world size {nproc}", line
        assert not (tmp_path / f"run{nproc}").exists()


@pytest.mark.parametrize("interpreter", ["/bin/true", "no libraries"])
def test_a_baseline_interpreter_that_cannot_run_the_benchmark_is_refused_before_anything_runs(tmp_path, interpreter):
    """Any --baseline_python that is no Python with torch, accelerate and transformers (a program that prints
    nothing, an interpreter that cannot import them) is refused by its own flag before any launch."""
    if interpreter == "no libraries":  # this interpreter, without its site-packages
        interpreter = str(tmp_path / "bare_python")
        (tmp_path / "bare_python").write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')
        (tmp_path / "bare_python").chmod(0o755)
    out, record = tmp_path / "run", tmp_path / "speed.json"
    argv = ["--nproc_per_node", "1", "--json", str(record), "--output_dir", str(out), "--baseline_python",
            interpreter, "--", *TINY, "--max_steps", "2"]
    if interpreter == "/bin/true":  # asked of speed.py's checks in this process, which its launch runs first
        lines = [refusal(speed.validate, argv)]
    else:
        proc = run_script(["speed.py", *argv], nproc=None)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] is not None, lines
    assert lines[0].startswith(f"error: --baseline_python {interpreter}: "), lines
    assert "cannot run the benchmark" in lines[0]
    assert not out.exists() and not (tmp_path / "run_baseline").exists() and not record.exists()


def test_a_baseline_run_that_wrote_nothing_is_told_by_the_flags_given_before_the_timed_run(tmp_path):
    """A baseline interpreter whose run writes no summary: named by the flag the user gave, at once."""
    fake = tmp_path / "python_that_runs_nothing"
    fake.write_text(f'#!/bin/sh\ncase "$1" in -c) exec {sys.executable} "$@";; esac\nexit 0\n')
    fake.chmod(0o755)
    out, record = tmp_path / "run", tmp_path / "speed.json"
    proc = run_script(["speed.py", "--nproc_per_node", "1", "--json", str(record), "--output_dir", str(out),
                       "--baseline_python", str(fake), "--", *TINY, "--max_steps", "2"], nproc=None)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --baseline_python {fake}: its run wrote no readable {out}_baseline/summary.json; the timed run was "
        "not started and no ratio is recorded")
    assert not out.exists() and not record.exists()


def test_an_interrupt_before_the_runs_wrote_anything_names_no_folder_that_is_not_there(tmp_path):
    out, record = tmp_path / "run", tmp_path / "speed.json"
    proc = start_script(["speed.py", "--nproc_per_node", "1", "--json", str(record), "--output_dir", str(out),
                         "--baseline", str(ROOT), "--", *TINY, "--max_steps", "2"], nproc=None, own_group=True)
    child_running(proc.pid, "torchrun")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal, while the baseline's launcher starts
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    there = [str(d) for d in (out, Path(f"{out}_baseline")) if d.exists()]
    said = f"what the runs wrote is in {' and '.join(there)}" if there else "no run wrote anything"
    assert stderr.strip().splitlines()[-1] == f"Interrupted; {said}; {record} was not written", stderr


@pytest.mark.parametrize("kept_at, module", [
    ("fsdp2bench/processes/torchrun.py", "fsdp2bench.processes.torchrun"),  # a tree with wings, as this one
    ("fsdp2bench/torchrun.py", "fsdp2bench.torchrun"),  # a tree from before the wings
    (None, "torch.distributed.run"),  # a tree from before the quiet launcher
])
def test_a_baseline_tree_is_launched_by_the_launcher_it_has(kept_at, module, tmp_path):
    if kept_at:
        (tmp_path / kept_at).parent.mkdir(parents=True)
        (tmp_path / kept_at).write_text("")
    assert speed.tree_launcher(str(tmp_path)) == module
    assert speed.tree_launcher(str(ROOT)) == "fsdp2bench.processes.torchrun"


def test_speed_times_a_simulated_rank_with_its_communication_emulated_bare_loop_alike(tmp_path):
    """--emulate_communication passes through to the timed launch and to the bare loop beside it: both emulate the
    same steps (every other one) and count the same collectives of the same work (on a CPU priced, nothing waits),
    and speed.json gives each run's emulated seconds a step, its compute-only, emulated and exposed figures, and the
    links."""
    out = tmp_path / "run"
    proc = run_script(["speed.py", "--nproc_per_node", "1", "--bare_loop", "--output_dir", str(out), "--",
                       "--model", "tiny", "--device", "cpu", "--max_steps", "5", "--simulate_world_size", "4",
                       "--variants", "torch_optimizer_after_fsdp", "--emulate_communication", "300,25"], nproc=None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = load(out / "speed.json")
    entry = load(out / "summary.json")["simulated"]["4"]["0"]["torch_optimizer_after_fsdp"]
    emulated, = entry["emulated"]
    name = "N=4 rank 0 torch_optimizer_after_fsdp"
    assert record["emulation"] == {name: entry["speed"]["emulation"]}
    assert set(record["emulation"][name]) >= {"compute_only", "emulated", "exposed"}
    assert record["emulated_links"]["within_gbps"] == 300.0 and record["emulated_links"]["across_gbps"] == 25.0
    assert record["emulated_s_per_step"] == {name: emulated["emulated_s_per_step"]}
    assert emulated["emulated_s_per_step"] > 0
    bare = record["bare_loop"]["emulated"]
    assert bare["per_step"] == emulated["per_step"] and set(bare["per_step"]) == {"all_gather over 4",
                                                                                  "reduce_scatter over 4"}
    assert not bare["waited_on_the_gpu"] and not record["bare_loop"]["speed"]["emulated"]
    assert bare["emulated_steps"] == emulated["emulated_steps"] == 2  # steps 1 and 3 of 5
    assert record["bare_loop"]["speed"]["emulation"]["emulated"]["timed_steps"] == 2


def test_emulated_communication_without_a_simulated_rank_is_refused_in_one_line(tmp_path):
    """Real ranks communicate for real: main.py's own refusal, before speed.py launches anything."""
    line = refusal(speed.validate, ["--nproc_per_node", "1", "--output_dir", str(tmp_path / "run"), "--", *TINY,
                                    "--emulate_communication"])
    assert line == "error: --emulate_communication needs --simulate_world_size: real ranks communicate for real", line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, said", [
    (["--model", "tiny"], "--model is main.py's: its options go after --, python3 speed.py -- --model ..."),
    (["--nproc_per_node", "2", "--max_steps=3"], "--max_steps is main.py's: its options go after --"),
    (["--jsn", "x.json"], None),
])
def test_a_main_option_before_the_double_dash_is_told_where_it_goes(argv, said):
    """``speed.py --model tiny`` was "unrecognized arguments: --model": main.py's options given before the ``--``
    are named as main.py's, a typo of speed.py's own is not."""
    line = refusal(speed.validate, argv)
    assert line is not None and line.startswith("error: unrecognized arguments: "), line
    assert (said in line) if said else "main.py's" not in line, line
