"""plan.json's figure: the peak measured against the batch or block of every answer, the edge each search found and the
cap it searched under (plan.py --find batch_size or block_size; the layout search draws layout.png in
plan/layout/plot.py)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fsdp2bench.names import short_name
from fsdp2bench.report.plots import EACH_COLOUR, in_each_colour, save
from fsdp2bench.report.traces import InputError

EDGE, UPPER, SHARED, AIMED, OOM, AT_LEAST = "edge", "upper bound", "shared", "aimed", "out of memory", "at least"


def plan_figure(answers: list[dict]) -> str:
    """The peak drawn: the allocator's peak allocated (what the aiming line fits), or on a CPU run (no
    allocator) the host RSS."""
    points = [o for a in answers for o in a["outcomes"] + a.get("shared", []) if o["fits"]]
    return "peak_allocated_mib" if any(o.get("peak_allocated_mib") is not None for o in points) else "peak_rss_mib"


def plot_plan(plan: dict, path: str) -> None:
    """plan.png: per variant (rows) and N (columns) a panel; per option set the peak of every probe
    that fit against its value (filled) and of its shared process's values (hollow), the line that aimed
    the probes, the edge (the largest value that fits) ringed, or a triangle where the search's upper bound
    fit, the probes that ran out of memory as crosses on the cap, and the cap itself as a line; the legend keys
    the marks drawn."""
    answers = plan["answers"]
    if not any(o["fits"] for a in answers for o in a["outcomes"] + a.get("shared", [])):
        raise InputError("plan.json has no probe that fit: nothing to draw")
    variants = list(dict.fromkeys(a["variant"] for a in answers))
    columns = sorted({(a["world_size"], a["fixed"]) for a in answers})
    sets = list(dict.fromkeys(a["option_set"] for a in answers))
    cap = plan["meta"].get("gpu_memory")
    figure = plan_figure(answers)
    fig, axes = plt.subplots(len(variants), len(columns), figsize=(max(6.5, 4.6 * len(columns)),
                                                                   3.6 * len(variants)), squeeze=False, sharey=True)
    drawn: set[str] = set()  # the kinds of mark drawn in some panel: the legend keys those alone
    for row, variant in enumerate(variants):
        for col, (n, fixed) in enumerate(columns):
            ax = axes[row][col]
            panel = [a for a in answers if (a["variant"], a["world_size"], a["fixed"]) == (variant, n, fixed)]
            for i, name in enumerate(sets):
                answer = next((a for a in panel if a["option_set"] == name), None)
                if answer is not None:
                    drawn |= _plan_answer(ax, answer, figure, f"C{i % 10}", cap)
            if cap:
                ax.axhline(cap["allocator_limit_mib"] / 1024, color="black", ls="--", lw=1)
            other = "block" if answers[0]["searched"] == "batch_size" else "batch"
            followed = panel and all(a.get("started_at") is not None for a in panel)  # no line aimed them
            ax.set_title(f"{short_name(variant)}, N = {n}, {other} {fixed}"
                         + (": each from the first variant's edge" if followed else ""), fontsize=9)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        axes[row][0].set_ylabel("GiB " + ("allocated (peak)" if figure == "peak_allocated_mib" else "host RSS (peak)"))
    for ax in axes[-1]:
        ax.set_xlabel(answers[0]["searched"].replace("_", " "))
    _plan_legend(fig, drawn, sets, cap, (len(variants), len(columns)), path)


PLAN_MARKS = {  # a kind of mark _plan_answer draws -> its legend key's label and style
    EDGE: ("the largest that fits (a larger value did not)", dict(marker="o", ms=11, mfc="none", ls="")),
    UPPER: ("fits at the upper bound searched: the edge lies above it", dict(marker="^", ms=10, mfc="none", ls="")),
    SHARED: ("a shared process's value (aims, decides nothing)", dict(marker="s", ms=5, mfc="none", ls="")),
    AIMED: ("the line that aimed the probes", dict(ls=":")),
    OOM: ("ran out of memory (drawn on the cap)", dict(marker="x", ls="")),
    AT_LEAST: ("interrupted: the largest fit so far, a lower bound", dict(marker=">", ms=10, mfc="none", ls="")),
}


def _plan_legend(fig, drawn: set[str], sets: list[str], cap: dict | None, panels: tuple[int, int],
                 path: str) -> None:
    colours = [f"C{i % 10}" for i in range(len(sets))]  # each mark below is drawn in its option set's colour
    handles: list = [plt.Line2D([], [], color=c, marker="o", label=name) for c, name in zip(colours, sets)]
    handles += [in_each_colour(colours, label, **style) for kind, (label, style) in PLAN_MARKS.items()
                if kind in drawn]
    if cap:
        handles.append(plt.Line2D([], [], color="black", ls="--",
                                  label=f"the allocator's limit ({cap['gib']:g} GiB less the CUDA context)"))
    rows, columns = panels
    ncol = min(len(handles), 2 if columns == 1 else 4)  # one panel is too narrow for four long labels
    fig.legend(handles, [(h[0] if isinstance(h, tuple) else h).get_label() for h in handles], loc="lower center",
               ncol=ncol, fontsize=8, handler_map=EACH_COLOUR)
    rows_of_legend = -(-len(handles) // ncol)
    save(fig, path, rect=(0, 0.04 + 0.05 * rows_of_legend / rows, 1, 1))


def _plan_answer(ax, answer: dict, figure: str, color: str, cap: dict | None) -> set[str]:
    """One option set's marks in one panel; returns the kinds drawn (``PLAN_MARKS``)."""
    drawn = set()
    fits = sorted((o["value"], o[figure] / 1024) for o in answer["outcomes"] if o["fits"] and o.get(figure) is not None)
    if fits:
        ax.plot(*zip(*fits), color=color, marker="o", ms=3, lw=1)
    shared = [(o["value"], o[figure] / 1024) for o in answer.get("shared", []) if o["fits"] and o.get(figure) is not None]
    if shared:
        ax.plot(*zip(*shared), color=color, marker="s", ms=4, mfc="none", ls="")
        drawn.add(SHARED)
    line = answer.get("line")
    if line and figure == "peak_allocated_mib":
        xs = [min(v for v, _ in shared + fits), max(v for v, _ in shared + fits)]
        ax.plot(xs, [(line["peak_allocated_mib"] + line["slope_mib"] * (x - line["value"])) / 1024 for x in xs],
                color=color, ls=":", lw=1)
        drawn.add(AIMED)
    best = next((y for x, y in fits if x == answer["largest"]), None)
    if best is not None:  # at the upper bound searched, every value fit: no edge was found
        kind = UPPER if answer.get("at_upper_bound") else EDGE
        marker, size = ("^", 10) if kind == UPPER else ("o", 11)
        ax.plot([answer["largest"]], [best], color=color, marker=marker, ms=size, mfc="none", ls="")
        drawn.add(kind)
    bound = next((y for x, y in fits if x == answer.get("at_least")), None)
    if bound is not None:  # unfinished: the edge lies above this point, not at it
        ax.plot([answer["at_least"]], [bound], color=color, marker=">", ms=10, mfc="none", ls="")
        drawn.add(AT_LEAST)
    failed = [o["value"] for o in answer["outcomes"] if not o["fits"]]
    if failed and cap:
        ax.plot(failed, [cap["allocator_limit_mib"] / 1024] * len(failed), color=color, marker="x", ls="")
        drawn.add(OOM)
    return drawn
