"""Reading what a run wrote, for the figures: each JSON file checked before it is drawn (one line names a file that is
not this benchmark's, or malformed), every rank's trace of every variant, and which run of a directory is the
latest."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re

from fsdp2bench.names import TRACE_KEYS


class InputError(Exception):
    """Unusable input: reported in one line."""


@contextlib.contextmanager
def reading(path: str):
    """A file of the right name with the wrong content becomes one line that names it."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise InputError(f"{path}: not what main.py writes ({type(exc).__name__}: {exc})") from None


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:  # its msg may end in "at" ("Unterminated string starting at")
        where = f"line {exc.lineno}, column {exc.colno}"
        raise InputError(f"{path}: not valid JSON ({exc.msg.removesuffix(' at')} at {where})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a memory trace of main.py (expected a JSON object)")
    return data


STEP_NUMBERS = ("loss", "step_time_s", "t", "peak_allocated_mib", "peak_reserved_mib", "allocated_mib",
                "reserved_mib", "rss_mib")


def _number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def trace_problem(data: dict) -> str | None:
    """What makes ``data`` unusable as a trace (the first thing found), or None."""
    missing = [k for k in (*TRACE_KEYS, "steps", "events") if k not in data]
    if missing:
        return f"not a memory trace of main.py (missing {', '.join(missing)})"
    for key in TRACE_KEYS:
        if not isinstance(data[key], list):
            return f"{key} is not a list"
        bad = next((i for i, v in enumerate(data[key]) if not _number(v)), None)
        if bad is not None:
            return f"{key}[{bad}] is not a number"
    if len({len(data[k]) for k in TRACE_KEYS}) != 1:
        return "trace lists have different lengths"
    for key, fields in (("steps", {"step": int, **{k: float for k in STEP_NUMBERS}}), ("events", {"t": float})):
        if not isinstance(data[key], list):
            return f"{key} is not a list"
        for i, record in enumerate(data[key]):
            if not isinstance(record, dict):
                return f"{key}[{i}] is not an object"
            for field, kind in fields.items():
                if field in ("step", "loss", "t") and field not in record:
                    return f"{key}[{i}] has no {field}"
                if field in record and not (_number(record[field]) if kind is float else
                                            isinstance(record[field], int) and not isinstance(record[field], bool)):
                    return f"{key}[{i}].{field} is not {'a number' if kind is float else 'a whole number'}"
            if key == "events" and not isinstance(record.get("name"), str):
                return f"events[{i}].name is not a string"
    return None


def load_traces(directory: str, stems: dict[str, str], problems: list[str]) -> dict[str, dict[int, dict]]:
    """{name: {rank: trace}} for each name whose rank-0 file ``<stem>.json`` is usable. A file that
    is not is left out, with a line in ``problems`` naming it and the field."""
    runs: dict[str, dict[int, dict]] = {}
    for name, stem in stems.items():
        rank0 = os.path.join(directory, f"{stem}.json")
        if not os.path.exists(rank0):
            continue
        ranks = {0: rank0}
        for path in glob.glob(os.path.join(directory, f"{stem}_rank*.json")):
            match = re.search(r"_rank(\d+)\.json$", path)
            if match:
                ranks[int(match.group(1))] = path
        traces = {}
        for rank, path in sorted(ranks.items()):
            try:
                data = read_json(path)
                problem = trace_problem(data)
            except InputError as exc:
                problem, path = str(exc), None
            if problem is None:
                traces[rank] = data
            else:
                problems.append(problem if path is None else f"{path}: {problem}")
        if 0 in traces:
            runs[name] = traces
    return runs


def latest_run(traces: dict[str, dict[int, dict]], preferred: str | None) -> tuple[dict, int]:
    """Only the traces of one launch: ``preferred`` (the run its summary describes; none of them where none is
    of that run), else the one that started last. Returns them and how many files of other launches were left
    out."""
    ids = {t.get("run_id") for ranks in traces.values() for t in ranks.values()}
    if ids <= {preferred} or (preferred is None and len(ids) <= 1):
        return traces, 0
    started = {i: max((t["started_at"] for ranks in traces.values() for t in ranks.values()
                       if t.get("run_id") == i and isinstance(t.get("started_at"), (int, float))), default=0.0)
               for i in ids}
    chosen = preferred if preferred is not None else max(ids, key=lambda i: started[i])
    kept = {name: {r: t for r, t in ranks.items() if t.get("run_id") == chosen} for name, ranks in traces.items()}
    left_out = sum(len(ranks) for ranks in traces.values()) - sum(len(ranks) for ranks in kept.values())
    return {name: ranks for name, ranks in kept.items() if 0 in ranks}, left_out


def loading_stems(directory: str) -> dict[str, str]:
    """Loading modes found in ``directory`` (files written by loading.py)."""
    stems = {}
    for path in sorted(glob.glob(os.path.join(directory, "loading_*_memory_usage.json"))):
        stem = os.path.basename(path)[: -len(".json")]
        stems[stem[len("loading_"): -len("_memory_usage")]] = stem
    return stems
