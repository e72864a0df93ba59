"""Nothing lost, nothing claimed: a reader that goes away, a full disk, two runs racing for one
directory, launcher variables set by hand, and Ctrl-C while the run starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, TINY, VARIANTS, environment, load, refusal, run_script, start_script

from fsdp2bench.run import arguments

SHORT = [*TINY, "--max_steps", "3"]


def statuses(directory) -> dict[str, str]:
    return {name: v["status"] for name, v in load(directory / "summary.json")["variants"].items()}


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_reader_that_stops_after_one_line_leaves_a_complete_run(tmp_path, nproc):
    """``main.py | head -1``: the rest of the output goes nowhere, the run goes on to its end."""
    proc = start_script(["main.py", *SHORT, "--output_dir", str(tmp_path)], nproc=nproc)
    assert proc.stdout.readline()
    proc.stdout.close()  # as head does once it has its line
    proc.wait(timeout=300)
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr
    assert statuses(tmp_path) == dict.fromkeys(VARIANTS, "ok")


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 16 KiB: room for a trace or two, not for a run."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_ends_in_an_error_line_and_what_was_written_is_valid(small_disk):
    out = small_disk / "out"
    proc = run_script(["main.py", *SHORT, "--output_dir", str(out), "--quiet"], nproc=None)
    assert proc.returncode == 1
    assert "Wrote per-rank traces" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: could not write {out}/summary.json (No space left on device); the results so far are " \
                   "in the files that were written"
    assert "FAILED: rank 0: cannot write " in proc.stderr and "(No space left on device)" in proc.stderr
    written = [p for p in out.iterdir() if p.suffix == ".json"]
    assert written
    for path in written:  # each whole: written under a temporary name, then renamed
        json.loads(path.read_text())


def test_an_empty_lock_is_not_taken_for_a_stale_one(tmp_path):
    """What a run whose write of the lock was slow would leave for a moment: refused, not taken over."""
    lock = tmp_path / ".fsdp2bench.lock"
    lock.write_text("")
    proc = run_script(["main.py", *SHORT, "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --output_dir {tmp_path}: {lock} is there but does not name a run; remove " \
                                  "it if no run is writing there"
    assert not (tmp_path / "summary.json").exists() and lock.read_text() == ""


LAUNCHER = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


@pytest.mark.parametrize("env, line", [
    ({"WORLD_SIZE": "abc"}, None),  # no RANK: plain python, one rank, whatever else is set
    ({**LAUNCHER, "WORLD_SIZE": "abc"}, "error: WORLD_SIZE='abc' in the environment is not an integer in [0, 1048576]"),
    ({**LAUNCHER, "WORLD_SIZE": "0"}, "error: WORLD_SIZE=0 in the environment: a world has at least one rank"),
    ({**LAUNCHER, "RANK": "3", "WORLD_SIZE": "2"}, "error: RANK=3 in the environment is not a rank of WORLD_SIZE=2"),
    ({**LAUNCHER, "RANK": "-1"}, "error: RANK='-1' in the environment is not an integer in [0, 1048576]"),
    ({**LAUNCHER, "LOCAL_WORLD_SIZE": "4"}, "error: LOCAL_WORLD_SIZE=4 in the environment is not in [1, WORLD_SIZE=1]"),
    ({**LAUNCHER, "LOCAL_RANK": "1"}, "error: LOCAL_RANK=1 in the environment is not a rank of LOCAL_WORLD_SIZE=1"),
    ({**LAUNCHER, "MASTER_PORT": "99999"}, "error: MASTER_PORT=99999 in the environment is not a port (1 to 65535)"),
    ({**LAUNCHER, "MASTER_ADDR": "nohost.invalid"}, "error: MASTER_ADDR='nohost.invalid' in the environment: no such "
                                                    "host"),
    ({"RANK": "0"}, "error: WORLD_SIZE is not set in the environment but RANK is"),
    ({**LAUNCHER, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "FSDP2_BENCH_PEER_WAIT_S": "3"},
     "error: rank 0: the 2 ranks of WORLD_SIZE=2 did not all meet at 127.0.0.1:"),
])
def test_launcher_variables_set_by_hand_give_one_line_or_a_clean_run(tmp_path, monkeypatch, env, line):
    """Each within 30 s (a hang fails the test): the wait for ranks that never come is 15 s, 3 s here. The
    variables that main.py's checks of its launch refuse (starting.check_launcher_env, run before anything
    starts) are asked of them in this process; launched are the clean run, the ranks that never meet, and a
    refusal on a rank other than 0 (said at once: no other rank would say it)."""
    env = {"MASTER_PORT": str(free_port()), **env}
    argv = [*SHORT, "--variants", VARIANTS[0], "--output_dir", str(tmp_path / "out")]
    if line is not None and "did not all meet" not in line and env.get("RANK") != "3":
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        said = refusal(arguments.validate, argv)
        assert said is not None and said.startswith(line), said
        assert not (tmp_path / "out").exists()
        return
    earlier = tmp_path / "out" / "summary.json"  # an earlier run's: a refused run leaves it where it is
    earlier.parent.mkdir()
    earlier.write_text(json.dumps({"written_by": "fsdp2bench"}))
    proc = run_script(["main.py", *argv], nproc=None, timeout=30, **env)
    if line is None:
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(line), proc.stderr
    assert sorted(p.name for p in earlier.parent.iterdir()) == ["summary.json"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("after_s", [0.3, 1.5, 3.0])
def test_ctrl_c_while_starting_gives_one_line_and_no_traceback(tmp_path, after_s):
    """During the imports, the checks of the command line and the model, or the set-up."""
    proc = start_script(["main.py", *SHORT, "--output_dir", str(tmp_path / "out")], nproc=None)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("Interrupted"), stderr
    assert not (tmp_path / "out" / ".fsdp2bench.lock").exists()


ENTRY_SCRIPTS = ["main.py", "loading.py", "plan.py", "matrix.py", "speed.py", "visualize.py"]


def test_every_entry_script_takes_interrupts_in_one_line_before_any_other_import():
    """A Ctrl-C to a rank in its first moments (torchrun's ranks start one by one; a signal to one rank) came in
    while the script imported its package and printed Python's traceback: the one-line handler is set first, by a
    module that imports only the standard library's os, signal and sys. (Before that is the interpreter's own
    start-up, which no script can reach.)"""
    import ast

    for script in ENTRY_SCRIPTS:
        tree = ast.parse((ROOT / script).read_text())
        body = tree.body[1:] if isinstance(tree.body[0].value, ast.Constant) else tree.body  # the docstring
        handler = next(i for i, node in enumerate(body) if isinstance(node, ast.If))
        before = [ast.unparse(node) for node in body[:handler]]
        assert before == ["from __future__ import annotations", "import sys",
                          "from fsdp2bench.processes.first import one_line_interrupts"], script
        assert ast.unparse(body[handler]) == "if __name__ == '__main__':\n    one_line_interrupts()", script
    first = ast.parse((ROOT / "fsdp2bench" / "processes" / "first.py").read_text())
    imported = {alias.name for node in ast.walk(first) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(first) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "os", "signal", "sys"}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_loading_starts_gives_one_line_and_no_traceback(tmp_path, signum):
    """loading.py during its imports and checks: one line, nothing written."""
    proc = start_script(["loading.py", "--device", "cpu", "--model", "small", "--output_dir", str(tmp_path / "out")],
                        nproc=None)
    time.sleep(1.5)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stderr.strip().splitlines() == ["Interrupted while starting; nothing ran"], stderr
    assert not (tmp_path / "out").exists()


def max_rss_mib(args: list[str]) -> float:
    """The largest resident set of any process of one launch, in MiB (the kernel's own peak, not polled)."""
    import sys

    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    proc = subprocess.run([sys.executable, "-c", code, sys.executable, *args], capture_output=True, text=True,
                          timeout=300, env=environment(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip()) / 1024


def test_a_dataset_costs_its_size_in_memory_not_twenty_times_it(tmp_path):
    """docs/reliability.md's bound: peak RSS rises by the file's size (its bytes, read once) plus 8 bytes
    a token of the batches kept, here a few KiB."""
    dataset = tmp_path / "data.txt"
    line = b"the quick brown fox jumps over the lazy dog and counts 42 barrels of salt by the river\n"
    dataset.write_bytes(line * (40 * 2**20 // len(line)))
    size_mib = dataset.stat().st_size / 2**20
    run = ["main.py", *SHORT, "--variants", VARIANTS[0], "--quiet"]
    without = max_rss_mib([*run, "--output_dir", str(tmp_path / "a")])
    with_data = max_rss_mib([*run, "--dataset", str(dataset), "--output_dir", str(tmp_path / "b")])
    assert with_data - without <= 1.25 * size_mib + 16, (without, with_data, size_mib)


@pytest.mark.parametrize("nproc", [None, 2])
def test_the_process_that_forks_the_variants_runs_no_other_thread(tmp_path, nproc):
    """A fork copies only the thread that calls it: a lock another thread held then (the store's
    libuv server thread, `pt_tcpstore_uv`, hosted in plain python's own process before) stays locked
    in the child forever, which can hang a variant before its first step. Plain python now holds
    the store in a process of its own, as torchrun's agent does."""
    proc = start_script(["main.py", *TINY, "--variants", "torch_optimizer_after_fsdp,accelerate",  # one after the other
                         "--output_dir", str(tmp_path)], nproc=nproc)
    for line in proc.stdout:
        if line.startswith("[torch_optimizer_after_fsdp]"):
            break
    launcher = psutil.Process(proc.pid)
    ranks = [launcher] if nproc is None else [p for p in launcher.children() if "main.py" in " ".join(p.cmdline())]
    threads = {p.pid: [t.id for t in p.threads()] for p in ranks}  # while its variant's children train
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    assert len(threads) == (nproc or 1) and all(len(ids) == 1 for ids in threads.values()), threads


def test_a_slow_write_of_the_lock_loses_the_race_and_is_refused(tmp_path, monkeypatch):
    """The slow writer of the old race, forced: one launch writes its lock slowly while another takes
    the directory. The lock appears only when whole (a hard link), so the slow one finds the other's
    lock, alive, and is refused; the fast one keeps it."""
    import threading

    from fsdp2bench import cli, files

    real_link, slow_started = os.link, threading.Event()

    def slow_link(src, dst):
        if threading.current_thread().name == "slow":
            slow_started.set()
            time.sleep(1.0)  # its lock's content is written; the link that makes it visible comes late
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", slow_link)
    monkeypatch.setattr(files.atexit, "register", lambda *a: None)  # this test process is both launches
    outcome = {}

    def launch(name: str) -> None:
        try:
            files.lock_output_dir(str(tmp_path))
            outcome[name] = "took it"
        except cli.UserError as exc:
            outcome[name] = str(exc)

    slow = threading.Thread(target=launch, args=("slow",), name="slow")
    slow.start()
    slow_started.wait(5)
    launch("fast")
    slow.join()
    assert outcome["fast"] == "took it"
    assert outcome["slow"].startswith(f"--output_dir {tmp_path}: another run (process {os.getpid()}")
    host, pid, started = (tmp_path / ".fsdp2bench.lock").read_text().split()  # and when its process started
    assert (host, int(pid), float(started)) == (socket.gethostname(), os.getpid(),
                                                round(psutil.Process().create_time(), 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fsdp2bench.lock"]  # no temporary lock left


def test_ctrl_c_outside_a_runs_own_handling_is_named_sigint(capsys, monkeypatch):
    """A KeyboardInterrupt carries no words: the line names the signal, not an empty pair of brackets."""
    from fsdp2bench import cli
    from fsdp2bench.cli import exit_with

    monkeypatch.setattr(cli, "_ENDING", [])  # this process goes on after the command exit_with ends

    def interrupted() -> int:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as ended:
        exit_with(interrupted)
    assert ended.value.code == 130
    assert capsys.readouterr().err == "Interrupted (SIGINT); what was written is whole, nothing more is\n"


def test_a_lock_naming_a_live_process_says_only_what_is_known_of_it(tmp_path):
    """Process 1 runs, but is no run of this benchmark: a lock without its start time is refused in words true
    of it (not "another run"); one whose start time is not process 1's was left by a run that is gone (its
    process id given again) and is taken over."""
    lock = tmp_path / ".fsdp2bench.lock"
    lock.write_text(f"{socket.gethostname()} 1")
    proc = run_script(["main.py", *SHORT, "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 2 and "another run" not in proc.stderr
    assert proc.stderr.strip().startswith(f"error: --output_dir {tmp_path}: its lock names process 1 on "
                                          f"{socket.gethostname()}, which is running (")
    assert "whether that process took it cannot be told" in proc.stderr and lock.exists()
    lock.write_text(f"{socket.gethostname()} 1 {psutil.Process(1).create_time() - 60:.2f}")
    proc = run_script(["main.py", *SHORT, "--variants", VARIANTS[0], "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode in (0, 1) and (tmp_path / "summary.json").exists() and not lock.exists(), proc.stderr


def test_an_interrupt_a_library_wrapped_in_its_own_error_is_still_one_line(capsys, monkeypatch):
    """A SIGTERM that lands inside torch's fake-tensor dispatch comes back as torch's error, its cause the
    interrupt: the same one line and exit code 130 as a bare one, no traceback; another error still raises."""
    from fsdp2bench import cli
    from fsdp2bench.cli import Stopped, exit_with

    monkeypatch.setattr(cli, "_ENDING", [])  # this process goes on after the commands exit_with ends

    def wrapped() -> int:
        try:
            raise Stopped("SIGTERM")
        except Stopped as exc:
            raise RuntimeError("while running a fake tensor op") from exc

    with pytest.raises(SystemExit) as ended:
        exit_with(wrapped)
    assert ended.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "Interrupted (SIGTERM); what was written is whole, nothing more is"]

    def broken() -> int:
        raise RuntimeError("not an interrupt")

    with pytest.raises(RuntimeError, match="not an interrupt"):
        exit_with(broken)


def tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("stop", ["a move that fails", "a signal"])
def test_the_earlier_runs_files_move_all_or_none(tmp_path, monkeypatch, stop):
    """Two files at the top move, then the one of a simulated folder cannot (its folder aside is a file of the
    user's), or a signal comes before it: the two are put back, the folders made for them removed, in one line."""
    from fsdp2bench.cli import UserError
    from fsdp2bench.processes.isolation import Interrupted
    from fsdp2bench.run import session

    ours = json.dumps({"written_by": "fsdp2bench"})
    for path in ("summary.json", "accelerate_memory_usage.json", "simulated_N8/accelerate_memory_usage.json"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(ours)
    (tmp_path / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    if stop == "a signal":
        renames, rename = [], os.rename

        def rename_then_signal(source, target):
            renames.append(source)
            if len(renames) == 3:
                raise Interrupted("SIGINT")
            rename(source, target)

        monkeypatch.setattr(os, "rename", rename_then_signal)
        with pytest.raises(Interrupted):
            session.move_earlier_runs_aside(str(tmp_path), "X")
        monkeypatch.undo()
    else:
        (tmp_path / "earlier_runs" / "before-X").mkdir(parents=True)
        (tmp_path / "earlier_runs" / "before-X" / "simulated_N8").write_text("a file of the user's")
        before = tree(tmp_path)
        with pytest.raises(UserError) as refused:
            session.move_earlier_runs_aside(str(tmp_path), "X")
        assert str(refused.value) == (f"--output_dir {tmp_path}: cannot move the earlier run's "
                                      "simulated_N8/accelerate_memory_usage.json to earlier_runs/before-X/ "
                                      "(File exists); nothing was moved: move it away or choose another --output_dir")
    assert tree(tmp_path) == before


PASSING = ("import pytest\n\n\n@pytest.fixture(scope='session')\ndef shared(tmp_path_factory):\n"
           "    return tmp_path_factory.mktemp('shared')\n\n\n"
           "def test_passes(tmp_path, shared):\n    (tmp_path / 'kept.bin').write_bytes(b'x' * 4096)\n"
           "    (shared / 'run.json').write_text('{}')\n")
FAILING = "\n\ndef test_fails(tmp_path):\n    (tmp_path / 'look.txt').write_text('why')\n    assert False\n"


@pytest.mark.parametrize("failing", [False, True])
def test_passing_tests_leave_nothing_in_pytests_temp_dir(tmp_path, failing):
    """pytest.ini's retention: a passing test's tmp_path goes with it, and a session's fixtures' too where every
    test passed; a failing test's stays for a look."""
    tests = tmp_path / "test_leftovers.py"
    tests.write_text(PASSING + (FAILING if failing else ""))
    root = tmp_path / "temproot"
    root.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pytest.ini"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", str(tests)], capture_output=True, text=True,
                          env=environment(PYTEST_DEBUG_TEMPROOT=str(root)), cwd=tmp_path, timeout=120)
    assert proc.returncode == int(failing), proc.stdout + proc.stderr
    left = sorted(p.name for p in root.rglob("*") if p.is_file())
    assert left == (["look.txt", "run.json"] if failing else [])


@pytest.mark.parametrize("script,args", [("plan.py", ["--world_size", "2"]), ("matrix.py", ["--option_sets", "default"]),
                                         ("speed.py", ["--", "--max_steps", "2"])])
def test_a_script_that_starts_its_own_processes_refuses_a_launcher(tmp_path, script, args):
    """Under ``torchrun --nproc_per_node 2`` matrix.py ran the whole matrix twice into one directory, and speed.py
    lost its ``--`` to torchrun (main.py's options read as its own): each driver is one process, and says so."""
    out = tmp_path / "out"
    proc = run_script([script, "--device", "cpu", "--output_dir", str(out), *args] if script != "speed.py" else
                      [script, "--output_dir", str(out), *args, "--device", "cpu"], nproc=2)
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and said and said[0].startswith(f"error: {script} is one process that ") and \
        said[0].endswith(": run it with python3, not a launcher (torchrun, accelerate launch)"), proc.stderr[-2000:]
    assert not out.exists()
