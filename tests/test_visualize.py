"""visualize.py on a real run's output, and on input it must refuse."""

from __future__ import annotations

import json
import shutil

from conftest import TINY, VARIANTS, run_script


def test_plots_a_cpu_run_and_says_what_it_skipped(suite, tmp_path):
    out, _ = suite
    work = tmp_path / "out"
    shutil.copytree(out, work)
    proc = run_script(["visualize.py", "--dir", str(work)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    for png in ("loss.png", "rss_memory.png"):
        assert (work / png).stat().st_size > 10_000
    assert "skipped allocated_memory.png" in proc.stdout and "skipped reserved_memory.png" in proc.stdout
    assert not (work / "allocated_memory.png").exists()


def test_plots_gpu_style_traces_and_a_partial_set(suite, tmp_path):
    out, _ = suite
    work = tmp_path / "out"
    work.mkdir()
    for name in VARIANTS[:2]:  # only two variants present
        for suffix in ("", "_rank1"):
            data = json.loads((out / f"{name}_memory_usage{suffix}.json").read_text())
            data["allocated_memory"] = [100.0 + i for i in range(len(data["timestamps"]))]
            data["reserved_memory"] = [200.0 + i for i in range(len(data["timestamps"]))]
            for s in data["steps"]:
                s.update(peak_allocated_mib=150.0, allocated_mib=120.0, peak_reserved_mib=250.0, reserved_mib=240.0)
            (work / f"{name}_memory_usage{suffix}.json").write_text(json.dumps(data))
    proc = run_script(["visualize.py", "--dir", str(work), "--memory_threshold", "110"], nproc=None)
    assert proc.returncode == 0, proc.stderr
    for png in ("allocated_memory.png", "reserved_memory.png", "loss.png"):
        assert (work / png).stat().st_size > 10_000
    assert f"no results for {VARIANTS[2]}, {VARIANTS[3]}" in proc.stdout


def test_refuses_missing_dir_empty_dir_corrupt_and_foreign_json(tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "nope"
    cases["empty"] = tmp_path / "empty"
    cases["empty"].mkdir()
    cases["corrupt"] = tmp_path / "corrupt"
    cases["corrupt"].mkdir()
    (cases["corrupt"] / f"{VARIANTS[0]}_memory_usage.json").write_text('{"timestamps": [1, 2')
    cases["foreign"] = tmp_path / "foreign"
    cases["foreign"].mkdir()
    (cases["foreign"] / f"{VARIANTS[0]}_memory_usage.json").write_text('{"hello": 1}')
    expected = {"missing": "no such file or directory", "empty": "no <variant>_memory_usage.json",
                "corrupt": "not valid JSON", "foreign": "missing timestamps"}
    for case, directory in cases.items():
        proc = run_script(["visualize.py", "--dir", str(directory)], nproc=None)
        assert proc.returncode == 2, case
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and expected[case] in lines[0], (case, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert f"{VARIANTS[0]}_memory_usage.json" in run_script(
        ["visualize.py", "--dir", str(cases["corrupt"])], nproc=None).stderr


def test_a_file_with_wrong_contents_is_named_left_out_and_the_rest_is_drawn(suite, tmp_path):
    work = tmp_path / "out"
    shutil.copytree(suite[0], work)
    bad_step = work / f"{VARIANTS[1]}_memory_usage_rank1.json"
    data = json.loads(bad_step.read_text())
    data["steps"][2]["loss"] = "low"
    bad_step.write_text(json.dumps(data))
    bad_event = work / f"{VARIANTS[2]}_memory_usage.json"
    data = json.loads(bad_event.read_text())
    del data["events"][0]["t"]
    bad_event.write_text(json.dumps(data))
    proc = run_script(["visualize.py", "--dir", str(work)], nproc=None)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad_step}: steps[2].loss is not a number; left out, the other plots were drawn",
        f"error: {bad_event}: events[0] has no t; left out, the other plots were drawn"]
    assert f"no results for {VARIANTS[2]}" in proc.stdout  # its rank 0 was unusable
    assert (work / "loss.png").stat().st_size > 10_000 and "Traceback" not in proc.stderr


def test_a_directory_holding_two_runs_is_drawn_as_the_run_its_summary_describes(suite, tmp_path):
    work = tmp_path / "out"
    shutil.copytree(suite[0], work)  # 2 ranks, 4 variants
    proc = run_script(["main.py", *TINY, "--max_steps", "2", "--variants", VARIANTS[0], "--output_dir", str(work)],
                      nproc=None)
    assert proc.returncode == 0, proc.stderr
    aside, = (work / "earlier_runs").iterdir()  # the run moved the first run's files there
    for trace in aside.glob("*_memory_usage*.json"):  # put back by hand: a directory of two runs
        if not (work / trace.name).exists():
            shutil.copy(trace, work / trace.name)
    run_id = json.loads((work / "summary.json").read_text())["meta"]["run_id"]
    proc = run_script(["visualize.py", "--dir", str(work)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    # The new run wrote the first variant's rank-0 file; its rank-1 file and the 3 others' 6 are the first run's.
    assert f"note: left out 7 trace files of other runs in {work}; plotting only the run summary.json describes " \
           f"({run_id})" in proc.stdout
    assert f"no results for {', '.join(VARIANTS[1:])}" in proc.stdout
    (work / "summary.json").write_text(json.dumps({**json.loads((work / "summary.json").read_text()),
                                                   "meta": {"run_id": "a later run"}}))
    for trace in work.glob("*_memory_usage*.json"):
        if json.loads(trace.read_text())["run_id"] == run_id:
            trace.unlink()
    proc = run_script(["visualize.py", "--dir", str(work)], nproc=None)  # a summary beside no trace of its run
    assert "plotting only the run summary.json describes (a later run), which has none here" in proc.stdout
    assert "wrote" not in proc.stdout.replace("memory_vs_world_size.png", "")


def test_json_errors_and_sizes_no_axis_can_draw_are_one_line_each(cpu_sweep, tmp_path):
    """A string cut short is named without "at at"; a world size of 0 on a log axis is refused by its field,
    before matplotlib warns (once per line that drew it) and fails."""
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / f"{VARIANTS[0]}_memory_usage.json").write_text('{\n "timestamps": [1],\n "events": "unterminated')
    proc = run_script(["visualize.py", "--dir", str(cut)], nproc=None)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {cut / VARIANTS[0]}_memory_usage.json: not valid JSON (Unterminated string starting at line 3, "
        "column 12)")
    for n in ("0", "-8"):
        zero = tmp_path / f"zero{n}"
        shutil.copytree(cpu_sweep, zero)
        summary = json.loads((zero / "summary.json").read_text())
        summary["simulated"][n] = summary["simulated"].pop("8")
        (zero / "summary.json").write_text(json.dumps(summary))
        proc = run_script(["visualize.py", "--dir", str(zero)], nproc=None)
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"error: {zero / 'summary.json'}: not what main.py writes (ValueError: simulated has '{n}' where a whole "
            "number above 0 goes)"), proc.stderr


def test_a_libraries_warning_is_one_line_said_once(capsys):
    import warnings

    import visualize

    warnings.showwarning = visualize.warn_once
    for _ in range(4):
        warnings.warn_explicit("Data has no positive values,\n and therefore cannot be log-scaled.", UserWarning,
                               "matplotlib/ticker.py", 48)
    assert capsys.readouterr().err == "warning: Data has no positive values, and therefore cannot be log-scaled.\n"


def drawn(monkeypatch, draw, module: str = "fsdp2bench.report.plots") -> list:
    """The figures a plot function of ``module`` draws, kept instead of saved."""
    import importlib

    plots = importlib.import_module(module)
    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path, dpi=110, rect=None: figures.append(fig))
    draw(plots)
    return figures


def test_plots_hide_no_series_and_say_what_they_count(suite, monkeypatch):
    """Coinciding losses are one line labelled with every variant; every variant's memory is in the legend,
    short-named, with its peak; magnitudes start at zero; a tiny model's state is drawn in MiB, as state only."""
    out, _ = suite
    runs = __import__("fsdp2bench.report.traces", fromlist=["load_traces"]).load_traces(
        str(out), {name: f"{name}_memory_usage" for name in VARIANTS}, [])
    loss, = drawn(monkeypatch, lambda plots: plots.plot_loss(runs, "loss.png"))
    labels = [t.get_text() for t in loss.axes[0].get_legend().get_texts()]
    assert labels == ["after = before, fixed = accelerate (equal at every step)", "before, stale"]
    rss, = drawn(monkeypatch, lambda plots: plots.plot_memory(runs, plots.MEMORY_PLOTS["rss_memory.png"], "x", 0, 2))
    labels = [t.get_text() for t in rss.axes[0].get_legend().get_texts()]
    assert len(rss.axes) == 1 and len(labels) == len(rss.axes[0].lines) == len(VARIANTS)
    peaks = {name: max(v for v in runs[name][0]["virtual_memory"] if v is not None) for name in VARIANTS}
    assert labels[1] == f"before, stale: peak {peaks[VARIANTS[1]]:.0f} MiB sampled"
    # From zero, or zoomed where the lines lie within a tenth of their height, and then said.
    assert all(ax.get_ylim()[0] <= 0 or ax.get_ylabel().endswith("axis not from zero") for ax in rss.axes)
    summary = json.loads((out / "summary.json").read_text())
    projection, = drawn(monkeypatch, lambda plots: plots.plot_projection(summary, "x"))
    assert projection.axes[0].get_ylabel() == "state per rank (MiB)"
    assert projection.axes[0].get_title() == "tiny: state per rank by the sharding rule (lines), counted here (stars)"


def test_figures_draw_what_has_data_and_say_truly_what_each_mark_is(suite, cpu_sweep, monkeypatch):
    """Lines of 300-360 MiB fill the axis (it does not start at 0); a legend key shows each colour its marks are
    drawn in; a line under another names that one whole; a CPU sweep has no empty allocator panel."""
    from fsdp2bench.report import traces

    out, _ = suite
    runs = traces.load_traces(str(out), {name: f"{name}_memory_usage" for name in VARIANTS}, [])
    rss, = drawn(monkeypatch, lambda p: p.plot_memory(runs, p.MEMORY_PLOTS["rss_memory.png"], "x", 0, 2))
    values = [v for line in rss.axes[0].get_lines() for v in line.get_ydata() if v == v]
    low, high = rss.axes[0].get_ylim()
    assert (max(values) - min(values)) / (high - low) > 0.5 and rss.axes[0].get_ylabel().endswith("not from zero")
    summary = json.loads((out / "summary.json").read_text())
    projection, = drawn(monkeypatch, lambda p: p.plot_projection(summary, "x"))
    ax = projection.axes[0]
    stars = {line.get_color() for line in ax.get_lines() if line.get_marker() == "*"}
    key, = [h for h in ax._legend_band[0] if isinstance(h, tuple)]
    assert len(stars) == 4 and {h.get_color() for h in key} == stars and {h.get_marker() for h in key} == {"*"}
    sweep = json.loads((cpu_sweep / "summary.json").read_text())
    figure, = drawn(monkeypatch, lambda p: p.plot_simulated(sweep, "x"))
    assert len(figure.axes) == 1 and not figure.axes[0].texts
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert 'after: sharding rule (under "accelerate")' in labels
    assert 'before, fixed: sharding rule (under "accelerate")' in labels
    assert not [label for label in labels if "before's" in label]


def legend_labels(figure) -> list[str]:
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None] + list(figure.legends)
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def test_titles_legends_and_marks_follow_the_data_drawn(suite, monkeypatch):
    """No title states a conclusion the run did not reach, no legend keys a mark that is not drawn, a mark is in its
    line's colour, and the largest value searched that fit is not called the edge."""
    import copy

    from conftest import ROOT

    out, _ = suite
    traces = __import__("fsdp2bench.report.traces", fromlist=["load_traces"])
    runs = traces.load_traces(str(out), {name: f"{name}_memory_usage" for name in VARIANTS}, [])
    for check, title in ((None, "Loss per step, rank 0's batches"),
                         ({"ok": None}, "Loss per step, rank 0's batches"),
                         ({"ok": True}, "Loss per step, rank 0's batches: the stale optimizer's model did not train"),
                         ({"ok": False}, "Loss per step, rank 0's batches: the stale optimizer's model trained")):
        loss, = drawn(monkeypatch, lambda p: p.plot_loss(runs, "x", check))
        assert loss.axes[0].get_title() == title
    failed = copy.deepcopy(runs)
    failed[VARIANTS[2]][0]["status"] = "failed"
    rss, = drawn(monkeypatch, lambda p: p.plot_memory(failed, p.MEMORY_PLOTS["rss_memory.png"], "x", 0, 2))
    line, = [ln for ln in rss.axes[0].get_lines() if ln.get_label().startswith("before, fixed")]
    stop, = [ln for ln in rss.axes[0].get_lines() if ln.get_marker() == "X"]
    assert stop.get_color() == line.get_color() == "C2"
    assert "did not finish: stopped at the X" in legend_labels(rss)
    summary = json.loads((out / "summary.json").read_text())
    summary["projection"]["measured"]["per_rank_state_bytes"] = {}  # nothing counted: no stars
    projection, = drawn(monkeypatch, lambda p: p.plot_projection(summary, "x"))
    assert projection.axes[0].get_title() == "tiny: state per rank by the sharding rule (lines)"
    assert not [label for label in legend_labels(projection) if "star" in label]
    matrix = {"meta": {"option_sets": ["default"], "main_args": []},
              "rows": [{"option_set": "default", "world_size": 2, "simulated": True, "variant": v, "status": "ok",
                        "training_peak_allocated_mib": 100.0} for v in (VARIANTS[0], VARIANTS[3])]}
    figure, = drawn(monkeypatch, lambda p: p.plot_matrix(matrix, "x"))
    assert legend_labels(figure) == ["after", "accelerate"]  # no stale bars, so no key for them or their extra
    plan = json.loads((ROOT / "results" / "h200" / "plan_1.5b" / "cap24_4f02486" / "plan.json").read_text())
    plan["meta"]["gpu_memory"] = None  # no cap: the out-of-memory crosses are drawn on none
    for answer in plan["answers"]:
        answer["at_upper_bound"] = True
    figure, = drawn(monkeypatch, lambda p: p.plot_plan(plan, "x"), "fsdp2bench.plan.plot")
    labels = legend_labels(figure)
    assert "fits at the upper bound searched: the edge lies above it" in labels
    assert not [label for label in labels if "largest that fits" in label or "out of memory" in label], labels
