"""plan.json and the console: every answer with its probes, the line that aimed them and what it found, the findings
that compare the option sets, and the table plan.py prints (pure logic, no torch)."""

from __future__ import annotations

from typing import Hashable

from fsdp2bench.cli import say
from fsdp2bench.names import counted
from fsdp2bench.plan.search import Search, outcome_said


def plan_record(meta: dict, questions: dict, searches: dict[Hashable, Search], probes: list, shared: dict,
                stood_down: list, interrupted: bool = False) -> dict:
    """plan.json: an answer per question with every probe it took (fresh, and its shared process's values),
    the counts (with the probes set up ahead that no value came to: ``stood_down``), and the findings."""
    limit = (meta.get("gpu_memory") or {}).get("allocator_limit_mib")
    answers = [{**answer_of(questions[key], search, limit),
                "shared_process": shared.get(key)} for key, search in searches.items()]
    reruns = sum(1 for p in probes if p.alone)
    meta = {**meta, "probes": len(probes), "probes_run_again_alone": reruns, "interrupted": interrupted,
            "probes_per_answer": len(probes) / len(answers) if answers else None,
            "shared_processes": len(shared), "shared_values": sum(len(s["values"]) for s in shared.values()),
            "probes_set_up_ahead": sum(1 for p in probes if p.ahead), "stood_down": len(stood_down),
            "stood_down_process_s": sum(p.ended_at - p.started_at for p in stood_down)}
    return {"meta": meta, "answers": answers, "findings": findings(answers, meta["variants"][0], meta["device"])}


def answer_of(question, search: Search, limit_mib: float | None) -> dict:
    """One answer of plan.json, its values in tokens or sequences (a search counts in ``question.unit`` steps)."""
    edge = in_units(search.answer(), question.unit)
    largest, fit = edge["largest"], edge["fit"]
    reserved = (fit or {}).get("peak_reserved_mib")
    headroom = limit_mib - reserved if limit_mib is not None and reserved is not None else None
    return {**{k: getattr(question, k) for k in ("option_set", "world_size", "rank", "variant", "searched", "fixed")},
            **edge, "headroom_mib": headroom,
            "tokens_per_rank_per_step": question.tokens_per_rank_per_step(largest // question.unit) if largest
            else None,
            "outcomes": [in_units(outcome_said(o), question.unit)
                         for o in sorted(search.outcomes, key=lambda o: o.value)],
            "shared": [in_units(outcome_said(o), question.unit) for o in search.shared_values],
            "line": line_of(search, question.unit)}


def line_of(search: Search, unit: int) -> dict | None:
    """The line that aimed the search's last probes, in the answer's units (plan.png draws it)."""
    line = search.line()
    if line is None:
        return None
    x, y, slope = line
    return {"value": x * unit, "peak_allocated_mib": y, "slope_mib": slope / unit}


def in_units(said: dict | None, unit: int) -> dict | None:
    """A search's answer or outcome with its values times ``unit``."""
    if said is None or unit == 1:
        return said
    scaled = {k: None if said.get(k) is None else said[k] * unit
              for k in ("largest", "value", "at_least", "below", "started_at")
              if k in said}
    scaled.update({k: in_units(said[k], unit) for k in ("fit", "above") if k in said})
    if "fits_above_edge" in said:
        scaled["fits_above_edge"] = [v * unit for v in said["fits_above_edge"]]
    return {**said, **scaled}


def findings(answers: list[dict], reference: str, device_type: str = "cuda") -> list[str]:
    """Per N (and fixed value): the cheapest set that fits more tokens per step than the default, by its
    probe's time per token; or, where nothing fits, the smallest peak seen."""
    out = []
    for n, fixed in sorted({(a["world_size"], a["fixed"]) for a in answers}):
        cell = [a for a in answers if a["world_size"] == n and a["fixed"] == fixed and a["variant"] == reference]
        where = f"N = {n}{_fixed_said(cell[0] if cell else None)}"
        open_ = [a for a in cell if a["error"] or not a["finished"]]
        if open_:  # a comparison with an answer that failed or was cut short would rest on a bound
            out.append(f"{where}: no finding, {len(open_)} of {counted(len(cell), 'answer')} open ("
                       + ", ".join(f"{a['option_set']} {open_said(a)}" for a in open_)
                       + ")" + "".join(f"; {a['option_set']} fits {_fit_said(a)}" for a in cell
                                       if a not in open_ and a["largest"]) + ".")
            continue
        fitting_ones = [a for a in cell if a["largest"]]
        if cell and not fitting_ones:
            smallest = min((a for a in cell if a["smallest_peak_mib"] is not None),
                           key=lambda a: a["smallest_peak_mib"], default=None)
            seen = f"; the smallest peak allocated was {smallest['smallest_peak_mib']:.0f} MiB " \
                f"({smallest['option_set']})" \
                if smallest else ""
            name = "B" if cell[0]["searched"] == "batch_size" else "L"
            lowest = min((o["value"] for a in cell for o in a["outcomes"]), default=1)
            out.append(f"{where}: {name} = {lowest} does not fit under any set{seen}.")
            continue
        default = next((a for a in cell if a["option_set"] == "default"), None)
        out.append(_cheapest_beyond(where, default, fitting_ones, "GPU" if device_type == "cuda" else "CPU's cores"))
    return out


def open_said(answer: dict) -> str:
    return ("unsupported" if unsupported(answer) else "failed") if answer["error"] else "interrupted"


def _fixed_said(answer: dict | None) -> str:
    if answer is None:
        return ""
    return f", block {answer['fixed']}" if answer["searched"] == "batch_size" else f", batch {answer['fixed']}"


def _time_per_token(answer: dict) -> float | None:
    step = (answer["fit"] or {}).get("median_step_time_s")
    return step / answer["tokens_per_rank_per_step"] if step else None


def _cheapest_beyond(where: str, default: dict | None, fitting_ones: list[dict], device: str) -> str:
    if default is None or not default["largest"]:
        best = max(fitting_ones, key=lambda a: a["tokens_per_rank_per_step"])
        first = "the default was not planned" if default is None else "the default fits nothing"
        return f"{where}: {first}; {best['option_set']} fits the most, {_fit_said(best)}."
    more = [a for a in fitting_ones if a["tokens_per_rank_per_step"] > default["tokens_per_rank_per_step"]
            and _time_per_token(a) is not None]
    said = f"{where}: the default fits {_fit_said(default)}"
    if not more:
        return f"{said}; no other set fits more."
    cheapest = min(more, key=_time_per_token)
    return (f"{said}; the cheapest set that fits more is {cheapest['option_set']}, {_fit_said(cheapest)}, at "
            f"{_time_per_token(cheapest) * 1e6:.1f} us per token in its probe (the default "
            f"{_time_per_token(default) * 1e6:.1f}; probes beside one another share the {device}, so these are "
            f"rough)")


def _fit_said(answer: dict) -> str:
    name = "B" if answer["searched"] == "batch_size" else "L"
    return f"{answer['tokens_per_rank_per_step']:,} tokens per rank per step ({name} = {answer['largest']})"


def unsupported(answer: dict) -> bool:
    """Whether an answer ended on what the installed libraries cannot do (accelerate refusing the layout, as
    main.py reports it: a finding, not a failure of the plan)."""
    return bool(answer["error"]) and ": unsupported: " in f": {answer['error']}"


def _above_said(answer: dict) -> str:
    above = answer["above"]
    if answer["error"]:
        return f"{'unsupported' if unsupported(answer) else 'failed'}: {answer['error'][:40]}"
    if answer["at_upper_bound"]:
        return "the upper bound"
    if not answer["finished"]:
        return "interrupted" + (f": below {answer['below']}" if answer.get("below") else "")
    if above is None:
        return "-"
    failed = above.get("failed_allocation_mib")
    return f"{above['value']}: out of memory" + (f" ({failed:.0f} MiB failed)" if failed is not None else "")


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def print_plan(plan: dict) -> None:
    """A table per option set and N: the largest value, its tokens and peak, and what failed above it."""
    meta = plan["meta"]
    name = "B_max" if meta["find"] == "batch_size" else "L_max"
    print(f"\n{'option set':20} {'N':>5} {'variant':26} {name:>6} {'tokens':>9} {'resv MiB':>8} {'headroom':>8} "
          f"{'probes':>6}  above it")
    for a in plan["answers"]:
        fit = a["fit"] or {}
        largest = a["largest"] or (f">={a['at_least']}" if a.get("at_least") else "-")
        print(f"{a['option_set']:20} {a['world_size']:>5} {a['variant'][:26]:26} {largest:>6} "
              f"{_mib(a['tokens_per_rank_per_step']):>9} {_mib(fit.get('peak_reserved_mib')):>8} "
              f"{_mib(a['headroom_mib']):>8} {a['probes']:>6}  {_above_said(a)}")
    cap = meta.get("gpu_memory")
    said = f"resv: the probe's peak reserved at the largest value; headroom: the allocator's limit of " \
        f"{cap['allocator_limit_mib']:,.0f} MiB less it." if cap else "A CPU run: no allocator, no cap."
    say(f"tokens: per rank per optimizer step at the largest value. {said} {counted(meta['probes'], 'fresh probe')} "
        f"({meta['probes_per_answer']:.1f} per answer, {meta['probes_run_again_alone']} run again alone, "
        f"{meta['probes_set_up_ahead']} set up ahead of their value and {meta['stood_down']} more stood down "
        f"unused) after {counted(meta['shared_values'], 'value')} in "
        f"{counted(meta['shared_processes'], 'shared process')}, in {meta['wall_s']:.0f} s; plan.json has each "
        "probe's phase and failed allocation.")
    for line in plan["findings"]:
        say(line)
