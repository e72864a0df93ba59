"""Running the variants: every rank together (the benchmark), or each simulated rank alone (a sweep)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from dataclasses import dataclass

import torch

from fsdp2bench.cli import say
from fsdp2bench.files import save_summary, unwritten
from fsdp2bench.memory.accounting import PROJECTION_WORLD_SIZES
from fsdp2bench.names import counted
from fsdp2bench.processes import simulation
from fsdp2bench.processes.isolation import (INTERRUPTED, Interrupted, Piece, StoreKeys, StoreLost, failed,
                                            gather_records, has_keys, leave_together, run_isolated, status_of,
                                            wait_for_keys)
from fsdp2bench.report import console
from fsdp2bench.report.summary import (accelerate_vs_torch, failed_status, measured_crossover, memory_summary,
                                       projection_summary, run_checks, run_entries, simulated_entries, state_projection,
                                       sweep_checks, unsupported_findings, variant_summary)
from fsdp2bench.run.concurrency import SweepRoom
from fsdp2bench.run.session import Session, say_interrupted
from fsdp2bench.train.runner import Job, TrainConfig, variant_process


@dataclass
class Suite:
    """One launch of the benchmark on this rank; rank 0 keeps ``summary`` and rewrites summary.json."""
    session: Session
    names: list[str]
    train: TrainConfig
    batches: torch.Tensor  # (steps, sequences, block): data.rank_batches
    meta: dict
    output_dir: str
    concurrent: int  # pieces of work at a time on this rank (at most, in a sweep with ``room``)
    summary: dict
    room: SweepRoom | None = None  # a sweep's runs side by side by their own needs

    @property
    def steps_said(self) -> str:
        """"12 steps", or with accumulation "12 steps of 4 microbatches"."""
        k = self.train.options.gradient_accumulation_steps
        return counted(len(self.batches), "step") + (f" of {counted(k, 'microbatch')}" if k > 1 else "")

    @property
    def summary_path(self) -> str:
        return os.path.join(self.output_dir, "summary.json")

    def job(self, name: str, keys: StoreKeys, rank: int, world_size: int, output_dir: str,
            simulated: bool = False, position: int = 0) -> Job:
        meta = {**self.meta, "rank": rank, "world_size": world_size, "simulated": simulated}
        s = self.session
        return Job(name=name, train=self.train, device=s.device, config=s.config, batches=self.batches,
                   layer_classes=s.layer_classes, meta=meta, rank=rank, world_size=world_size, keys=keys,
                   output_dir=output_dir, simulated=simulated, position=position)


# --------------------------------------------------------------------------- the benchmark

def run_variants(suite: Suite) -> int:
    """Every variant on every rank, ``concurrent`` at a time. A variant that ran out of memory
    while sharing the GPUs is run again alone, and its summary says so."""
    s = suite.session
    suite.summary.update(variants={}, checks={}, projection=None)
    groups = [suite.names[i:i + suite.concurrent] for i in range(0, len(suite.names), suite.concurrent)]
    shared_failure: dict[str, str] = {}  # variant -> why it is run again alone
    any_failed = False
    while groups:
        group = groups.pop(0)
        if s.rank == 0:
            print(f"[{', '.join(group)}] {suite.steps_said} on {counted(s.world_size, 'rank')}"
                  f"{' (again, alone)' if group[0] in shared_failure else ''}...", flush=True)
        jobs = [suite.job(name, StoreKeys(f"{name}/alone" if name in shared_failure else name), s.rank, s.world_size,
                          suite.output_dir, position=i) for i, name in enumerate(group)]
        started, started_at = time.perf_counter(), time.time()
        try:
            failures = run_isolated([Piece(variant_process, (job,), job.keys) for job in jobs], s.rank,
                                    range(s.world_size), s.store, s.device)
            wall = time.perf_counter() - started  # the group's, so one figure for every variant in it
        except Interrupted as exc:
            if s.rank == 0:
                record_interrupted(suite, jobs, group + [n for g in groups for n in g], started_at)
            return say_interrupted(s, exc, f" during {', '.join(group)}"
                                           f"{kept_said(suite, list(suite.summary['variants'].values()), 'variant')}")
        again = [job.name for job, f in zip(jobs, failures) if len(group) > 1 and simulation.out_of_memory(f)]
        shared_failure.update({job.name: f for job, f in zip(jobs, failures) if job.name in again})
        groups[0:0] = [[name] for name in again]
        if s.rank == 0:
            for name in again:
                print(f"[{name}] ran out of memory beside {', '.join(n for n in group if n != name)}; run again alone "
                      f"before it is reported ({shared_failure[name]})", flush=True)
        any_failed = any_failed or any(failed(f) for job, f in zip(jobs, failures) if job.name not in again)
        if s.rank == 0:
            kept = [(job, f) for job, f in zip(jobs, failures) if job.name not in again]
            record_group(suite, [j for j, _ in kept], [f for _, f in kept], started_at, wall, group, shared_failure)
    return finish(suite, console.print_table, any_failed)


def kept_said(suite: Suite, entries: list[dict], what: str) -> str:
    """Where an interrupt leaves the results, said as they are: the finished runs, the partial traces of the
    interrupted ones, or that none had finished."""
    finished = sum(e.get("status") == "ok" for e in entries)
    partial = any(e.get("status") == INTERRUPTED for e in entries)
    kept = [counted(finished, f"finished {what}")] if finished else []
    kept += ["the partial traces of the interrupted"] if partial else []
    if not kept:
        return f"; no {what} had finished or begun to train"
    return f"; {' and '.join(kept)} are in {suite.output_dir}/" + ("" if finished else f" (no {what} had finished)")


def record_interrupted(suite: Suite, jobs: list[Job], left: list[str], started_at: float) -> None:
    """Rank 0: a variant that finished on every rank before the interrupt is ``ok``, whatever came
    after it; the others of its group are ``interrupted``, the later ones ``not run``."""
    s = suite.session
    ranks = range(s.world_size)
    try:
        done = [job for job in jobs if has_keys(s.store, [job.keys.record(r) for r in ranks])]
    except StoreLost:  # the launcher was killed: what finished was recorded before
        done = []
    for name in left:
        suite.summary["variants"][name] = {"status": "interrupted" if any(j.name == name for j in jobs) else "not run"}
    if done:
        record_group(suite, done, [None] * len(done), started_at, time.time() - started_at)
    else:
        save_summary(suite.summary_path, suite.summary)


def failure_records(s: Session, keys: StoreKeys) -> list[dict]:
    """Per rank that reported it, how far a failed variant got (phase, step, peak, failed allocation)."""
    ranks = [r for r in range(s.world_size) if has_keys(s.store, [keys.record(r)])]
    return [{"rank": r, "status": rec["status"], "error": rec.get("error"), **rec.get("failure", {})}
            for r, rec in zip(ranks, gather_records(s.store, keys, ranks))]


def record_group(suite: Suite, jobs: list[Job], failures: list[str | None], started_at: float, wall: float,
                 group: list[str] | None = None, shared_failure: dict[str, str] | None = None) -> None:
    """Rank 0: summarise the variants that just ended and rewrite summary.json. ``group`` is what
    ran at the same time (their step times are shared); ``shared_failure`` why one ran again alone."""
    s, variants = suite.session, suite.summary["variants"]
    for job, failure in zip(jobs, failures):
        if failure is None:
            records = gather_records(s.store, job.keys, range(s.world_size))
            suite.summary["meta"]["gpu_name"] = records[0]["gpu_name"]
            variants[job.name] = variant_summary(job.name, records, s.shapes, suite.train.options, s.device.type,
                                                        suite.train.init_device)
            variants[job.name].update(process_started_at=started_at, process_wall_s=wall,
                                      ran_beside=[n for n in group or [] if n != job.name])
        else:
            variants[job.name] = {"status": status_of(failure), "failure": failure_records(s, job.keys)}
            print(f"[{job.name}] {'FAILED: ' + failure if failed(failure) else variants[job.name]['status']}",
                  file=sys.stderr if failed(failure) else sys.stdout, flush=True)
        if job.name in (shared_failure or {}):
            variants[job.name]["rerun_alone_after"] = shared_failure[job.name]
    suite.summary["checks"] = run_checks(variants, s.device.type, suite.train.options)
    suite.summary["unsupported"] = unsupported_findings(list(variants.items()))
    suite.summary["accelerate_vs_torch"] = accelerate_vs_torch(variants)
    suite.summary["projection"] = projection_summary(s.shapes, variants, s.world_size, suite.train.options)
    save_summary(suite.summary_path, suite.summary)


# --------------------------------------------------------------------------- a sweep of simulated ranks

def run_sweep(suite: Suite, sizes: list[int], rank_specs: list) -> int:
    """Each run plays one rank of N alone; the launch's processes share the runs out."""
    s = suite.session
    runs, notes = simulation.plan(sizes, rank_specs, suite.names, s.shapes, suite.train.options)
    suite.summary["meta"]["simulated"] = {"world_sizes": sizes, "ranks": suite.meta["args"]["simulate_rank"],
                                          "runs": len(runs), "steps": len(suite.batches), "processes": s.world_size,
                                          "notes": notes}
    if s.rank == 0:
        for note in notes:
            print(note)
        print(f"Simulating {counted(len(runs), 'run')} ({counted(len(sizes), 'world size')} x "
              f"{counted(len(suite.names), 'variant')} x the ranks played) over {counted(s.world_size, 'process')}, "
              f"{suite.steps_said} each...", flush=True)
    for n in sizes:
        os.makedirs(simulation.world_size_dir(suite.output_dir, n), exist_ok=True)

    def make_job(run: simulation.SimulatedRun) -> Job:
        return suite.job(run.variant, run.keys, run.rank, run.world_size,
                         simulation.world_size_dir(suite.output_dir, run.world_size), simulated=True)

    try:
        together = suite.room.fits if suite.room else (lambda group: len(group) <= suite.concurrent)
        own_failed = simulation.run_share(runs, make_job, variant_process, s.rank, s.world_size, s.store, s.device,
                                          together)
        if s.rank == 0:
            simulation.wait_for_sweep(runs, s.store)
    except Interrupted as exc:
        if s.rank == 0 and not isinstance(exc, StoreLost):
            record_sweep(suite, runs, sizes)
        ended = [e for *_, e in simulated_entries(suite.summary.get("simulated") or {})]
        return say_interrupted(s, exc, kept_said(suite, ended, "run") if ended else
                               f"; what was written is in {suite.output_dir}/")
    if s.rank == 0:
        record_sweep(suite, runs, sizes)
    any_failed = own_failed or (s.rank == 0 and any(failed_status(e["status"])
                                                    for *_, e in simulated_entries(suite.summary["simulated"])))
    return finish(suite, console.print_sweep_table, any_failed)


def record_sweep(suite: Suite, runs: list, sizes: list[int]) -> None:
    """Rank 0: summary.json of a sweep, with every run that has ended (the rest marked so)."""
    s = suite.session
    simulated: dict = {}
    again = simulation.reruns(runs, s.store)
    for run, status in simulation.statuses(runs, s.store).items():
        played = dataclasses.replace(run, alone=True) if run in again else run
        if status == "ok":
            record, = gather_records(s.store, played.keys, [run.rank])
            suite.summary["meta"]["gpu_name"] = record["gpu_name"]
            entry = memory_summary(run.variant, [record], s.shapes, run.world_size, [run.rank],
                                          suite.train.options, s.device.type, suite.train.init_device)
        else:
            entry = {"status": status}
        if run in again:
            entry["rerun_alone_after"] = again[run]
        simulated.setdefault(str(run.world_size), {}).setdefault(str(run.rank), {})[run.variant] = \
            {"label": run.label, **entry}
    suite.summary["simulated"] = simulated
    suite.summary["checks"] = sweep_checks(simulated)
    suite.summary["unsupported"] = unsupported_findings(run_entries(suite.summary))
    suite.summary["accelerate_vs_torch"] = {n: {r: accelerate_vs_torch(by_variant)
                                                for r, by_variant in by_rank.items()}
                                            for n, by_rank in simulated.items()}
    suite.summary["simulation_findings"] = {
        "unfixed_exceeds_intended_from_world_size": measured_crossover(simulated)}
    suite.summary["projection"] = state_projection(s.shapes, suite.names,
                                                          sorted(set(PROJECTION_WORLD_SIZES) | set(sizes)),
                                                          suite.train.options)
    save_summary(suite.summary_path, suite.summary)


# --------------------------------------------------------------------------- the end

def finish(suite: Suite, print_results, any_failed: bool) -> int:
    """Every rank leaves together; rank 0 prints the results and decides the exit code."""
    s = suite.session
    if s.rank == 0:
        suite.summary["meta"]["timeline"]["variants_finished"] = time.time()
        save_summary(suite.summary_path, suite.summary)
    leave_together(s.store, s.rank, s.world_size)
    done = StoreKeys("results-printed").prefix
    if s.rank != 0:
        # An early non-zero exit here would make torchrun stop rank 0 in the middle of its table.
        wait_for_keys(s.store, [done])
        return 1 if any_failed else 0
    print_results(suite.summary)
    missing = unwritten()
    entries = run_entries(suite.summary)
    rerun = console.reruns_said(entries)
    if rerun:
        say(rerun)
    if not missing and any(e["status"] == "ok" for _, e in entries):
        print(f"Wrote per-rank traces and summary.json to {suite.output_dir}/; draw the plots with:\n"
              f"    python3 visualize.py --dir {shlex.quote(suite.output_dir)}", flush=True)
    why = console.why_failed(entries, suite.summary["checks"])
    if why:
        print(f"FAILED: {why}; summary.json says more", file=sys.stderr, flush=True)
    if missing:  # last: what the run could not keep
        print(missing, file=sys.stderr, flush=True)
    s.store.set(done, "yes")
    return 1 if any_failed or why or missing else 0
