"""What a run says on the console: the per-variant table, the sentences that explain its figures, the sweep's table,
the checks, and why a run failed; every figure is summary.json's (summary.py)."""

from __future__ import annotations

from fsdp2bench.cli import say
from fsdp2bench.memory.accounting import FULL_PRECISION, QUANTIZED
from fsdp2bench.names import INTENDED, MIB, MICROBATCH_PHASE, UNFIXED, counted, ranks_said, short_name, size_said
from fsdp2bench.options.layout import AXES
from fsdp2bench.options.links import Links, links_said
from fsdp2bench.options.step import MODEL, UPSTREAM
from fsdp2bench.options.tuning import LOW_BIT, NO_PEFT, QUANTIZED_FROM, TUNING_DEFAULTS, what_trains
from fsdp2bench.report.summary import (ACCELERATE, MEASURED_FIGURES, TORCH, worst_rank, compared_sizes, failed_status,
                                       run_entries, simulated_entries, unsupported_findings)
from fsdp2bench.train import throughput


def _fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / MIB:.1f}"


# The console table, at most 120 columns: (title, width, cell, needs an allocator). The rest of each
# figure (steps, first loss, polled peaks, what is allocated beyond the state) is in summary.json.
TABLE_COLUMNS = [
    ("final", 7, lambda v: f"{v['final_loss']:.4f}", False),
    ("drop", 6, lambda v: f"{v['loss_drop']:.1%}", False),
    ("alloc", 8, lambda v: _fmt(v["peak_allocated_mib"]["max"]), True),
    ("resv", 6, lambda v: _fmt(v["peak_reserved_mib"]["max"], ".0f"), True),
    ("RSS", 6, lambda v: _fmt(v["peak_rss_mib"]["max"], ".0f"), False),
    ("params", 7, lambda v: _mib(worst_rank(v, "end_of_training")["param_bytes"]), False),
    ("grads", 7, lambda v: _mib(worst_rank(v, "end_of_training")["grad_bytes"]), False),
    ("optim", 7, lambda v: _mib(worst_rank(v, "end_of_training")["optimizer_state_bytes"]), False),
    ("stale", 7, lambda v: _mib(worst_rank(v, "end_of_training")["stale_param_bytes"]), False),
    ("tok/s", 6, lambda v: throughput.rate_said(v.get("speed")), False),
    ("MFU", 5, lambda v: throughput.mfu_said(v.get("speed")), False),
]


NAME_WIDTH = 37  # the longest run name


def print_table(summary: dict) -> None:
    world, gpu = summary["meta"]["world_size"], summary["meta"]["device"] == "cuda"
    columns = [c for c in TABLE_COLUMNS if gpu or not c[3]]
    print(f"\nResults over {counted(world, 'rank')}; memory columns are the maximum over ranks.")
    header = f"{'variant':{NAME_WIDTH}} " + " ".join(f"{title:>{width}}" for title, width, _, _ in columns)
    print(header)
    print("-" * len(header))
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            print(f"{name:{NAME_WIDTH}} {v['status'][:80]}{how_far(v.get('failure', []))}")
            continue
        print(f"{name:{NAME_WIDTH}} " + " ".join(f"{cell(v):>{width}}" for _, width, cell, _ in columns))
    print(("MiB. alloc: the CUDA allocator's own peak; resv: its peak reserved; " if gpu else "MiB. ") +
          "RSS: the process's host memory (polled).\n"
          "     Held by one rank after the last step: params (local shards), grads, optim (the optimizer's state), "
          "stale\n     (tensors the optimizer holds that the model no longer uses). drop: fall of the loss from the "
          "first to the\n"
          "     last quarter of steps. summary.json has every figure per rank, the polled peaks and the phases.")
    say(speed_said(summary, [v for v in summary["variants"].values() if v["status"] == "ok"]), indent="     ")
    say(step_said(summary))
    for sentence in explanations(summary):
        say(sentence)
    print_checks(summary["checks"])


def speed_said(summary: dict, entries: list[dict]) -> str:
    """What tok/s and MFU are, against which peak, and why a figure is missing; the compile time where one ran."""
    figures = [v["speed"] for v in entries if v.get("speed")]  # a summary written before speeds were: none
    if not figures:
        return ""
    first = figures[0]
    warm = "steps 0 and 1, which compile" if first["warmup_steps"] == 2 else "step 0"
    gpu = summary["meta"].get("gpu_name")
    peak = (f"{gpu}'s dense bf16 peak, {first['peak_bf16_tflops']:.0f} TFLOP/s (float8 included)"
            if first["peak_bf16_tflops"] else f"no peak FLOP/s known for {gpu}" if gpu else "none on the CPU")
    flops = f"{first['model_flops_per_token'] / 1e9:.3g}"
    line = (f"tok/s: tokens per second per rank over the median step after warm-up ({warm}); MFU: {flops} GFLOP of "
            f"model FLOPs per token (docs/levers.md) against {peak}.")
    if any(f["compute_only"] for f in figures):
        line += " *: compute only (a simulated rank: no communication happens)."
    if any(f.get("emulated") for f in figures):
        line += (" +: communication emulated (each collective's time, by the links in summary.json's "
                 "meta.emulated_links, waited on the GPU stream FSDP2 issues it on; what the compute hides is hidden), "
                 "the median of the emulated steps: the odd ones; the even ones, in the same launch, time the compute "
                 "alone (the line per run gives both).")
    missing = next((f["not_measured"] for f in figures if f["not_measured"]), None)
    if missing:
        line += f" n/a: {missing}."
    compiled = [f["compile_s"] for f in figures if f["compile_s"] is not None]
    if compiled:
        line += f" Compiling took {min(compiled):.1f}-{max(compiled):.1f} s a run (warm-up beyond its median steps)."
    return line


def unfixed_loss_said(drop: float) -> str:
    """The unfixed variant's loss between its first and last quarter of steps: a change there is the batches'."""
    said = f"{abs(drop):.1%} from the first to the last quarter of steps"
    if f"{abs(drop):.1%}" == "0.0%":
        return f"its loss did not move, {said}"
    return f"its loss {'fell' if drop > 0 else 'rose'} {said} only because the batches differ"


def step_said(summary: dict) -> str:
    """The loop and the loss every variant trained with, and what the loop kept of the outputs (the same for
    every variant and N; summaries written before they existed: the upstream's)."""
    meta = summary["meta"]
    loop, loss = meta.get("loop", UPSTREAM), meta.get("loss", MODEL)
    kept = [phases["before_zero_grad"] for _, e in run_entries(summary) if e.get("kept_output_bytes")
            for phases in e["kept_output_bytes"]]
    held = f": {size_said(max(kept))} a rank" if kept and max(kept) else ""
    said = f"the outputs kept until the next forward{held}" if loop == UPSTREAM else "the loss alone kept"
    return f"Step: loop {loop} ({said}), loss {loss}."


def how_far(failure: list[dict]) -> str:
    """"; it reached step 3 (training_started), peak 139519 MiB, 896 MiB more asked" from the failing rank."""
    own = next((f for f in failure if f["status"] == "failed"), None)
    if own is None:
        return ""
    peak = own.get("peak_allocated_mib_so_far")
    asked = own.get("failed_allocation_mib")
    return (f"\n{'':38} rank {own['rank']} reached step {own['steps_done']} ({own['last_event']})"
            + (f", peak {peak:.0f} MiB allocated" if peak is not None else "")
            + (f", then asked for {asked:.0f} MiB more" if asked else ""))


def compared_sentence(found: dict | None) -> str | None:
    """accelerate against torch in one sentence, from ``accelerate_vs_torch``."""
    if not found:
        return None
    diff = found["difference_mib"]["training_peak_allocated_mib"]
    acc, ref = found["holds_at_step_peak"][ACCELERATE], found["holds_at_step_peak"][TORCH]
    state = "the same state" if acc["state_bytes"] == ref["state_bytes"] else \
        f"{(acc['state_bytes'] - ref['state_bytes']) / MIB:+.1f} MiB of state"
    peak = "no allocator counters on CPU" if diff is None else f"{diff:+.1f} MiB of training peak allocated"
    tensors = "".join(f"; at its peak accelerate holds {row['difference_mib']:+.1f} MiB of {row['tensor']} "
                      f"(allocated at {row['site']})" for row in found.get("peak_tensors_difference", [])[:3])
    return (f"accelerate against {TORCH}: {peak}; {state} at the step peak (params, grads, optimizer state, stale), "
            f"so a difference is in what a step holds beyond it (gathered parameters, activations, buffers)"
            f"{tensors}.")


def explanations(summary: dict) -> list[str]:
    """Plain sentences for the numbers that matter most."""
    out = [f"{name} {cause}; the other variants ran (what the installed libraries cannot do is a finding of this "
           f"run, not its failure)." for name, cause in unsupported_findings(run_entries(summary)).items()]
    out += [s for s in [compared_sentence(summary.get("accelerate_vs_torch")), uneven_ranks_sentence(summary),
                        tuning_sentence(summary), low_bit_sentence(summary)] if s]
    tuned = tuned_options(summary)
    unfixed = summary["variants"].get(UNFIXED)
    if unfixed and unfixed["status"] == "ok":
        rank0 = unfixed["accounting"][0]
        intended = [v["loss_drop"] for n, v in summary["variants"].items()
                    if n in INTENDED and v.get("status") == "ok" and v.get("loss_drop") is not None]
        beside = f"; the intended variants' fell {max(intended):.1%} on the same batches" if intended else ""
        stale = "adapters" if tuned.get("peft", NO_PEFT) != NO_PEFT else "parameters"
        out.append(f"{UNFIXED}: its optimizer still holds {size_said(rank0['stale_param_bytes'])} of full {stale} "
                   f"per rank that the model no longer uses; they never get gradients, so the optimizer never creates "
                   f"state ({size_said(rank0['optimizer_state_bytes'])}) and the model's weights never change "
                   f"({unfixed_loss_said(unfixed['loss_drop'])}{beside}); zero_grad() never reaches the model's "
                   f"sharded {stale}, so their "
                   f"{size_said(rank0['grad_bytes'])} of gradients are never cleared.")
    out += accumulation_sentences(summary)
    out += graph_break_sentences(summary["variants"])
    proj = summary.get("projection") or {}
    n = proj.get("unfixed_costs_more_from_world_size")
    if n is not None:
        there = proj.get("state_bytes_there") or {name: cell["before_zero_grad"]  # a summary of before the exact N
                                                  for name, cell in proj["per_rank_state_bytes"][str(n)].items()}
        rule = " (P + 2P/N) exceeds the intended one's (4P/N)" if not tuned or tuned == TUNING_DEFAULTS else \
            " exceeds the intended one's"  # under LoRA or another optimizer the terms are the adapters' and its state
        out.append(f"At the step peak the unfixed variant's state{rule} "
                   f"from N = {n} ranks on: {size_said(there[UNFIXED])} vs {size_said(there[proj['reference']])} per rank "
                   f"there (the sharding rule at every N; projection in summary.json).")
    return out


def tuned_options(summary: dict) -> dict:
    """The run's --peft and --optimizer with their knobs (none in a summary written before they existed)."""
    return summary["meta"].get("fsdp_options", {}).get("tuning", {})


FROZEN_RANKS_SHOWN, UNEVEN_RANKS_SHOWN, MOMENT_RANKS_SHOWN = 4, 8, 8  # the ranks a sentence lists (summary.json: all)


def tuning_sentence(summary: dict) -> str | None:
    """What was trained and with which optimizer, where it is not the whole model with AdamW, and what the frozen
    base held on each rank (its chunk of the whole, and no gradient or optimizer state)."""
    said = trained_said(summary)
    held = {name: e for name, e in run_entries(summary) if e.get("status") == "ok" and e.get("frozen_base")}
    if said is None or not held:
        return said
    return said + frozen_base_said(held) + statistics_said(next(iter(held.values())).get("four_bit_statistics_bytes"))


def frozen_base_said(held: dict[str, dict]) -> str:
    """What the frozen base held per rank, saying whose figures they are (one variant's, or every variant's where
    they are the same), and the most gradient and optimizer state it had in any variant on any rank."""
    (name, entry), *others = held.items()
    ranks = entry["frozen_base"]
    whose = (f"in each of the {len(held)} variants" if others and all(e["frozen_base"] == ranks for _, e in others)
             else f"in {name}" + (" (the other variants' in summary.json's frozen_base)" if others else ""))
    every = [r for e in held.values() for r in e["frozen_base"]]
    return (f" The frozen base held, {whose}, on "
            f"{ranks_said([size_said(r['frozen_param_bytes']) for r in ranks], FROZEN_RANKS_SHOWN)} of its "
            f"{size_said(entry['expected_frozen_base'][0]['frozen_full_bytes'])} (FSDP2's padded chunk), and at most "
            f"{size_said(max(r['frozen_grad_bytes'] for r in every))} of gradients and "
            f"{size_said(max(r['frozen_state_bytes'] for r in every))} of optimizer state in any variant and rank.")


def trained_said(summary: dict) -> str | None:
    """What was trained and with which optimizer, where it is not the whole model with AdamW."""
    said = what_trains(tuned_options(summary))
    return None if said is None else f"Trained: {said}."


def low_bit_sentence(summary: dict) -> str | None:
    """Under a torchao optimizer, how many trained tensors it kept in low bits and how many its rule left in full
    precision (it does so in silence, and the state counts them so): one rank's tensors, elements and state bytes,
    and the count on every rank (or simulated run) of the first variant whose optimizer stepped."""
    runs = moments_per_run(summary)
    if not runs:
        return None
    optimizer = tuned_options(summary)["optimizer"]
    low, (where, name, ranks) = LOW_BIT[optimizer], runs[0]
    quantized, plain = ranks[0][QUANTIZED], ranks[0][FULL_PRECISION]
    head = (f"{optimizer} kept in {low.codes} the moments of {quantized['tensors']} of the {trained(ranks[0])} "
            f"trained tensors ({quantized['elements']:,} elements, {size_said(quantized['state_bytes'])} of state) and "
            f"left {plain['tensors']} in full precision ({plain['elements']:,} elements, "
            f"{size_said(plain['state_bytes'])} of state), by torchao's rule: a rank's chunk is quantized only from "
            f"{QUANTIZED_FROM:,} elements and in whole blocks of {low.block}")
    if summary.get("simulated"):
        per = ", ".join(f"{w} {r[0][QUANTIZED]['tensors']} of {trained(r[0])}" for w, _, r in runs)
        return f"{head} ({where} of {name}). In {low.codes}, per run: {per}."
    per = ranks_said([f"{r[QUANTIZED]['tensors']} of {trained(r)}" for r in ranks], MOMENT_RANKS_SHOWN)
    return f"{head} (rank 0 of {name}). In {low.codes}, per rank, {per}."


def moments_per_run(summary: dict) -> list[tuple[str, str, list[dict]]]:
    """(where, variant, each rank's ``low_bit_moments``) of the first variant whose optimizer stepped: the run's,
    or each simulated N and rank's."""
    def stepped(entry: dict) -> bool:
        return entry.get("status") == "ok" and any(trained(r) for r in entry.get("low_bit_moments", []))

    if not summary.get("simulated"):
        return [("", name, e["low_bit_moments"]) for name, e in summary["variants"].items() if stepped(e)][:1]
    first: dict = {}
    for n, rank, name, e in simulated_entries(summary["simulated"]):
        if stepped(e):
            first.setdefault((n, rank), (f"N = {n} rank {rank}", name, e["low_bit_moments"]))
    return list(first.values())


def trained(moments: dict) -> int:
    """The trained tensors of one rank's ``low_bit_moments``, of either kind."""
    return sum(kind["tensors"] for kind in moments.values())


def sweep_tuning_sentence(summary: dict) -> str | None:
    """A sweep's fine-tuning: what was trained, and bitsandbytes' statistics a simulated rank held beside its 4-bit
    shards (the same at every N: they are not sharded); what the base held per N is in the table's params."""
    said = trained_said(summary)
    entry = next((v for *_, v in simulated_entries(summary["simulated"]) if v["status"] == "ok"), {})
    return None if said is None else said + statistics_said(entry.get("four_bit_statistics_bytes"))


def statistics_said(per_rank: list[int] | None) -> str:
    """bitsandbytes' statistics beside the 4-bit shards: whole on every rank, so they do not shrink with N."""
    if not per_rank:
        return ""
    return (f" Beside the base's shards, bitsandbytes' quantization statistics: {size_said(max(per_rank))} a rank, "
            "whole on every rank (no parameter, so FSDP2 does not shard them).")


def graph_break_sentences(variants: dict) -> list[str]:
    """Under --compile, each variant whose compiled blocks broke, with its block's nesting (where FSDP2's hooks
    sit against the compiled region and the checkpoint: the reason a variant's compiled speed differs)."""
    out = []
    for name, v in variants.items():
        breaks = max(v.get("graph_breaks") or [0])
        if v["status"] != "ok" or not breaks:
            continue
        nesting = v["applied"][0].get("block_nesting") or []
        inside = ("compiled" in nesting and "fully_shard" in nesting
                  and nesting.index("compiled") < nesting.index("fully_shard"))
        why = (": FSDP2's hooks run inside the compiled call, and dynamo does not trace them (a checkpoint around "
               "them then runs whole and uncompiled)" if inside else "")
        out.append(f"{name}: {counted(breaks, 'graph break')} while compiling; its block is nested "
                   f"{' > '.join(nesting)}{why}. summary.json's applied.block_nesting has each variant's.")
    return out


def uneven_ranks_sentence(summary: dict) -> str | None:
    """Where the ranks hold different parameter bytes (FSDP2's padding, TP's uneven splits), which holds what:
    the table's memory columns are the heaviest rank's."""
    name, entry = next(((n, v) for n, v in summary["variants"].items() if n in INTENDED and v.get("status") == "ok"),
                       (None, None))
    held = [rank["end_of_training"]["param_bytes"] for rank in entry["accounting"]] if entry else []
    if len(set(held)) < 2:
        return None
    heaviest = held.index(max(held))
    return ("The ranks hold different parameter bytes (FSDP2 pads the last shard; TP splits a dim that its ranks do "
            f"not divide evenly), in {name}: {ranks_said([size_said(b) for b in held], UNEVEN_RANKS_SHOWN)}; rank "
            f"{heaviest} holds the most.")


def accumulation_sentences(summary: dict) -> list[str]:
    """What a step of K microbatches is, and what each variant held between two of them."""
    step = summary["meta"].get("per_optimizer_step") or {}
    if step.get("microbatches", 1) == 1:
        return []
    mesh = step.get("mesh") or {}
    layout = " x ".join(f"{mesh[axis]} {axis}" for axis in AXES if mesh.get(axis, 1) > 1 and axis != "dp_shard")
    out = [f"One optimizer step: {counted(step['microbatches'], 'microbatch')}, "
           f"{counted(step['sequences_per_rank'], 'sequence')} and {counted(step['tokens_per_rank'], 'token')} per "
           f"rank, {step.get('tokens', 'n/a')} tokens in all"
           + (f", on {mesh['dp_shard']} dp_shard x {layout}" if layout else "") + "."]
    held = {name: worst_rank(v, MICROBATCH_PHASE) for name, v in summary["variants"].items()
            if v.get("status") == "ok" and MICROBATCH_PHASE in v["accounting"][0]}
    if held:
        out.append("Between two microbatches of the last step (before its optimizer step) each rank held gradients "
                   "not yet reduced: " + "; ".join(f"{name} {size_said(h['unreduced_grad_bytes'])} unreduced, "
                                                    f"{size_said(h['grad_bytes'])} sharded" for name, h in held.items())
                   + ".")
    return out


def emulated_said(summary: dict) -> list[str]:
    """The links the emulation priced over, then per run with emulated communication: each kind of collective a step
    issued, and the time it was given."""
    lines = []
    for n, rank, name, v in simulated_entries(summary["simulated"]):
        emulated = (v.get("emulated") or [None])[0]
        if v["status"] != "ok" or not emulated:
            continue
        kinds = "; ".join(f"{kind}: {counted(e['calls'], 'call')}, {size_said(e['bytes'])}, "
                          f"{e['emulated_s'] * 1e3:.2f} ms" for kind, e in emulated["per_step"].items())
        how = (f"waited on the GPU as {emulated.get('waited_as') or 'a sleep'}" if emulated["waited_on_the_gpu"]
               else "priced only: on a CPU nothing waits")
        lines.append(f"Emulated a step, N = {n} rank {rank} {short_name(name)}: {kinds or 'no collective'}; "
                     f"{emulated['emulated_s_per_step'] * 1e3:.2f} ms of communication in all ({how}). "
                     + one_launch_said((v.get("speed") or {}).get("emulation")))
    links = summary["meta"].get("emulated_links")
    if not (lines and links):
        return lines
    return [f"Emulated over {links_said(Links(**links))} (summary.json's meta.emulated_links; docs/links.md).", *lines]


def one_launch_said(figures: dict | None) -> str:
    """Both figures of a launch that emulated every other step, and what the step left exposed, each labelled."""
    if not figures:
        return ""
    priced = "" if figures["waited_on_the_gpu"] else " (nothing waited)"
    halves = f"compute_only {half_said(figures['compute_only'])}; emulated{priced} {half_said(figures['emulated'])}"
    exposed = figures["exposed"]
    said = (f"not measured ({exposed['not_measured']})" if exposed["s"] is None else
            f"{exposed['s'] * 1e3:+.2f} ms a step" + (f", {exposed['share']:.0%} of the "
                                                     f"{exposed['emulated_s_per_step'] * 1e3:.2f} ms emulated"
                                                     if exposed["share"] is not None else ""))
    return f"In one launch, {figures['steps']}: {halves}; exposed {said}."


def half_said(half: dict) -> str:
    if half["median_step_time_s"] is None:
        return f"n/a ({half['not_measured']})"
    return (f"{half['tokens_per_s_per_gpu']:.0f} tok/s, {half['median_step_time_s']:.4f} s a step "
            f"(median of {half['timed_steps']})")


def print_sweep_table(summary: dict) -> None:
    sim = summary["meta"]["simulated"]
    say(f"\nSimulated world sizes ({summary['meta']['model']}): one process played each rank shown, on a fake "
        f"process group (real allocations, no communication); {counted(sim['steps'], 'step')} per run. "
        f"{step_said(summary)}")
    header = (f"{'N':>4} {'rank':>4} {'variant':{NAME_WIDTH}} {'train':>8} {'resv':>6} {'tok/s':>8} {'MFU':>6} "
              f"{'params':>7} {'grads':>7} {'optim':>7} {'stale':>7} {'beyond':>7}")
    print(header)
    print("-" * len(header))
    for n, rank, name, v in simulated_entries(summary["simulated"]):
        if v["status"] != "ok":
            print(f"{n:>4} {rank:>4} {name:38} {v['status']}")
            continue
        state = v["accounting"][0]["before_zero_grad"]
        speed = v.get("speed")
        print(f"{n:>4} {rank:>4} {name:{NAME_WIDTH}} {_fmt(v['training_peak_allocated_mib']['max']):>8} "
              f"{_fmt(v['peak_reserved_mib']['max'], '.0f'):>6} {throughput.rate_said(speed):>8} "
              f"{throughput.mfu_said(speed):>6} {_mib(state['param_bytes']):>7} {_mib(state['grad_bytes']):>7} "
              f"{_mib(state['optimizer_state_bytes']):>7} {_mib(state['stale_param_bytes']):>7} "
              f"{_fmt(v['training_peak_beyond_state_mib']['max']):>7}")
    say("MiB: train = the allocator's peak over the optimizer steps (summary.json has the whole run's, building the "
        "model included); resv = reserved by the caching allocator, the set-up's cache given back before the "
        "first step. Then the state held at the step peak (after the last optimizer step): params, grads, optim "
        "(the optimizer's state), stale (the old unsharded parameters the optimizer holds); beyond = train minus "
        "that state (activations, gathered parameters, buffers, the outputs the loop keeps). The check "
        "accounting_matches_expected compares every byte of the state, at every moment, with the FSDP2 sharding "
        "rule.", indent="     ")
    say(speed_said(summary, [v for *_, v in simulated_entries(summary["simulated"]) if v["status"] == "ok"]),
        indent="     ")
    for line in emulated_said(summary):
        say(line, indent="     ")
    for sentence in (sweep_tuning_sentence(summary), low_bit_sentence(summary)):
        if sentence:
            say(sentence)
    crossover = summary["simulation_findings"]["unfixed_exceeds_intended_from_world_size"]
    exact = (summary.get("projection") or {}).get("unfixed_costs_more_from_world_size")
    rule = f"; by the sharding rule from N = {exact} on" if exact else ""
    for key, n in crossover.items():
        sizes = ", ".join(str(size) for size, _ in compared_sizes(summary["simulated"], MEASURED_FIGURES[key][0]))
        said = f"first at N = {n} of the simulated {sizes}" if n is not None else f"at none of the simulated {sizes}"
        say(f"The unfixed variant's {MEASURED_FIGURES[key][1]} exceeds every intended variant's {said}{rule}.")
    print_checks(summary["checks"])


def print_checks(checks: dict) -> None:
    """One paragraph per check: its verdict, why where it did not pass, and its figures rounded."""
    for key, check in checks.items():
        verdict = "SKIPPED" if check["ok"] is None else "PASS" if check["ok"] else "FAIL"
        why = check.get("skipped") or check.get("reason")
        figures = ", ".join(f"{k}={figure_said(v)}" for k, v in check.items() if k not in ("ok", "skipped", "reason"))
        say(f"check {key}: {verdict}{f': {why}' if why else ''}{f' ({figures})' if figures else ''}", indent="  ")


def figure_said(value) -> str:
    """A check's figure for the console: numbers to 4 significant digits, mappings as name value pairs."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {figure_said(v)}" for k, v in value.items()) + "}" if value else "none"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(figure_said(v) for v in value) + "]" if value else "none"
    return str(value)


def reruns_said(entries: list[tuple[str, dict]]) -> str | None:
    """The runs that ran out of memory beside others and were run again alone: their figures are of that run."""
    again = [label for label, e in entries if e.get("rerun_alone_after")]
    if not again:
        return None
    return (f"Run again alone after running out of memory beside others (summary.json: rerun_alone_after): "
            f"{', '.join(again)}; what each reports is of its run alone.")


def why_failed(entries: list[tuple[str, dict]], checks: dict) -> str | None:
    """The run's failure in one line: the variants that did not finish, then the checks that failed."""
    parts = []
    failed = [(label, e["status"][:120]) for label, e in entries if failed_status(e["status"])]
    if failed and not any(e["status"] == "ok" for _, e in entries):
        parts.append(f"no variant finished ({'; '.join(f'{label}: {status}' for label, status in failed)})")
    elif failed:
        parts.append("; ".join(f"{label}: {status}" for label, status in failed))
    bad = [key for key, c in checks.items() if c["ok"] is False]
    if bad:
        parts.append("check" + ("s " if len(bad) > 1 else " ") + ", ".join(
            f"{key} ({checks[key]['reason']})" if checks[key].get("reason") else key for key in bad) + " failed")
    return "; ".join(parts) or None
