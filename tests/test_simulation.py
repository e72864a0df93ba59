"""--simulate_world_size: one process plays one rank of N; a 2-process launch shares the sweep out."""

from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import TINY, VARIANTS, load, run_script, start_script

UNFIXED = "torch_optimizer_before_fsdp_not_fixed"
KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "stale_param_bytes")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """tiny (odd sizes: padding at every N > 1) at N = 5 and 8, ranks 0 and N - 1."""
    out = tmp_path_factory.mktemp("sweep")
    proc = run_script(["main.py", *TINY, "--max_steps", "3", "--simulate_world_size", "8,5",
                       "--simulate_rank", "0,last", "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def test_every_variant_rank_and_world_size_has_its_own_trace(sweep):
    out, proc = sweep
    for n, last in ((5, 4), (8, 7)):
        for name in VARIANTS:
            for rank, file in ((0, f"{name}_memory_usage.json"), (last, f"{name}_memory_usage_rank{last}.json")):
                trace = load(out / f"simulated_N{n}" / file)
                assert trace["status"] == "ok"
                assert (trace["meta"]["world_size"], trace["meta"]["rank"], trace["meta"]["simulated"]) == \
                    (n, rank, True)
                assert [s["loss"] for s in trace["steps"]] == [None] * 3  # no loss is reported as measured
    # The two processes of the launch shared the 16 runs.
    assert proc.stdout.count("[process 0]") == 8 and proc.stdout.count("[process 1]") == 8


def test_accounting_equals_the_sharding_rule_to_the_byte_for_every_rank_played(sweep):
    out, _ = sweep
    summary = load(out / "summary.json")
    assert summary["meta"]["simulated"]["world_sizes"] == [5, 8]
    assert summary["meta"]["world_size"] == 2  # the launch's own processes
    full_bytes = 4 * summary["meta"]["num_parameters"]
    for n, last in ((5, 4), (8, 7)):
        by_rank = summary["simulated"][str(n)]
        assert sorted(by_rank, key=int) == ["0", str(last)]
        for rank in (0, last):
            for name in VARIANTS:
                entry = by_rank[str(rank)][name]
                assert entry["label"] == f"simulated N={n}, rank {rank}" and entry["status"] == "ok"
                assert entry["accounting_matches_expected"] is True
                assert entry["accounting"] == entry["expected"]
                held = entry["accounting"][0]["before_zero_grad"]
                assert held["param_bytes"] == held["grad_bytes"] > 0
                assert held["param_bytes"] < full_bytes / n + 4096  # one padded shard, not the model
                assert held["stale_param_bytes"] == (full_bytes if name == UNFIXED else 0)
                assert (held["optimizer_state_bytes"] == 0) == (name == UNFIXED)
                assert "losses" not in entry
        # The last rank holds less AdamW state than rank 0 (its rows are padding), the same shards.
        first, final = (by_rank[str(r)]["torch_optimizer_after_fsdp"]["accounting"][0]["before_zero_grad"]
                        for r in (0, last))
        assert final["param_bytes"] == first["param_bytes"]
        assert final["optimizer_state_bytes"] < first["optimizer_state_bytes"]


def test_convergence_checks_are_skipped_not_passed(sweep):
    out, proc = sweep
    checks = load(out / "summary.json")["checks"]
    assert checks["accounting_matches_expected"] == {"ok": True, "mismatched": []}
    for key in ("intended_losses_match", "unfixed_did_not_train"):
        assert checks[key]["ok"] is None and "losses mean nothing" in checks[key]["skipped"]
        assert f"check {key}: SKIPPED" in proc.stdout
    assert checks["options_applied"] == {"ok": True, "mismatched": []}
    assert "PASS" not in proc.stdout.replace("check accounting_matches_expected: PASS", "").replace(
        "check options_applied: PASS", "")


def test_the_unfixed_state_exceeds_the_intended_one_from_the_smallest_n_where_the_rule_says_so(sweep):
    out, proc = sweep
    summary = load(out / "summary.json")
    # P + 2P/N against 4P/N: from N = 3 on, so at every simulated N here.
    assert summary["simulation_findings"]["unfixed_exceeds_intended_from_world_size"] == {"state_at_step_peak": 5}
    assert "state held at the step peak exceeds every intended variant's first at N = 5 of the simulated 5, 8; " \
        "by the sharding rule from N = 3 on." in " ".join(proc.stdout.split())  # folded at 120 columns
    assert "Simulated world sizes (tiny): one process played each rank shown" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 120  # the console's stated width


def test_a_last_rank_that_holds_the_bytes_of_rank_0_is_not_played_twice(tmp_path):
    # Every dimension of this model divides by 2: both ranks of N = 2 hold the same bytes.
    config = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "even").mkdir()
    (tmp_path / "even" / "config.json").write_text(json.dumps(config))
    proc = run_script(["main.py", "--model", str(tmp_path / "even"), "--device", "cpu", "--max_steps", "1",
                       "--simulate_world_size", "2", "--simulate_rank", "0,last",
                       "--variants", "torch_optimizer_after_fsdp", "--output_dir", str(tmp_path / "out")], nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "N=2: rank 1 holds the same bytes as rank 0; not played" in proc.stdout
    summary = load(tmp_path / "out" / "summary.json")
    assert list(summary["simulated"]["2"]) == ["0"]
    assert summary["meta"]["simulated"]["notes"] == ["N=2: rank 1 holds the same bytes as rank 0; not played"]


def test_visualize_draws_the_sweep_and_the_traces_of_one_world_size(sweep):
    out, _ = sweep
    proc = run_script(["visualize.py", "--dir", str(out)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    assert (out / "memory_vs_world_size.png").stat().st_size > 10_000
    assert f"visualize.py --dir {out / 'simulated_N8'}" in proc.stdout
    proc = run_script(["visualize.py", "--dir", str(out / "simulated_N8")], nproc=None)
    assert proc.returncode == 0, proc.stderr
    assert "skipped loss.png: losses of a simulated world size mean nothing" in proc.stdout
    assert not (out / "simulated_N8" / "loss.png").exists()


def test_sigterm_keeps_finished_runs_and_marks_the_interrupted_one(tmp_path):
    """The N = 4 run finished, the N = 8 one interrupted, the N = 16 one never started: each said as it is, and
    visualize.py's hints name only the world sizes with traces to draw."""
    proc = start_script(["main.py", *TINY, "--max_steps", "200", "--simulate_world_size", "4,8,16",
                         "--variants", "torch_optimizer_after_fsdp", "--output_dir", str(tmp_path)], nproc=None)
    for line in proc.stdout:  # the N = 4 run has ended once the N = 8 one starts
        if "(simulated N=8, rank 0)" in line:
            break
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    simulated = load(tmp_path / "summary.json")["simulated"]
    assert simulated["4"]["0"]["torch_optimizer_after_fsdp"]["status"] == "ok"
    assert simulated["8"]["0"]["torch_optimizer_after_fsdp"]["status"] == "interrupted"
    assert simulated["16"]["0"]["torch_optimizer_after_fsdp"]["status"] == "not run"
    partial = load(tmp_path / "simulated_N8" / "torch_optimizer_after_fsdp_memory_usage.json")
    assert partial["status"] == "interrupted" and 0 < len(partial["steps"]) < 200
    assert stderr.strip().splitlines() == [f"Interrupted (SIGTERM); 1 finished run and the partial traces of the "
                                           f"interrupted are in {tmp_path}/"], stderr
    drawn = run_script(["visualize.py", "--dir", str(tmp_path)], nproc=None)
    assert drawn.returncode == 0, drawn.stderr
    hints = [line.strip() for line in drawn.stdout.splitlines() if "visualize.py --dir" in line]
    assert hints == [f"python3 visualize.py --dir {tmp_path / f'simulated_N{n}'}" for n in (4, 8)]
    for hint in hints:  # each a command that works
        assert run_script(hint.split()[1:], nproc=None).returncode == 0


def test_runs_side_by_side_start_as_others_end_and_measure_what_they_measure_alone(sweep, tmp_path):
    """Three at a time from one process: every run still plays its rank alone and counts the same bytes."""
    out, _ = sweep
    proc = run_script(["main.py", *TINY, "--max_steps", "3", "--simulate_world_size", "8,5",
                       "--simulate_rank", "0,last", "--concurrent_variants", "3", "--output_dir", str(tmp_path)],
                      nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("[process 0]") == 16 and "FAILED" not in proc.stdout
    alone = load(out / "summary.json")["simulated"]
    together = load(tmp_path / "summary.json")["simulated"]
    assert together.keys() == alone.keys()
    for n, by_rank in alone.items():
        for rank, by_variant in by_rank.items():
            for name, entry in by_variant.items():
                assert together[n][rank][name]["status"] == "ok"
                assert together[n][rank][name]["accounting"] == entry["accounting"], (n, rank, name)


def test_a_sweep_on_a_gpu_packs_each_run_by_its_own_need(monkeypatch):
    """The 7B shape under tp2 on a GPU of 140 GiB and a host of 128: three runs at N = 8, five at N = 128,
    never more than the GPU together; the weights, mapped by every run, counted once on the host (each run
    drawing its own would leave room for four)."""
    import psutil

    from fsdp2bench.run import concurrency

    from fsdp2bench.memory import estimate
    from fsdp2bench.names import GIB
    from fsdp2bench.options.fsdp import OPTION_SETS
    from fsdp2bench.processes.simulation import SimulatedRun
    from fsdp2bench.run.session import model_facts

    class Host:
        total = available = 128 * GIB

    monkeypatch.setattr(concurrency, "gpu_memory", lambda: 140 * GIB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Host)
    facts, options = model_facts("qwen2.5-7b", 421), OPTION_SETS["tp2"]
    tokens = estimate.step_bytes(2, 128, facts.config, options)

    def room(shared: bool) -> concurrency.SweepRoom:
        return concurrency.sweep_room(facts.shapes, [8, 128], VARIANTS, "cpu", options, tokens, None, shared)

    def most_at(room: concurrency.SweepRoom, n: int) -> int:
        runs = [SimulatedRun(n, 0, "torch_optimizer_after_fsdp")] * 8
        return max(k for k in range(1, 9) if room.fits(runs[:k]))

    shared = room(True)
    assert (most_at(shared, 8), most_at(shared, 128)) == (3, 5)
    assert 5 * shared.needs[(128, "torch_optimizer_after_fsdp")][0] <= 140 * GIB
    assert shared.most == 5 and "the 140 GiB GPU" in shared.said()
    assert most_at(room(False), 128) == 4  # 30.5 GB of weights per process: the host holds four


def test_the_issue_runs_never_share_a_gpu_once_their_activations_are_counted(monkeypatch):
    """1.5B at batch 4 x 4096, simulated N = 8, on one H200: each run reserved about 89 GiB; an estimate of 36.4 GiB
    (the logits, not the activations) ran two side by side and one ran out of memory. By the planner's rule each
    needs more than half the GPU, and the line that says the choice says by which rule."""
    from fsdp2bench.memory import estimate
    from fsdp2bench.names import GIB
    from fsdp2bench.options.fsdp import OPTION_SETS
    from fsdp2bench.processes.simulation import SimulatedRun
    from fsdp2bench.run import concurrency
    from fsdp2bench.run.session import model_facts

    monkeypatch.setattr(concurrency, "gpu_memory", lambda: 140 * GIB)
    facts, options = model_facts("qwen2.5-1.5b", 421), OPTION_SETS["default"]
    names = ["torch_optimizer_after_fsdp", "accelerate"]
    tokens = estimate.step_bytes(4, 4096, facts.config, options)
    room = concurrency.sweep_room(facts.shapes, [8], names, "cpu", options, tokens, None, True)
    assert not room.fits([SimulatedRun(8, 0, name) for name in names]) and room.most == 1
    assert 89 * GIB < room.needs[(8, "accelerate")][0] < 100 * GIB
    assert f"{tokens / GIB:.1f} GiB of it the activations and logits of a step, by the planner's rule" in room.said()


def test_only_a_run_that_shared_the_gpu_is_run_again_alone_and_nothing_runs_beside_it():
    """The schedule of a sweep's share (in-process): two runs side by side, a third alone; the second runs out of
    memory (it shared the GPU: run again alone, first of those waiting, once none runs), the third too (alone:
    reported as it is)."""
    from fsdp2bench.processes.simulation import Share, SimulatedRun

    runs = [SimulatedRun(8, 0, name) for name in VARIANTS[:3]]
    share = Share(list(runs), lambda group: len(group) <= 2, [0, 1, 2])
    assert share.next_piece([]) == 0 and share.next_piece([0]) == 1 and share.next_piece([0, 1]) is None
    oom = "rank 0: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
    again = share.again_alone(1, oom)
    assert again == SimulatedRun(8, 0, VARIANTS[1], alone=True) and again.first == runs[1]
    assert again.keys.prefix != runs[1].keys.prefix  # its own keys: a piece's keys are used once
    assert share.next_piece([0]) is None  # it waits for the GPU to itself...
    assert share.next_piece([]) == 3 and share.next_piece([3]) is None  # ...and nothing starts beside it
    assert share.again_alone(3, oom) is None  # out of memory alone: its own failure
    assert share.next_piece([]) == 2 and share.again_alone(2, oom) is None
    assert share.again_alone(0, "rank 0: RuntimeError: boom") is None


def test_a_run_out_of_memory_beside_others_is_run_again_alone_before_it_is_reported(tmp_path):
    proc = run_script(["main.py", *TINY, "--max_steps", "2", "--simulate_world_size", "2", "--variants",
                       f"{VARIANTS[0]},{VARIANTS[2]}", "--concurrent_variants", "2", "--inject_failure",
                       f"{VARIANTS[2]}:1:0:oom", "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 1  # the injection strikes again when it runs alone
    oom = "rank 0: out of memory (injected: Tried to allocate 1.00 GiB at step 1 on rank 0)"
    assert (f"[process 0] {VARIANTS[2]} (simulated N=2, rank 0) ran out of memory beside other runs; run again alone "
            f"before it is reported ({oom})\n[process 0] {VARIANTS[2]} (simulated N=2, rank 0) again, alone\n"
            f"[process 0] {VARIANTS[2]} (simulated N=2, rank 0) FAILED: {oom}\n") in proc.stdout
    assert (f"Run again alone after running out of memory beside others (summary.json: rerun_alone_after): "
            f"{VARIANTS[2]} (N=2, rank 0)") in " ".join(proc.stdout.split("\n"))
    assert "The unfixed variant" not in proc.stdout  # it never ran: no finding about it
    runs = load(tmp_path / "summary.json")["simulated"]["2"]["0"]
    assert runs[VARIANTS[2]]["status"] == f"failed: {oom}" and runs[VARIANTS[2]]["rerun_alone_after"] == oom
    assert runs[VARIANTS[0]]["status"] == "ok" and "rerun_alone_after" not in runs[VARIANTS[0]]
    trace = load(tmp_path / "simulated_N2" / f"{VARIANTS[2]}_memory_usage.json")
    assert trace["status"] == "failed" and [s["step"] for s in trace["steps"]] == [0]
