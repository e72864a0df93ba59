"""The first hour on a real machine: a name that may be a Hub id is answered at once offline, nothing a user
left where a script writes is replaced, and two runs started into one directory run one."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest
from conftest import TINY, VARIANTS, child_running, load, refusal, run_script, start_script

import loading
import matrix
import plan
from fsdp2bench.names import counted
from fsdp2bench.run import arguments

UNREACHABLE = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}  # a port nothing listens on
CPU = ["--device", "cpu"]


@pytest.mark.parametrize("script, flags, flag", [
    ("main.py", ["--model", "does-not-exist"], "--model"),
    ("main.py", ["--model", "tiny", "--dataset", "README.md", "--tokenizer", "no-org/no-tokenizer"], "--tokenizer"),
    ("loading.py", ["--model", "does-not-exist"], "--model"),
    ("plan.py", ["--model", "org/does-not-exist"], "--model"),
])
def test_a_name_that_is_no_preset_nor_directory_is_answered_at_once_when_the_hub_is_unreachable(
        tmp_path, script, flags, flag):
    proc = run_script([script, *CPU, *flags, "--output_dir", str(tmp_path / "out")], nproc=None, **UNREACHABLE)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), proc.stderr
    assert "not in the local Hugging Face cache, and the Hub (http://127.0.0.1:9) cannot be reached" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def foreign(path, content: str = '{"timestamps": [0.0], "allocated_memory": [1.0]}') -> bytes:
    """A file a user (or the upstream benchmark) left at a name a script writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return path.read_bytes()


# Each entry script's checks of its command line, which it runs before any process or file exists.
CHECKS = {"main.py": arguments.validate, "loading.py": loading.validate, "plan.py": plan.validate,
          "matrix.py": lambda argv: matrix.check(*matrix.parse_args(argv))}


@pytest.mark.parametrize("script, flags, name", [
    ("main.py", [*CPU, "--model", "tiny"], "summary.json"),
    ("main.py", [*CPU, "--model", "tiny"], "accelerate_memory_usage.json"),
    ("main.py", [*CPU, "--model", "tiny", "--simulate_world_size", "4", "--simulate_rank", "last"],
     "simulated_N4/torch_optimizer_after_fsdp_memory_usage_rank3.json"),
    ("loading.py", [*CPU, "--model", "tiny"], "loading_summary.json"),
    ("loading.py", [*CPU, "--model", "tiny", "--modes", "naive"], "loading_naive_memory_usage.json"),
    ("matrix.py", [*CPU, "--model", "tiny", "--option_sets", "default"], "matrix.json"),
    ("plan.py", [*CPU, "--model", "tiny"], "plan.json"),
])
def test_a_file_the_benchmark_did_not_write_is_left_untouched_and_the_run_refused(tmp_path, script, flags, name):
    """The first case launched for real; the others asked of each script's checks in this process, which its launch
    runs before anything else."""
    out = tmp_path / "out"
    before = foreign(out / name)
    argv = [*flags, "--output_dir", str(out)]
    if (script, name) == ("main.py", "summary.json"):
        proc = run_script([script, *argv], nproc=None)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
    else:
        lines = [refusal(CHECKS[script], argv)]
    assert lines == [
        f"error: --output_dir: {out / name} was not written by this benchmark, and this run would replace it; it is "
        "left untouched: move it away or choose another --output_dir"], lines
    assert (out / name).read_bytes() == before
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == [name.rsplit("/", 1)[-1]]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """What a run of ours leaves in its directory (one variant, 2 steps, plain python), copied into each test that
    starts from one."""
    out = tmp_path_factory.mktemp("short_run")
    proc = run_script(["main.py", *TINY, "--max_steps", "2", "--variants", VARIANTS[0], "--output_dir", str(out)],
                      nproc=None)
    assert proc.returncode == 0, proc.stderr
    return out


def test_speed_and_visualize_leave_a_foreign_file_untouched(tmp_path, short_run):
    before = foreign(tmp_path / "speed.json", '{"mine": true}')
    proc = run_script(["speed.py", "--json", str(tmp_path / "speed.json"), "--", *CPU, "--model", "tiny"], nproc=None)
    assert proc.returncode == 2 and "--json: " in proc.stderr and "was not written by this benchmark" in proc.stderr
    assert (tmp_path / "speed.json").read_bytes() == before
    # Traces of ours without their summary, beside a figure that is not ours: the figure is not replaced.
    traces = tmp_path / "traces"
    shutil.copytree(short_run, traces)
    (traces / "summary.json").unlink()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    fig.savefig(traces / "rss_memory.png")
    plt.close(fig)
    figure = (traces / "rss_memory.png").read_bytes()
    proc = run_script(["visualize.py", "--dir", str(traces)], nproc=None)
    assert proc.returncode == 2 and "rss_memory.png was not written by this benchmark" in proc.stderr, \
        proc.stderr
    assert (traces / "rss_memory.png").read_bytes() == figure


def test_a_run_of_ours_is_replaced_by_the_next_and_its_figures_redrawn(tmp_path, short_run):
    tmp_path = tmp_path / "out"
    shutil.copytree(short_run, tmp_path)  # the first run's
    args = ["main.py", *TINY, "--max_steps", "2", "--variants", VARIANTS[0], "--output_dir", str(tmp_path)]
    assert run_script(["visualize.py", "--dir", str(tmp_path)], nproc=None).returncode == 0
    run_id = load(tmp_path / "summary.json")["meta"]["run_id"]
    second = run_script(args, nproc=None)
    assert second.returncode == 0, second.stderr
    assert load(tmp_path / "summary.json")["meta"]["run_id"] != run_id
    assert run_script(["visualize.py", "--dir", str(tmp_path)], nproc=None).returncode == 0


def test_two_runs_into_one_directory_at_once_run_one(tmp_path):
    """The second is started once the first holds the directory (its lock file is there), so the two always
    overlap: under load a first run of 3 steps could end before the second began, and both ran."""
    first = start_script(["main.py", *TINY, "--max_steps", "1000", "--variants", VARIANTS[0], "--quiet",
                          "--output_dir", str(tmp_path)], nproc=None)
    deadline = time.monotonic() + 120
    while not (tmp_path / ".fsdp2bench.lock").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.05)
    second = run_script(["main.py", *TINY, "--max_steps", "3", "--variants", VARIANTS[0], "--output_dir",
                         str(tmp_path)], nproc=None)
    assert first.poll() is None  # still writing there
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=120) == 130
    assert second.returncode == 2 and "another run (process" in second.stderr and "is writing there" in second.stderr
    assert not (tmp_path / ".fsdp2bench.lock").exists()


def signal_when(proc, marker: str, signum: int) -> tuple[str, str]:
    """Send ``signum`` half a second after ``marker`` starts a line of the output; (stdout, stderr)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(marker):
            break
    time.sleep(0.5)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    return "".join(seen) + stdout, stderr


# Each phase under one signal, each signal in two phases: SIGINT and SIGTERM to loading.py's process go to one
# handler (isolation.catch_interrupts), which names the signal.
@pytest.mark.parametrize("signum, marker, kept", [
    (signal.SIGINT, "Writing a", {}),  # while the checkpoint is written: nothing loaded, no half checkpoint left
    (signal.SIGTERM, "Writing a", {}),
    (signal.SIGTERM, "[naive]", {"naive": "interrupted"}),
    (signal.SIGINT, "[sharded_read]", {"naive": "ok", "rank0_broadcast": "ok", "accelerate": "ok",
                                       "sharded_read": "interrupted"}),
])
def test_a_signal_to_loading_ends_in_one_line_naming_what_exists(tmp_path, signum, marker, kept):
    out = tmp_path / "out"
    proc = start_script(["loading.py", *CPU, "--model", "small", "--output_dir", str(out)], nproc=None)
    _, stderr = signal_when(proc, marker, signum)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Interrupted ({signal.Signals(signum).name})"), stderr
    assert not list(out.glob("**/*.tmp*"))
    if not kept:
        assert "the incomplete checkpoint was removed" in lines[0]
        assert not list(out.glob("checkpoint-*")) and not (out / "loading_summary.json").exists()
        return
    named = out / "loading_summary.json"
    assert str(named) in lines[0]
    statuses = {mode: entry["status"] for mode, entry in load(named)["modes"].items()}
    assert statuses == {**{m: "not run" for m in ("naive", "rank0_broadcast", "accelerate", "sharded_read",
                                                  "shared_memory")}, **kept}


def test_an_interrupt_while_a_file_is_written_leaves_the_file_as_it_was_and_nothing_beside_it(tmp_path,
                                                                                               monkeypatch):
    import os

    from fsdp2bench import files

    path = tmp_path / "summary.json"
    files.write_json(str(path), {"step": 1})

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.write_json(str(path), {"step": 2})
    assert load(path)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def signal_the_first_mode(out) -> tuple[subprocess.Popen, str, dict]:
    """loading.py with SIGTERM sent to the process of its first mode as soon as it exists (the test may be
    scheduled late on a busy machine, after that mode has finished: then no mode fails)."""
    proc = start_script(["loading.py", *CPU, "--model", "small", "--output_dir", str(out)], nproc=None)
    for line in proc.stdout:
        if line.startswith("[naive]"):
            break
    child_running(proc.pid, "loading.py").send_signal(signal.SIGTERM)  # the mode loading now, not the launcher
    _, stderr = proc.communicate(timeout=120)
    return proc, stderr, {mode: entry["status"] for mode, entry in load(out / "loading_summary.json")["modes"].items()}


def test_a_signal_to_one_loading_process_fails_its_mode_only_and_the_last_line_says_so(tmp_path):
    """Whenever it lands in the mode's process, its first moments included: that mode fails naming the signal."""
    for attempt in range(3):
        proc, stderr, statuses = signal_the_first_mode(tmp_path / f"out{attempt}")
        assert "Traceback" not in stderr
        failed = [mode for mode, status in statuses.items() if status != "ok"]
        if failed or proc.returncode:
            break
    assert proc.returncode == 1 and len(failed) == 1 and "SIGTERM" in statuses[failed[0]], statuses
    assert stderr.strip().splitlines()[-1].startswith(f"FAILED: {failed[0]}: failed: "), stderr


def png(path) -> bytes:
    """A figure a user drew with matplotlib (no mark of this benchmark's)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    fig.savefig(path)
    plt.close(fig)
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["another program's JSON with a run id", "a directory", "a link to a run's summary",
                                  "a broken link", "a symbolic link loop"])
def test_only_a_file_with_the_benchmarks_mark_is_replaced(tmp_path, kind):
    """A run id, a "meta" or a familiar shape is no mark: another program writes those too."""
    out = tmp_path / "out"
    out.mkdir()
    summary = out / "summary.json"
    if kind.startswith("another program"):
        summary.write_text('{"run_id": "wandb-7f3a", "meta": {"run_id": "wandb-7f3a"}, "variants": {}}')
    elif kind == "a directory":
        summary.mkdir()
    elif kind == "a link to a run's summary":
        (tmp_path / "kept.json").write_text('{"written_by": "fsdp2bench", "meta": {}}')
        summary.symlink_to(tmp_path / "kept.json")
    else:
        summary.symlink_to(summary if kind == "a symbolic link loop" else tmp_path / "gone")
    before = sorted((p.name, p.is_symlink()) for p in out.iterdir())
    if kind.startswith("another program"):  # launched for real; the others asked of main.py's checks here
        proc = run_script(["main.py", *TINY, "--output_dir", str(out)], nproc=None)
        assert proc.returncode == 2, proc.stdout[-2000:]
        line, = proc.stderr.strip().splitlines()
        assert "Traceback" not in proc.stderr
    else:
        line = refusal(arguments.validate, [*TINY, "--output_dir", str(out)])
    assert line is not None and line.startswith("error: ") and str(summary) in line, line
    assert sorted((p.name, p.is_symlink()) for p in out.iterdir()) == before
    if kind.startswith("another program"):
        assert "wandb-7f3a" in summary.read_text()


def test_visualize_leaves_a_users_figure_beside_a_summary_of_ours(tmp_path, short_run):
    out = tmp_path / "out"
    shutil.copytree(short_run, out)
    figure = png(out / "loss.png")
    proc = run_script(["visualize.py", "--dir", str(out)], nproc=None)
    assert proc.returncode == 2 and f"{out / 'loss.png'} was not written by this benchmark" in proc.stderr
    assert (out / "loss.png").read_bytes() == figure
    from PIL import Image

    with Image.open(out / "rss_memory.png") as drawn:  # the figures it draws carry the mark
        assert drawn.info.get("written_by") == "fsdp2bench"


def test_a_second_run_into_a_directory_moves_the_first_runs_files_aside_in_one_line(tmp_path, short_run):
    """The README's run, then a sweep into the same out/: the sweep owns out/; the first run is kept whole."""
    out = tmp_path / "out"
    shutil.copytree(short_run, out)  # the first run's
    assert run_script(["visualize.py", "--dir", str(out)], nproc=None).returncode == 0
    first_id = load(out / "summary.json")["meta"]["run_id"]
    firsts = sorted(p.name for p in out.iterdir() if p.is_file())
    notes = png(out / "my_notes.png")  # the user's: stays where it is
    second = run_script(["main.py", *TINY, "--max_steps", "2", "--variants", VARIANTS[0], "--simulate_world_size",
                         "2", "--output_dir", str(out)], nproc=None)
    assert second.returncode in (0, 1), second.stderr
    said = [line for line in second.stdout.splitlines() if "earlier runs" in line]
    aside, = (out / "earlier_runs").iterdir()
    assert said == [f"note: moved the {counted(len(firsts), 'file')} of earlier runs in {out} to {aside}/; this run writes "
                    "its own in their place"]
    assert sorted(p.name for p in aside.iterdir()) == firsts and load(aside / "summary.json")["meta"]["run_id"] == first_id
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["my_notes.png", "summary.json"]
    assert (out / "my_notes.png").read_bytes() == notes
    drawn = run_script(["visualize.py", "--dir", str(out)], nproc=None)
    assert drawn.returncode == 0 and "note:" not in drawn.stdout, drawn.stdout
    assert sorted(p.name for p in out.glob("*.png")) == ["memory_vs_world_size.png", "my_notes.png"]


def test_a_matrix_run_again_keeps_the_earlier_matrix_json_aside(tmp_path):
    """matrix.py replaced the matrix.json of the run before it in silence (main.py, plan.py and loading.py move an
    earlier run's files to earlier_runs/): it keeps it the same way."""
    args = ["matrix.py", "--model", "tiny", "--device", "cpu", "--max_steps", "2", "--option_sets", "default",
            "--output_dir", str(tmp_path)]
    assert run_script(args, nproc=None).returncode == 0
    first = (tmp_path / "matrix.json").read_bytes()
    second = run_script(args, nproc=None)
    assert second.returncode == 0 and f"note: moved the 1 file of earlier runs in {tmp_path} to" in second.stdout, \
        second.stdout[-2000:] + second.stderr[-2000:]
    kept = list((tmp_path / "earlier_runs").glob("before-*/matrix.json"))
    assert [k.read_bytes() for k in kept] == [first] and (tmp_path / "matrix.json").read_bytes() != first
