"""Helpers that launch the real scripts, the way a user does."""

from __future__ import annotations

import json
import os
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


def command(args: list[str], nproc: int | None = 2, launcher: list[str] | None = None) -> list[str]:
    """``torchrun --standalone --nproc_per_node nproc <args>``, plain python when nproc is None, or
    torchrun with the given ``launcher`` options instead of ``--standalone`` and the process count."""
    if nproc is None and launcher is None:
        return [sys.executable, *args]
    options = launcher if launcher is not None else ["--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, "-m", "torch.distributed.run", *options, *args]


def environment(**extra: str) -> dict:
    """One thread per process (2 cores run 2 ranks), unbuffered output, never the Hub, and the temp
    dir of this test run (torchrun leaves a log folder per launch there, not in the machine's)."""
    temp = {"TMPDIR": LAUNCHES_TMP[0]} if LAUNCHES_TMP else {}
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **temp, **extra}


LAUNCHES_TMP: list[str] = []  # the temp dir of every process the tests launch
# torchrun's logs; multiprocessing's, when a test kills it; torch's compiled-kernel cache
LEFT_BY_LAUNCHERS = ("torchelastic_", "pymp-", "torchinductor_")
# Names that a test run can leave in the machine's temp dir (the project's, the launchers', tempfile's
# default), so that what another program writes there meanwhile is not counted.
OURS = ("fsdp2bench", "tmp", *LEFT_BY_LAUNCHERS)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_the_temp_dir(tmp_path_factory):
    """A test run leaves nothing in the machine's temp dir, and the launched processes nothing of
    this project's in theirs (pytest's own folders, removed by pytest, are not counted)."""
    machine = tempfile.gettempdir()
    before = set(os.listdir(machine))
    LAUNCHES_TMP.append(str(tmp_path_factory.mktemp("launches_tmp")))
    # this process's compiled-kernel cache (a CP layout's check imports inductor), beside the launched ones'
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(LAUNCHES_TMP[0], "torchinductor_tests"))
    yield
    left = sorted(n for n in set(os.listdir(machine)) - before if n.startswith(OURS))
    ours = sorted(n for n in os.listdir(LAUNCHES_TMP[0]) if not n.startswith(LEFT_BY_LAUNCHERS))
    assert not left and not ours, f"left in {machine}: {left}; by the launched processes: {ours}"


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
