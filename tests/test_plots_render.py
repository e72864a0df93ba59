"""Every figure the project draws, rendered and inspected: every text inside the figure, no legend
over a data point, every legend entry visible or said to coincide with another, and every label that
promises a marker has one. The checker itself is checked on figures broken on purpose."""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from conftest import ROOT

from fsdp2bench.plan import plot as plan_plot
from fsdp2bench.report import plots

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COINCIDE = ("coincide", " = ", "under ")  # how a label says its line lies under another's
MARKER_WORDS = {"dots": ("o", "."), "crosses": ("x", "X", "+"), "stars": ("*",)}


def _points(line) -> np.ndarray:
    xy = np.asarray(line.get_xydata(), dtype=float)
    xy = xy[np.isfinite(xy).all(axis=1)] if xy.size else xy.reshape(0, 2)
    return line.get_transform().transform(xy) if len(xy) else xy


def _legends(fig) -> list:
    return [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)


def figure_problems(fig) -> list[str]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box, problems = fig.bbox, []
    undrawn = {id(label) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) for tick in axis.get_major_ticks()
               + axis.get_minor_ticks() for label in (tick.label1, tick.label2)}
    undrawn -= {id(label) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) for tick in axis._update_ticks()
                for label in (tick.label1, tick.label2)}  # the ticks within the view are the ones drawn
    for text in fig.findobj(matplotlib.text.Text):
        if text.get_visible() and text.get_text().strip() and id(text) not in undrawn:
            b = text.get_window_extent(renderer)
            if b.x0 < box.x0 - 1 or b.y0 < box.y0 - 1 or b.x1 > box.x1 + 1 or b.y1 > box.y1 + 1:
                problems.append(f"text outside the figure: {text.get_text()[:60]!r}")
    for legend in _legends(fig):
        frame = legend.get_window_extent(renderer)
        for ax in fig.axes:
            for line in ax.get_lines():
                pts = _points(line)
                inside = (pts[:, 0] > frame.x0) & (pts[:, 0] < frame.x1) & (pts[:, 1] > frame.y0) & (pts[:, 1] < frame.y1)
                if len(pts) and inside.any() and line.get_visible():
                    problems.append(f"a legend covers a point of {line.get_label()!r}")
    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        for i, low in enumerate(lines):
            for high in lines[i + 1:]:
                a, b = np.asarray(low.get_xydata(), float), np.asarray(high.get_xydata(), float)
                if a.shape == b.shape and len(a) > 1 and np.allclose(a, b, equal_nan=True) and \
                        not any(w in low.get_label() for w in COINCIDE):
                    problems.append(f"{low.get_label()!r} lies under {high.get_label()!r} and does not say so")
    for legend in _legends(fig):  # inside the canvas, and an axes' legend inside its axes
        frame, owner = legend.get_window_extent(renderer), legend.axes
        inside = owner.get_window_extent(renderer) if owner is not None else box
        if frame.x0 < inside.x0 - 1 or frame.x1 > inside.x1 + 1 or frame.y0 < inside.y0 - 1 or frame.y1 > inside.y1 + 1:
            problems.append(f"a legend outside its {'axes' if owner is not None else 'figure'}")
    for ax in fig.axes:
        for loc in ("left", "center", "right"):
            if "\n" in ax.get_title(loc):
                problems.append(f"a title of more than one line: {ax.get_title(loc)[:60]!r}")
    share = sum(ax.get_window_extent(renderer).width * ax.get_window_extent(renderer).height for ax in fig.axes)
    if share < 0.45 * box.width * box.height:
        problems.append(f"the axes take {share / (box.width * box.height):.0%} of the canvas")
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    markers = {ln.get_marker() for ax in fig.axes for ln in ax.get_lines() if len(_points(ln))}
    for word, kinds in MARKER_WORDS.items():
        if any(word in t for t in texts) and not markers & set(kinds):
            problems.append(f"a label promises {word} and none is drawn")
    return problems


def png_problems(path: Path) -> list[str]:
    """The drawn file itself: nothing touches its border (a cut label, a legend off the edge)."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("L"), dtype=float)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    return [] if border.min() >= 250 else [f"{path.name}: something is drawn on its border"]


@pytest.fixture
def drawn(monkeypatch) -> dict[str, list[str]]:
    """{file: problems} of every figure ``save`` writes while the test runs."""
    found: dict[str, list[str]] = {}
    real_save = plots.save

    def checked_save(fig, path, dpi=110, rect=(0, 0, 1, 1)):
        fig.tight_layout(rect=rect)
        for ax in fig.axes:
            plots.make_room_for_legend(ax)
        problems = figure_problems(fig)
        real_save(fig, path, dpi, rect)
        found[Path(path).name] = problems + png_problems(Path(path))

    for module in (plots, plan_plot):  # plan.png is drawn in the plan wing, by the same save
        monkeypatch.setattr(module, "save", checked_save)
    return found


def draw(directory: Path, tmp_path: Path, monkeypatch) -> None:
    import visualize

    target = tmp_path / "drawn" / directory.name
    shutil.copytree(directory, target, ignore=shutil.ignore_patterns("*.png"))
    monkeypatch.chdir(ROOT)
    visualize.plot(visualize.validate(["--dir", str(target)]))


COMMITTED = ["results/h200/default_1.5b", "results/h200/sweep_1.5b", "results/h200/matrix_1.5b",
             "results/h200/loading_1.5b/simulated", "results/h200x2", "results/h200/plan_1.5b/cap80_partial",
             "results/h200/parallel_7b", "results/h200/long_context_1.5b"]


@pytest.mark.parametrize("directory", COMMITTED)
def test_the_figures_of_the_committed_gpu_results_are_clean(directory, drawn, tmp_path, monkeypatch):
    draw(ROOT / directory, tmp_path, monkeypatch)
    assert drawn and not {k: v for k, v in drawn.items() if v}


def test_the_figures_of_cpu_runs_are_clean(drawn, tmp_path, monkeypatch, suite, cpu_sweep, loaded):
    """The shared runs: the suite's 2 ranks, a sweep of N = 2 and 8, and loading.py's every mode on 2 ranks."""
    out, _ = suite
    loads = tmp_path / "loading"  # its traces and summary, without the checkpoint
    loads.mkdir()
    for path in loaded[0].glob("loading_*.json"):
        shutil.copy(path, loads)
    for directory in (out, cpu_sweep, loads):
        draw(directory, tmp_path, monkeypatch)
    assert {"rss_memory.png", "loss.png", "memory_vs_world_size.png", "loading_memory.png"} <= set(drawn)
    assert not {k: v for k, v in drawn.items() if v}


def test_the_checker_sees_a_label_outside_and_a_legend_over_data():
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [0, 1, 2], label="a")
    ax.plot([0, 1, 2], [0, 1, 2], label="b")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 1.0))
    ax.set_ylabel("dots: measured")
    ax.text(1.5, 0, "far right", transform=ax.transAxes)
    problems = figure_problems(fig)
    plt.close(fig)
    assert any(p.startswith("text outside the figure: 'far right'") for p in problems), problems
    assert "'a' lies under 'b' and does not say so" in problems
    assert "a label promises dots and none is drawn" in problems
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [0, 2, 0], label="c")
    ax.legend(loc="upper center")  # right on top of the line's peak
    assert any("a legend covers a point of 'c'" in p for p in figure_problems(fig))
    plt.close(fig)


def test_the_checker_sees_a_legend_off_the_axes_a_title_in_lines_small_axes_and_a_cut_border(tmp_path):
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, as the figures once had it
    ax.set_title("a title\nin two lines")
    fig.subplots_adjust(left=0.1, right=0.5, top=0.6, bottom=0.2)
    problems = figure_problems(fig)
    assert "a legend outside its axes" in problems
    assert "a title of more than one line: 'a title\\nin two lines'" in problems
    assert any(p.startswith("the axes take ") for p in problems), problems
    fig.text(0.9, 0.5, "MMMMMM", fontsize=30)  # runs off the right edge
    fig.savefig(tmp_path / "cut.png")
    plt.close(fig)
    assert png_problems(tmp_path / "cut.png") == ["cut.png: something is drawn on its border"]
