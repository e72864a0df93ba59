"""speed.py: the record docs/performance.md is made from."""

from __future__ import annotations

from conftest import VARIANTS, load, run_script


def test_speed_json_splits_the_launch_and_every_variant(tmp_path):
    out, record = tmp_path / "run", tmp_path / "speed.json"
    proc = run_script(["speed.py", "--nproc_per_node", "2", "--json", str(record), "--output_dir", str(out), "--",
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
