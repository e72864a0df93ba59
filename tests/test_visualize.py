"""visualize.py on a real run's output, and on input it must refuse."""

from __future__ import annotations

import json
import shutil

from conftest import VARIANTS, run_script


def test_plots_a_cpu_run_and_says_what_it_skipped(suite, tmp_path):
    out, _ = suite
    work = tmp_path / "out"
    shutil.copytree(out, work)
    proc = run_script(["visualize.py", "--dir", str(work)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    for png in ("loss.png", "rss_memory.png"):
        assert (work / png).stat().st_size > 10_000
    assert "skipped allocated_memory.png" in proc.stdout and "skipped reserved_memory.png" in proc.stdout
    assert not (work / "allocated_memory.png").exists()


def test_plots_gpu_style_traces_and_a_partial_set(suite, tmp_path):
    out, _ = suite
    work = tmp_path / "out"
    work.mkdir()
    for name in VARIANTS[:2]:  # only two variants present
        for suffix in ("", "_rank1"):
            data = json.loads((out / f"{name}_memory_usage{suffix}.json").read_text())
            data["allocated_memory"] = [100.0 + i for i in range(len(data["timestamps"]))]
            data["reserved_memory"] = [200.0 + i for i in range(len(data["timestamps"]))]
            for s in data["steps"]:
                s.update(peak_allocated_mib=150.0, allocated_mib=120.0, peak_reserved_mib=250.0, reserved_mib=240.0)
            (work / f"{name}_memory_usage{suffix}.json").write_text(json.dumps(data))
    proc = run_script(["visualize.py", "--dir", str(work), "--memory_threshold", "110"], nproc=None)
    assert proc.returncode == 0, proc.stderr
    for png in ("allocated_memory.png", "reserved_memory.png", "loss.png"):
        assert (work / png).stat().st_size > 10_000
    assert f"no results for {VARIANTS[2]}, {VARIANTS[3]}" in proc.stdout


def test_refuses_missing_dir_empty_dir_corrupt_and_foreign_json(tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "nope"
    cases["empty"] = tmp_path / "empty"
    cases["empty"].mkdir()
    cases["corrupt"] = tmp_path / "corrupt"
    cases["corrupt"].mkdir()
    (cases["corrupt"] / f"{VARIANTS[0]}_memory_usage.json").write_text('{"timestamps": [1, 2')
    cases["foreign"] = tmp_path / "foreign"
    cases["foreign"].mkdir()
    (cases["foreign"] / f"{VARIANTS[0]}_memory_usage.json").write_text('{"hello": 1}')
    expected = {"missing": "no such directory", "empty": "no <variant>_memory_usage.json",
                "corrupt": "not valid JSON", "foreign": "missing timestamps"}
    for case, directory in cases.items():
        proc = run_script(["visualize.py", "--dir", str(directory)], nproc=None)
        assert proc.returncode == 2, case
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and expected[case] in lines[0], (case, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert f"{VARIANTS[0]}_memory_usage.json" in run_script(
        ["visualize.py", "--dir", str(cases["corrupt"])], nproc=None).stderr
