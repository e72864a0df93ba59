"""Helpers that launch the real scripts, the way a user does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_not_fixed",
            "torch_optimizer_before_fsdp_fixed", "accelerate"]
# A tiny Qwen2 on CPU learns visibly within a dozen steps at this learning rate.
TINY = ["--model", "tiny", "--device", "cpu", "--max_steps", "12", "--learning_rate", "1e-3"]


def run_script(args: list[str], nproc: int | None = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc <args>``, or plain python when nproc is None."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


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
