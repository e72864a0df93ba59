"""The figures of a run, drawn from the JSON files alone (no torch here)."""

from __future__ import annotations

import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.legend_handler import HandlerTuple  # noqa: E402

from fsdp2bench.files import MARK, MARK_KEY, refuse_foreign  # noqa: E402
from fsdp2bench.names import MIB, VARIANTS, short_name, size_unit, state_bytes
from fsdp2bench.report.traces import InputError, read_json, reading  # noqa: E402

# The zero of every time axis: all variants are compared from the moment their model is sharded,
# so the time each spent building the model does not offset the curves.
ALIGN_EVENT = "sharded"
MEMORY_PLOTS = {  # file -> (trace key, per-step peak key (the allocator's counter), what is measured)
    "allocated_memory.png": ("allocated_memory", "peak_allocated_mib", "GPU memory allocated"),
    "reserved_memory.png": ("reserved_memory", "peak_reserved_mib", "GPU memory reserved"),
    "rss_memory.png": ("virtual_memory", None, "host RSS"),
}


def aligned_times(trace: dict) -> list[float]:
    zero = next((e["t"] for e in trace["events"] if e["name"] == ALIGN_EVENT), 0.0)
    return [t - zero for t in trace["timestamps"]]


def filtered(times: list[float], values: list, threshold: float, partition: float) -> tuple[list, list]:
    """Drop missing values, and values under ``threshold`` within the first 1/partition of the trace."""
    head = int(len(values) / partition) if partition > 0 else 0
    kept = [(t, v) for i, (t, v) in enumerate(zip(times, values))
            if v is not None and not (i < head and v < threshold)]
    return [t for t, _ in kept], [v for _, v in kept]


def save(fig, path: str, dpi: int = 110, rect: tuple = (0, 0, 1, 1)) -> None:
    """``rect``: the part of the figure the axes may take (the rest holds a figure legend). Each axes'
    legend gets a band of its own above the data (``finish_axes``). Written under a temporary name, then
    renamed: a full disk or a Ctrl-C never leaves half a figure."""
    fig.tight_layout(rect=rect)
    for ax in fig.axes:
        make_room_for_legend(ax)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        refuse_foreign([path], "--dir")
        fmt = os.path.splitext(path)[1][1:] or "png"
        fig.savefig(tmp, dpi=dpi, format=fmt, metadata={MARK_KEY: MARK} if fmt == "png" else None)
        os.replace(tmp, path)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


LEGEND_FONT = 8
EACH_COLOUR = {tuple: HandlerTuple(ndivide=None, pad=0.0)}  # a key of one shape in each colour it is drawn in


def in_each_colour(colours: list[str], label: str, **style) -> tuple:
    """A legend key for a mark drawn in several colours (one per variant or option set): the mark in each of
    them, side by side, not in a colour none of them has."""
    return tuple(plt.Line2D([], [], color=c, label=label, **style) for c in colours)
LEGEND_GAP = 0.03  # of the axes' height, between the legend's band and the highest point


def finish_axes(ax, legend_font: float = LEGEND_FONT, columns: int = 4) -> None:
    """Every axes' last step: a line drawn over another with the same points says so in its label, and the
    legend goes inside the axes, at the top, in a band of its own that no data reaches (``save`` sizes it).
    Titles are one line: the callers keep them short."""
    name_coinciding(ax)
    handles, labels = ax.get_legend_handles_labels()
    if labels:
        legend_inside(ax, handles, labels, legend_font, columns)


def legend_inside(ax, handles: list, labels: list[str], font: float = LEGEND_FONT, columns: int = 4) -> None:
    """The legend at the top of the axes, in a band of its own (``make_room_for_legend``)."""
    ax.legend(handles, labels, fontsize=font, loc="upper center", ncol=min(columns, len(labels)),
              bbox_to_anchor=(0.5, 1.0), borderaxespad=0.4, framealpha=0.95, handler_map=EACH_COLOUR)
    ax._legend_band = (handles, labels, font, min(columns, len(labels)))


def make_room_for_legend(ax) -> None:
    """Fewer columns until the legend fits the axes' width; then the top of a linear y axis raised until the
    data's highest point sits below the legend's band."""
    if not getattr(ax, "_legend_band", None) or ax.get_legend() is None:
        return
    renderer = ax.figure.canvas.get_renderer()
    handles, labels, font, columns = ax._legend_band
    while columns > 1 and ax.get_legend().get_window_extent(renderer).width > ax.get_window_extent(renderer).width:
        columns -= 1
        legend_inside(ax, handles, labels, font, columns)
    if ax.get_yscale() != "linear":
        return
    band = ax.get_legend().get_window_extent(renderer).height / max(1.0, ax.get_window_extent(renderer).height)
    values = [v for line in ax.get_lines() for v in np.asarray(line.get_ydata(), dtype=float).ravel()
              if np.isfinite(v)]
    values += [p.get_y() + p.get_height() for p in ax.patches if np.isfinite(p.get_y() + p.get_height())]
    if not values:
        return
    low = ax.get_ylim()[0]
    high = max(max(values), low + 1e-9)
    ax.set_ylim(low, low + (high - low) / max(0.2, 1.0 - band - LEGEND_GAP))


def name_coinciding(ax) -> None:
    """A labelled line with the same points as one drawn after it lies under it: its label names the line that
    is seen, the last drawn of them, whole (a name cut at its comma can be the start of another's)."""
    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    labels = [line.get_label() for line in lines]
    for i, low in enumerate(lines):
        seen = next((j for j in range(len(lines) - 1, i, -1) if _same_points(low, lines[j])), None)
        if seen is not None:
            low.set_label(f'{labels[i]} (under "{_distinct_part(labels[seen], labels[i])}")')


def _distinct_part(label: str, other: str) -> str:
    """``label`` less the ": what" it shares with ``other`` ("before, fixed" of "before, fixed: sharding rule"
    beside "after: sharding rule"), else whole."""
    name, colon, what = label.partition(": ")
    return name if colon and other.endswith(f": {what}") else label


def _same_points(a, b) -> bool:
    xa, ya = (list(map(nan_if_none, v)) for v in a.get_data())
    xb, yb = (list(map(nan_if_none, v)) for v in b.get_data())
    return len(xa) > 1 and len(xa) == len(xb) and all(
        (p == q) or (p != p and q != q) for p, q in zip(xa + ya, xb + yb))


def fit_y_axis(ax, label: str) -> None:
    """From zero, so that magnitudes compare, with room above the highest point; where the band from zero to the
    lowest point would be taller than the lines' own (they would be squeezed into one band), zoomed to the lines
    instead, and said."""
    values = [v for line in ax.get_lines() for v in line.get_ydata() if v is not None and v == v]
    if not values:
        ax.set_ylabel(label)
        return
    low, high = min(values), max(values)
    span = high - low
    if 0 < span < low:
        ax.set_ylim(low - span * 0.3, high + span * 0.3)
        ax.set_ylabel(f"{label}, axis not from zero")
    else:
        ax.set_ylim(min(0.0, low), max(high, 1e-9) * 1.08)
        ax.set_ylabel(label)


def nan_if_none(value):
    return float("nan") if value is None else value


def simulated_label(runs: dict) -> str | None:
    """"simulated N=.., rank R" for the traces of one world size of a --simulate_world_size sweep."""
    meta = next(iter(runs.values()))[0]["meta"]
    return f"simulated N={meta['world_size']}, rank {meta['rank']}" if meta.get("simulated") else None


def failure_note(trace: dict) -> str:
    """", failed at step 3 (training_started), 2048 MiB requested" for a trace that did not finish."""
    if trace.get("status", "ok") == "ok":
        return ""
    state = trace.get("failure") if isinstance(trace.get("failure"), dict) else {}
    where = f" at step {state['steps_done']} ({state.get('last_event')})" if "steps_done" in state else ""
    asked = state.get("failed_allocation_mib")
    return f", {trace['status'].split(':')[0]}{where}" + (f", {asked:.0f} MiB requested" if asked else "")


def counter_peak(ranks: dict, key: str | None) -> float | None:
    """The highest per-step peak of any rank (the allocator's counter), or None where there is none."""
    values = [s.get(key) for trace in ranks.values() for s in trace["steps"]] if key else []
    values = [v for v in values if v is not None]
    return max(values) if values else None


def plot_memory(runs: dict, keys: tuple, path: str, threshold: float, partition: float) -> bool:
    """Rank 0's polled trace over time, one line per variant, each named with its peak over the steps (the
    allocator's counter, every rank; host RSS: rank 0's highest sample; the per-step figures are in the traces
    and summary.json). False when no data."""
    trace_key, peak_key, what = keys
    if not any(v is not None for ranks in runs.values() for v in ranks[0][trace_key]):
        return False
    fig, ax = plt.subplots(figsize=(12, 5))
    stopped: list[str] = []  # the colours of the lines of runs that did not finish, marked where they stopped
    for i, (name, ranks) in enumerate(runs.items()):
        times, values = filtered(aligned_times(ranks[0]), ranks[0][trace_key], threshold, partition)
        peak = counter_peak(ranks, peak_key)
        sampled = [v for v in ranks[0][trace_key] if v is not None]
        said = f": peak {peak:.0f} MiB" if peak is not None else \
            f": peak {max(sampled):.0f} MiB sampled" if sampled else ""
        colour = f"C{VARIANTS.index(name) if name in VARIANTS else i}"
        ax.plot(times, values, color=colour, lw=0.9, alpha=0.8,
                label=f"{short_name(name)}{said}{failure_note(ranks[0])}")
        if values and ranks[0].get("status", "ok") != "ok":  # where it stopped
            ax.plot(times[-1:], values[-1:], ls="none", marker="X", ms=11, color=colour, markeredgecolor="black")
            stopped.append(colour)
    ax.set_xlabel(f"seconds since the model was sharded ('{ALIGN_EVENT}' event)")
    ax.set_title(f"{what}, {simulated_label(runs) or 'rank 0'}, over time")
    fit_y_axis(ax, f"{what} (MiB)")
    ax.grid(alpha=0.3)
    name_coinciding(ax)
    handles, labels = ax.get_legend_handles_labels()
    if stopped:
        handles.append(in_each_colour(stopped, "did not finish: stopped at the X", marker="X", ms=8, ls="none",
                                      markeredgecolor="black"))
        labels.append(handles[-1][0].get_label())
    legend_inside(ax, handles, labels)
    save(fig, path)
    return True


LOSS_VERDICTS = {True: ": the stale optimizer's model did not train", False: ": the stale optimizer's model trained"}


def loss_title(unfixed_check: dict | None) -> str:
    """The loss plot's title: a conclusion about the unfixed variant only where the run's own check made one
    (summary.json's ``unfixed_did_not_train``: it ran, and the intended variants' loss fell beyond the spread of
    the batches), else what is drawn."""
    verdict = LOSS_VERDICTS.get(unfixed_check.get("ok")) if unfixed_check else None
    return "Loss per step, rank 0's batches" + (verdict or "")


def plot_loss(runs: dict, path: str, unfixed_check: dict | None = None) -> None:
    """Rank 0's loss per step; variants whose losses are equal step for step are one line, labelled
    with all of them, so that none hides under another."""
    groups: dict[tuple, list[str]] = {}
    for name, ranks in runs.items():
        groups.setdefault(tuple(s["loss"] for s in ranks[0]["steps"]), []).append(name)
    fig, ax = plt.subplots(figsize=(12, 5))
    for i, (losses, names) in enumerate(groups.items()):
        color = f"C{VARIANTS.index(names[0])}" if names[0] in VARIANTS else f"C{i}"
        ax.plot(range(len(losses)), [nan_if_none(v) for v in losses], color=color, lw=2.5 if len(names) > 1 else 1.4,
                ls="-" if i == 0 else "--", marker="o" if len(losses) <= 50 else None, ms=3,
                label=" = ".join(map(short_name, names)) + (" (equal at every step)" if len(names) > 1 else ""))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (rank 0's batches)")
    ax.set_title(loss_title(unfixed_check))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    finish_axes(ax)
    save(fig, path, dpi=120)


def plot_projection(summary: dict, path: str) -> bool:
    """Expected per-rank state against world size, with the run's own measurements on top. The variants
    whose lines coincide (the intended ones) share one legend entry; the styles say which moment."""
    proj = summary.get("projection")
    if not proj:
        return False
    table = proj["per_rank_state_bytes"]
    sizes = positive_sizes(table, "projection.per_rank_state_bytes")
    positive_sizes([proj["measured"]["world_size"]], "projection.measured.world_size")
    unit, unit_name = size_unit(max(v for row in table.values() for cell in row.values() for v in cell.values()))
    fig, ax = plt.subplots(figsize=(12, 5))
    drawn: dict[tuple, list[str]] = {}
    starred: list[str] = []  # the colours of the stars drawn
    for i, name in enumerate(VARIANTS):
        if name not in table[str(sizes[0])]:
            continue
        peak = [table[str(n)][name]["before_zero_grad"] / unit for n in sizes]
        held = [table[str(n)][name]["end_of_training"] / unit for n in sizes]
        drawn.setdefault(tuple(peak + held), []).append(name)
        ax.plot(sizes, peak, color=f"C{i}", marker="o", ms=3)
        ax.plot(sizes, held, color=f"C{i}", ls=":")
        measured = proj["measured"]["per_rank_state_bytes"].get(name)
        if measured:
            n = proj["measured"]["world_size"]
            x = n * 2 ** (0.06 * (i - 1.5))  # nudged apart: the intended ones coincide
            ax.plot([x, x], [measured["before_zero_grad"] / unit, measured["end_of_training"] / unit], ls="none",
                    marker="*", ms=12, color=f"C{i}", markeredgecolor="black")
            starred.append(f"C{i}")
    handles = [plt.Line2D([], [], color=f"C{VARIANTS.index(names[-1])}", lw=2,
                          label=" = ".join(map(short_name, names)) + (" (one line)" if len(names) > 1 else ""))
               for names in drawn.values()]
    handles += [plt.Line2D([], [], color="black", marker="o", ms=3, label="at the step peak"),
                plt.Line2D([], [], color="black", ls=":", label="between steps")]
    if starred:
        handles.append(in_each_colour(starred, "counted in this run (stars)", marker="*", ms=10, ls="none",
                                      markeredgecolor="black"))
    crossover = proj.get("unfixed_costs_more_from_world_size")
    if crossover:
        ax.axvline(crossover, color="grey", ls="--", lw=1)
        handles.append(plt.Line2D([], [], color="grey", ls="--", label=f"stale holds more from N = {crossover}"))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel(f"state per rank ({unit_name})")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{summary['meta']['model']}: state per rank by the sharding rule (lines)"
                 + (", counted here (stars)" if starred else ""))
    ax.grid(alpha=0.3)
    legend_inside(ax, handles, [(h[0] if isinstance(h, tuple) else h).get_label() for h in handles], columns=3)
    save(fig, path)
    return True


def plot_training(runs: dict, directory: str, threshold: float, partition: float) -> None:
    """The plots of a main.py run (or of one world size of a sweep); see plot_memory for the filter."""
    missing = [n for n in VARIANTS if n not in runs]
    if missing:
        print(f"note: no results for {', '.join(missing)}; plotting the others")
    for filename, keys in MEMORY_PLOTS.items():
        path = os.path.join(directory, filename)
        if plot_memory(runs, keys, path, threshold, partition):
            print(f"wrote {path}")
        else:
            print(f"skipped {filename}: the traces hold no {keys[0]} values (a CPU run has no allocator counters)")
    if simulated_label(runs):
        print("skipped loss.png: losses of a simulated world size mean nothing")
    else:
        summary_path = os.path.join(directory, "summary.json")
        with reading(summary_path):
            checks = read_json(summary_path).get("checks", {}) if os.path.exists(summary_path) else {}
            plot_loss(runs, os.path.join(directory, "loss.png"), checks.get("unfixed_did_not_train"))
        print(f"wrote {os.path.join(directory, 'loss.png')}")
    plot_summary_projection(directory)


def plot_summary_projection(directory: str) -> None:
    """memory_vs_world_size.png of the run summary.json describes, where it has a projection."""
    summary_path = os.path.join(directory, "summary.json")
    path = os.path.join(directory, "memory_vs_world_size.png")
    summary = read_json(summary_path) if os.path.exists(summary_path) else {}
    with reading(summary_path):
        drawn = plot_projection(summary, path)
    if drawn:
        print(f"wrote {path}")
    else:
        print("skipped memory_vs_world_size.png: no summary.json with a projection")


def plot_loading(loads: dict, path: str) -> None:
    """Host RSS and, where there is one, GPU memory while each mode loads the checkpoint; rank 0 solid,
    others dashed."""
    panels = [(key, what) for key, what in (("virtual_memory", "host RSS (MiB)"),
                                            ("allocated_memory", "GPU memory allocated (MiB)"))
              if any(v is not None for ranks in loads.values() for t in ranks.values() for v in t[key])]
    fig, axes = plt.subplots(1, len(panels), figsize=(12 if len(panels) == 1 else 16, 5.5), squeeze=False)
    for ax, (key, what) in zip(axes[0], panels):
        for i, (mode, ranks) in enumerate(loads.items()):
            for rank, trace in ranks.items():
                times, values = filtered(trace["timestamps"], trace[key], 0.0, 1.0)
                if values:
                    ax.plot(times, values, color=f"C{i}", lw=1.6 if rank == 0 else 1.0, ls="-" if rank == 0 else "--",
                            label=f"{mode}, rank {rank}")
        ax.set_xlabel("seconds since the mode's process started")
        ax.set_title(f"{what.split(' (')[0]} while loading")
        ax.grid(alpha=0.3)
        fit_y_axis(ax, what)
        finish_axes(ax, columns=3)
    save(fig, path)


def plot_loading_sweep(summary: dict, path: str) -> None:
    """loading.py --simulate_world_size: per mode, what rank 0 of each N added to its host RSS while
    loading, and (where there is a GPU) its GPU peak; shared_memory's one copy per node dotted."""
    sizes = sorted(positive_sizes(summary["simulated"], "simulated"))
    modes = sorted({m for by_mode in summary["simulated"].values() for m, e in by_mode.items() if e["status"] == "ok"})
    points = {mode: [(n, summary["simulated"][str(n)][mode]) for n in sizes
                     if summary["simulated"][str(n)].get(mode, {}).get("status") == "ok"] for mode in modes}
    gpu = {mode: [(n, e["ranks"][0]["peak_allocated_mib"]) for n, e in found
                  if e["ranks"][0]["peak_allocated_mib"] is not None] for mode, found in points.items()}
    fig, axes = plt.subplots(1, 2 if any(gpu.values()) else 1, figsize=(16 if any(gpu.values()) else 12, 5.5),
                             squeeze=False)
    rss = axes[0][0]
    for i, mode in enumerate(modes):
        ranks = [(n, e["ranks"][0]) for n, e in points[mode]]
        rss.plot([n for n, _ in ranks], [r["peak_rss_mib"] - r["baseline_rss_mib"] for _, r in ranks],
                 marker="o", color=f"C{i}", label=f"{mode}: added, rank 0")
        copies = [(n, e["node_copy_mib"]) for n, e in points[mode] if "node_copy_mib" in e]
        if copies:
            rss.plot(*zip(*copies), ls=":", color=f"C{i}", label=f"{mode}: the node's one copy")
        if gpu[mode]:
            axes[0][1].plot(*zip(*gpu[mode]), marker="o", color=f"C{i}", label=mode)
    whats = ("host RSS added while loading (MiB)", "GPU peak allocated while loading (MiB)")
    for ax, what in zip(axes[0], whats):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("simulated world size N (rank 0 played alone)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        finish_axes(ax, columns=3)
    rss.set_title(f"Loading {summary['model']} from a {summary['checkpoint']['dtype']} "
                  f"{summary['checkpoint'].get('format', 'safetensors')} checkpoint")
    save(fig, path)


# --------------------------------------------------------------------------- simulated world sizes

def sweep_points(summary: dict, name: str) -> list[tuple[int, int, dict]]:
    """(N, rank, entry) of every finished run of one variant in a sweep's summary.json."""
    return [(int(n), int(r), by_variant[name]) for n, by_rank in summary["simulated"].items()
            for r, by_variant in by_rank.items() if by_variant.get(name, {}).get("status") == "ok"]


def plot_sweep(summary: dict, directory: str) -> None:
    """memory_vs_world_size.png of a --simulate_world_size sweep."""
    path = os.path.join(directory, "memory_vs_world_size.png")
    plot_simulated(summary, path)
    print(f"wrote {path}")


def plot_simulated(summary: dict, path: str) -> None:
    """Top: the sharding rule's per-rank state for every N (lines) and, at each simulated N, the
    measured peak allocated in training (dots) and the state counted (crosses). Bottom: the
    measured memory beyond that state (activations, gathered parameters, buffers), the finding the
    rule cannot give; a run without an allocator (the CPU) has no such figure, and no bottom panel."""
    table = summary["projection"]["per_rank_state_bytes"]
    sizes = positive_sizes(table, "projection.per_rank_state_bytes")
    positive_sizes(summary["simulated"], "simulated")
    unit, unit_name = size_unit(max(v for row in table.values() for cell in row.values() for v in cell.values()))
    measured = any(e["training_peak_allocated_mib"]["max"] is not None
                   for name in VARIANTS for _, _, e in sweep_points(summary, name))
    fig, axes = plt.subplots(2 if measured else 1, 1, figsize=(12, 8.5 if measured else 5), sharex=True,
                             squeeze=False)
    top = axes[0][0]
    for i, name in enumerate(VARIANTS):
        if name in table[str(sizes[0])]:
            _simulated_variant(summary, name, i, sizes, unit, [ax for ax, in axes])
    ranks = sorted({int(r) for by_rank in summary["simulated"].values() for r in by_rank})
    played = "rank 0" if ranks == [0] else f"ranks {', '.join(map(str, ranks))}"
    top.set_title(f"{summary['meta']['model']}, {played} of simulated N: state at the step peak"
                  + (" and peak allocated" if measured else " (no allocator on the CPU: nothing measured beyond it)"))
    if measured:
        axes[1][0].set_title("Measured beyond the state: peak allocated in training minus the state at the step peak")
    for ax, in axes:
        ax.set_ylabel(f"{unit_name} per rank")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        finish_axes(ax, legend_font=7)
    axes[-1][0].set_xlabel("world size N (ranks)")
    save(fig, path)


def _simulated_variant(summary: dict, name: str, i: int, sizes: list[int], unit: float, axes: list) -> None:
    """One variant's line, crosses and (with a second panel: the allocator's figures) dots."""
    table = summary["projection"]["per_rank_state_bytes"]
    axes[0].plot(sizes, [table[str(n)][name]["before_zero_grad"] / unit for n in sizes], color=f"C{i}", lw=1,
                 label=f"{short_name(name)}: sharding rule")
    points = sweep_points(summary, name)
    if not points:  # it finished at no N: no crosses, no dots, and no key for them
        return
    x = [n * 2 ** (0.05 * (i - 1.5)) for n, _, _ in points]  # nudged apart: the intended ones coincide
    state = [max(state_bytes(rank["before_zero_grad"]) for rank in e["accounting"]) / unit for _, _, e in points]
    axes[0].plot(x, state, ls="none", marker="x", ms=7, color=f"C{i}", label=f"{short_name(name)}: counted (crosses)")
    peak = [nan_if_none(e["training_peak_allocated_mib"]["max"]) * MIB / unit for _, _, e in points]
    if len(axes) > 1 and any(v == v for v in peak):
        beyond = [nan_if_none(e["training_peak_beyond_state_mib"]["max"]) * MIB / unit for _, _, e in points]
        axes[0].plot(x, peak, ls="none", marker="o", ms=6, color=f"C{i}", markeredgecolor="black",
                     label=f"{short_name(name)}: peak allocated (dots)")
        axes[1].plot(x, beyond, marker="o", ms=5, lw=1, color=f"C{i}", label=short_name(name))


def positive_sizes(by_size: dict, where: str) -> list[int]:
    """The world sizes (or lengths) keying ``by_size``, each a whole number above 0: a log axis cannot draw
    another, and a file that holds one is not what the benchmark wrote (the error names the field)."""
    sizes = []
    for key in by_size:
        if not (isinstance(key, (str, int)) and str(key).isdigit() and int(key) > 0):
            raise ValueError(f"{where} has {key!r} where a whole number above 0 goes")
        sizes.append(int(key))
    return sizes


# --------------------------------------------------------------------------- runs at growing sequence lengths

def sequence_runs(directory: str) -> list[dict]:
    """The sweeps of one simulated N in ``directory``'s subdirectories (one summary.json each): what
    ``sequence_length.png`` compares, a run per sequence length and context-parallel size."""
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name, "summary.json")
        if os.path.isfile(path):
            with reading(path):
                summary = read_json(path)
                if summary.get("simulated"):
                    positive_sizes([summary["meta"]["args"]["block_size"]], "meta.args.block_size")
                    positive_sizes(summary["simulated"], "simulated")
                    found.append(summary)
    return found


def _sequence_points(summary: dict) -> list[tuple[str, int, int, float | None]]:
    """(variant, block size, cp size, peak allocated in training or None where it ran out of memory)."""
    meta = summary["meta"]
    block, cp = meta["args"]["block_size"], meta["fsdp_options"].get("layout", {}).get("cp_size", 1)
    return [(name, block, cp, e["training_peak_allocated_mib"]["max"] if e["status"] == "ok" else None)
            for by_rank in summary["simulated"].values() for by_variant in by_rank.values()
            for name, e in by_variant.items() if e["status"] == "ok" or "out of memory" in e["status"]]


def plot_sequences(runs: list[dict], path: str) -> None:
    """sequence_length.png: peak allocated per rank against the tokens of a sequence, one line per variant and
    way of holding it: FSDP2 alone (every rank the whole sequence), or context parallelism with C growing with
    it (each rank the same share). A run that ran out of memory is a cross at the top."""
    points = [p for summary in runs for p in _sequence_points(summary)]
    if not any(peak is not None for *_, peak in points):
        raise InputError("no run at any sequence length finished: nothing to draw")
    top = max(peak for *_, peak in points if peak is not None) / 1024 * 1.25
    meta = runs[0]["meta"]
    fig, ax = plt.subplots(figsize=(10, 5))
    lines = sorted({(name, cp > 1) for name, _, cp, _ in points}, key=lambda k: (k[1], VARIANTS.index(k[0])))
    for i, (name, with_cp) in enumerate(lines):
        mine = sorted((block, cp, peak) for n, block, cp, peak in points if n == name and (cp > 1) == with_cp)
        per_rank = {block // cp for block, cp, _ in mine}
        how = f"C = L / {min(per_rank)}" if with_cp and len(per_rank) == 1 else "context parallel" if with_cp \
            else "FSDP2 alone (C = 1)"
        if with_cp and len(per_rank) == 1:  # its line starts where C = 1 holds the same tokens per rank
            mine = sorted({*mine, *((b, c, p) for n, b, c, p in points if n == name and c == 1 and b in per_rank)})
        fits = [(block, peak / 1024) for block, _, peak in mine if peak is not None]
        ax.plot([b for b, _ in fits], [g for _, g in fits], marker="o", color=f"C{i}", ls="--" if with_cp else "-",
                label=f"{name}, {how}")
        failed = [block for block, _, peak in mine if peak is None]
        if failed:
            ax.plot(failed, [top] * len(failed), ls="none", marker="x", ms=10, color=f"C{i}",
                    label=f"{name}, {how}: out of memory (crosses)")
    blocks = sorted({block for _, block, _, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(blocks, [str(b) for b in blocks])
    ax.set_xlabel("tokens per sequence L (batch 1)")
    ax.set_ylim(0, top * 1.08)
    ax.set_ylabel("GiB per rank: peak allocated in training")
    ax.grid(alpha=0.3)
    n = next(iter(runs[0]["simulated"]))
    ax.set_title(f"{meta['num_parameters'] / 1e9:.2f}B {meta['model_type']}, rank 0 of simulated N = {n}: longer "
                 "sequences, with and without CP")
    finish_axes(ax)
    save(fig, path)


# --------------------------------------------------------------------------- a matrix of option sets

def matrix_cells(matrix: dict) -> tuple[list[str], list[tuple[int, bool]], dict, str]:
    """Option sets, (N, simulated) columns, {(set, N, simulated, variant): MiB} of the compared figure
    (the allocator's training peak, or on a CPU run the state at the step peak), and its name."""
    from fsdp2bench.report.matrix import compared_figure

    values: dict = {}
    figure = "training_peak_allocated_mib"
    for r in matrix["rows"]:
        if r["status"] == "ok":
            figure, value = compared_figure(r)
            key = (r["option_set"], r["world_size"], r["simulated"], r["variant"])
            values[key] = max(value, values.get(key, value))
    sets = [s for s in matrix["meta"]["option_sets"] if any(k[0] == s for k in values)]
    columns = sorted({(k[1], k[2]) for k in values}, key=lambda c: (c[1], c[0]))
    return sets, columns, values, figure


def plot_matrix(matrix: dict, path: str) -> None:
    """matrix.png: per world size a panel, per option set a group of bars (one per variant); the part
    of the unfixed variant's bar above the intended torch variant's is hatched: the stale optimizer's
    extra. Bars that coincide are drawn side by side, so none hides another."""
    sets, columns, values, figure = matrix_cells(matrix)
    if not columns:
        raise InputError("matrix.json has no finished row to draw")
    fig, axes = plt.subplots(1, len(columns), figsize=(4.2 * len(columns), 5.5), squeeze=False)
    width = 0.8 / len(VARIANTS)
    keys: dict[str, object] = {}  # one legend key per kind of bar drawn somewhere
    for ax, (n, simulated) in zip(axes[0], columns):
        for i, name in enumerate(VARIANTS):
            xs = [j + (i - 1.5) * width for j in range(len(sets))]
            ys = [values.get((s, n, simulated, name), float("nan")) / 1024 for s in sets]
            bars = ax.bar(xs, ys, width, color=f"C{i}")
            if any(y == y for y in ys):
                keys.setdefault(short_name(name), bars)
            if name == VARIANTS[1]:  # the unfixed variant
                base = [values.get((s, n, simulated, VARIANTS[0]), float("nan")) / 1024 for s in sets]
                extra = [max(0.0, y - b) for y, b in zip(ys, base)]
                hatched = ax.bar(xs, extra, width, bottom=[min(y, b) for y, b in zip(ys, base)], fill=False,
                                 hatch="///", edgecolor="black", lw=0)
                if any(e > 0 for e in extra):
                    keys.setdefault("stale optimizer's extra", hatched)
        ax.set_title(f"N = {n}{' (simulated)' if simulated else ''}")
        ax.set_xticks(range(len(sets)), sets, rotation=45, ha="right")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    what = "measured peak allocated in training" if figure == "training_peak_allocated_mib" else \
        "state held at the step peak (counted; no allocator on CPU)"
    axes[0][0].set_ylabel(f"GiB per rank: {what}")
    fig.suptitle(f"Peak per rank by option set and variant ({' '.join(matrix['meta']['main_args'])})"[:140],
                 y=0.995, fontsize=9)
    wide = len(columns) >= 3  # room for the legend on one row
    fig.legend(list(keys.values()), list(keys), loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=5 if wide else 2,
               fontsize=8)
    save(fig, path, rect=(0, 0.1 if wide else 0.2, 1, 0.97))


# --------------------------------------------------------------------------- a plan of what fits
