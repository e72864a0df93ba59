"""Verdicts and success lines that are true: a check says SKIPPED where its evidence cannot decide, the
two training checks never both pass on one drop, a failed run says why on its last line, and nothing
claims work that did not happen."""

from __future__ import annotations

import random
import re

import pytest
from conftest import load, run_script

from fsdp2bench.cli import UserError, check_gpus_per_rank
from fsdp2bench.names import INTENDED, UNFIXED
from fsdp2bench.report import console
from fsdp2bench.report.summary import drop_threshold, loss_drop, run_checks

CPU_TINY = ["--model", "tiny", "--device", "cpu"]


def entries(intended: list[float], unfixed: list[float]) -> dict:
    """Variant entries as run_checks reads them, from two loss series."""
    def entry(losses):
        return {"status": "ok", "steps": len(losses), "losses": losses, "loss_drop": loss_drop(losses),
                "accounting_matches_expected": True, "applied_matches_options": True}
    return {**{name: entry(intended) for name in INTENDED}, UNFIXED: entry(unfixed)}


def noisy(steps: int, start: float, slope: float, spread: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [start - slope * i + rng.gauss(0, spread) for i in range(steps)]


def test_the_two_training_checks_never_both_pass_on_one_drop():
    """Whatever the series, a drop that passes "trained" fails or skips "did not train" when the unfixed
    variant shows that same drop, and the bar comes from the series' own spread."""
    for seed in range(200):
        rng = random.Random(seed)
        steps, spread = rng.randint(8, 60), rng.choice([0.0, 0.001, 0.01, 0.1])
        losses = noisy(steps, 6.0, rng.choice([0.0, 0.001, 0.01, 0.05]), spread, seed)
        checks = run_checks(entries(losses, losses), "cpu")
        trained, not_trained = checks["intended_variants_trained"], checks["unfixed_did_not_train"]
        assert not (trained["ok"] is True and not_trained["ok"] is True), (seed, trained, not_trained)
        assert trained["threshold"] == not_trained["threshold"]


def test_a_loss_of_zero_is_no_training_whatever_the_other_variants_show():
    """A causal LM's cross entropy is positive wherever its forward computed anything: a variant at loss 0 from its
    second step on (QLoRA's uint8 storage under FSDP2, accelerate#3983) fails the run, named, and no drop is
    claimed for it; nothing divides by its zero loss."""
    variants = entries(noisy(12, 6.0, 0.05, 0.01, 4), noisy(12, 6.0, 0.0, 0.01, 5))
    zeros = [6.0] + [0.0] * 11
    variants["accelerate"].update(losses=zeros, loss_drop=loss_drop(zeros))
    checks = run_checks(variants, "cpu")
    assert checks["losses_finite"] == {"ok": False, "first_non_finite_step": {"accelerate": 1}}
    assert checks["intended_variants_trained"]["ok"] is False
    assert checks["intended_variants_trained"]["reason"] == "a loss is not a positive number"
    assert loss_drop([0.0] * 8) != loss_drop([0.0] * 8)  # NaN: no fall to measure


def test_the_bar_follows_the_spread_of_the_batches_not_a_constant():
    quiet = drop_threshold([noisy(40, 6.0, 0.0, 0.001, 1)])["threshold"]
    loud = drop_threshold([noisy(40, 6.0, 0.0, 0.1, 1)])["threshold"]
    assert 50 < loud / quiet < 200  # a hundred times the spread, about a hundred times the bar
    # A trend is not spread: a clean straight fall leaves none.
    assert drop_threshold([[6.0 - 0.1 * i for i in range(12)]])["threshold"] < 1e-9


def test_a_rise_within_the_spread_is_said_as_a_rise():
    """A loss that rose, but less than the bar, once read "the loss fell -0.25%"."""
    flat = noisy(12, 6.0, 0.0, 0.05, 3)
    rising = [x + 0.001 * i for i, x in enumerate(flat)]
    trained = run_checks(entries(rising, flat), "cpu")["intended_variants_trained"]
    assert trained["ok"] is None and min(trained["loss_drop"].values()) < 0, trained
    assert trained["skipped"].startswith("the loss rose ") and "steps would show whether it falls" in \
        trained["skipped"], trained["skipped"]


def test_a_fall_within_the_spread_is_skipped_with_the_steps_it_would_need():
    flat = noisy(12, 6.0, 0.0, 0.05, 3)
    slow = [x - 0.002 * i for i, x in enumerate(flat)]
    checks = run_checks(entries(slow, flat), "cpu")
    trained = checks["intended_variants_trained"]
    assert trained["ok"] is None and "within the spread of its batches" in trained["skipped"]
    needed = int(trained["skipped"].split("about ")[1].split(" steps")[0])
    assert needed > 12
    assert checks["unfixed_did_not_train"]["ok"] is None
    # The same series, longer: the fall shows, and the unfixed variant's flat loss is evidence.
    long_flat = noisy(4 * needed, 6.0, 0.0, 0.05, 3)
    checks = run_checks(entries([x - 0.002 * i for i, x in enumerate(long_flat)], long_flat), "cpu")
    assert checks["intended_variants_trained"]["ok"] is True
    assert checks["unfixed_did_not_train"]["ok"] is True


def test_a_rising_loss_fails_and_an_unfixed_one_that_falls_fails():
    rising = [6.0 + 0.05 * i for i in range(12)]
    falling = [6.0 - 0.05 * i for i in range(12)]
    checks = run_checks(entries(rising, falling), "cpu")
    assert checks["intended_variants_trained"]["ok"] is False
    assert checks["unfixed_did_not_train"]["ok"] is False
    assert console.why_failed(list(entries(rising, falling).items()), checks) == (
        "checks intended_variants_trained (the loss rose beyond the spread of its batches), unfixed_did_not_train "
        "(its loss fell beyond the spread of its batches) failed")


@pytest.mark.parametrize("flags", [["--max_steps", "2"], ["--max_steps", "3"],
                                   ["--max_steps", "3", "--gradient_accumulation_steps", "2", "--batch_size", "1"]])
def test_a_valid_short_run_exits_0_and_says_why_its_training_checks_are_skipped(tmp_path, flags):
    proc = run_script(["main.py", *CPU_TINY, *flags, "--output_dir", str(tmp_path)], nproc=None)  # steps, not ranks
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = load(tmp_path / "summary.json")["checks"]
    for key in ("intended_variants_trained", "unfixed_did_not_train"):
        assert checks[key]["ok"] is None and "it needs at least 8 steps" in checks[key]["skipped"], checks[key]
        assert f"check {key}: SKIPPED: " in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"    python3 visualize.py --dir {tmp_path}"
    assert "FAILED" not in proc.stderr


def test_check_lines_print_rounded_figures(suite):
    _, proc = suite  # 2 ranks, 12 steps at 1e-3: every check decided
    lines = [line for line in proc.stdout.splitlines() if "check " in line or line.startswith("  ")]
    assert re.search(r"check intended_variants_trained: PASS \(loss_drop=\{torch_optimizer_after_fsdp 0\.\d{1,4},",
                     proc.stdout), proc.stdout
    digits = [word for line in lines for word in line.replace(",", " ").replace("}", " ").split()
              if word.replace(".", "").replace("-", "").isdigit()]
    assert digits and all(len(word.lstrip("-0.").replace(".", "")) <= 4 for word in digits), digits


def test_a_run_whose_every_variant_failed_claims_no_results_and_says_why_last(tmp_path):
    proc = run_script(["main.py", *CPU_TINY, "--max_steps", "3", "--variants", "torch_optimizer_after_fsdp",
                       "--inject_failure", "torch_optimizer_after_fsdp:1:0", "--output_dir", str(tmp_path)], nproc=None)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "draw the plots" not in proc.stdout and "Wrote" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("FAILED: no variant finished (torch_optimizer_after_fsdp: failed: rank 0: RuntimeError: "
                           "injected failure at step 1 on rank 0)"), proc.stderr


def test_a_run_with_a_failed_check_names_it_on_its_last_line(diverged):
    _, proc = diverged  # a NaN injected at step 1 of the second variant; exit code 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "FAILED: checks losses_finite, intended_losses_match, intended_variants_trained (a loss is not a positive "
        "number) "
        "failed; summary.json says more")


def test_more_ranks_than_gpus_is_refused_with_the_ways_out():
    check_gpus_per_rank(1, 1)
    check_gpus_per_rank(2, 8)
    with pytest.raises(UserError) as refused:
        check_gpus_per_rank(2, 1)
    assert str(refused.value) == (
        "2 ranks were started on this node but 1 GPU is visible to them, and each rank needs a GPU of its own: "
        "start 1 (--nproc_per_node 1), measure N = 2 on one GPU with --simulate_world_size 2, or run on the CPU "
        "with --device cpu")


# A refusal under torchrun said once, by rank 0: test_faults.py's test_bad_input_under_torchrun_stops_every_rank_with_
# one_line (the same launch of a refused command line on 2 ranks).


@pytest.mark.parametrize("drop, said", [
    (0.0, "its loss did not move, 0.0% from the first to the last quarter of steps"),
    (-0.0004, "its loss did not move, 0.0% from the first to the last quarter of steps"),
    (0.012, "its loss fell 1.2% from the first to the last quarter of steps only because the batches differ"),
    (-0.007, "its loss rose 0.7% from the first to the last quarter of steps only because the batches differ"),
])
def test_the_unfixed_variants_loss_is_said_as_it_moved(drop, said):
    """No "fell 0.0% ... only because the batches differ" where nothing fell."""
    assert console.unfixed_loss_said(drop) == said


@pytest.mark.parametrize("device, levers, tolerance", [
    ("cpu", {}, 0.0), ("cuda", {}, 1e-2),
    ("cpu", {"compile": True}, 1e-2), ("cuda", {"compile": True}, 1e-2), ("cuda", {"float8": True}, 1e-2),
])
def test_the_losses_may_differ_only_where_the_variants_run_other_kernels(device, levers, tolerance):
    """Bit-identical on the CPU, unless a lever has accelerate compile or convert its model by its own path: then a
    loss one bf16 step apart is the kernels', not a failure (a 2-rank CPU run under --compile differed so)."""
    from fsdp2bench.options.fsdp import FsdpOptions

    losses = [2.0 - 0.05 * i for i in range(12)]
    apart = [x * (1 + 2 ** -8) if i == 5 else x for i, x in enumerate(losses)]  # one bf16 step at one step
    variants = entries(losses, losses)
    variants["accelerate"]["losses"] = apart
    checks = run_checks(variants, device, FsdpOptions(**levers))
    matched = checks["intended_losses_match"]
    assert matched["relative_tolerance"] == tolerance and matched["ok"] is (tolerance > 0), matched
