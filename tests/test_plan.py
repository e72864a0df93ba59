"""What fits (plan.py): the search against probes with a known edge, the refusals, and a real CPU
plan of the tiny model whose probes run out of memory above a chosen batch."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import time
import types

import pytest
import torch
from conftest import child_running, load, refusal, run_script, start_script

import plan
from fsdp2bench.cli import OneLineParser, UserError, gpu_memory_gib
from fsdp2bench.memory import estimate
from fsdp2bench.names import MIB, VARIANTS, counted
from fsdp2bench.plan import checks, report as plan_report, search as plan_search
from fsdp2bench.plan.probes import BLOCKS_FREE, ProbeRunner, Question
from fsdp2bench.plan.room import ROOM_MARGIN
from fsdp2bench.plan.search import Outcome, Search, run_searches
from fsdp2bench.run.session import model_facts

LIMIT = 24049.0  # MiB: a 24 GiB cap less the CUDA context, as on one H200
STATE, PER_SEQUENCE = 4800.0, 640.0  # MiB: a 1.5B rank's peak at batch 0 and what a sequence adds


def probes_with_edge(edge: int | None, upper: int = 4096, noise: float = 0.0):
    """A probe runner whose values fit up to ``edge`` (None: none fits), with linear peaks."""
    def run(wanted):
        return {(key, v): Outcome(v, edge is not None and v <= edge, STATE + PER_SEQUENCE * v + noise * (v % 3))
                for key, v in wanted}
    return run


def answer(search: Search, run) -> dict:
    rounds = run_searches({"q": search}, run)
    assert rounds >= 1
    return search.answer()


@pytest.mark.parametrize("edge", [1, 2, 17, 29, 113, 4095])
def test_the_search_finds_the_edge_in_few_probes(edge):
    limit = STATE + PER_SEQUENCE * (edge + 0.5)  # the cap between the edge and the next value
    found = answer(Search(1, 4096, limit, PER_SEQUENCE * 1.1), probes_with_edge(edge))
    assert found["largest"] == edge and found["finished"]
    assert found["above"]["value"] == edge + 1 and not found["above"]["fits"]
    assert found["probes"] <= 6, found  # B = 1, the first aim (the slope 10% high), then the edge


def test_an_edge_at_the_upper_bound_says_so():
    found = answer(Search(1, 64, LIMIT, PER_SEQUENCE), probes_with_edge(10_000))
    assert found["largest"] == 64 and found["at_upper_bound"] and found["above"] is None


def test_nothing_fits_gives_none_and_the_smallest_peak_seen():
    found = answer(Search(1, 4096, LIMIT, PER_SEQUENCE), probes_with_edge(None))
    assert found["largest"] is None and found["probes"] == 1
    assert found["smallest_peak_mib"] == STATE + PER_SEQUENCE


@pytest.mark.parametrize("edge", [1, 5, 77, 300])
def test_without_peaks_the_search_doubles_then_halves(edge):
    def run(wanted):  # a CPU run: no allocator, fits or out of memory only
        return {(key, v): Outcome(v, v <= edge) for key, v in wanted}
    found = answer(Search(1, 4096), run)
    assert found["largest"] == edge and found["above"]["value"] == edge + 1
    assert found["probes"] <= 2 * (edge.bit_length() + 1)


def test_a_fit_above_a_failure_does_not_move_the_edge():
    """Near the cap the allocator's packing can let 69 fit where 68 did not: the edge is 68's."""
    search = Search(1, 4096)
    for value, fits in [(1, True), (62, True), (69, True), (68, False)]:
        search.record(Outcome(value, fits))
    assert search.largest_fit == 62 and search.fits_above_edge == [69]
    assert all(62 < v < 68 for v in search.next_values())


def test_a_probe_failing_for_another_reason_ends_its_search_with_that_reason():
    searches = {"a": Search(1, 8), "b": Search(1, 8)}
    run_searches(searches, lambda wanted: {(k, v): ("a: ValueError: boom" if k == "a" else Outcome(v, v <= 3))
                                           for k, v in wanted})
    assert searches["a"].error == "a: ValueError: boom" and searches["b"].answer()["largest"] == 3


def test_finished_searches_aim_the_others_with_the_edge_they_found():
    done, waiting = Search(1, 4096, LIMIT, PER_SEQUENCE, 74.0, 1.5), Search(1, 4096, LIMIT, PER_SEQUENCE, 74.0, 1.5)
    for value, fits in [(1, True), (28, True), (29, True), (30, False)]:
        done.record(Outcome(value, fits, STATE + PER_SEQUENCE * value))
    plan_search.aim_with_edges({"a": done, "b": waiting})
    assert done.done and waiting.blocks_free == plan_search.edge_blocks_free(done) != 1.5


BEND = 2400.0  # MiB: AdamW's transients, the peak of a small batch (the line through batch 1 bends)
BLOCK = 74.0  # MiB: one sequence's fp32 logits, the largest block of a step


def gpu_rank(limit: float, blocks_free: float, quirk: int | None = None):
    """A simulated rank under a cap: its peak allocated bends at small batches; a value fits while its peak
    leaves ``blocks_free`` of its largest block free under ``limit``, except ``quirk``, which fits above the edge
    (the allocator's packing: a reserved peak that is not monotone)."""
    def peak(v: int) -> float:
        return STATE + max(BEND, PER_SEQUENCE * v)

    def fits(v: int) -> bool:
        return v == quirk or peak(v) + blocks_free * BLOCK * v <= limit
    return peak, fits


def shared_then_fresh(limit: float, blocks_free: float, quirk: int | None = None, variants: int = 1) -> list[Search]:
    """plan.py's order for the ``variants`` answers of one option set and N: a shared process's ladder for the
    first (under its own lower limit), fresh probes aimed by its line, then the other variants' fresh probes
    from the edge it found."""
    peak, fits = gpu_rank(limit, blocks_free, quirk)
    ladder = plan_search.Ladder(1, 4096, plan_search.SHARED_LIMIT * limit, PER_SEQUENCE * 1.1,
                            free_mib=BLOCK * BLOCKS_FREE)  # as plan.py's (ProbeRunner.ladder)
    points = []
    while (value := ladder.next_value(points)) is not None:
        assert peak(value) <= plan_search.SHARED_LIMIT * limit, "a shared process's values stay under its own limit"
        points.append((value, peak(value)))
    assert len(points) == 3 and points[-1][1] > 0.5 * limit  # batch 1, then two far above it
    searches = {i: Search(1, 4096, limit, PER_SEQUENCE * 1.1, BLOCK, BLOCKS_FREE) for i in range(variants)}
    searches[0].take_shared_values([Outcome(v, True, y) for v, y in points])
    run_searches(searches, lambda wanted: {(k, v): Outcome(v, fits(v), peak(v)) for k, v in wanted},
                 leaders={i: (0, 0) for i in range(1, variants)})
    return list(searches.values())


@pytest.mark.parametrize("limit", [24049.0, 40433.0, 81393.0])
def test_a_shared_line_aims_the_fresh_probes_at_the_edge(limit):
    """The probes confirm each edge from both sides, at most 3 fresh ones per answer on average over an option
    set's two variants at one N, across edges that leave the blocks a search starts from free, fewer, or more
    (0.4-1.5: what the 1.5B model's left on one H200); the second variant takes two."""
    counts = []
    for blocks_free in (0.4, 0.7, 1.0, 1.2, 1.5):
        peak, fits = gpu_rank(limit, blocks_free)
        edge = max(v for v in range(1, 4096) if fits(v))
        searches = shared_then_fresh(limit, blocks_free, variants=2)
        for found in (search.answer() for search in searches):
            assert found["largest"] == edge and found["above"]["value"] == edge + 1 and not found["above"]["fits"]
        counts += [search.answer()["probes"] for search in searches]
        assert counts[-1] == 2, counts  # the follower starts at the edge
    assert sum(counts) / len(counts) <= 3, counts


@pytest.mark.parametrize("offset, probes", [(0, 2), (1, 2), (-1, 3), (2, 3), (-2, 4), (3, 5), (-3, 6)])
def test_a_follower_searches_outward_from_its_leaders_edge(offset, probes):
    """Another variant starts one above where the first found its edge (its own edge lay there or one above in
    the committed plans: either takes two probes), then steps outward from that pair: one, another of one, then
    twice as far each time, then halves."""
    edge = 40
    leader, follower = Search(1, 4096), Search(1, 4096)
    for value, fits in [(edge, True), (edge + 1, False)]:
        leader.record(Outcome(value, fits))
    searches = {"lead": leader, "follow": follower}
    run_searches(searches, lambda wanted: {(k, v): Outcome(v, v <= edge + offset) for k, v in wanted},
                 leaders={"follow": ("lead", 0)})
    found = follower.answer()
    assert found["largest"] == edge + offset and found["started_at"] == edge and found["probes"] == probes


def test_a_follower_whose_leader_failed_searches_on_its_own():
    leader, follower = Search(1, 64), Search(1, 64)
    leader.stop("lead: ValueError: boom")
    run_searches({"lead": leader, "follow": follower}, lambda wanted: {(k, v): Outcome(v, v <= 9) for k, v in wanted},
                 leaders={"follow": ("lead", 0)})
    assert follower.answer()["largest"] == 9 and follower.answer()["started_at"] is None


def test_a_followers_probe_gets_the_room_its_leaders_line_predicts():
    """A follower has no shared process: the GPU room of its probes, near its leader's edge, comes from the
    leader's line (the memory model's estimate without it was a third of what they held under 80 GiB)."""
    cap = estimate.GpuCap(24.0, 140 * 1024 * MIB, 527 * MIB)
    keys = [("default", 8, variant, 128) for variant in ("torch_optimizer_after_fsdp", "accelerate")]
    searches = {key: Search(1, 4096, LIMIT, PER_SEQUENCE, BLOCK, BLOCKS_FREE) for key in keys}
    searches[keys[0]].take_shared_values([Outcome(v, True, STATE + PER_SEQUENCE * v) for v in (1, 8, 20)])
    session = types.SimpleNamespace(device=torch.device("cuda", 0))
    questions = {key: Question(key[0], key[1], 0, key[2], "batch_size", key[3]) for key in keys}
    runner = ProbeRunner(session, None, None, questions, searches, cap, "unused", leaders={keys[1]: (keys[0], 0)})
    expected = int((STATE + PER_SEQUENCE * 15) * MIB * ROOM_MARGIN) + cap.context
    assert runner.gpu.probe_room(keys[1], 15) == runner.gpu.probe_room(keys[0], 15) == expected < cap.process_bytes
    # Within NEAR_CAP_RESERVED of the cap (25: 20,800 MiB on the line), reserved may reach it: the whole cap
    assert runner.gpu.probe_room(keys[1], 25) == runner.gpu.probe_room(keys[0], 25) == cap.process_bytes


def test_a_fit_above_the_edge_of_a_shared_line_is_listed_and_the_edge_is_a_fresh_pair():
    """A reserved peak that is not monotone: a value above the first failure may fit. The answer is always a
    fit and a failure one above it, both probed; a fit above a failure it saw is listed, and never the edge."""
    limit, blocks_free = 24049.0, 0.7
    edge = max(v for v in range(1, 4096) if gpu_rank(limit, blocks_free)[1](v))
    for quirk in (edge + 2, edge + 3):
        search, = shared_then_fresh(limit, blocks_free, quirk=quirk)
        found, failed = search.answer(), [o.value for o in search.outcomes if not o.fits]
        assert found["above"]["value"] == found["largest"] + 1 and not found["above"]["fits"]
        assert found["largest"] == (edge if edge + 1 in failed or quirk not in [o.value for o in search.outcomes]
                                    else quirk)
        assert all(v > min(failed) for v in found["fits_above_edge"])


@pytest.mark.parametrize("edge", [1, 3, 5, 40, 100])
def test_without_peaks_the_fresh_probes_start_inside_the_edge_a_shared_process_met(edge):
    """On a CPU run the shared process doubles until a value fails; the fresh probes search that bracket."""
    ladder, points = plan_search.Ladder(1, 4096, None, None, inject_oom_above=edge), []
    while (value := ladder.next_value(points)) is not None and value <= edge:
        points.append((value, None))
    search = Search(1, 4096)
    search.take_shared_values([Outcome(v, True) for v, _ in points] + ([Outcome(value, False)] if value else []))
    run_searches({"q": search}, lambda wanted: {(k, v): Outcome(v, v <= edge) for k, v in wanted})
    found = search.answer()
    assert found["largest"] == edge and found["above"]["value"] == edge + 1
    assert found["probes"] <= max(2, edge.bit_length() + 1), [o.value for o in search.outcomes]


@pytest.mark.parametrize("argv, message", [
    (["--sets", "nonesuch"], "--sets: unknown option set"),
    (["--find", "block_size", "--block_size", "128,256"], "--find block_size takes one value"),
    (["--world_size", "0"], "--world_size: every N must be at least 1"),
    (["--world_size", "8,x"], "--world_size: expected comma-separated integers"),
    (["--world_size", "70000"], "more than the 65536 ranks"),
    (["--world_size", "4", "--sets", "hsdp"], "none can run at --world_size 4"),
    (["--gpu_memory", "24"], "--gpu_memory needs a GPU"),
    (["--gpu_memory", "nan"], "--gpu_memory must be in"),
    (["--gpu_memory", "inf"], "--gpu_memory must be in"),
    (["--gpu_memory", "-1"], "--gpu_memory must be in"),
    (["--variants", "nonesuch"], "--variants"),
    (["--batch_size", "4"], "--batch_size is not read by --find batch_size: the fixed batch of --find block_size"),
    (["--find", "block_size", "--block_size", "128", "--upper_bound", "64"], "below --block_size 128"),
    (["--find", "block_size", "--upper_bound", "100000"], "exceeds the model's"),
    (["--find", "block_size", "--block_size", "130", "--upper_bound", "150"], "holds no multiple of 64 tokens"),
    (["--block_size", "1"], "--block_size must be in"),
    (["--upper_bound", "0"], "--upper_bound must be in"),
    (["--emulate_communication", "0,50"], "0,50: within_gbps must be in "),
    (["--world_size", "12", "--emulate_communication"], "nodes of 8 GPUs do not make up N = 12"),
])
def test_bad_input_is_refused_before_any_probe(argv, message, tmp_path):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("+", r"\+")):
        plan.validate(["--device", "cpu", "--output_dir", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, what", [
    (["--world_size", "2,8", "--sets", "default,all"], r"one probe \((default|all) at N = 2, "),
    (["--find", "layout", "--world_size", "2", "--global_batch", "4"], r"the lightest candidate's timing \(N = 2: "),
])
def test_a_plan_the_host_cannot_hold_is_refused_with_the_figure(monkeypatch, tmp_path, argv, what):
    """The 7B shape on a 24 GiB CPU host had its first probe killed by the kernel after 109 s, and the layout search
    ended with every timing refused and "raise --max_timings": each probe's or timing's process (the model built on
    the host, its state, the runtime) must fit the host's memory, else one line says both figures."""
    argv = ["--device", "cpu", *argv, "--output_dir", str(tmp_path / "out")]
    assert refusal(plan.validate, argv) is None
    monkeypatch.setattr(checks, "host_memory_for_launch", lambda: 256 * MIB)
    line = refusal(plan.validate, argv)
    need = re.search(rf"needs about ([0-9.]+) GiB of host memory for {what}", line or "")
    assert need and float(need.group(1)) > 0.25 and "0.2 GiB are available" in line, line
    assert not (tmp_path / "out").exists()


def test_a_cpu_plan_sets_a_probe_up_ahead_only_where_the_host_holds_two(monkeypatch):
    from fsdp2bench.plan import room
    from fsdp2bench.plan.probes import BATCH, Probe, ProbeRunner, Question

    monkeypatch.setattr(room, "host_bytes", lambda *args: 2 << 30)
    session = types.SimpleNamespace(device=torch.device("cpu"), shapes=None)
    runner = ProbeRunner(session, types.SimpleNamespace(init_device="cpu", build_threads=32), None, {}, {}, None, "")
    question = Question("default", 8, 0, "torch_optimizer_after_fsdp", BATCH, 128)
    stepping = Probe(question_key="k", question=question, value=4, room=0, setup_bytes=0)
    ahead = Probe(question_key="k", question=question, value=None, room=0, setup_bytes=0, ahead=True)
    for host_gib, starts in ((3, False), (5, True)):
        monkeypatch.setattr(room, "host_memory_for_launch", lambda: host_gib << 30)
        assert runner.gpu.may_start(ahead, [stepping]) is starts


@pytest.mark.parametrize("argv, reason", [
    (["--sets", "cp2"], "cp2: --cp_size 2: context parallelism does not run on the CPU"),
    (["--sets", "cp2,tp4", "--world_size", "4"], "tp4: --tp_size 4 does not divide"),
])
def test_a_plan_of_sets_none_of_which_can_run_names_each_ones_reason(argv, reason, tmp_path):
    """The reason is the CPU, or the model's heads: not the world size."""
    with pytest.raises(UserError, match=f"--sets [^:]*: none can be planned here: .*{reason}") as refused:
        plan.validate(["--device", "cpu", "--output_dir", str(tmp_path / "out"), *argv])
    assert "none can run at --world_size" not in str(refused.value)


def test_findings_without_the_default_planned_and_on_a_cpu_say_so():
    answer = {"option_set": "tp2", "world_size": 8, "fixed": 128, "variant": "v", "searched": "batch_size",
              "error": None, "finished": True, "largest": 4, "tokens_per_rank_per_step": 512,
              "fit": {"median_step_time_s": 0.5}, "smallest_peak_mib": 100.0}
    said, = plan_report.findings([answer], "v", "cpu")
    assert "the default was not planned; tp2 fits the most" in said and "fits nothing" not in said
    default = {**answer, "option_set": "default", "largest": 2, "tokens_per_rank_per_step": 256}
    said, = plan_report.findings([default, answer], "v", "cpu")
    assert "share the CPU's cores" in said and "GPU" not in said


def test_a_cpu_plan_says_first_that_it_has_no_cap_and_stops_soon(tmp_path):
    proc = run_script(["plan.py", "--device", "cpu", "--world_size", "2", "--sets", "default", "--variants",
                       "torch_optimizer_after_fsdp", "--output_dir", str(tmp_path / "out")], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert said.startswith("A CPU plan has no memory cap")
    assert "A real answer needs a GPU: the same command there" in said
    refused = run_script(["plan.py", "--device", "cpu", "--world_size", "2", "--peft", "lora", "--lora_targets", "foo",
                          "--output_dir", str(tmp_path / "refused")], nproc=None)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout  # the refusal is the one line
    answer, = load(tmp_path / "out" / "plan.json")["answers"]
    upper = load(tmp_path / "out" / "plan.json")["meta"]["upper_bound"]
    assert answer["largest"] == checks.CPU_UPPER["batch_size"] == upper


@pytest.mark.parametrize("gib, total, message", [
    (200, 139.8, "more than this GPU's 139.8 GiB"),
    (0.5, 139.8, "under the 527 MiB that a process's CUDA context holds"),
    (None, 0.6, r"--gpu_memory 0.6: under the 527 MiB"),  # the default, the whole GPU, said by its size
])
def test_a_cap_the_gpu_cannot_make_real_is_refused(monkeypatch, gib, total, message):
    monkeypatch.setattr(estimate, "measure_gpu", lambda index: (int(total * 1024 * MIB), 527 * MIB))
    with pytest.raises(UserError, match=message):
        estimate.gpu_cap(gib, 0)


def test_a_cap_becomes_the_allocator_limit_less_the_context(monkeypatch):
    monkeypatch.setattr(estimate, "measure_gpu", lambda index: (int(139.8 * 1024 * MIB), 527 * MIB))
    cap = estimate.gpu_cap(24, 0)
    assert cap.allocator_bytes == 24 * 1024 * MIB - 527 * MIB
    assert estimate.gpu_cap(None, 0).process_bytes == int(139.8 * 1024 * MIB)


H100 = 85_031_714_816  # bytes, as torch reports an 80 GB H100: 79.2 GiB
GPU_MEMORY_REFUSED = ("error: --gpu_memory must be in [0.001, 1048576] GiB, written as 80GB (10^9 bytes), 80GiB or "
                      "80 (GiB): got {!r}")


@pytest.mark.parametrize("text, process_bytes", [
    ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("80 GB", 80 * 10**9), ("7.5e1 GB", 75 * 10**9),
    ("24GiB", 24 * 2**30), ("24 GiB", 24 * 2**30), ("24gib", 24 * 2**30), ("24", 24 * 2**30), ("2.5", 5 * 2**29),
])
def test_gpu_memory_takes_the_size_a_user_thinks_in(monkeypatch, text, process_bytes):
    """Both parsers read it alike, and the cap made of it on an H100 is that many bytes."""
    from fsdp2bench.run import arguments

    gib = checks.parse_args(["--gpu_memory", text])[0].gpu_memory
    assert gib == arguments.parse_args(["--gpu_memory", text]).gpu_memory
    monkeypatch.setattr(estimate, "measure_gpu", lambda index: (H100, 527 * MIB))
    cap = estimate.gpu_cap(gib, 0)
    assert abs(cap.process_bytes - process_bytes) <= 1 and cap.said() is None


@pytest.mark.parametrize("text", ["80XB", "80G", "nan", "inf", "-1", "0", "1e30", "", "GB", "nan GB", "80 GB GB"])
def test_a_bad_gpu_memory_gets_the_same_line_from_every_script(text, tmp_path):
    import speed
    from fsdp2bench.run import arguments

    out = ["--output_dir", str(tmp_path / "out")]
    said = {refusal(plan.validate, ["--device", "cpu", *out, "--gpu_memory", text]),
            refusal(arguments.validate, ["--device", "cpu", "--model", "tiny", *out, "--gpu_memory", text]),
            refusal(speed.validate, ["--nproc_per_node", "1", *out, "--", "--gpu_memory", text])}
    assert said == {GPU_MEMORY_REFUSED.format(text)}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["main.py", "plan.py"])
def test_a_launch_with_a_bad_gpu_memory_ends_in_one_line(script, tmp_path):
    proc = run_script([script, "--device", "cpu", "--gpu_memory", "80XB", "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [GPU_MEMORY_REFUSED.format("80XB")], \
        proc.stderr


@pytest.mark.parametrize("gib, total, cap_gib, said", [
    (80, H100, H100 / 2**30, "--gpu_memory 80 GiB is taken for this card's nominal size: it reports 79.2 GiB, the "
                             "cap here (cards report up to 8% under their nominal size)"),
    (85, H100, H100 / 2**30, "--gpu_memory 85 GiB is taken for this card's nominal size: it reports 79.2 GiB"),
    (80e9 / 2**30, H100, 80e9 / 2**30, None),  # 80GB: 74.5 GiB, under the card
    (79.1, H100, 79.1, None),  # what the refusal of a larger cap offers
    (141, 150_100_000_000, 150_100_000_000 / 2**30, "--gpu_memory 141 GiB is taken for this card's nominal size: "
                                                    "it reports 139.8 GiB"),  # a 141 GB H200
])
def test_a_cap_at_the_cards_nominal_size_is_the_card_said_in_one_line(monkeypatch, gib, total, cap_gib, said):
    monkeypatch.setattr(estimate, "measure_gpu", lambda index: (total, 527 * MIB))
    cap = estimate.gpu_cap(gib, 0)
    assert cap.gib == cap_gib and cap.process_bytes <= total
    assert cap.said() is None if said is None else cap.said().startswith(said)
    assert cap.as_dict()["asked_gib"] == (None if said is None else gib)


def test_a_cap_beyond_the_card_says_what_this_card_can_do(monkeypatch):
    monkeypatch.setattr(estimate, "measure_gpu", lambda index: (H100, 527 * MIB))
    with pytest.raises(UserError) as refused:
        estimate.gpu_cap(141, 0)
    assert str(refused.value) == ("--gpu_memory 141 GiB: more than this GPU's 79.2 GiB (a cap is made real on a GPU "
                                  "at least as large): leave --gpu_memory out to run at this GPU's own 79.2 GiB, or "
                                  "pass --gpu_memory 79.1 or less")


def test_a_printed_command_names_the_cap_only_where_it_is_less_than_the_gpu(monkeypatch):
    """The layout search's check and timings: the whole GPU is no flag (on the user's card, that card), a smaller
    cap its size in GiB, which reads back to the same bytes."""
    monkeypatch.setattr(estimate, "measure_gpu", lambda index: (H100, 527 * MIB))
    assert estimate.gpu_cap(None, 0).flags() == estimate.gpu_cap(80, 0).flags() == []
    flags = estimate.gpu_cap(gpu_memory_gib("80GB"), 0).flags()
    assert flags == ["--gpu_memory", "74.5058"]
    assert estimate.gpu_cap(gpu_memory_gib(flags[1]), 0).process_bytes == pytest.approx(80e9, rel=1e-6)


def test_a_launch_with_a_bad_flag_ends_in_one_line(tmp_path):
    proc = run_script(["plan.py", "--device", "cpu", "--world_size", "0", "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == \
        ["error: --world_size: every N must be at least 1, got 0"], proc.stderr


def test_a_cpu_plan_of_tiny_finds_the_injected_edge_and_draws_it(tmp_path):
    """With its communication emulated: each fresh probe that fits counts and prices its collectives (on a CPU
    nothing waits), the bytes the layout search's projection counts from the shapes."""
    from fsdp2bench.plan.layout.traffic import gathered_bytes

    out = tmp_path / "plan"
    proc = run_script(["plan.py", "--device", "cpu", "--world_size", "2,4", "--sets", "default,ac",
                       "--variants", "torch_optimizer_after_fsdp", "--inject_oom_above", "3",
                       "--emulate_communication", "300,25", "--output_dir", str(out)], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = load(out / "plan.json")
    assert len(result["answers"]) == 4 and result["meta"]["emulated_links"]["across_gbps"] == 25.0
    assert "each fresh probe's collectives emulated over 300 GB/s within a node of 8" in " ".join(proc.stdout.split())
    for a in result["answers"]:
        n = a["world_size"]
        blocks, root, elements = gathered_bytes(tuple(model_facts("tiny", 421).shapes), n, 1, False, 2)
        emulated = a["outcomes"][0]["emulated"]
        assert not emulated["waited_on_the_gpu"] and emulated["per_step"][f"all_gather over {n}"]["bytes"] == \
            2 * blocks + root and emulated["per_step"][f"reduce_scatter over {n}"]["bytes"] == 2 * elements
        assert "emulated" not in a["outcomes"][1]  # out of memory: no tally
        assert a["largest"] == 3 and a["finished"] and a["tokens_per_rank_per_step"] == 3 * 128
        assert a["above"]["value"] == 4 and a["above"]["error"].startswith("rank 0: out of memory")
        assert a["above"]["phase"] == "training_started" and a["above"]["failed_allocation_mib"] == 1024
        assert [(o["value"], o["fits"]) for o in a["outcomes"]] == [(3, True), (4, False)]  # fresh, both sides
        speed = a["outcomes"][0]["speed"]  # a probe's speed: compute only, or why it has none (too few steps here)
        assert speed["compute_only"] and speed["tokens_per_step_per_gpu"] == 3 * 128, speed
        assert [(o["value"], o["fits"]) for o in a["shared"]] == [(1, True), (2, True), (4, False)]
        assert a["shared_process"]["values"] == [1, 2] and "out of memory" in a["shared_process"]["error"]
    assert result["meta"]["probes"] == sum(a["probes"] for a in result["answers"]) == 8
    assert result["meta"]["shared_processes"] == 4 and result["meta"]["shared_values"] == 8
    trace = load(next((out / "probes").glob("default_N2_*_shared/*memory_usage*.json")))
    names = [e["name"] for e in trace["events"]]  # one process: built once, then each value
    assert names.count("model_built") == 1 and [n for n in names if n.startswith("value_")] == \
        ["value_1_start", "value_1", "value_2_start", "value_2"]
    assert "N = 2, block 128: the default fits 384 tokens per rank per step (B = 3)" in proc.stdout
    # Each fresh probe set up, said so at its gate, and went on to its steps only when let
    assert all(o["set_up_s"] > 0 and o["waited_s"] >= 0 for a in result["answers"] for o in a["outcomes"])
    trace = load(next((out / "probes").glob("default_N2_*_B4_L128/*memory_usage*.json")))
    names = [e["name"] for e in trace["events"]]
    assert names.index("optimizer_created") < names.index("gate_passed") == names.index("training_started") - 1
    # ... set up ahead of its value, which its go named; each search's probe set up after its last was stood down
    gate = next(e for e in trace["events"] if e["name"] == "gate_passed")
    assert gate["go"] == "4" and gate["batches"] == [2, 4, 128] and trace["meta"]["probe"]["batch_size"] == 4
    assert result["meta"]["probes_set_up_ahead"] == 8 and result["meta"]["stood_down"] == 4
    assert not list((out / "probes").glob("*_ahead*"))
    drawn = run_script(["visualize.py", "--dir", str(out)], nproc=None)
    assert drawn.returncode == 0 and (out / "plan.png").stat().st_size > 10_000, drawn.stderr


def test_main_refuses_a_cap_on_the_cpu(tmp_path):
    from fsdp2bench.run import arguments

    with pytest.raises(UserError, match="--gpu_memory needs a GPU"):
        arguments.validate(["--device", "cpu", "--model", "tiny", "--gpu_memory", "8", "--output_dir", str(tmp_path)])


def test_the_findings_name_the_cheapest_set_that_fits_more_than_the_default():
    def answer_of(name, largest, step_s):
        return {"option_set": name, "world_size": 8, "fixed": 128, "variant": "v", "searched": "batch_size",
                "error": None, "finished": True, "largest": largest, "tokens_per_rank_per_step": largest * 128,
                "fit": {"median_step_time_s": step_s}, "smallest_peak_mib": 100.0}
    lines = plan_report.findings([answer_of("default", 29, 0.5), answer_of("ac", 65, 1.5),
                                  answer_of("cpu_offload", 40, 3.0)], "v")
    assert lines == ["N = 8, block 128: the default fits 3,712 tokens per rank per step (B = 29); the cheapest set "
                     "that fits more is ac, 8,320 tokens per rank per step (B = 65), at 180.3 us per token in its "
                     "probe (the default 134.7; probes beside one another share the GPU, so these are rough)"]
    nothing = plan_report.findings([{**answer_of("default", 1, 0.5), "largest": None, "tokens_per_rank_per_step": None,
                                 "outcomes": [{"value": 1, "fits": False}]}], "v")
    assert nothing == ["N = 8, block 128: B = 1 does not fit under any set; the smallest peak allocated was 100 MiB "
                       "(default)."]


def test_a_block_search_moves_in_steps_of_64_tokens_and_of_2c():
    """A block is searched in steps of 64 tokens, a multiple of 2C under CP (which cuts each sequence into 2C
    chunks), counted in those steps and said in tokens."""
    from fsdp2bench.plan.probes import BLOCK, Question

    question = Question("cp2", 8, 0, "torch_optimizer_after_fsdp", BLOCK, 1)
    assert question.unit == 64 and question.batch_and_block(5) == (1, 320)  # 64 tokens, a multiple of 2C = 4
    assert Question("default", 8, 0, "torch_optimizer_after_fsdp", BLOCK, 1).unit == 64
    search = Search(2, 64)  # 128 to 4096 tokens
    answer(search, probes_with_edge(10))  # fits up to 10 steps: 640 tokens
    found = plan_report.answer_of(question, search, None)
    assert found["largest"] == 640 and found["above"]["value"] == 704 and found["fit"]["value"] == 640
    assert found["tokens_per_rank_per_step"] == 640
    assert all(o["value"] % 64 == 0 for o in found["outcomes"])


def test_a_set_whose_layout_cannot_run_here_is_skipped_and_said(tmp_path):
    checked = plan.validate(["--device", "cpu", "--world_size", "8", "--sets", "default,cp2,tp4", "--find",
                             "block_size", "--output_dir", str(tmp_path / "out")])
    assert checked.sets == ["default"]
    assert checked.skipped[0].startswith("cp2: not planned (--cp_size 2: context parallelism does not run on the CPU")
    assert checked.skipped[1].startswith("tp4: not planned (--tp_size 4 does not divide the model's 2 key/value heads")


def test_an_answer_cut_short_is_a_bound_and_no_finding_rests_on_it():
    """An interrupted search knows only that its edge lies in [at_least, below): no largest value, no
    tokens, and the findings at its N compare nothing (a set probed only at 1 said 'no other set fits more')."""
    from fsdp2bench.plan.probes import BATCH, Question

    search = Search(1, 4096)
    search.record(Outcome(1, True, 100.0))
    search.record(Outcome(32, True, 900.0))
    search.record(Outcome(48, False, None))
    found = plan_report.answer_of(Question("ac", 8, 0, "v", BATCH, 128), search, None)
    assert (found["largest"], found["at_least"], found["below"], found["finished"]) == (None, 32, 48, False)
    assert found["tokens_per_rank_per_step"] is None
    done = {"option_set": "default", "world_size": 8, "fixed": 128, "variant": "v", "searched": BATCH, "error": None,
            "finished": True, "largest": 29, "tokens_per_rank_per_step": 29 * 128, "fit": {}, "smallest_peak_mib": 1.0}
    failed = {**done, "option_set": "no_reshard", "error": "no_reshard N=8 v B=1 L=128: rank 0: Interrupted: SIGTERM",
              "largest": None, "tokens_per_rank_per_step": None}
    lines = plan_report.findings([done, {**found, "smallest_peak_mib": 100.0}, failed], "v")
    assert lines == ["N = 8, block 128: no finding, 2 of 3 answers open (ac interrupted, no_reshard failed); default "
                     "fits 3,712 tokens per rank per step (B = 29)."]


def plan_until(tmp_path, probes_seen: int, own_group: bool = False):
    """A CPU plan of tiny with an edge at 40, started (in a process group of its own: ``own_group``) and left
    running once ``probes_seen`` probes ended."""
    proc = start_script(["plan.py", "--device", "cpu", "--world_size", "2,4", "--sets", "default,ac",
                         "--variants", "torch_optimizer_after_fsdp", "--inject_oom_above", "40", "--upper_bound", "4096",
                         "--output_dir", str(tmp_path / "plan")], nproc=None, own_group=own_group)
    seen = 0
    for line in proc.stdout:
        seen += line.startswith("[probe]")
        if seen >= probes_seen:
            break
    time.sleep(0.3)
    return proc


def ended_said(result: dict) -> str:
    """How an interrupted plan's last line counts the probes that ended (each counted once, in plan.json)."""
    ended = result["meta"]["probes"]
    return f"the {counted(ended, 'probe')} that ended {'is' if ended == 1 else 'are'}"


@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_an_interrupted_plan_says_what_it_kept_and_claims_nothing(tmp_path, signum):
    """A scheduler's SIGTERM to plan.py alone. Its SIGINT goes to the same handler (isolation.catch_interrupts):
    a SIGINT reaching plan.py is test_a_signal_to_the_plan_and_every_process_it_started_ends_in_one_line's."""
    proc = plan_until(tmp_path, 5)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    plan_json = tmp_path / "plan" / "plan.json"
    result = load(plan_json)
    assert proc.returncode == 130 and stderr.strip().splitlines() == [
        f"Interrupted ({signal.Signals(signum).name}); {ended_said(result)} in {plan_json}"], stderr
    assert result["meta"]["interrupted"] is True and result["meta"]["probes"] >= 5
    unfinished = [a for a in result["answers"] if not a["finished"]]
    assert unfinished and all(a["largest"] is None and a["tokens_per_rank_per_step"] is None for a in unfinished)
    assert all(line.split(":")[1].startswith(" no finding") for line in result["findings"]), result["findings"]
    drawn = run_script(["visualize.py", "--dir", str(tmp_path / "plan")], nproc=None)
    assert drawn.returncode == 0, drawn.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_plan_and_every_process_it_started_ends_in_one_line(tmp_path, signum):
    """A terminal's Ctrl-C (or its SIGHUP as it closes) reaches the whole process group: plan.py, its shared
    processes and its probes."""
    plan_json = tmp_path / "plan" / "plan.json"
    proc = plan_until(tmp_path, 1, own_group=True)
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=120)
    result = load(plan_json)
    assert proc.returncode == 130 and stderr.strip().splitlines() == [
        f"Interrupted ({signal.Signals(signum).name}); {ended_said(result)} in {plan_json}"], stderr
    assert result["meta"]["interrupted"] is True and result["meta"]["probes"] >= 1
    assert not any(a["largest"] for a in result["answers"] if not a["finished"])


def signal_child_after(tmp_path, marker: str, extra: list[str], child: str):
    """A CPU plan of tiny at N = 2 (default and ac), its child named ``child`` (plan-shared, plan-probe) sent
    SIGTERM as soon as the console has printed a line that starts with ``marker``; returns the ended process, its
    stderr and plan.json."""
    proc = start_script(["plan.py", "--device", "cpu", "--world_size", "2", "--sets", "default,ac",
                         "--variants", "torch_optimizer_after_fsdp", "--output_dir", str(tmp_path / "plan"), *extra],
                        nproc=None)
    for line in proc.stdout:
        if line.startswith(marker):
            break
    child_running(proc.pid, child).send_signal(signal.SIGTERM)  # the piece that printed it has ended
    _, stderr = proc.communicate(timeout=300)
    return proc, stderr, load(tmp_path / "plan" / "plan.json")


def test_a_signal_to_one_probe_fails_its_answer_and_the_last_line_says_so(tmp_path):
    # Every value up to 8 fits: the shared process measures 1 to 8, then the first fresh probe (8) trains.
    proc, stderr, result = signal_child_after(tmp_path, "[shared]", ["--upper_bound", "8"], "plan-probe")
    failed = [a for a in result["answers"] if a["error"]]
    # The probe's own words depend on where the signal found it (Interrupted, or torch's RuntimeError).
    assert proc.returncode == 1 and len(failed) == 1 and "SIGTERM" in failed[0]["error"], stderr
    assert "(its shared process)" not in failed[0]["error"]
    assert stderr.strip().splitlines()[-1] == f"FAILED: 1 answer: {failed[0]['error']}"
    assert any(line.startswith("N = 2, block 128: no finding") for line in result["findings"]), result["findings"]
    assert [a["largest"] for a in result["answers"] if not a["error"]] == [8]


def test_a_signal_to_a_shared_process_fails_its_answer_and_the_last_line_says_so(tmp_path):
    # The first answer's shared process and fresh probes have ended: the second's shared process runs.
    proc, stderr, result = signal_child_after(tmp_path, "[answer 1/2]", ["--inject_oom_above", "3"], "plan-shared")
    failed = [a for a in result["answers"] if a["error"]]
    assert proc.returncode == 1 and len(failed) == 1 and "its shared process" in failed[0]["error"], stderr
    assert "SIGTERM" in failed[0]["error"]
    assert stderr.strip().splitlines()[-1] == f"FAILED: 1 answer: {failed[0]['error']}"
    assert [a["largest"] for a in result["answers"] if not a["error"]] == [3]


@pytest.mark.parametrize("free, again", [("122.81 GiB", False), ("1.90 GiB", True)])
def test_a_probe_out_of_memory_beside_others_runs_again_alone_only_where_the_gpu_was_full(free, again):
    """Torch's message says what the GPU had free: more than the allocation, and the probe's own cap refused it."""
    from fsdp2bench.plan.probes import BATCH, Probe, ProbeRunner, Question

    cap = estimate.GpuCap(24.0, int(139.8 * 1024) * MIB, 527 * MIB)
    runner = ProbeRunner(None, None, None, {}, {}, cap, "")
    question = Question("default", 8, 0, "torch_optimizer_after_fsdp", BATCH, 128)
    beside = [Probe(question_key="k", question=question, value=20, room=10 * 1024 * MIB, started_at=0.0,
                    ended_at=1.0) for _ in range(6)]
    probe = Probe(question_key="k", question=question, value=30, room=cap.process_bytes, started_at=0.5,
                  ended_at=2.0, result=Outcome(30, False, None, {
        "error": f"rank 0: out of memory (CUDA out of memory. Tried to allocate 2.03 GiB. GPU 0 has a total "
                 f"capacity of 139.80 GiB of which {free} is free."}))
    assert runner.gpu.crowded_out(probe, beside) is again
    probe.alone = True  # run again alone: what it found is its answer
    assert runner.gpu.crowded_out(probe, beside) is False


def test_a_shared_process_whose_first_value_fills_its_room_measures_only_that():
    """N = 1: the state alone is most of the cap; the line then takes the model's slope through that one value."""
    ladder = plan_search.Ladder(1, 4096, 31000.0, PER_SEQUENCE)
    assert ladder.next_value([]) == 1 and ladder.next_value([(1, 29546.0)]) is None
    search = Search(1, 4096, 40433.0, PER_SEQUENCE, BLOCK, 1.5)
    search.take_shared_values([Outcome(1, True, 29546.0)])
    assert search.line() == (1, 29546.0, PER_SEQUENCE) and search.next_values() == [search.aim(1.5)] != [1]


@pytest.mark.parametrize("gib, stepping", [(80.0, 1), (24.0, 5)])
def test_probes_set_up_ahead_and_step_only_where_the_gpu_holds_their_room(monkeypatch, gib, stepping):
    """A probe holds its set-up until it is let go on to its steps, then its room: on a 140 GiB GPU one probe at an
    80 GiB cap steps at a time (two more set up behind it), five at a 24 GiB cap; none waits for ever."""
    from fsdp2bench.plan import room
    from fsdp2bench.plan.probes import BATCH, Probe, ProbeRunner, Question

    monkeypatch.setattr(room, "host_bytes", lambda *args: 1 << 30)
    cap = estimate.GpuCap(gib, 140 * 1024 * MIB, 527 * MIB)
    session = types.SimpleNamespace(device=torch.device("cuda", 0), shapes=None)
    runner = ProbeRunner(session, types.SimpleNamespace(init_device="cpu", build_threads=32), None, {}, {}, cap, "")
    question = Question("default", 8, 0, "torch_optimizer_after_fsdp", BATCH, 128)
    live: list = []
    for _ in range(12):
        probe = Probe(question_key="k", question=question, value=30, room=cap.process_bytes, setup_bytes=1500 * MIB)
        if not runner.gpu.may_start(probe, live):
            break
        live.append(probe)
        if runner.gpu.may_go(probe, live):
            probe.went_at = 1.0
    going = [p for p in live if p.went_at is not None]
    assert len(going) == stepping and len(live) - stepping == max(2, stepping)
    assert not runner.gpu.may_go(live[-1], live)  # its room is not there while the others step
    for probe in going:
        live.remove(probe)
    assert all(runner.gpu.may_go(p, live) for p in live[:stepping])


def queue_of(monkeypatch, gib: float, blocks_free_each: list[float], limit: float):
    """A plan's queue on a simulated 140 GiB GPU: an option set per blocks_free value, each answered for two variants
    (the second follows the first); a probe's outcome and a shared process's values come from ``gpu_rank``."""
    from fsdp2bench.plan import probes, room
    from fsdp2bench.plan.probes import BATCH, PlanQueue

    monkeypatch.setattr(room, "host_bytes", lambda *args: 1 << 30)
    cap = estimate.GpuCap(gib, 140 * 1024 * MIB, 527 * MIB)
    variants = ("torch_optimizer_after_fsdp", "accelerate")
    keys = [(f"set{s}", 8, variant, 128) for s in range(len(blocks_free_each)) for variant in variants]
    questions = {key: Question("default", 8, 0, key[2], BATCH, 128) for key in keys}
    searches = {key: Search(1, 4096, limit, PER_SEQUENCE, BLOCK, BLOCKS_FREE) for key in keys}
    leaders = {key: ((key[0], 8, variants[0], 128), 0) for key in keys if key[2] == variants[1]}
    rank = {key: gpu_rank(limit, blocks_free_each[int(key[0][3:])]) for key in keys}
    session = types.SimpleNamespace(device=torch.device("cuda", 0), shapes=None)
    runner = ProbeRunner(session, types.SimpleNamespace(init_device="cpu", build_threads=32), None, questions,
                         searches, cap, "", leaders=leaders)

    def took(probe, job, failure, beside):
        peak, fits = rank[probe.question_key]
        probe.result = Outcome(probe.value, fits(probe.value), peak(probe.value))
        runner.probes.append(probe)
        return True

    def take_shared_process(shared, job, failure):
        peak = rank[shared.question_key][0]
        searches[shared.question_key].take_shared_values([Outcome(v, True, peak(v)) for v in (1, 8, 20)])

    monkeypatch.setattr(runner, "piece", lambda item: types.SimpleNamespace(args=(None,)))
    monkeypatch.setattr(runner.gpu, "setup_bytes", lambda key: 1500 * MIB)
    for name, fake in [("took_probe", took), ("take_shared_process", take_shared_process),
                       ("file_probe", lambda *args: None)]:
        monkeypatch.setattr(runner, name, fake)
    planner = plan_search.Planner(searches, group=lambda key: key[0], unready={k for k in keys if k not in leaders},
                              leaders=leaders)
    queue = PlanQueue(runner, planner, lambda: None)
    for key in keys:
        if key not in leaders:
            queue.add(probes.SharedProcess(question_key=key, question=questions[key], ladder=None,
                                    room=runner.cap.process_bytes // 4))
    return queue, rank


def drive(queue, setup: float = 3.0, step: float = 4.0, shared_s: float = 10.0) -> float:
    """run_queue's part in virtual time: a probe reaches its gate ``setup`` s after it starts and ends ``step`` s
    after its go (at once, stood down); a shared process ends ``shared_s`` s after it starts. Returns the time
    the last piece ended; fails where every running piece waits at its gate for ever, or the GPU is overdrawn."""
    from fsdp2bench.plan.probes import SharedProcess
    from fsdp2bench.processes.isolation import STAND_DOWN

    now, running, at_gate, ready_at, ends_at = 0.0, [], [], {}, {}
    while True:
        for i in [i for i in at_gate if ready_at[i] <= now]:
            if (go := queue.let_go(i, str(1000 * MIB), list(running))) is not None:
                at_gate.remove(i)
                assert go == STAND_DOWN or int(go) == queue.items[i].value
                ends_at[i] = now + (0 if go == STAND_DOWN else step)
        while (i := queue.next_piece(list(running))) is not None:
            running.append(i)
            queue.started(i)
            if isinstance(queue.items[i], SharedProcess):
                ends_at[i] = now + shared_s
            else:
                at_gate.append(i)
                ready_at[i] = now + setup
        assert sum(queue.runner.gpu.holding(queue.items[r]) for r in running) <= queue.runner.cap.total
        if not running:
            return now
        times = [ends_at[i] for i in running if i in ends_at] + [ready_at[i] for i in at_gate if ready_at[i] > now]
        assert times, "every running piece waits at its gate"
        now = min(times)
        for i in [i for i in running if ends_at.get(i, math.inf) <= now]:
            running.remove(i)
            queue.ended(i, None)


def test_a_searchs_next_probe_sets_up_while_the_one_before_steps(monkeypatch):
    """On a GPU with room, no set-up lies on a search's path: the leader's first probe sets up while its shared
    process runs, each next one while the one before steps (its value named at its gate), the follower's first
    while the leader's last steps. The plan then takes the shared process and the steps, and a search's probe
    set up ahead that no value came to is stood down (at most one per search)."""
    queue, rank = queue_of(monkeypatch, 24.0, [0.7], LIMIT)
    wall = drive(queue)
    runner = queue.runner
    for key, search in runner.searches.items():
        assert search.largest_fit == max(v for v in range(1, 200) if rank[key][1](v)) and search.done
    assert all(p.ahead for p in runner.probes)
    assert wall == 10.0 + 4.0 * len(runner.probes)
    assert len(runner.stood_down) <= len(runner.searches)


@pytest.mark.parametrize("gib, limit", [(24.0, LIMIT), (80.0, 81393.0)])
def test_a_crowded_gpu_runs_every_search_to_its_edge_with_probes_set_up_ahead(monkeypatch, gib, limit):
    """Six option sets of two variants each on one GPU (five probes step at once under 24 GiB, one under 80):
    none waits for ever, the GPU is never overdrawn, every answer is found, and most probes were set up
    ahead of their value."""
    queue, rank = queue_of(monkeypatch, gib, [0.4, 0.6, 0.8, 1.0, 1.2, 1.5], limit)
    drive(queue)
    runner = queue.runner
    for key, search in runner.searches.items():
        assert search.largest_fit == max(v for v in range(1, 1000) if rank[key][1](v)) and search.done
    assert sum(p.ahead for p in runner.probes) >= 0.75 * len(runner.probes)


def test_blocks_free_learned_after_the_first_probe_aim_the_second():
    """The value beside the first probe only where that probe was aimed by finished searches' edges (most often
    off by one); one aimed by the prior blocks_free is followed by the learned blocks_free's aim."""
    for learned_first in (True, False):
        search = Search(1, 4096, LIMIT, PER_SEQUENCE, BLOCK, 1.5)
        search.take_shared_values([Outcome(v, True, STATE + PER_SEQUENCE * v) for v in (1, 8, 20)])
        search.learned = learned_first
        first, = search.next_values()
        search.record(Outcome(first, True, STATE + PER_SEQUENCE * first))
        search.blocks_free, search.learned = 0.4, True  # the edges other searches found since
        assert search.aim(0.4) > first + 1
        assert search.next_values() == [first + 1 if learned_first else search.aim(0.4)]


def test_a_shared_process_leaves_blocks_free_of_the_largest_block_under_its_target():
    """Its values aim as the probes do: peak plus blocks_free of the step's largest block (the logits) at the target.
    Aimed at the peak alone, the third value of a set with checkpointing and offload ran out of memory in its own
    process on one H200 (3.5 GiB of logits asked with 1.8 GiB cached apart), leaving its line no slope."""
    limit, slope, free = 16834.0, 250.0, BLOCK * BLOCKS_FREE

    def peak(v: int) -> float:  # the `all` set's at N = 8 under 24 GiB: 261 MiB a sequence above batch 19
        return 3680 + 238.6 * (v - 1) if v < 19 else 20509 + 261 * (v - 67)

    for free_mib, third in [(0.0, 47), (free, 39)]:
        ladder, points = plan_search.Ladder(1, 4096, limit, slope, free_mib=free_mib), []
        while (value := ladder.next_value(points)) is not None:
            points.append((value, peak(value)))
        assert [v for v, _ in points][-1] == third and len(points) == 3
    (x1, _), (x2, _) = points[-2:]
    assert x1 >= plan_search.SHARED_NEAR * x2  # far enough up for the line to take its slope from them
    target = points[0][1] + plan_search.SHARED_TARGETS[1] * (plan_search.SHARED_TOP * limit - points[0][1])
    x, y = points[1]
    assert y + slope * (39 - x) + free * 39 <= target < y + slope * (40 - x) + free * 40


def test_a_layout_accelerate_refuses_is_a_finding_of_the_plan_as_of_main_py_not_a_failure(tmp_path):
    """tp2 at N = 2 leaves FSDP nothing to shard: accelerate refuses it (at every tested release pair), which main.py
    and matrix.py report as unsupported with exit 0; plan.py says the same, not FAILED."""
    proc = run_script(["plan.py", "--device", "cpu", "--world_size", "2", "--sets", "tp2", "--variants", "accelerate",
                       "--output_dir", str(tmp_path / "plan")], nproc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = " ".join(proc.stdout.split())
    assert "unsupported by the installed libraries (a finding, not a failure of the plan): 1 answer: tp2 N=2 " \
           "accelerate" in said and "no dimension for FSDP to shard" in said
    assert "(tp2 unsupported)" in said and "FAILED" not in proc.stderr
    assert "no probe fit, so there is nothing to draw" in said


# The long-context answers of results/h200/long_context_8b (Llama-3.1-8B shape, N = 8, 80 GiB, batch 1, 64-token
# steps): the shared process's values, the peak's intercept and slope the fresh fits measured (MiB, MiB a token),
# the step's largest block a token (MiB: fp32 logits over C ranks, or liger's MLP row), the edge, and the fresh
# probes the search took on one H200 at b07b058.
LONG_CONTEXT = [
    ([(128, 19412), (768, 21156), (2304, 32244)], 13900, 7.9, 0.489, 7936, 10),
    ([(128, 19377), (1472, 21067), (4544, 32520)], 13200, 3.93, 0.489 / 2, 15552, 10),
    ([(128, 19359), (2880, 21007), (9024, 32476)], 12900, 1.97, 0.489 / 4, 30976, 15),
    ([(128, 19365), (960, 20264), (2944, 28671)], 16100, 4.26, 0.0273, 15104, 6),
    ([(128, 19355), (1792, 20261), (5824, 29237)], 16100, 2.13, 0.0273 / 2, 28480, 13),
    ([(128, 19349), (3520, 20212), (11584, 29267)], 16100, 1.13, 0.0273 / 4, 56896, 14),
]


def test_a_long_sequences_search_steps_down_from_a_far_failure_instead_of_walking():
    """Its shared process measures far below the edge (a 20 GiB room under an 80 GiB cap), where the slope was 9%
    low: the first aim fails, and the search walked down 64 tokens a probe (10-15 probes). Replayed on the same
    peaks, it now steps back a tenth of the way to the shared values, takes the slope its fit measures there, and
    needs a third fewer probes (42 for the six, where they took 68), every answer found."""
    limit, unit, counts = 81393.1875, 64, []
    for shared, intercept, slope, block, edge, before in LONG_CONTEXT:
        def peak(v: int) -> float:
            return intercept + slope * v * unit
        blocks_free = (limit - peak(edge // unit + 0.5)) / (block * unit * (edge // unit + 0.5))
        search = Search(2, 2048, limit, 6.5 * unit, block * unit, BLOCKS_FREE)
        search.take_shared_values([Outcome(x // unit, True, y) for x, y in shared])
        run_searches({"q": search}, lambda wanted: {
            (k, v): Outcome(v, peak(v) + blocks_free * block * unit * v <= limit, peak(v)) for k, v in wanted})
        found = search.answer()
        assert found["largest"] * unit == edge and found["above"]["value"] * unit == edge + unit
        counts.append(found["probes"])
        assert found["probes"] <= before, (edge, found["probes"])
    assert sum(counts) <= 0.65 * sum(before for *_, before in LONG_CONTEXT), counts


# Every option of plan.py, by the modes that read it: the rest of each mode's options are refused (checks.UNREAD).
READ_BY_ALL = {"model", "world_size", "gpu_memory", "find", "block_size", "init_device", "device", "output_dir",
               "loop", "peft", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "qlora_storage",
               "allow_known_failure", "optimizer"}
READ_BY_PROBES = {"sets", "variants", "upper_bound", "inject_oom_above", "loss", "activation_checkpointing",
                  "ac_every", "compile", "float8", "config_file", "emulate_communication"}
READ = {"batch_size": READ_BY_ALL | READ_BY_PROBES, "block_size": READ_BY_ALL | READ_BY_PROBES | {"batch_size"},
        "layout": READ_BY_ALL | set(checks.LAYOUT_ONLY)}
# A value each option takes, so that only the mode can refuse it.
A_VALUE = {"sets": "default", "variants": "accelerate", "batch_size": "1", "upper_bound": "4", "inject_oom_above": "3",
           "activation_checkpointing": "full", "ac_every": "2", "compile": "true", "float8": "false",
           "loss": "chunked", "config_file": "/dev/null", "global_batch": "8", "global_batch_tokens": "1024",
           "levers": "full", "links": "450,50", "max_timings": "12", "confirm": "3", "time_budget_s": "420",
           "emulate_communication": "450,50"}


def test_every_option_is_read_or_refused_by_each_mode(monkeypatch):
    """A new option must be placed: read by a mode, or refused there with the mode that reads it."""
    parsers = []
    parse = OneLineParser.parse_args
    monkeypatch.setattr(OneLineParser, "parse_args", lambda self, *a, **k: parsers.append(self) or parse(self, *a, **k))
    checks.parse_args([])
    dests = {a.dest for a in parsers[0]._actions if a.dest != "help"}
    for mode, read in READ.items():
        assert read | set(checks.UNREAD[mode]) == dests and not read & set(checks.UNREAD[mode]), mode


@pytest.mark.parametrize("mode, name", [(mode, name) for mode in READ for name in checks.UNREAD[mode]])
def test_an_option_the_mode_does_not_read_is_refused_even_at_its_default(mode, name, tmp_path):
    """Given at all (its default included), never taken and dropped: one line naming the mode."""
    extra = ["--global_batch", "8"] if mode == "layout" and name not in ("global_batch", "global_batch_tokens") else []
    said = refusal(plan.validate, ["--device", "cpu", "--find", mode, "--world_size", "4", "--output_dir",
                                   str(tmp_path / "out"), *extra, f"--{name}={A_VALUE[name]}"])
    assert said == f"error: --{name} is not read by --find {mode}: {checks.UNREAD[mode][name]}", said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--global_batch", "8", "--global_batch_tokens", "1024"], "give one of them"),
    (["--global_batch", "8", "--links", "-1,50"], "within_gbps must be in [0.01, 100000] GB/s, got -1.0"),
    (["--global_batch", "8", "--links", "nan,50"], "within_gbps must be in [0.01, 100000] GB/s, got nan"),
    (["--global_batch", "8", "--links", "450,inf"], "across_gbps must be in [0.01, 100000] GB/s, got inf"),
    (["--global_batch", "8", "--links", "0.0001,50"], "within_gbps must be in [0.01, 100000] GB/s, got 0.0001"),
    (["--global_batch", "8", "--links", "/dev/zero"], "/dev/zero: neither a file nor a directory, not a file"),
    (["--global_batch", "8", "--links", "/"], "/: a directory, not a file"),
    (["--global_batch", "8", "--links", "nothere.json"], "--links nothere.json: no such file or directory"),
    (["--global_batch", "8", "--init_device", "cuda"], "--init_device cuda needs a GPU"),
    (["--world_size", "12", "--global_batch", "12"], "--links: nodes of 8 GPUs do not make up N = 12"),
])
def test_a_layout_value_is_refused_for_its_own_cause(argv, message, tmp_path):
    said = refusal(plan.validate, ["--device", "cpu", "--find", "layout", "--world_size", "4", "--output_dir",
                                   str(tmp_path / "out"), *argv])
    assert said is not None and message in said, said


def test_a_config_whose_layout_divides_n_but_does_not_fill_it_is_told_why(tmp_path):
    """R 2 x S 2 divides N = 8 but does not make it: the layout's own reason at each N, not 'divides none'."""
    path = tmp_path / "r2s2.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: "
                    "TRANSFORMER_BASED_WRAP\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                    "  parallelism_config_dp_shard_size: 2\n")
    said = refusal(plan.validate, ["--device", "cpu", "--world_size", "8", "--config_file", str(path),
                                   "--output_dir", str(tmp_path / "out")])
    assert "N = 8: --dp_replicate_size 2 x --dp_shard_size 2 is not the world size 8" in said, said


def missing(*packages: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in packages), reason="not installed")


@pytest.mark.parametrize("peft", ["none", pytest.param("lora", marks=missing("peft")),
                                  pytest.param("qlora", marks=missing("peft", "bitsandbytes"))])
def test_probes_build_on_the_gpu_where_the_whole_model_fits_under_the_cap(peft, monkeypatch):
    """--init_device auto: the GPU where 1.2 x the fp32 model fits the allocator a probe runs in, else the CPU, and
    the CPU where there is no cap (a CPU run); where the host cannot hold it either, meta if only the variant built
    from its shards is planned; a device asked for is kept. A LoRA or QLoRA model is built in fp32 before its base
    is cast or packed: its fp32 bytes decide, every weight counted (a 4-bit one is not its packed items), not the
    bytes it holds once built."""
    from fsdp2bench.memory.accounting import built_bytes, model_bytes
    from fsdp2bench.options.tuning import Tuning
    from fsdp2bench.run.session import model_facts

    shapes = model_facts("tiny", 421, tuning=Tuning(peft=peft)).shapes
    fits = estimate.GpuCap(1.21 * built_bytes(shapes) / (1 << 30), 80 << 30, 0)
    short = estimate.GpuCap(1.19 * built_bytes(shapes) / (1 << 30), 80 << 30, 0)
    both, one = list(VARIANTS[:2]), [VARIANTS[0]]
    assert checks.build_device("auto", shapes, fits, both) == "cuda"
    assert checks.build_device("auto", shapes, short, both) == "cpu" == checks.build_device("auto", shapes, None, one)
    assert checks.build_device("cpu", shapes, fits, both) == "cpu"
    assert checks.build_device("cuda", shapes, short, both) == "cuda"
    monkeypatch.setattr(checks, "host_memory_for_launch", lambda: estimate.HOST_RUNTIME + built_bytes(shapes) - 1)
    assert checks.build_device("auto", shapes, short, one) == "meta" == checks.build_device("auto", shapes, None, one)
    assert checks.build_device("auto", shapes, short, both) == "cpu"  # the host check then says the figure
    with pytest.raises(UserError, match="--init_device meta: the model exists only as each rank's shards"):
        checks.build_device("meta", shapes, None, both)
    held = {"none": 492_032, "lora": 393_216, "qlora": 184_832}  # fp32 as built, a bf16 base, a base packed in 4 bits
    assert model_bytes(shapes) == held[peft] and built_bytes(shapes) == 492_032 + (4 * 36_800 if peft != "none" else 0)
