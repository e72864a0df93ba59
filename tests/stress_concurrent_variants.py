"""On demand, not in CI: run the concurrent-variants path many times and report any run that hangs.

    python3 tests/stress_concurrent_variants.py --runs 300

Each run is ``main.py --device cpu --model tiny --max_steps 2 --concurrent_variants 3`` (one rank,
plain python: three variants forked at once), given ``--limit`` seconds. A run still going then is
a hang: every process of it is sent SIGUSR1 (each prints every thread's Python stack to the run's
log, see fsdp2bench/cli.py), then killed, and its log kept as ``hang_<i>.log`` in ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["main.py", "--device", "cpu", "--model", "tiny", "--max_steps", "2", "--concurrent_variants", "3", "--quiet"]


def one_run(i: int, work: str, limit: float, keep: str) -> str:
    """"ok", "failed (exit code N)" or "hang"."""
    out, log_path = os.path.join(work, "out"), os.path.join(work, "run.log")
    shutil.rmtree(out, ignore_errors=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *RUN, "--output_dir", out], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout=limit)
            return "ok" if code == 0 else f"failed (exit code {code})"
        except subprocess.TimeoutExpired:
            family = [proc, *psutil.Process(proc.pid).children(recursive=True)]
            for p in family:
                with_stack(p)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            shutil.copy(log_path, os.path.join(keep, f"hang_{i}.log"))
            return "hang"


def with_stack(p) -> None:
    try:
        p.send_signal(signal.SIGUSR1)
    except psutil.Error:
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--limit", type=float, default=90.0, help="seconds a run may take before it counts as a hang")
    p.add_argument("--keep", default="stress_logs", help="where the logs of hung runs go")
    args = p.parse_args()
    os.makedirs(args.keep, exist_ok=True)
    counts: dict[str, int] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp2bench-stress-") as work:
        for i in range(1, args.runs + 1):
            outcome = one_run(i, work, args.limit, args.keep)
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome != "ok":
                print(f"run {i}: {outcome}", flush=True)
    print(f"{args.runs} runs in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
    return 0 if counts.get("ok", 0) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
