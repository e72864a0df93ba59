"""plan.py --find layout: the candidates of N, the pruning, the projection's bytes for the tiny model, the ranking,
the refusals, and one CPU search whose winner's command lines run as given."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import types

import pytest
from conftest import load, refusal, run_script, start_script

import plan
import utils
from fsdp2bench.memory.estimate import GpuCap
from fsdp2bench.names import GIB, MIB, counted, size_said
from fsdp2bench.options import accelerate_config
from fsdp2bench.options.fsdp import FsdpOptions
from fsdp2bench.options.layout import Degrees
from fsdp2bench.options.links import Links, parse_links
from fsdp2bench.plan.layout import report, search as layout_search, timing as layout_timing
from fsdp2bench.plan.layout.candidates import TRAINED, Candidate, Levers, candidates_of, layouts_of, parse_levers
from fsdp2bench.plan.layout.traffic import step_collectives
from fsdp2bench.processes.starting import LAUNCHER_VARS, one_rank_env
from fsdp2bench.run import arguments
from fsdp2bench.run.session import model_facts
from fsdp2bench.train import data

TINY = model_facts("tiny", 421)  # hidden 64, MLP 170, 2 blocks, 4 heads, 2 key/value heads, vocabulary 509, tied


def test_every_layout_of_n_the_model_admits_and_none_it_does_not():
    """tiny's 2 key/value heads admit tp 1 and 2; on a GPU every cp that divides the rest (128 % 2C == 0)."""
    on_gpu, _ = layouts_of(8, TINY.config, 128, "cuda")
    expected = {(r, 8 // (t * c * r), c, t) for t in (1, 2) for c in (1, 2, 4, 8) if 8 % (t * c) == 0
                for r in (1, 2, 4, 8) if (8 // (t * c)) % r == 0}
    assert {(d.replicate, d.shard, d.cp, d.tp) for d in on_gpu} == expected and len(on_gpu) == 16
    on_cpu, notes = layouts_of(8, TINY.config, 128, "cpu")
    assert {(d.replicate, d.shard, d.cp, d.tp) for d in on_cpu} == {x for x in expected if x[2] == 1}
    assert any(n.startswith("tp 4: --tp_size 4 does not divide the model's 2 key/value heads") for n in notes)
    assert any(n.startswith("cp 2 (tp 1): context parallelism does not run on the CPU") for n in notes)


def test_candidates_reach_the_global_batch_with_every_lever_each_layout_admits():
    layouts, _ = layouts_of(4, TINY.config, 128, "cpu")  # 4 flat or replicated, and tp 2 over 2 data ranks
    found = candidates_of(layouts, parse_levers("none,full,model,chunked"), 6, "cpu")
    assert {c.degrees.data_ranks for c in found} == {2}  # 6 sequences: 4 data ranks leave a remainder
    assert all(c.batch * c.microbatches * c.degrees.data_ranks == 6 for c in found)
    # per layout (R2xS1xT2, R1xS2xT2): 2 checkpointing modes x 2 losses x (B3x1, B1x3 once a step or each microbatch)
    assert len(found) == 2 * 2 * 2 * 3
    float8 = candidates_of(layouts_of(4, TINY.config, 128, "cpu")[0], Levers(float8=(False, True)), 4, "cuda")
    assert not any(c.float8 and c.degrees.tp > 1 for c in float8) and any(c.float8 for c in float8)
    # Beside compile, float8 is searched only with it (eager, its casts cost more than it saves); asked alone, alone.
    assert {(c.compile, c.float8) for c in float8} == {(False, False), (True, False), (True, True)}
    alone = candidates_of(layouts_of(4, TINY.config, 128, "cpu")[0], Levers(compile=(False,), float8=(False, True)),
                          4, "cuda")
    assert any(c.float8 and not c.compile for c in alone)


def test_the_memory_model_prunes_what_cannot_fit_and_says_by_how_much():
    setup = setup_of(GpuCap(2.0, 140 * GIB, 300 * MIB))
    small, large = (Candidate(Degrees(replicate=1, shard=8), "none", "model", False, False, b, 1) for b in (1, 4096))
    assert layout_search.assess(small, setup).fits is True
    pruned = layout_search.assess(large, setup)
    estimate = layout_search.estimated_bytes(large, TINY.shapes, TINY.config, 128, FsdpOptions())
    assert pruned.fits is False and estimate > 1.2 * 2 * GIB
    assert pruned.memory["over_gib"] == pytest.approx((estimate - 2 * GIB) / GIB)


def setup_of(cap=None, links=Links()) -> layout_search.SearchInputs:
    return layout_search.SearchInputs(model="tiny", world_size=8, block=128, global_sequences=16, shapes=TINY.shapes,
                               config=TINY.config, base=FsdpOptions(), cap=cap, links=links, device_type="cpu",
                               gpu_name=None, output_dir="unused", max_timings=2, init_device="cpu",
                               num_parameters=123008)


def test_the_projections_bytes_are_the_tiny_models_counted_by_hand():
    """bf16 all-gathers, bf16 reduction (autocast). A block's padded elements over 8 shards: q 4096 + 64, k and v
    2048 + 32 each, o 4096, gate and up 22 x 8 rows x 64 = 11264 each, down 10880, two norms 128: 45952, twice;
    the root: the embedding's 64 x 8 rows x 64 = 32768 and the final norm 64: 32832."""
    flat = {c.name: c.bytes for c in step_collectives(TINY.shapes, TINY.config, Degrees(replicate=1, shard=8),
                                                      FsdpOptions(), 1, 128, 2)}
    blocks, root = 2 * 45952 * 2, 32832 * 2
    assert flat == {"FSDP all-gather of parameters": 7 * (2 * blocks + root) * 2 // 8,  # forward and backward, x2
                    "FSDP reduce-scatter of gradients": 7 * (2 * 45952 + 32832) * 2 // 8}  # once a step
    hsdp = {c.name: c for c in step_collectives(TINY.shapes, TINY.config, Degrees(replicate=2, shard=4),
                                                FsdpOptions(), 1, 128, 1)}
    # Over 4 shards gate and up pad to 172 rows, the embedding to 512: 123712 elements, a quarter a shard
    assert hsdp["HSDP all-reduce across replicas"].bytes == 2 * (123712 // 4 * 2) // 2
    assert hsdp["HSDP all-reduce across replicas"].span == 8 and hsdp["FSDP all-gather of parameters"].span == 4
    tp = {c.name: c.bytes for c in step_collectives(TINY.shapes, TINY.config, Degrees(replicate=1, shard=4, tp=2),
                                                    FsdpOptions(), 2, 128, 1)}
    # 7 a block (2 rowwise outputs forward, 5 colwise inputs' gradients backward), 2 blocks
    assert tp["TP all-reduce of activations and their gradients"] == 2 * 2 * 128 * 64 * 2 // 2 * 7 * 2
    links = Links(node_size=4, within_gbps=100.0, across_gbps=10.0)
    assert hsdp["HSDP all-reduce across replicas"].seconds(links) == 123712 // 4 * 2 / 10e9
    assert parse_links("100,10") == Links(within_gbps=100.0, across_gbps=10.0)


def flat(batch: int, ac: str = "none", **levers) -> Candidate:
    return Candidate(Degrees(replicate=1, shard=8), ac, levers.get("loss", "model"), levers.get("compile", False),
                     levers.get("float8", False), batch, 16 // 8 // batch)


def timed(microbatch_s: float, peak_mib: float | None = None, name: str = "timed", optimizer_s: float = 0.0,
          exposed_s: float = 0.0, gathers_s: float = 0.03, reductions_s: float = 0.02, waited: bool = True) -> dict:
    """A timing as run_timing returns it: the compute alone and, emulated at one microbatch, a step that left
    ``exposed_s`` of its communication (``gathers_s`` of all-gathers, ``reductions_s`` of reduce-scatters) exposed;
    on a CPU (``waited`` false) the step is the compute + all of it."""
    comm = gathers_s + reductions_s
    per_step = {"all_gather over 8": {"calls": 5, "bytes": 1, "emulated_s": gathers_s},
                "reduce_scatter over 8": {"calls": 3, "bytes": 1, "emulated_s": reductions_s}}
    return {"candidate": name, "fits": True, "microbatch_s": microbatch_s, "optimizer_s": optimizer_s, "clean": True,
            "peak_reserved_mib": peak_mib, "wall_s": 1.0, "local_share": 1 / 8,
            "emulated": {"step_s": microbatch_s + (exposed_s if waited else comm), "comm_s": comm,
                         "waited_on_the_gpu": waited, "per_step": per_step}}


def own_timing(found: layout_search.Assessed, timing: dict) -> None:
    found.compute, found.compute_own, found.emulated = timing, True, timing


def test_the_ranking_takes_the_emulated_step_with_both_bounds_beside_it_and_leaves_out_what_does_not_fit():
    """B1x2 and B2x1 over 8 shards, each timed on its own layout at one microbatch with 0.05 s of communication
    emulated (0.03 s of all-gathers, 0.02 of reduce-scatters). FSDP2's schedule hid all of B1's and left 0.04 s of
    B2's exposed: B1x2's step is 2 x 0.10 s of compute and nothing more (its 2 x 0.03 + 0.02 s of communication
    hidden: no overlap would say 0.28 s), B2x1's 0.17 + 0.04 s. The step ranks B1x2 first, where either bound
    would have put B2x1 first; B4 does not fit."""
    setup = setup_of()
    found = []
    for batch, microbatch_s, exposed_s, fits in ((1, 0.10, 0.0, True), (2, 0.17, 0.04, True), (4, 0.2, 0.0, False)):
        each = layout_search.assess(flat(batch), setup)
        each.fits = fits
        own_timing(each, timed(microbatch_s, exposed_s=exposed_s))
        layout_search.project(each, setup, [])
        found.append(each)
    b1, b2 = found[0].speed, found[1].speed
    assert b1["compute_s"] == pytest.approx(0.20) and b1["comm_s"] == pytest.approx(0.08)
    assert b1["exposed_share"] == 0
    assert b1["step_s"] == pytest.approx(0.20) and b1["tokens_per_s"] == pytest.approx(256 / 0.20)
    assert b1["no_overlap_tokens_per_s"] == pytest.approx(256 / 0.28)
    assert b1["full_overlap_tokens_per_s"] == pytest.approx(256 / 0.20)
    assert b2["step_s"] == pytest.approx(0.21) and b2["exposed_share"] == pytest.approx(0.8)
    assert b2["no_overlap_tokens_per_s"] == pytest.approx(256 / 0.22)  # either bound puts B2x1 first
    assert b2["full_overlap_tokens_per_s"] == pytest.approx(256 / 0.17)
    assert [f.candidate.batch for f in layout_search.ranked(found)] == [1, 2]
    assert b1["labels"] == {"compute": "measured", "communication": "emulated", "step": "emulated"}
    assert b1["exposed_share_from"] == layout_search.OWN and layout_search.decided(found[0], setup)


def test_on_a_cpu_the_emulated_step_is_compute_plus_the_priced_communication_and_says_so():
    """Nothing waits on a CPU: a timing's step is its compute + all its communication, the no-overlap bound, and
    its label says that the overlap is not measured."""
    setup = setup_of()
    each = layout_search.assess(flat(2), setup)
    own_timing(each, timed(0.17, waited=False))
    layout_search.project(each, setup, [])
    assert each.speed["step_s"] == pytest.approx(0.17 + 0.05) and each.speed["exposed_share"] == 1.0
    assert each.speed["tokens_per_s"] == each.speed["no_overlap_tokens_per_s"]
    assert each.speed["labels"]["step"] == layout_search.CPU_STEP and "no overlap" in layout_search.CPU_STEP


def test_an_untimed_layouts_step_takes_the_exposed_share_of_its_shapes_timed_layouts_labelled_estimated():
    """Timed: FSDP over 8 (S) left 0.01 of its 0.05 s exposed, HSDP 2 x 4 (RxS) 0.03 of 0.05. Untimed, each by the
    layouts of its shape: FSDP at B2 0.2 of its projected communication, HSDP 4 x 2 0.6; FSDP beside TP 2 (SxT), no
    layout of its shape timed, by every timed one's, 0.04 of 0.10 s: 0.4, its TP all-reduce projected and added
    whole. With no clean timing to take a share from: no overlap."""
    setup = setup_of()
    fsdp, hsdp = (Candidate(d, "none", "model", False, False, 1, 2) for d in (Degrees(replicate=1, shard=8),
                                                                            Degrees(replicate=2, shard=4)))
    references = [(fsdp, timed(0.10, name="fsdp", exposed_s=0.01)), (hsdp, timed(0.10, name="hsdp", exposed_s=0.03))]
    cases = {flat(2): (0.2, "the timed S layouts"),
             Candidate(Degrees(replicate=4, shard=2), "none", "model", False, False, 1, 2):
                 (0.6, "the timed RxS layouts"),
             Candidate(Degrees(replicate=1, shard=4, tp=2), "none", "model", False, False, 2, 1):
                 (0.4, "every timed layout")}
    for candidate, (share, source) in cases.items():
        each = layout_search.assess(candidate, setup)
        layout_search.project(each, setup, references)
        s = each.speed
        tp = sum(c.seconds(setup.links) for c in each.collectives if not c.emulated)
        assert (s["exposed_share"], s["exposed_share_from"]) == (pytest.approx(share), source)
        assert s["step_s"] == pytest.approx(s["compute_s"] + share * (each.comm_s - tp) + tp)
        assert s["labels"]["step"] == "estimated" and s["labels"]["communication"].startswith("projected")
        assert (tp > 0) == (candidate.degrees.tp > 1) and not layout_search.decided(each, setup)
    alone = layout_search.assess(flat(2), setup)
    layout_search.project(alone, setup, [(fsdp, {**timed(0.10, exposed_s=0.01), "clean": False})])
    assert alone.speed["exposed_share"] == 1.0 and alone.speed["step_s"] == pytest.approx(
        alone.speed["compute_s"] + alone.comm_s)


def test_an_untimed_candidate_is_estimated_from_the_nearest_timing_flops_and_the_levers_ratio():
    """B2 does twice B1's FLOPs at B1's FLOP/s; full checkpointing's prior is 1/1.33 of none's; tp 2 halves a rank's
    share. The nearest timing is the one with the same levers, whatever the batch."""
    setup = setup_of()
    references = [(flat(1), timed(0.10, name="B1 none")), (flat(1, "full"), timed(0.30, name="B1 full"))]
    cases = {flat(2): 0.20, flat(2, "full"): 0.60, flat(2, "selective"): 0.20 * 1.33 / 1.10,
             Candidate(Degrees(replicate=1, shard=4, tp=2), "none", "model", False, False, 2, 1): 0.10}
    for candidate, microbatch_s in cases.items():
        each = layout_search.assess(candidate, setup)
        layout_search.project(each, setup, references)
        assert each.speed["compute_s"] == pytest.approx(microbatch_s * candidate.microbatches)
        assert each.speed["compute_measured"] is False
    assert layout_search.estimated_forward_backward(flat(2, "full"), references, setup)[1]["candidate"] == "B1 full"


def test_a_step_is_k_forwards_and_backwards_and_one_optimizer_step_its_share_scaled_to_the_layout():
    """Timed at one microbatch over 8 shards: 0.10 s, 0.02 s of it the optimizer. B1x2 over 8 shards: twice 0.08
    and 0.02 once; over 4 shards (R2xS4) the rank holds twice the parameters: 0.04; estimated at B2 (R1xS8, K=1):
    twice the FLOPs, 0.16, and the optimizer's 0.02."""
    setup = setup_of()
    timing = timed(0.10, optimizer_s=0.02)
    cases = {flat(1): 2 * 0.08 + 0.02, Candidate(Degrees(replicate=2, shard=4), "none", "model", False, False, 1, 1):
             0.08 + 0.04}
    for candidate, compute_s in cases.items():
        each = layout_search.assess(candidate, setup)
        each.compute = timing
        layout_search.project(each, setup, [])
        assert each.speed["compute_s"] == pytest.approx(compute_s) and each.speed["compute_measured"]
    estimated = layout_search.assess(flat(2), setup)
    layout_search.project(estimated, setup, [(flat(1), timing)])
    assert estimated.speed["compute_s"] == pytest.approx(0.16 + 0.02)


def test_the_timings_confirm_the_rows_on_top_and_stop_once_they_are_measured(monkeypatch):
    """A made-up device where a microbatch takes 0.1 s a sequence (1.33x under full checkpointing) and a rank holds
    10 GiB plus 1 GiB a sequence, under 12 GiB: B1 fits, B2 does not. A step's compute is the same at B2x1 and
    B1x2; B2x1 gathers the parameters once, not twice, so it ranks first by the prior and by projection. Its
    timing runs out of memory; B1x2 ran through, and then every candidate ranks: the rows on top are timed until
    three are measured (B1x2 and B1x2 sync share one timing; B2x1 with full checkpointing is out too)."""
    setup = dataclasses.replace(setup_of(GpuCap(12.0, 140 * GIB, 0)), confirm=3, max_timings=10)
    found = [layout_search.assess(c, setup) for c in candidates_of([Degrees(replicate=1, shard=8)],
                                                                   parse_levers("none,full,model"), 16, "cuda")]
    order = []

    def fake_timing(each, setup, index):
        order.append((each.candidate.batch, each.candidate.ac))
        if each.candidate.batch > 1:
            return {"candidate": each.candidate.name, "fits": False, "error": "CUDA out of memory"}
        slower = 1.33 if each.candidate.ac == "full" else 1.0
        return timed(0.1 * slower, (10 + each.candidate.batch) * 1024, each.candidate.name)

    monkeypatch.setattr(layout_timing, "run_timing", fake_timing)
    timings = []
    layout_timing.choose_and_time(found, setup, lambda line: None, timings)
    assert order == [(2, "none"), (1, "none"), (2, "full"), (1, "full")] and len(timings) == 4
    rows = layout_search.ranked(found)
    assert [r.candidate.name for r in rows] == ["R1xS8xC1xT1 B1x2 ac=none loss=model",
                                                 "R1xS8xC1xT1 B1x2 sync ac=none loss=model",
                                                 "R1xS8xC1xT1 B1x2 ac=full loss=model",
                                                 "R1xS8xC1xT1 B1x2 sync ac=full loss=model"]
    assert all(layout_search.decided(r, setup) for r in rows)
    assert layout_search.winner_of(found, setup) == (rows[0], 1)


def test_a_timing_on_a_candidates_own_layout_wins_over_one_on_a_like_layout():
    """R1xS8 and R2xS4 at B1 share their per-rank shapes: the first timing (R1xS8) serves both; R2xS4's own timing
    then replaces it for R2xS4 alone, compute and memory, and a later like timing does not undo that."""
    setup = setup_of(GpuCap(12.0, 140 * GIB, 0))
    flat8, hsdp = (layout_search.assess(Candidate(d, "none", "model", False, False, 1, 1), setup)
                   for d in (Degrees(replicate=1, shard=8), Degrees(replicate=2, shard=4)))
    first, own = timed(0.10, 1024, flat8.candidate.name), timed(0.13, 2048, hsdp.candidate.name)
    for timing, probed in ((first, flat8), (own, hsdp), (first, flat8)):
        layout_timing.take_timing(timing, probed, [flat8, hsdp], setup)
    assert flat8.compute is first and hsdp.compute is own and hsdp.memory["own_layout"]
    moved = hsdp.estimated_bytes - flat8.estimated_bytes  # R2xS4 holds twice the shard R1xS8 does
    assert moved > 0 and hsdp.memory["measured_gib"] == pytest.approx(2.0) and flat8.memory["measured_gib"] == 1.0


def test_a_timing_calibrates_the_memory_models_estimate_for_candidates_of_its_levers():
    """The model says 100 GiB where the timed candidate held 70: every candidate of the same levers is placed again
    at 0.7 of its estimate, those of other levers keep theirs, and one that ran out of memory stays out."""
    setup = setup_of(GpuCap(80.0, 140 * GIB, 0))
    same, other, failed = (layout_search.assess(flat(1, ac), setup) for ac in ("none", "full", "none"))
    for f in (same, other, failed):
        f.estimated_bytes = 110 * GIB
        layout_search.judge_by_estimate(f, setup, 1.0, "estimated")
    failed.out_of_memory = True
    assert [f.fits for f in (same, other, failed)] == [False, False, False]
    layout_search.calibrate([same, other, failed], setup, {("none", "model", False, False): 0.7})
    assert same.fits is None and same.memory["calibrated_gib"] == pytest.approx(77) and "over_gib" not in same.memory
    assert other.fits is False and other.memory["over_gib"] == pytest.approx(30) and failed.fits is False
    layout_search.calibrate([same], setup, {("none", False, False): 0.5})  # levers without the loss: 55 GiB
    assert same.fits is True and "well under the cap" in same.memory["how"]


def test_what_does_not_fit_is_counted_once_by_what_decided_it():
    """Over the cap by the estimate (with how far), by a measurement moved by the memory model, or out of memory
    where a like candidate ran (one that the estimate had put over the cap too counted there alone): each candidate
    counted once, by kind, and the closest named."""
    setup = setup_of(GpuCap(80.0, 140 * GIB, 0))
    estimated, measured, failed, both = (layout_search.assess(flat(1, ac), setup)
                                         for ac in ("none", "full", "selective", "none"))
    for row in (estimated, both):
        row.estimated_bytes = 110 * GIB
        layout_search.judge_by_estimate(row, setup, 1.0, "estimated")
    measured.fits, measured.memory["measured_gib"] = False, 84.0
    failed.fits, failed.out_of_memory = False, True
    both.out_of_memory = True
    said = report.not_fitting([estimated, measured, failed, both], setup.cap)
    assert said[0] == ("4 of 4 candidates do not fit, each counted once: 2 measured: a like candidate's timing ran "
                       "out of memory; 1 measured: rank 0's peak reserved, moved by the memory model's difference "
                       "(accumulation, a larger shard), over the allocator's limit; 1 estimated: over the cap by the "
                       "memory model's estimate, calibrated where a timing of the same levers measured it (not run)")
    assert said[1] == f"    out of memory where a like candidate ran: {failed.candidate.name}; {both.candidate.name}"
    assert said[2] == (f"    over the allocator's limit of 80.0 GiB, the closest: {measured.candidate.name} (84.0 "
                       "GiB measured+, 4.00 GiB over)")
    assert said[3] == (f"    over the cap by the estimate, the closest of each layout: {estimated.candidate.name} "
                       "(30.0 GiB over, estimated)")
    assert len(said) == 4


def test_a_candidate_a_like_timing_puts_over_the_limit_is_named_once_as_measured():
    """The LoRA search's case: nothing over the cap by the estimate, one timing (R1xS8) whose peak, moved by what the
    memory model says R2xS4 holds more (twice the shard), puts R2xS4 over the allocator's limit. It is the one
    candidate that does not fit, said so once, as measured, with how far over; nothing is 'more'."""
    setup = setup_of(GpuCap(1.0, 140 * GIB, 0))
    flat8, hsdp = (layout_search.assess(Candidate(d, "none", "model", False, False, 1, 1), setup)
                   for d in (Degrees(replicate=1, shard=8), Degrees(replicate=2, shard=4)))
    assert flat8.fits is not False and hsdp.fits is not False  # under the cap by the estimate
    moved = hsdp.estimated_bytes - flat8.estimated_bytes
    peak_mib = (setup.cap.allocator_bytes - moved // 2) / MIB
    layout_timing.take_timing(timed(0.10, peak_mib, flat8.candidate.name), flat8, [flat8, hsdp], setup)
    assert flat8.fits is True and hsdp.fits is False and not hsdp.out_of_memory
    said = report.not_fitting([flat8, hsdp], setup.cap)
    assert said[0].startswith("1 of 2 candidates does not fit, each counted once: 1 measured: rank 0's peak reserved")
    assert "estimated" not in said[0] and not any("more" in line for line in said)
    over = size_said(moved - moved // 2)
    assert said[1:] == [f"    over the allocator's limit of 1.0 GiB, the closest: {hsdp.candidate.name} (1.0 GiB "
                        f"measured+, {over} over)"]


def test_a_timing_never_reads_an_earlier_searchs_summary_as_its_own(tmp_path, monkeypatch):
    """Run again into the same directory, a launch that dies before writing its summary is a failure, not the
    figures the earlier search's launch left there."""
    from fsdp2bench.files import write_json

    setup = dataclasses.replace(setup_of(), output_dir=str(tmp_path))
    old = {"simulated": {"8": {"0": {TRAINED: {"status": "ok", "speed": {"tokens_per_s_per_gpu": 1.0,
                                                                         "median_step_time_s": 0.1}}}}}}
    (tmp_path / "timings" / "t0").mkdir(parents=True)
    write_json(str(tmp_path / "timings" / "t0" / "summary.json"), old)
    monkeypatch.setattr(layout_timing.subprocess, "run", lambda *a, **k: types.SimpleNamespace(
        returncode=1, stderr="error: killed before its summary\n"))
    timing = layout_timing.run_timing(layout_search.assess(flat(1), setup), setup, 0)
    assert timing["fits"] is None and timing["error"] == "error: killed before its summary"


def test_a_timing_runs_the_candidates_own_sizes_with_its_communication_emulated_over_the_searchs_links(tmp_path):
    """HSDP 2 x 2 beside TP 2 at N = 8: main.py gets the candidate's sizes, one microbatch, and
    --emulate_communication with the links the search was given (bare where it was given none), and steps enough for
    both halves of its one launch, compiled or not (main.py refuses fewer)."""
    candidate = Candidate(Degrees(replicate=2, shard=2, tp=2), "full", "model", False, False, 2, 4, True)
    for given, after in ((None, "--device"), ("300,25", "300,25"), ("/links/a100.json", "/links/a100.json")):
        setup = dataclasses.replace(setup_of(), links_given=given)
        command = layout_timing.timing_command(candidate, setup, "out")
        flags = dict(zip(command, command[1:]))
        assert {k: flags[k] for k in ("--dp_replicate_size", "--tp_size", "--simulate_world_size", "--batch_size")} \
            == {"--dp_replicate_size": "2", "--tp_size": "2", "--simulate_world_size": "8", "--batch_size": "2"}
        assert "--gradient_accumulation_steps" not in command  # one microbatch a step
        assert command[command.index("--emulate_communication") + 1] == after
        assert arguments.parse_args(command[2:]).emulate_communication == (given or arguments.DEFAULT_LINKS)
    for compiled in (False, True):
        command = layout_timing.timing_command(flat(1, compile=compiled), setup_of(), str(tmp_path / "t"))
        assert command[command.index("--max_steps") + 1] == str(layout_search.TIMING_STEPS)
        assert refusal(arguments.validate, command[2:]) is None, command


def fake_entry(compute_s: float, emulated_s: float, waited: bool, comm_s: float = 0.05) -> dict:
    """Rank 0's summary entry of a timing's launch: its speed (its compute-only and its emulated steps' medians),
    peaks and tally."""
    halves = {label: {"median_step_time_s": step_s, "median_optimizer_s": 0.01, "tokens_per_s_per_gpu": 100.0,
                      "not_measured": None}
              for label, step_s in (("compute_only", compute_s), ("emulated", emulated_s))}
    speed = {**halves["emulated" if waited else "compute_only"],
             "emulation": {**halves, "waited_on_the_gpu": waited}}
    tally = {"waited_on_the_gpu": waited, "emulated_s_per_step": comm_s,
             "per_step": {"all_gather over 8": {"calls": 5, "bytes": 1, "emulated_s": comm_s}}}
    return {"status": "ok", "speed": speed, "median_step_time_s": (compute_s + emulated_s) / 2,
            "training_peak_reserved_mib": {"max": 1024.0}, "training_peak_allocated_mib": {"max": 900.0},
            "emulated": [tally]}


def test_a_timing_is_one_launch_its_compute_the_steps_not_emulated(tmp_path, monkeypatch):
    """One launch, into timings/t3: on a GPU its emulated steps waited (0.13 s a step) and the steps between are its
    compute alone (0.10 s): the timing's microbatch is the compute, its emulated step the emulated steps', 0.03 of its
    0.05 s of communication exposed. On a CPU (nothing waited) the step is the compute + the communication priced."""
    setup = dataclasses.replace(setup_of(), output_dir=str(tmp_path), device_type="cuda")
    launched = []

    def fake_launch(command, directory, world_size):
        launched.append((command, directory))
        return {"command": " ".join(command), "exit_code": 0, "wall_s": 1.0,
                "entry": fake_entry(0.10, 0.13, waited=True)}

    monkeypatch.setattr(layout_timing, "launch", fake_launch)
    each = layout_search.assess(flat(1), setup)
    timing = layout_timing.run_timing(each, setup, 3)
    assert [directory for _, directory in launched] == [str(tmp_path / "timings" / "t3")]
    assert "--emulate_communication" in launched[0][0]
    assert timing["microbatch_s"] == 0.10 and timing["optimizer_s"] == 0.01
    assert timing["emulated"]["step_s"] == 0.13 and timing["clean"]
    layout_timing.take_timing(timing, each, [each], setup)
    layout_search.project(each, setup, [(each.candidate, timing)])
    assert each.speed["exposed_share"] == pytest.approx(0.6) and each.speed["labels"]["step"] == "emulated"
    assert "0.130 s with its 50 ms of communication emulated" in layout_timing.timing_said(timing)
    assert layout_timing.timing_said(timing).endswith("(1 s)")
    monkeypatch.setattr(layout_timing, "launch", lambda command, directory, world_size: {
        "command": "", "exit_code": 0, "wall_s": 1.0, "entry": fake_entry(0.10, 0.11, waited=False)})
    cpu = layout_timing.run_timing(each, dataclasses.replace(setup, device_type="cpu"), 4)
    assert cpu["microbatch_s"] == 0.10 and cpu["emulated"]["step_s"] == pytest.approx(0.15)


def test_a_timing_whose_compute_only_steps_shared_the_device_decides_nothing():
    """Another run beside it left fewer than two clean compute-only steps: the timing is not clean, with the reason,
    its compute the median of every step."""
    entry = fake_entry(0.10, 0.13, waited=True)
    entry["speed"]["emulation"]["compute_only"].update(median_step_time_s=None, median_optimizer_s=None,
                                                       tokens_per_s_per_gpu=None, not_measured="shared")
    figures = layout_timing.timed_figures(entry)
    assert not figures["clean"] and figures["unclean"] == "shared" and figures["microbatch_s"] == 0.115


def test_a_timing_that_fails_does_not_fail_the_next(tmp_path, monkeypatch):
    """plan.py holds a store of its own and its variables (``one_rank_env``, before its imports). A timing launched
    with them shared that store: the first that failed set its abort key, and every later timing read it and ended
    at once with the same reason. Here the first timing fails (an injected failure), and the next is measured."""
    for name in (*LAUNCHER_VARS, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.setenv(name, "")  # put back as they were after the test
        monkeypatch.delenv(name)
    one_rank_env()  # as plan.py starts
    setup = dataclasses.replace(setup_of(), output_dir=str(tmp_path))
    first, second = (layout_search.assess(flat(1, ac), setup) for ac in ("none", "full"))
    commands = layout_timing.timing_command
    monkeypatch.setattr(layout_timing, "timing_command", lambda candidate, setup, directory: [
        *commands(candidate, setup, directory), *(["--inject_failure", f"{TRAINED}:1:0"] if candidate.ac == "none"
                                                  else [])])
    failed, measured = (layout_timing.run_timing(each, setup, i) for i, each in enumerate((first, second)))
    assert failed["fits"] is None and "injected" in failed["error"], failed
    assert measured["fits"] is True and measured["exit_code"] == 0 and measured["microbatch_s"] > 0, measured
    found = [first, second]
    layout_timing.take_timing(failed, first, found, setup)
    layout_timing.take_timing(measured, second, found, setup)
    for each in found:
        layout_search.project(each, setup, [(second.candidate, measured)])
    assert [f.candidate.ac for f in layout_search.ranked(found)] == ["full"] and first.failed


def test_a_timing_beside_other_runs_is_taken_again_and_never_decides_the_ranking(monkeypatch, tmp_path):
    """R8xS1 and R1xS8 at B1x2 share their per-rank shapes and differ in their optimizer's share (all of it, an
    eighth). Timed beside other runs, a timing has no optimizer time: the two tied on compute, and R8xS1, which
    projects less communication, was named fastest. Here the first two timings are not clean: the row they rest on
    is timed again once, then the other is, and the winner is the one a clean timing puts first, R1xS8 (0.4 s of
    optimizer against 0.05 s); the console and plan.json say which timings decided nothing."""
    setup = dataclasses.replace(setup_of(), confirm=1, max_timings=6, output_dir=str(tmp_path))
    found = [layout_search.assess(Candidate(d, "none", "model", False, False, 1, 2), setup)
             for d in (Degrees(replicate=8, shard=1), Degrees(replicate=1, shard=8))]
    order = []

    def fake_timing(each, setup, index):
        order.append(each.candidate.degrees.replicate)
        share = layout_search.local_share(each.candidate)
        timing = {**timed(0.1, None, each.candidate.name, optimizer_s=0.4 * share, gathers_s=0.0, reductions_s=0.0),
                  "local_share": share}
        if len(order) <= 2:
            return {**timing, "clean": False, "optimizer_s": None, "unclean": "steps shared with another run"}
        return timing

    monkeypatch.setattr(layout_timing, "run_timing", fake_timing)
    timings = []
    layout_timing.choose_and_time(found, setup, lambda line: None, timings)
    assert len(order) == 3 and order[0] == order[1]  # the row on top, taken again; then the other row, clean
    winner, place = layout_search.winner_of(found, setup)
    assert winner.candidate.degrees == Degrees(replicate=1, shard=8) and winner.speed["compute_clean"]
    assert winner.speed["optimizer_s"] == pytest.approx(0.05)
    said = report.unclean_said(timings)
    assert said.startswith("2 of 3 timings not clean (steps shared with another run)") and "never the winner" in said
    path = report.write_search(found, setup, [], timings, {}, None)
    assert load(path)["meta"]["unclean_timings"] == said


def test_the_timings_stop_at_max_timings_and_at_the_time_budget(monkeypatch):
    setup = dataclasses.replace(setup_of(), confirm=100, max_timings=2)
    found = [layout_search.assess(c, setup) for c in candidates_of([Degrees(replicate=1, shard=8)],
                                                                   parse_levers("none,full,model"), 16, "cpu")]
    monkeypatch.setattr(layout_timing, "run_timing", lambda each, setup, index: timed(0.1, None, each.candidate.name))
    timings, said = [], []
    layout_timing.choose_and_time(found, setup, lambda line: None, timings)
    assert len(timings) == 2
    timings = []
    layout_timing.choose_and_time(found, dataclasses.replace(setup, time_budget_s=0.0, max_timings=10), said.append,
                                  timings)
    assert len(timings) == 1  # the budget is read before each
    assert said[-1] == "--time_budget_s 0 s spent: no further timing starts"


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "4,8"], "--world_size 4,8: --find layout plans one N"),
    (["--world_size", "4", "--global_batch", "5"], "no layout of N = 4 splits it evenly"),
    (["--world_size", "4", "--global_batch", "4", "--levers", "none,turbo"], "unknown lever turbo"),
    (["--world_size", "4", "--global_batch_tokens", "1000"], "not a whole number of --block_size 128 sequences"),
    (["--world_size", "4"], "needs one of --global_batch"),
    (["--world_size", "4", "--global_batch", "4", "--levers", "float8"], "--levers float8: --float8 needs a GPU"),
    (["--world_size", "4", "--global_batch", "4", "--confirm", "0"], "--confirm must be in [1, 1000], got 0"),
    (["--world_size", "4", "--global_batch", "4", "--max_timings", "0"], "--max_timings must be in [1, 1000]"),
    (["--world_size", "4", "--global_batch", "4", "--time_budget_s", "nan"], "--time_budget_s must be in [0, "),
    (["--world_size", "4", "--global_batch", "4", "--time_budget_s", "inf"], "--time_budget_s must be in [0, "),
    (["--world_size", "4", "--global_batch", "4", "--time_budget_s", "-1"], "--time_budget_s must be in [0, "),
])
def test_bad_input_is_one_line_before_anything_runs(argv, message, tmp_path):
    said = refusal(plan.validate, ["--find", "layout", "--device", "cpu", "--output_dir", str(tmp_path / "o"), *argv])
    assert said is not None and message in said, said
    assert not (tmp_path / "o").exists()


CPU_SEARCH = ["plan.py", "--find", "layout", "--device", "cpu", "--world_size", "4", "--block_size", "64",
              "--global_batch", "4", "--levers", "none,full,model"]


def test_a_cpu_search_cannot_tell_what_fits_ranks_every_candidate_and_its_commands_run(tmp_path):
    """Its timings run with their communication emulated over the search's own links (a file: A100 nodes of 4),
    each on its candidate's own layout; every row carries its compute, step, both bounds and their labels, the step
    emulated (on a CPU: compute + the communication priced, no overlap, and said so) where its layout ran and
    estimated where it did not. Then run again into the same folder: the earlier search's own files are gone, its
    accelerate config replaced (or gone with no winner to write one for)."""
    out, links = tmp_path / "search", tmp_path / "a100.json"
    links.write_text('{"node_size": 4, "within_gbps": 300, "across_gbps": 25}')
    proc = run_script([*CPU_SEARCH, "--max_timings", "2", "--links", str(links), "--output_dir", str(out)],
                      nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert "a CPU run: no cap, so it cannot tell what fits" in said and "estimated (e) on the rest" in said
    assert "on a CPU nothing waits for the emulated communication, so the overlap is not measured" in said
    # No GPU words on a CPU run: its ranks, what it can tell and what it cannot.
    assert "tok/s/GPU" not in proc.stdout and "tok/s/rank" in proc.stdout and "one GPU first" not in said
    # The table shows 15 of the 18 ranked rows and says where the rest are.
    numbered = [line for line in proc.stdout.splitlines() if re.match(r"\s*\d+ R\d+xS", line)]
    assert len(numbered) == report.SHOWN == 15
    assert f"the first 15 of 18 ranked rows shown; the other 3 are in {out / 'plan.json'} (every candidate)" in said
    result = load(out / "plan.json")
    assert result["meta"]["timings"] == 2 and all(c["fits"] is None for c in result["candidates"])
    assert sorted(os.listdir(out / "timings")) == ["t0", "t1"]  # one launch a timing
    check_the_timings_emulate(result, out, str(links))
    ranked = [c for c in result["candidates"] if c["speed"]]
    assert len(ranked) == len(result["candidates"]) == 18  # every candidate ranks, measured or estimated
    measured = {c["name"] for c in ranked if c["speed"]["compute_measured"]}
    assert 0 < len(measured) < 18
    check_the_rows(ranked, {t["candidate"] for t in result["timings"] if t["fits"]})
    check_the_winner(result, said, measured, out, tmp_path)
    drawn = run_script(["visualize.py", "--dir", str(out)], nproc=None)
    assert drawn.returncode == 0 and (out / "layout.png").stat().st_size > 10_000, drawn.stderr
    again = run_script([*CPU_SEARCH, "--max_timings", "1", "--output_dir", str(out)], nproc=None, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    result = load(out / "plan.json")
    assert result["meta"]["timings"] == 1 and sorted(os.listdir(out / "timings")) == ["t0"]
    assert not (out / "layout.png").exists()
    from fsdp2bench.files import digest_of

    written = (result["winner"] or {"commands": {}})["commands"].get(report.CONFIG_DIGEST)
    assert digest_of(str(out / "accelerate_config.json")) == written


def check_the_timings_emulate(result: dict, out, links: str) -> None:
    """Each timing ran main.py on its candidate's own sizes with --emulate_communication over the search's links
    file, and its summary says so."""
    for i, timing in enumerate(result["timings"]):
        command = shlex.split(timing["command"])
        assert command[command.index("--emulate_communication") + 1] == links, command
        sizes = re.search(r"R(\d+)xS(\d+)xC(\d+)xT(\d+)", timing["candidate"]).groups()
        flags = {"--dp_replicate_size": sizes[0], "--tp_size": sizes[3]}
        assert all(command[command.index(flag) + 1] == size for flag, size in flags.items() if size != "1"), command
        assert command[command.index("--simulate_world_size") + 1] == "4"
        meta = load(out / "timings" / f"t{i}" / "summary.json")["meta"]
        assert meta["emulated_links"]["node_size"] == 4 and meta["emulated_links"]["across_gbps"] == 25


def check_the_rows(ranked: list[dict], timed: set) -> None:
    """Every row: compute, step, both bounds, each labelled; the step emulated on a CPU (compute + all of the
    communication: the no-overlap bound) where its own layout ran clean, estimated where it did not."""
    for row in ranked:
        s = row["speed"]
        low, step, high = (s[k] for k in ("no_overlap_tokens_per_s", "tokens_per_s", "full_overlap_tokens_per_s"))
        assert low <= step * (1 + 1e-9) and step <= high * (1 + 1e-9)  # within the bounds, to the rounding
        assert s["step_s"] >= s["compute_s"] > 0 and set(s["labels"]) == {"compute", "communication", "step"}
        if s["labels"]["step"] == "estimated":
            assert row["emulated_timing"] is None or s["exposed_share_from"] != layout_search.OWN
        else:
            assert s["labels"]["step"] == layout_search.CPU_STEP and row["emulated_timing"] in timed
            assert s["step_s"] == pytest.approx(s["compute_s"] + s["comm_s"]) and s["labels"]["compute"] == "measured"
            assert s["labels"]["communication"].startswith("emulated")
    assert any(row["speed"]["labels"]["step"] == "estimated" for row in ranked)


def check_the_winner(result: dict, said: str, measured: set, out, tmp_path) -> None:
    """A winner named by a clean timing and its commands run; where another run shared this host's cores with
    every timing (a shared machine), none is named, and the console and plan.json say why."""
    unclean = result["meta"]["unclean_timings"]
    if unclean and result["winner"] is None:
        assert " ".join(unclean.split()) in said and "No candidate is measured enough to name" in said
        return
    winner = next(c for c in result["candidates"] if c["name"] == result["winner"]["name"])
    assert "A CPU run checks the search, not the speed" in said and "Check it here first" in said
    assert winner["name"] in measured and winner["speed"]["compute_clean"]
    figures = result["winner"]["commands"]["figures"]  # the winner's line says what each figure is
    assert winner["speed"]["labels"]["step"] == layout_search.CPU_STEP and figures in said
    assert "a step measured; communication" in figures and "emulated on a CPU" in figures
    check_the_winners_commands(result["winner"]["commands"], out, tmp_path)


def check_the_winners_commands(winner: dict, out, tmp_path) -> None:
    """The one-GPU check runs as given (on the CPU), torchrun's main.py flags pass main.py's checks, and the
    accelerate config reads back through accelerate's own loader to the winner's layout and levers."""
    check = shlex.split(winner["one_gpu_check"])
    ran = run_script([*check[1:], "--device", "cpu", "--output_dir", str(tmp_path / "check")], nproc=None)
    assert ran.returncode == 0, ran.stderr[-2000:]
    torchrun = shlex.split(winner["torchrun"])
    main_args = torchrun[torchrun.index("main.py") + 1:]
    assert arguments.validate([*main_args, "--device", "cpu", "--output_dir", str(tmp_path / "real")], 4)
    tp = int(re.search(r"xT(\d+)", winner["name"]).group(1))
    if tp > 1 and utils.name_prepare_cannot_import() is not None:  # main.py reports such a run as unsupported
        # no config either way: accelerate's own refusal of the layout (TP beside replicas with a shard of 1) comes
        # first where it applies, else the import prepare() would fail on
        said = winner["accelerate_refuses"]
        assert said.startswith("the installed accelerate cannot prepare FSDP2 + TP") or (
            "cannot be used with pure data parallelism" in said and "xS1x" in winner["name"]), winner
    if winner["accelerate_refuses"]:
        assert not (out / "accelerate_config.json").exists()
        return
    config = accelerate_config.read(str(out / "accelerate_config.json"))
    record = next(c for c in load(out / "plan.json")["candidates"] if c["name"] == winner["name"])
    assert config.num_processes == 4 and not config.not_measured
    assert {axis: config.values.get(f"{axis}_size", 1) for axis in ("dp_replicate", "dp_shard", "cp", "tp")} == \
        {axis: record[axis] for axis in ("dp_replicate", "dp_shard", "cp", "tp")}
    assert config.values.get("compile", False) == record["compile"]
    assert (config.values["activation_checkpointing"] == "full") == (record["activation_checkpointing"] == "full")


def test_a_long_block_many_microbatch_candidates_commands_run_as_printed(tmp_path):
    """B2 x 64 microbatches of 512 tokens at N = 4: the check's ten steps are 655,360 tokens, more than one pass of the
    built-in text (it held five; of the 8B search's winner, B4 x 16 of 8192 tokens, none: 'too few for one step').
    Each command trains every step it names: the check, torchrun's flags and the accelerate config with them."""
    setup = dataclasses.replace(setup_of(), world_size=4, block=512, global_sequences=4 * 2 * 64)
    said = layout_search.commands(Candidate(Degrees(replicate=1, shard=4), "none", "model", False, False, 2, 64), setup)
    assert layout_search.TIMING_STEPS * 2 * 64 * 512 > data.BUILTIN_TOKENS
    check = shlex.split(said["one_gpu_check"])
    assert "--emulate_communication" in check  # its step as the search's timings measured theirs
    ran = run_script([*check[1:], "--device", "cpu", "--output_dir", str(tmp_path / "check")], nproc=None)
    assert ran.returncode == 0, ran.stderr[-2000:]
    summary = load(tmp_path / "check" / "summary.json")
    assert summary["meta"]["steps_per_variant"] == layout_search.TIMING_STEPS == 10
    assert summary["meta"]["per_optimizer_step"]["tokens_per_rank"] == 2 * 64 * 512
    trained = summary["simulated"]["4"]["0"][TRAINED]
    assert trained["status"] == "ok" and trained["steps"] == 10
    assert summary["checks"]["accounting_matches_expected"]["ok"]
    torchrun = shlex.split(said["torchrun"])
    main_args = torchrun[torchrun.index("main.py") + 1:]
    assert main_args[-2:] == ["--max_steps", "10"]
    real = arguments.validate([*main_args, "--device", "cpu", "--output_dir", str(tmp_path / "real")], 4)
    assert real.batches.shape == (10, 2 * 64, 512)  # rank 0's: every step of its data rank's share
    config = tmp_path / "accelerate_config.json"
    assert report.write_unmarked(str(config), said["accelerate_config"]) is None
    assert arguments.validate(["--config_file", str(config), *main_args, "--device", "cpu", "--output_dir",
                               str(tmp_path / "accelerate")], 4).fsdp_options.gradient_accumulation_steps == 64


@pytest.mark.parametrize("degrees, refused", [
    (Degrees(replicate=2, shard=2), None), (Degrees(replicate=1, shard=2, tp=2), None),
    (Degrees(replicate=2, shard=1, tp=2), "cannot be used with pure data parallelism")])
def test_the_accelerate_config_reads_back_through_accelerate_or_says_why_not(degrees, refused, tmp_path):
    setup = dataclasses.replace(setup_of(), world_size=4)
    fields = layout_search.accelerate_fields(Candidate(degrees, "full", "model", True, False, 1, 2), setup)
    said = report.write_unmarked(str(tmp_path / "accelerate_config.json"), fields)
    if refused:
        assert refused in said and not (tmp_path / "accelerate_config.json").exists()
        return
    config = accelerate_config.read(str(tmp_path / "accelerate_config.json"))
    assert said is None and config.num_processes == 4 and config.values["activation_checkpointing"] == "full"
    assert config.values["compile"] is True and config.values.get("tp_size", 1) == degrees.tp
    assert config.values.get("dp_replicate_size", 1) == degrees.replicate


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_timings_ends_in_one_line_and_ranks_what_they_measured(tmp_path, signum):
    """A terminal's Ctrl-C (or a SIGTERM, or its SIGHUP as it closes) reaches plan.py and the timing it waits for:
    the timings that ended are ranked in plan.json, marked interrupted, and one line says so."""
    out = tmp_path / "search"
    proc = start_script(["plan.py", "--find", "layout", "--device", "cpu", "--world_size", "4", "--block_size", "64",
                         "--global_batch", "4", "--levers", "none,full,model", "--output_dir", str(out)],
                        nproc=None, own_group=True)
    for line in proc.stdout:
        if line.startswith("[timing 1/"):
            break
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=120)
    result = load(out / "plan.json")
    ended = result["meta"]["timings"]
    assert proc.returncode == 130 and stderr.strip().splitlines() == [
        f"Interrupted ({signal.Signals(signum).name}); the {counted(ended, 'timing')} that ended "
        f"{'is' if ended == 1 else 'are'} ranked in "
        f"{out / 'plan.json'}"], stderr
    assert result["meta"]["interrupted"] is True and ended >= 1
    assert any(c["speed"] and c["speed"]["compute_measured"] for c in result["candidates"])


def test_an_accelerate_config_not_beside_our_plan_is_left_untouched(tmp_path):
    (tmp_path / "accelerate_config.json").write_text("{}")
    said = refusal(plan.validate, ["--find", "layout", "--device", "cpu", "--world_size", "4", "--global_batch", "4",
                                   "--output_dir", str(tmp_path)])
    assert said is not None and "accelerate_config.json is there and this run would replace it" in said
    assert (tmp_path / "accelerate_config.json").read_text() == "{}"


def test_a_hand_edited_accelerate_config_beside_our_plan_is_refused_and_ours_is_replaced(tmp_path):
    """plan.json records the digest of the accelerate config its search wrote: the same file is the search's to
    replace; one edited since is a user's, and the next search is refused in one line, the file untouched."""
    from fsdp2bench.files import digest_of, write_json

    config = tmp_path / "accelerate_config.json"
    config.write_text('{"distributed_type": "FSDP"}')
    write_json(str(tmp_path / "plan.json"), {"winner": {"commands": {report.CONFIG_DIGEST: digest_of(str(config))}}})
    argv = ["--find", "layout", "--device", "cpu", "--world_size", "4", "--global_batch", "4", "--output_dir",
            str(tmp_path)]
    assert refusal(plan.validate, argv) is None
    config.write_text('{"distributed_type": "FSDP", "num_processes": 16}')
    said = refusal(plan.validate, argv)
    assert said == (f"error: --output_dir: {config} is not the file the search of {tmp_path / 'plan.json'} wrote "
                    "(edited since?) and this run would replace it; it is left untouched: move it away or choose "
                    "another --output_dir")
    assert config.read_text() == '{"distributed_type": "FSDP", "num_processes": 16}'


@pytest.mark.parametrize("place, content, message", [
    ("timings", "a file", "timings is a file, where a timing's folder goes"),
    ("timings/t1", "a file", "t1 is a file, where a timing's folder goes"),
    ("timings/t0/summary.json", '{"run_id": 1}', "summary.json was not written by this benchmark"),
])
def test_what_is_where_a_timing_folder_goes_is_refused_before_anything_runs(tmp_path, place, content, message):
    """A file where a timing's folder goes, or another program's summary.json in it: main.py refused it, and the
    search reported the candidate as failing and went on (exit 0); now one line before anything runs."""
    (tmp_path / place).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / place).write_text(content)
    said = refusal(plan.validate, ["--find", "layout", "--device", "cpu", "--world_size", "4", "--global_batch", "4",
                                   "--max_timings", "2", "--output_dir", str(tmp_path)])
    assert said is not None and said.startswith("error: --output_dir: ") and message in said, said
    assert (tmp_path / place).read_text() == content and not (tmp_path / "plan.json").exists()


def test_a_foreign_summary_where_a_timing_goes_ends_the_search_in_one_line_exit_2(tmp_path):
    (tmp_path / "timings" / "t0").mkdir(parents=True)
    (tmp_path / "timings" / "t0" / "summary.json").write_text("{}")
    proc = run_script(["plan.py", "--find", "layout", "--device", "cpu", "--world_size", "4", "--global_batch", "4",
                       "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "summary.json was not written by this benchmark" in proc.stderr and not (tmp_path / "plan.json").exists()


def test_a_search_run_again_removes_the_earlier_searchs_own_files_and_keeps_the_rest(tmp_path):
    """layout.png, the accelerate config and the timings' files of the search before (each carrying the mark) go;
    another program's file stays, and the folder that holds it."""
    from fsdp2bench.files import write_json
    from fsdp2bench.plan.layout.run import clear_earlier_search
    from PIL import Image, PngImagePlugin

    marked = PngImagePlugin.PngInfo()
    marked.add_text("written_by", "fsdp2bench")
    Image.new("RGB", (4, 4)).save(tmp_path / "layout.png", pnginfo=marked)
    (tmp_path / "accelerate_config.json").write_text("{}")
    for folder in ("t0", "t5", "t5/earlier_runs/before-1"):
        (tmp_path / "timings" / folder).mkdir(parents=True, exist_ok=True)
        write_json(str(tmp_path / "timings" / folder / "summary.json"), {})
    (tmp_path / "timings" / "t0" / "notes.txt").write_text("mine")
    clear_earlier_search(str(tmp_path))
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["timings", "timings/t0", "timings/t0/notes.txt"]


def test_a_failed_timings_reason_is_whole_in_plan_json_and_cut_at_a_word_on_the_console():
    why = "error: " + " ".join(f"word{i}" for i in range(60))
    said = layout_timing.timing_said({"fits": None, "error": why})
    assert said.startswith("did not run through (error: word0 word1") and said.endswith(" ...)") and len(said) < 200
    assert said[:-5].rsplit(" ", 1)[-1] in why.split()  # a whole word before the cut
