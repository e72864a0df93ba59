"""Helpers that launch the real scripts, the way a user does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_not_fixed",
            "torch_optimizer_before_fsdp_fixed", "accelerate"]
# A tiny Qwen2 on CPU learns visibly within a dozen steps at this learning rate.
TINY = ["--model", "tiny", "--device", "cpu", "--max_steps", "12", "--learning_rate", "1e-3"]


# ``launcher``'s first word: accelerate's launcher with the options after it, instead of torchrun.
ACCELERATE_LAUNCH = "accelerate launch"


def command(args: list[str], nproc: int | None = 2, launcher: list[str] | None = None) -> list[str]:
    """``torchrun --standalone --nproc_per_node nproc <args>``, plain python when nproc is None, torchrun
    with the given ``launcher`` options instead of ``--standalone`` and the process count, or ``accelerate
    launch`` with the options that follow ``ACCELERATE_LAUNCH`` in ``launcher``."""
    if nproc is None and launcher is None:
        return [sys.executable, *args]
    if launcher and launcher[0] == ACCELERATE_LAUNCH:
        return [sys.executable, "-m", "accelerate.commands.launch", *launcher[1:], *args]
    options = launcher if launcher is not None else ["--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, "-m", "torch.distributed.run", *options, *args]


def environment(**extra: str) -> dict:
    """One thread per process (2 cores run 2 ranks), unbuffered output, never the Hub; the temp dir is the
    session's own (``TESTS_TMP``, inherited)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}


# torchrun's logs; multiprocessing's, when a test kills it; torch's compiled-kernel cache
LEFT_BY_LAUNCHERS = ("torchelastic_", "pymp-", "torchinductor_")
TESTS_TMP: list[str] = []  # the temp dir of every process of this session, its own and those it launches
MACHINE_TMPDIR: list[str | None] = []  # TMPDIR as the session found it


def pytest_configure(config) -> None:
    """Before the test modules are imported (some make files as they are), every process of the session is given
    a temp dir of its own, inside the machine's: on a shared machine, what other jobs write there is theirs.
    pytest's own folders stay where they are (kept for a look after a failure)."""
    machine = tempfile.gettempdir()
    MACHINE_TMPDIR.append(os.environ.get("TMPDIR"))
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", machine)
    TESTS_TMP.append(tempfile.mkdtemp(prefix="fsdp2bench-tests-", dir=machine))
    os.environ["TMPDIR"] = tempfile.tempdir = TESTS_TMP[0]


def pytest_unconfigure(config) -> None:
    """The session's temp dir goes with it, what the launchers leave there too."""
    if TESTS_TMP:
        tempfile.tempdir = os.path.dirname(TESTS_TMP[0])
        if MACHINE_TMPDIR[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = MACHINE_TMPDIR[0]
        shutil.rmtree(TESTS_TMP.pop(), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_the_temp_dir():
    """The tests' processes leave nothing of theirs in their temp dir but the launchers' own leftovers (what the
    test modules made as they were imported is already there, and removed by them at exit)."""
    before = set(os.listdir(TESTS_TMP[0]))
    yield
    left = sorted(n for n in set(os.listdir(TESTS_TMP[0])) - before if not n.startswith(LEFT_BY_LAUNCHERS))
    assert not left, f"left in the tests' temp dir {TESTS_TMP[0]}: {left}"


def start_script(args: list[str], nproc: int | None = 2, launcher: list[str] | None = None, own_group: bool = False,
                 **env: str) -> subprocess.Popen:
    """The same launch as ``run_script``, left running (to signal it, or to start several); ``own_group``: in a
    process group of its own, which a terminal's Ctrl-C reaches whole (``os.killpg(proc.pid, ...)``)."""
    return subprocess.Popen(command(args, nproc, launcher), cwd=ROOT, env=environment(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=own_group)


def run_script(args: list[str], nproc: int | None = 2, timeout: int = 300, launcher: list[str] | None = None,
               **env: str) -> subprocess.CompletedProcess:
    """Launch a script of the project as a user does, wait for it, and keep its output."""
    return subprocess.run(command(args, nproc, launcher), cwd=ROOT, env=environment(**env), capture_output=True,
                          text=True, timeout=timeout)


def child_running(pid: int, marker: str, timeout: float = 60.0):
    """The first child process of ``pid`` whose command line holds ``marker``, or whose name is it, waited for;
    a child that has just ended (a zombie, or gone) is passed over."""
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children():
            try:
                if marker in " ".join(child.cmdline()) or child.name() == marker:
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no child of {pid} running {marker} within {timeout} s")


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def suite(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One 2-rank run of all four variants, shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("suite")
    proc = run_script(["main.py", *TINY, "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc
