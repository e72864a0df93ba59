"""Nothing lost, nothing hung: failing variants, interrupts, bad input, two nodes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import time

import psutil
import pytest
from conftest import TINY, VARIANTS, load, refusal, run_script, start_script

from fsdp2bench.run import arguments, concurrency

FIXED = "torch_optimizer_before_fsdp_fixed"
SHORT = ["--model", "tiny", "--device", "cpu", "--max_steps", "6"]


def statuses(out) -> dict:
    return {name: v["status"] for name, v in load(out / "summary.json")["variants"].items()}


def rank_processes(agent) -> dict[int, psutil.Process]:
    """The main process of every rank of a torchrun agent, by rank."""
    ranks = {}
    for child in psutil.Process(agent.pid).children():
        with contextlib.suppress(psutil.Error, KeyError, ValueError):
            ranks[int(child.environ()["RANK"])] = child
    return ranks


LONG_STEPS = 80  # the first variant trains them all; the second is signalled 2 s after it starts
PLAIN_STEPS = 240  # the same for one rank, which runs them faster (80 ended within 2 s on an idle host)


def start_long_run(out, nproc: int | None = 2, own_group: bool = False, steps: int = LONG_STEPS):
    """Two ranks (or ``nproc``), a finished first variant, then a long second one: returned once the second runs."""
    proc = start_script(["main.py", "--model", "tiny", "--device", "cpu", "--max_steps", str(steps),
                         "--variants", "torch_optimizer_after_fsdp,accelerate", "--output_dir", str(out)],
                        nproc=nproc, own_group=own_group)
    for line in proc.stdout:
        if line.startswith("[accelerate]"):
            break
    time.sleep(2)
    return proc


def test_an_exception_on_one_rank_fails_that_variant_only(tmp_path):
    """Two at a time: the failing variant shares its turn with accelerate, which must finish."""
    proc = run_script(["main.py", *SHORT, "--output_dir", str(tmp_path), "--concurrent_variants", "2",
                       "--inject_failure", f"{FIXED}:3:1"])
    assert proc.returncode != 0
    reason = "rank 1: RuntimeError: injected failure at step 3 on rank 1"
    assert statuses(tmp_path) == {VARIANTS[0]: "ok", VARIANTS[1]: "ok", FIXED: f"failed: {reason}",
                                  "accelerate": "ok"}
    assert f"[{FIXED}] FAILED: {reason}" in proc.stderr
    failed = load(tmp_path / f"{FIXED}_memory_usage_rank1.json")
    assert failed["status"] == "failed" and "injected failure" in failed["error"]
    assert [s["step"] for s in failed["steps"]] == [0, 1, 2]  # the partial trace, up to the failure
    peer = load(tmp_path / f"{FIXED}_memory_usage.json")
    assert peer["status"] == f"aborted: {reason}"
    assert len(peer["steps"]) <= 4 and len(peer["timestamps"]) > 0
    assert load(tmp_path / "accelerate_memory_usage_rank1.json")["status"] == "ok"  # ran beside the failure
    assert load(tmp_path / "summary.json")["checks"]["intended_losses_match"]["ok"] is True
    assert not list(tmp_path.glob("*.tmp*"))
    # How far it got, per rank, for the summary (on a GPU the peak and the failed allocation too).
    failure = {f["rank"]: f for f in load(tmp_path / "summary.json")["variants"][FIXED]["failure"]}
    assert failure[1]["status"] == "failed" and failure[1]["last_event"] == "training_started"
    assert failure[1]["steps_done"] == 3 and failure[1]["failed_allocation_mib"] is None
    assert failure[0]["status"] == f"aborted: {reason}" and failure[0]["steps_done"] <= 4
    assert failed["failure"]["steps_done"] == 3
    assert "rank 1 reached step 3 (training_started)" in proc.stdout


def test_a_rank_that_dies_does_not_hang_the_others(tmp_path):
    proc = run_script(["main.py", *SHORT, "--output_dir", str(tmp_path), "--variants",
                       f"{FIXED},torch_optimizer_after_fsdp", "--inject_failure", f"{FIXED}:2:1:kill"],
                      timeout=180)
    assert proc.returncode != 0
    reason = "rank 1: process ended (killed by SIGKILL)"
    assert statuses(tmp_path) == {FIXED: f"failed: {reason}", "torch_optimizer_after_fsdp": "ok"}
    assert load(tmp_path / f"{FIXED}_memory_usage.json")["status"] == f"aborted: {reason}"
    assert not (tmp_path / f"{FIXED}_memory_usage_rank1.json").exists()  # a killed process writes nothing


def test_sigterm_keeps_finished_variants_and_marks_the_interrupted_one(tmp_path):
    proc = start_long_run(tmp_path)
    proc.send_signal(signal.SIGTERM)  # stop the launcher as a cluster scheduler would
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    summary = load(tmp_path / "summary.json")
    assert {n: v["status"] for n, v in summary["variants"].items()} == {
        "torch_optimizer_after_fsdp": "ok", "accelerate": "interrupted"}
    assert summary["variants"]["torch_optimizer_after_fsdp"]["steps"] == LONG_STEPS
    assert load(tmp_path / "torch_optimizer_after_fsdp_memory_usage_rank1.json")["status"] == "ok"
    for suffix in ("", "_rank1"):
        partial = load(tmp_path / f"accelerate_memory_usage{suffix}.json")
        assert partial["status"] == "interrupted" and 0 < len(partial["steps"]) < LONG_STEPS
    assert not list(tmp_path.glob("*.tmp*"))
    assert "Interrupted (SIGTERM) during accelerate" in stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_a_plain_run_and_its_processes_ends_it_as_ctrl_c_does(tmp_path, signum):
    """``python main.py`` in a terminal that closes: SIGHUP reaches every process of its job (main.py, its store,
    the variant's process), as a kill of the job's group sends SIGTERM to each. One line; the finished variant
    kept, the running one marked interrupted; the directory unlocked."""
    proc = start_long_run(tmp_path, nproc=None, own_group=True, steps=PLAIN_STEPS)
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=120)
    lines = stderr.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, stderr
    assert lines[0].startswith(f"Interrupted ({signal.Signals(signum).name}) during accelerate"), stderr
    summary = load(tmp_path / "summary.json")
    assert {n: v["status"] for n, v in summary["variants"].items()} == {
        "torch_optimizer_after_fsdp": "ok", "accelerate": "interrupted"}
    partial = load(tmp_path / "accelerate_memory_usage.json")
    assert partial["status"] == "interrupted" and 0 < len(partial["steps"]) < PLAIN_STEPS
    assert not (tmp_path / ".fsdp2bench.lock").exists() and not list(tmp_path.glob("*.tmp*"))


# What nohup does: SIGHUP ignored, then the command executed in the same process.
NOHUP = ["-c", "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


def test_a_run_started_to_outlive_its_terminal_goes_on_when_the_terminal_closes(tmp_path):
    """``nohup python main.py``: the terminal's SIGHUP, ignored from the start, stays ignored by every process."""
    proc = start_script([*NOHUP, "main.py", "--model", "tiny", "--device", "cpu", "--max_steps", "30", "--variants",
                         "torch_optimizer_after_fsdp,accelerate", "--output_dir", str(tmp_path)], nproc=None,
                        own_group=True)
    for line in proc.stdout:
        if line.startswith("[accelerate]"):
            break
    os.killpg(proc.pid, signal.SIGHUP)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert {n: v["status"] for n, v in load(tmp_path / "summary.json")["variants"].items()} == {
        "torch_optimizer_after_fsdp": "ok", "accelerate": "ok"}


def digest(directory) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


BAD_INPUTS = {
    "batch zero": (["--batch_size", "0"], "--batch_size must be a positive integer"),
    "block negative": (["--block_size", "-4"], "--block_size must be a positive integer"),
    "block too long": (["--block_size", "4096"], "exceeds the model's 2048 positions"),
    "unknown preset": (["--model", "qwen9-huge"], "--model qwen9-huge: not a preset"),
    "dir without config": (["--model", "{tmp}"], "directory has no config.json"),
    "unknown variant": (["--variants", "torch_optimizer_after_fsdp,deepspeed"], "unknown name(s) deepspeed"),
    "dataset missing": (["--dataset", "{tmp}/nope.txt"], "nope.txt: no such file or directory"),
    "dataset is a dir": (["--dataset", "{tmp}"], "a directory, not a file"),
    "dataset too short": (["--dataset", "{tmp}/short.txt"], "too few for one step"),
    "fraction zero": (["--dataset_fraction", "0"], "--dataset_fraction must be in (0, 1]"),
    "fraction above one": (["--dataset_fraction", "1.5"], "--dataset_fraction must be in (0, 1]"),
    # A fraction so small that the text repeated for one step outgrows its bound: the fraction is named as the cause.
    "fraction tiny": (["--dataset_fraction", "5e-10"], "--dataset_fraction 5e-10 keeps that share of them"),
    "no gpu": (["--device", "cuda"], "--device cuda: no CUDA GPU"),
    "output under a file": (["--output_dir", "{tmp}/short.txt/out"], "cannot write there"),
    "bad failure spec": (["--inject_failure", "accelerate:x:1"], "expected VARIANT:STEP:RANK"),
    "concurrency zero": (["--concurrent_variants", "0"], "--concurrent_variants must be a positive integer"),
    "bad flag": (["--batch_sizes", "2"], "unrecognized arguments"),
    "model too big for the host": (["--model", "qwen2.5-7b"], "GiB of host memory (1 process at N = 1"),
    "checkpoint offload alone": (["--activation_checkpointing_offload"],
                                 "--activation_checkpointing_offload needs --activation_checkpointing"),
    "reshard not a bool": (["--reshard_after_forward", "maybe"], "--reshard_after_forward: expected true or false, got 'maybe'"),
    "unknown precision policy": (["--mixed_precision_policy", "fp8"], "--mixed_precision_policy: invalid choice"),
    "simulated N zero": (["--simulate_world_size", "4,0"], "every N must be at least 1"),
    "simulated N not an integer": (["--simulate_world_size", "8,x"], "expected comma-separated integers, got 'x'"),
    "simulated N repeated": (["--simulate_world_size", "8,8"], "a value is given twice"),
    "simulated rank too large": (["--simulate_world_size", "4,16", "--simulate_rank", "4"],
                                 "--simulate_rank 4: outside [0, N) for N = 4"),
    "simulated rank negative": (["--simulate_world_size", "4", "--simulate_rank", "-1"], "outside [0, N)"),
    "simulated rank a word": (["--simulate_world_size", "4", "--simulate_rank", "first"],
                              "integers or 'last', got 'first'"),
    "config not JSON": (["--model", "{tmp}/not_json"], "config.json is not valid JSON"),
    "config without model_type": (["--model", "{tmp}/no_type"], "config.json has no model_type"),
    "not a causal LM": (["--model", "{tmp}/t5"], "a t5 model is not a causal language model"),
    "tokenizer larger than the model": (["--dataset", "{tmp}/words.txt", "--tokenizer", "{tmp}/big_tokenizer"],
                                        "its vocabulary has 1001 tokens, the model's 509"),
    "summary.json is a directory": (["--output_dir", "{tmp}/taken"], "summary.json is a directory"),
}


def write_bad_inputs(tmp) -> None:
    """The files and directories the cases above point at."""
    (tmp / "short.txt").write_text("too short")
    (tmp / "words.txt").write_text("w1 w2 w3 " * 2000)
    for name, text in {"not_json": "{model_type: qwen2", "no_type": '{"hidden_size": 64}',
                       "t5": '{"model_type": "t5"}'}.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(text)
    (tmp / "taken" / "summary.json").mkdir(parents=True)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(1000)}, "[UNK]": 1000}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp / "big_tokenizer")


# Launched for real: the parser's refusal and one that main.py's checks make after the model is built. Every
# case is refused by main.py's checks (arguments.validate), which a launch runs first: the others are asked of
# them in this process.
LAUNCHED = ("bad flag", "tokenizer larger than the model")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_line_and_loses_nothing(case, tmp_path, suite, monkeypatch):
    if case == "no gpu" and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    flags, message = BAD_INPUTS[case]
    write_bad_inputs(tmp_path)
    out = tmp_path / "previous"  # results of an earlier run must survive
    out.mkdir()
    (out / "summary.json").write_bytes((suite[0] / "summary.json").read_bytes())
    before = digest(out)
    args = ["main.py", "--model", "tiny", "--device", "cpu", "--max_steps", "1", "--output_dir", str(out)]
    args += [f.format(tmp=tmp_path) for f in flags]
    if case in LAUNCHED:
        proc = run_script(args, nproc=None, timeout=120)
        assert proc.returncode == 2, (case, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as launched: a name that is no preset is not asked of the Hub
        lines = [refusal(arguments.validate, args[1:])]
    assert len(lines) == 1 and lines[0] is not None and lines[0].startswith("error: ") and message in lines[0], \
        (case, lines)
    assert digest(out) == before


def test_a_failed_background_thread_fails_its_variant_in_one_line(tmp_path):
    """The memory tracker's thread raising mid-run: the variant fails with that reason, the others run,
    and no traceback is printed while the run goes on without it."""
    proc = run_script(["main.py", *SHORT, "--max_steps", "6", "--variants", f"{FIXED},accelerate",
                       "--inject_failure", f"{FIXED}:2:0:thread", "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 1
    reason = "rank 0: the memory tracker thread failed: RuntimeError: injected failure at step 2 on rank 0"
    assert statuses(tmp_path) == {FIXED: f"failed: {reason}", "accelerate": "ok"}
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("spec, sweep, message", [
    ("accelerate:0:2", [], "rank 2 is not among the 2 ranks played: 0, 1"),
    ("accelerate:0:12", ["--simulate_world_size", "16", "--simulate_rank", ",".join(map(str, range(10)))],
     "rank 12 is not among the 10 ranks played: 0, 1, 2, 3, 4, 5, 6, 7, ..."),
    ("accelerate:12:0", [], "step 12 is not among this run's steps 0..11"),
    ("accelerate:0:0:kill", [], "accelerate is not among --variants"),
])
def test_a_failure_that_would_never_fire_is_refused(monkeypatch, tmp_path, spec, sweep, message):
    """Checked as rank 0 of a 2-rank launch checks it (its launcher's variables), in this process; that a refusal
    under torchrun is said once, by rank 0, is test_bad_input_under_torchrun_stops_every_rank_with_one_line. A list
    of ranks cut short says so."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    variants = "accelerate" if "among --variants" not in message else "torch_optimizer_after_fsdp"
    line = refusal(arguments.validate, [*TINY, "--variants", variants, "--inject_failure", spec, *sweep,
                                        "--output_dir", str(tmp_path / "out")])
    assert line == f"error: --inject_failure {spec.rsplit(':kill', 1)[0]}: {message}", line
    assert not (tmp_path / "out").exists()


def test_bad_input_under_torchrun_stops_every_rank_with_one_line(tmp_path):
    """Every rank refuses the command line; rank 0 alone says it, once, and nothing is written."""
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--variants", "nope",
                       "--output_dir", str(tmp_path / "out")])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --variants: unknown name(s) nope"), proc.stderr
    assert not (tmp_path / "out").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_give_the_losses_of_one_node_with_two_processes(tmp_path, suite):
    out = tmp_path / "two_nodes"
    port = free_port()
    agents = [start_script(["main.py", *TINY, "--output_dir", str(out)],
                           launcher=["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--rdzv-backend=c10d",
                                     f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fsdp2bench-test"])
              for node in (0, 1)]
    for agent in agents:
        agent.communicate(timeout=300)
        assert agent.returncode == 0
    one_node = load(suite[0] / "summary.json")
    two_nodes = load(out / "summary.json")
    assert two_nodes["meta"]["world_size"] == 2
    for name in VARIANTS:
        assert two_nodes["variants"][name]["losses"] == one_node["variants"][name]["losses"]


def test_variants_run_together_from_the_fork_server_give_the_numbers_of_the_sequential_run(tmp_path, suite):
    """With CUDA the children come from a fork server (starting.child_context), not from the main
    process; --concurrent_variants runs several at once. Neither may change what a variant measures."""
    proc = run_script(["main.py", *TINY, "--variants", "torch_optimizer_after_fsdp,accelerate",
                       "--concurrent_variants", "2", "--output_dir", str(tmp_path)],
                      FSDP2_BENCH_START_METHOD="forkserver")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[torch_optimizer_after_fsdp, accelerate] 12 steps on 2 ranks..." in proc.stdout
    sequential = load(suite[0] / "summary.json")["variants"]
    together = load(tmp_path / "summary.json")["variants"]
    assert set(together) == {"torch_optimizer_after_fsdp", "accelerate"}
    for name, v in together.items():
        assert v["losses"] == sequential[name]["losses"]
        assert v["accounting"] == sequential[name]["accounting"]
    # both children ran at the same time: each started before the other finished
    traces = [load(tmp_path / f"{name}_memory_usage.json") for name in together]
    ends = [t["started_at"] + t["events"][-1]["t"] for t in traces]
    assert traces[0]["started_at"] < ends[1] and traces[1]["started_at"] < ends[0]
    # one of the two drew the rank's weights while the other waited for them, whichever came first
    for rank_file in ("memory_usage.json", "memory_usage_rank1.json"):
        sources = sorted(next(e["weights"] for e in load(tmp_path / f"{name}_{rank_file}")["events"]
                              if e["name"] == "model_built") for name in together)
        assert sources == ["drew", "mapped"]


def test_a_binary_dataset_is_read_as_its_bytes(tmp_path):
    data = tmp_path / "binary.bin"
    data.write_bytes(bytes(range(128, 256)) * 3)  # no byte of it is UTF-8 on its own
    proc = run_script(["main.py", *TINY, "--variants", "torch_optimizer_after_fsdp", "--dataset", str(data),
                       "--block_size", "64", "--output_dir", str(tmp_path / "out")], nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 384 bytes are 6 blocks of 64, 3 steps of batch 2; decoded as text, each byte would become 3.
    assert load(tmp_path / "out" / "summary.json")["variants"]["torch_optimizer_after_fsdp"]["steps"] == 3


def test_a_diverging_run_fails_its_checks_and_names_the_cause(diverged, tmp_path):
    out, proc = diverged  # exit code 1
    tmp_path = tmp_path / "out"
    shutil.copytree(out, tmp_path)  # visualize.py draws beside the copy
    checks = load(tmp_path / "summary.json")["checks"]
    assert checks["losses_finite"]["ok"] is False
    assert checks["losses_finite"]["first_non_finite_step"] == {"torch_optimizer_before_fsdp_fixed": 1}
    assert checks["intended_losses_match"]["ok"] is False
    assert checks["intended_variants_trained"]["ok"] is False
    assert "check losses_finite: FAIL" in proc.stdout
    # strict JSON, which any reader takes: the diverged losses are null, not a bare NaN
    def refuse(constant):
        raise ValueError(f"{constant} in a JSON file")
    for path in [tmp_path / "summary.json", tmp_path / f"{FIXED}_memory_usage.json"]:
        data = json.loads(path.read_text(), parse_constant=refuse)
        losses = data["variants"][FIXED]["losses"] if "variants" in data else \
            [s["loss"] for s in data["steps"]]
        assert math.isfinite(losses[0]) and losses[1] is None
    assert run_script(["visualize.py", "--dir", str(tmp_path)], nproc=None).returncode == 0


def test_an_interrupt_that_reaches_one_rank_only_ends_every_rank_with_the_summary_written(tmp_path):
    proc = start_long_run(tmp_path)
    rank_processes(proc)[1].send_signal(signal.SIGINT)  # Ctrl-C on one node of a multi-node run
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    # rank 0 got the launcher's SIGTERM once rank 1 had ended: it names the signal that began it, and where
    said = [line for line in stderr.splitlines() if line.startswith("Interrupted")]
    assert said == [f"Interrupted (SIGINT to rank 1) during accelerate; 1 finished variant and the partial traces "
                    f"of the interrupted are in {tmp_path}/"], stderr
    assert statuses(tmp_path) == {"torch_optimizer_after_fsdp": "ok", "accelerate": "interrupted"}
    assert load(tmp_path / "accelerate_memory_usage.json")["status"] == "interrupted"


def test_a_second_signal_during_shutdown_adds_nothing(tmp_path):
    proc = start_script(["main.py", *TINY, "--max_steps", "400", "--variants", "torch_optimizer_after_fsdp",
                         "--output_dir", str(tmp_path)], nproc=None)
    for line in proc.stdout:
        if line.startswith("[torch_optimizer_after_fsdp]"):
            break
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert len(stderr.strip().splitlines()) == 1 and "Interrupted (SIGINT) during" in stderr, stderr
    assert "Exception ignored" not in stderr and "Traceback" not in stderr
    assert statuses(tmp_path) == {"torch_optimizer_after_fsdp": "interrupted"}


# A sitecustomize, first on PYTHONPATH, so that it runs as every process of a launch starts: a finalizer that the
# interpreter runs as main.py's ranks end (weakref.finalize's exit hook, which runs torch's own Library finalizers
# too), in which rank R (of {plan}: R -> (the signal it sends itself, or none, and how long it then waits)) marks
# that it began and, where nothing ended it meanwhile, that its wait ran out.
IN_TEARDOWN = """import os, signal, sys, time, weakref
def _in_teardown(plan, marks):
    rank = os.environ.get("RANK", "0")
    if not (sys.argv[0].endswith("main.py") and rank in plan):
        return
    name, wait_s = plan[rank]
    open(os.path.join(marks, "began_" + rank), "w").close()
    if name:
        os.kill(os.getpid(), getattr(signal, name))
    time.sleep(wait_s)
    open(os.path.join(marks, "waited_" + rank), "w").close()
weakref.finalize(sys, _in_teardown, {plan!r}, {marks!r})
"""


def teardown_hook(tmp_path, plan: dict[str, tuple[str, float]]) -> tuple[str, object]:
    """The PYTHONPATH that runs ``IN_TEARDOWN`` with ``plan`` (before the session's own), and where it marks."""
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(IN_TEARDOWN.format(plan=plan, marks=str(marks)))
    return os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])), marks


def test_a_signal_as_a_finished_run_tears_down_ends_it_as_ctrl_c_does(tmp_path):
    """The run has written and printed everything, and a SIGTERM comes while its finalizers run: one line and exit
    code 130, as a Ctrl-C anywhere else gives, never Python's stack of the interrupt raised inside a finalizer (and
    the run's exit code 0 after it); what it wrote stays, the directory unlocked."""
    out = tmp_path / "out"
    path, marks = teardown_hook(tmp_path, {"0": ("SIGTERM", 30)})
    proc = run_script(["main.py", *SHORT, "--variants", FIXED, "--output_dir", str(out)], nproc=None,
                      PYTHONPATH=path)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["Interrupted (SIGTERM); what was written is whole, nothing more is"]
    assert sorted(p.name for p in marks.iterdir()) == ["began_0"]  # it ended there, in its finalizers
    assert f"visualize.py --dir {out}" in proc.stdout and statuses(out) == {FIXED: "ok"}
    assert not (out / ".fsdp2bench.lock").exists() and not list(out.glob("*.tmp*"))


def test_rank_1_stopped_by_torchrun_as_it_ends_after_rank_0_failed_its_checks_says_nothing(tmp_path):
    """Rank 0 fails its checks (a NaN injected: the loss diverges) and exits 1; torchrun then stops rank 1, which had
    ended its run and was tearing down, with SIGTERM: rank 1 ends at once, with no word (rank 0 said why), never
    with the interrupt's stack raised inside torch's finalizers. Rank 0 tears down slowly here (3 s), so that rank 1
    is in its finalizers when the launcher's signal comes."""
    out = tmp_path / "out"
    path, marks = teardown_hook(tmp_path, {"0": ("", 3), "1": ("", 60)})
    proc = run_script(["main.py", *SHORT, "--variants", FIXED, "--inject_failure", f"{FIXED}:1:0:nan",
                       "--output_dir", str(out)], PYTHONPATH=path)
    assert proc.returncode == 1, proc.stderr  # rank 0's
    assert "FAILED: " in proc.stderr and load(out / "summary.json")["checks"]["losses_finite"]["ok"] is False
    assert sorted(p.name for p in marks.iterdir()) == ["began_0", "began_1", "waited_0"]  # 1 stopped in its wait
    assert "Exception ignored" not in proc.stderr and "Interrupted" not in proc.stderr, proc.stderr
    assert not (out / ".fsdp2bench.lock").exists()


FINALIZER_SIGNALLED = """
import os, signal, time
from fsdp2bench.processes.isolation import Interrupted, catch_interrupts

catch_interrupts()


class SignalledWhileFinalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


SignalledWhileFinalized()
try:
    time.sleep(30)
    print("the interrupt was lost")
except Interrupted as exc:
    print(f"interrupted after the finalizer: {exc}")
"""


def test_a_signal_inside_a_finalizer_mid_run_interrupts_the_work_after_it_and_prints_nothing():
    """A finalizer (a ``__del__`` the garbage collector runs) where a signal lands: Python drops what the handler
    raises there, so it comes again once the finalizer is over, and the main process's work is interrupted as by
    any other signal; no stack of the dropped one."""
    proc = run_script(["-c", FINALIZER_SIGNALLED], nproc=None, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "interrupted after the finalizer: SIGTERM\n", "")


def test_a_killed_launcher_leaves_no_orphan_and_keeps_the_partial_traces(tmp_path):
    proc = start_long_run(tmp_path)
    family = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()  # kill -9 of the torchrun agent: nobody will tell its ranks to stop
    proc.communicate(timeout=30)
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert statuses(tmp_path) == {"torch_optimizer_after_fsdp": "ok", "accelerate": "interrupted"}
    for suffix in ("", "_rank1"):
        partial = load(tmp_path / f"accelerate_memory_usage{suffix}.json")
        assert partial["status"] == "interrupted" and 0 < len(partial["steps"]) < LONG_STEPS


def test_a_second_run_into_the_same_directory_is_refused_while_the_first_lives(tmp_path):
    lock = tmp_path / ".fsdp2bench.lock"
    lock.write_text(f"{socket.gethostname()} {os.getpid()} {psutil.Process().create_time():.2f}")  # this process
    args = ["main.py", *TINY, "--max_steps", "1", "--variants", VARIANTS[0], "--output_dir", str(tmp_path)]
    proc = run_script(args, nproc=None)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: --output_dir {tmp_path}: another run (process {os.getpid()} on "
                                   f"{socket.gethostname()}) is writing there; wait for it to end, choose another "
                                   f"directory, or remove {lock} if no run is writing there")
    assert not (tmp_path / "summary.json").exists()
    lock.write_text(f"{socket.gethostname()} 999999999")  # a run that is gone: its lock is taken over
    proc = run_script(args, nproc=None)
    assert proc.returncode == 0, proc.stderr
    assert not lock.exists()  # and released at the end


def test_a_variant_out_of_memory_beside_others_is_run_again_alone(tmp_path):
    proc = run_script(["main.py", *SHORT, "--variants", f"{VARIANTS[0]},{FIXED}", "--concurrent_variants", "2",
                       "--inject_failure", f"{FIXED}:2:0:oom", "--output_dir", str(tmp_path)])
    assert proc.returncode == 1  # the injection strikes again when it runs alone
    oom = "rank 0: out of memory (injected: Tried to allocate 1.00 GiB at step 2 on rank 0)"
    assert f"[{FIXED}] ran out of memory beside {VARIANTS[0]}; run again alone before it is reported ({oom})\n" \
           f"[{FIXED}] 6 steps on 2 ranks (again, alone)..." in proc.stdout
    assert f"Run again alone after running out of memory beside others (summary.json: rerun_alone_after): {FIXED};" \
        in " ".join(proc.stdout.split("\n"))
    summary = load(tmp_path / "summary.json")
    fixed, after = summary["variants"][FIXED], summary["variants"][VARIANTS[0]]
    assert fixed["status"].startswith("failed: rank 0: out of memory (injected")
    assert fixed["failure"][0]["failed_allocation_mib"] == 1024.0
    assert fixed["rerun_alone_after"].startswith("rank 0: out of memory (injected")
    assert after["status"] == "ok" and after["ran_beside"] == [FIXED]
    assert summary["meta"]["concurrent_variants"] == 2


def test_plain_python_children_from_the_fork_server_reach_the_store_and_train_every_step(tmp_path):
    """Plain ``python main.py`` is one rank; the fork server starts before that rank's launcher
    variables are set, and its children must still find the store (the GPU path).

    The fork server receives each tensor's storage as a file descriptor and takes at most 252: the README's
    plain run (1280 steps at one rank) failed there with "too many fds" while every run of the tests (12 steps)
    passed. The batches travel as one tensor: 300 steps train.

    The same run asks for a memory snapshot: on the CPU that is a warning, and no snapshot is written."""
    proc = run_script(["main.py", *TINY, "--max_steps", "300", "--variants", "torch_optimizer_after_fsdp",
                       "--save_memory_snapshot", "--output_dir", str(tmp_path)], nproc=None,
                      FSDP2_BENCH_START_METHOD="forkserver")
    assert proc.returncode == 0, proc.stderr[-3000:]
    variant = load(tmp_path / "summary.json")["variants"]["torch_optimizer_after_fsdp"]
    assert variant["status"] == "ok" and len(variant["losses"]) == 300
    assert "warning: --save_memory_snapshot needs CUDA" in proc.stdout
    assert not list(tmp_path.glob("*.pkl"))


# torch's message under a cap with other processes on the GPU (one H200, plan.py under 24 GiB)
TORCH_OOM = ("CUDA out of memory. Tried to allocate 5.29 GiB. GPU 0 has a total capacity of 139.80 GiB of which 48.09 "
             "GiB is free. Process 3551 has 24.21 GiB memory in use. Including non-PyTorch memory, this process has "
             "19.01 GiB memory in use. Process 3604 has 2.48 GiB memory in use. Process 3608 has 2.88 GiB memory in "
             "use. 23.49 GiB allowed; Of the allocated memory 14.94 GiB is allocated by PyTorch, and 3.57 GiB is "
             "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


ALONE_OOM = ("CUDA out of memory. Tried to allocate 5.29 GiB. GPU 0 has a total capacity of 139.80 GiB of which 48.09 "
             "GiB is free. 23.49 GiB allowed; Of the allocated memory 14.94 GiB is allocated by PyTorch, and 3.57 GiB "
             "is reserved by PyTorch but unallocated.")


@pytest.mark.parametrize("message", [TORCH_OOM, ALONE_OOM])
def test_an_out_of_memory_line_keeps_what_the_process_held(message):
    """The line is cut at 300 characters, where a list of the GPU's other processes can push out the limit and what
    the process held; they are kept, once, and read back."""
    import torch

    from fsdp2bench.processes.isolation import describe
    from measure import HELD_AT_FAILURE, failed_allocation_mib, gpu_free_mib, held_at_failure

    said = describe(torch.OutOfMemoryError(message))
    assert said.startswith("out of memory (CUDA out of memory. Tried to allocate 5.29 GiB.")
    assert said.count("allowed") == 1
    assert failed_allocation_mib(said) == 5.29 * 1024 and gpu_free_mib(said) == 48.09 * 1024
    assert held_at_failure(said) == {"allowed_mib": 23.49 * 1024, "allocated_by_pytorch_mib": 14.94 * 1024,
                                     "reserved_unallocated_mib": 3.57 * 1024}
    assert held_at_failure("rank 0: out of memory (injected)") == dict.fromkeys(HELD_AT_FAILURE)


def _signalled_in_its_first_moments(keys, stderr: str) -> None:
    """A child that gets SIGTERM before it could report anything, then starts its work."""
    from fsdp2bench.processes.isolation import Finisher, run_child

    sys.stderr = open(stderr, "w", buffering=1)  # where the test reads it (pytest's is not this child's)
    os.kill(os.getpid(), signal.SIGTERM)
    run_child(Finisher(keys, 0, lambda status, extra: {"status": status, **extra}), lambda store: None)


class _SignalsOnDelete:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)


def _swallows_its_signal(keys, stderr: str) -> None:
    """A child whose main thread gets SIGTERM inside a ``__del__``, where Python drops the exception, then works on
    (until the test's end, without the watcher thread)."""
    from fsdp2bench.processes.isolation import Finisher, run_child

    def work(store) -> None:
        _SignalsOnDelete()
        time.sleep(60)

    sys.stderr = open(stderr, "w", buffering=1)
    sys.unraisablehook = sys.__unraisablehook__  # Python's, which prints; pytest's keeps them for itself
    run_child(Finisher(keys, 0, lambda status, extra: {"status": status, **extra}), work)


@pytest.mark.parametrize("child", [_signalled_in_its_first_moments, _swallows_its_signal])
def test_a_signal_in_a_childs_first_moments_fails_it_naming_the_signal(monkeypatch, tmp_path, child):
    """A SIGTERM (or a terminal's SIGINT to the whole group) can reach a child before it can report one: it is
    held until it can, and the piece fails naming it, with no traceback. One its main thread drops (raised in a
    ``__del__``) ends it all the same."""
    import torch
    import torch.distributed as dist

    from fsdp2bench.processes import isolation

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setattr(isolation, "end_with_parent", lambda: None)  # not for the test process itself
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # catch_interrupts sets it: put back after
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    failures: list = []
    keys = isolation.StoreKeys(child.__name__)
    waiting = [0]
    try:
        isolation.catch_interrupts()  # the main process's handlers, which a forked child inherits
        isolation.run_queue([isolation.Piece(child, (keys, str(tmp_path / "stderr")), keys)],
                            lambda running: waiting.pop() if waiting else None, 0, store, torch.device("cpu"),
                            lambda i: None, lambda i, failure: failures.append(failure))
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert failures == ["rank 0: Interrupted: SIGTERM"] and "Traceback" not in (tmp_path / "stderr").read_text()


def test_a_cpu_run_counts_its_steps_activations_on_the_host(monkeypatch, tmp_path):
    """``--batch_size 65536`` of tiny on the CPU passed the host check (its logits alone, 16 GiB) and was killed by the
    kernel after 54 s: on a CPU a step's activations are host memory too (tiny at batch 4096 peaked at 6.99 GiB of
    RSS), so the check counts them by the planner's rule."""
    monkeypatch.setattr(concurrency, "host_memory_for_launch", lambda: 4 << 30)
    argv = [*TINY, "--output_dir", str(tmp_path / "out")]
    assert refusal(arguments.validate, [*argv, "--batch_size", "8"]) is None
    line = refusal(arguments.validate, [*argv, "--batch_size", "4096"])
    need = re.search(r"needs about ([0-9.]+) GiB of host memory .*, a step and the runtime\); 4.0 GiB are available",
                     line or "")
    assert need and 6.5 < float(need.group(1)) < 10.0, line  # the runtime (HOST_RUNTIME) on top
