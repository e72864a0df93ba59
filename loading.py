"""Load a pretrained checkpoint into an FSDP2 model without paying for N copies of it.

``torchrun --nproc_per_node N loading.py`` (or ``accelerate launch loading.py``) loads the same
checkpoint (safetensors or pytorch_model.bin) five ways, each ending with the same sharded model
ready to train, and measures per rank the host RAM, the GPU memory and the time it took;
``python3 loading.py --simulate_world_size 8,32`` measures one rank of larger N, for the modes that
need nothing from the other ranks. See docs/loading.md; the modes are in ``fsdp2bench/loading/modes.py``.
"""

from __future__ import annotations

import sys

from fsdp2bench.processes.first import one_line_interrupts

if __name__ == "__main__":  # before any other import: a Ctrl-C from here on is one line, never a traceback
    one_line_interrupts()

from fsdp2bench.processes.starting import check_launcher_env, start_before_imports

if __name__ == "__main__":  # ahead of the imports below, on purpose: the fork server's overlap them
    start_before_imports(sys.argv[1:])

import argparse
import contextlib
import json
import os
import shutil
import socket
from typing import Callable

from fsdp2bench.cli import OneLineParser, UserError, check_ranges, exit_with, parse_names, pick_device
from fsdp2bench.files import check_output_dir, expect_path, refuse_foreign, save_summary, unwritten
from fsdp2bench.loading.checkpoints import FORMATS, Checkpoint
from fsdp2bench.loading.modes import (CHECKPOINT_DTYPES, MODES, NEEDS_PEERS, SIMULABLE, LoadConfig, LoadJob,
                                      host_need, load_process, print_simulated, print_table, summarise, trace_file,
                                      write_checkpoint_process)
from fsdp2bench.memory.estimate import HOST_RUNTIME
from fsdp2bench.names import GIB, counted
from fsdp2bench.options import accelerate_config
from fsdp2bench.processes import simulation
from fsdp2bench.processes.isolation import (Interrupted, Piece, StoreKeys, gather_records, launcher_keeps_to_one_thread,
                                            leave_together, run_isolated, wait_for_keys)
from fsdp2bench.run.arguments import add_config_option, check_wrapped_classes
from fsdp2bench.run.concurrency import host_memory_for_launch
from fsdp2bench.run.session import ModelFacts, Session, model_facts, open_session, say_interrupted
from fsdp2bench.run.versions import check_releases
from fsdp2bench.train import weights
from fsdp2bench.train.model import CPU_DEFAULT_MODEL, GPU_DEFAULT_MODEL, PRESETS, default_model, say_default_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(__doc__.splitlines()[0], [
        ("torchrun --nproc_per_node N loading.py", "N ranks; rank0_broadcast and accelerate need them (a broadcast)"),
        ("python3 loading.py", "one rank"),
        ("python3 loading.py --simulate_world_size 8", f"one rank of any N: {', '.join(SIMULABLE)}")],
        "docs/loading.md")
    p.add_argument("--model", default=None,
                   help=f"preset ({', '.join(PRESETS)}), local directory with config.json, or Hub id "
                        "(default: the --checkpoint directory's config, else qwen2.5-1.5b on a GPU, tiny on a CPU "
                        "run)")
    p.add_argument("--checkpoint", default=None, help="directory of a checkpoint, safetensors or pytorch_model.bin "
                   "(default: rank 0 writes one of --model's shape into --output_dir first)")
    p.add_argument("--checkpoint_format", choices=list(FORMATS), default="safetensors",
                   help="format of a checkpoint written here (default: safetensors)")
    p.add_argument("--checkpoint_dtype", choices=list(CHECKPOINT_DTYPES), default="bfloat16",
                   help="dtype of a checkpoint written here (default: bfloat16, as published checkpoints)")
    p.add_argument("--checkpoint_shard_size", default="2GB",
                   help="max file size of a written checkpoint (default: 2GB)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated loading modes: {', '.join(MODES)} (default: all of them)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when a GPU is present, else CPU with gloo (default: auto)")
    p.add_argument("--output_dir", default="out_loading",
                   help="where the traces, loading_summary.json and a written checkpoint go (default: out_loading)")
    p.add_argument("--seed", type=int, default=421, help="seed of a written checkpoint's random weights (default: 421)")
    p.add_argument("--log_interval", type=float, default=0.01, help="seconds between memory samples (default: 0.01)")
    p.add_argument("--simulate_world_size", default=None, metavar="N[,N...]",
                   help=f"play rank 0 of each N alone, with one process ({', '.join(SIMULABLE)}; the other modes "
                        f"need the other ranks' data and are skipped) (default: off)")
    add_config_option(p, "the setup whose loading mode is named: fsdp_cpu_ram_efficient_loading true loads as "
                         "the accelerate mode, false as naive")
    return p.parse_args(argv)


def write_checkpoint(session: Session, options: LoadConfig, model_name: str) -> tuple[str, float]:
    """Rank 0 writes a checkpoint of the model's shape (random weights); its path and the time it took."""
    suffix = "-bin" if options.checkpoint_format == "bin" else ""
    path = os.path.join(options.output_dir,
                        f"checkpoint-{os.path.basename(model_name)}-{options.checkpoint_dtype}{suffix}")
    if session.rank == 0:
        print(f"Writing a {options.checkpoint_dtype} checkpoint of {model_name} to {path} ...", flush=True)
    writer = LoadJob("write-checkpoint", options, session.device, session.config, session.layer_classes, None,
                     session.rank, session.world_size, StoreKeys("load-write-checkpoint"))
    try:
        failure, = run_isolated([Piece(write_checkpoint_process, (writer, path), writer.keys)], session.rank,
                                range(session.world_size), session.store, session.device)
    except Interrupted:
        if session.rank == 0:  # a checkpoint cut short would be read by the next run as a whole one
            shutil.rmtree(path, ignore_errors=True)
        raise
    if failure:
        if session.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise UserError(f"writing the checkpoint failed: {failure}; the incomplete checkpoint was removed")
    return path, json.loads(session.store.get(writer.keys.record(0)))["write_s"]


NUMBER_RANGES = {"seed": (0, 2**32 - 1), "log_interval": (0.001, 60.0)}  # as main.py's


def check_args(args: argparse.Namespace) -> list[str]:
    """Refuse what cannot work before any process exists; return the modes."""
    modes = parse_names(args.modes, "--modes", MODES, noun="mode")
    if args.checkpoint is not None:
        expect_path(args.checkpoint, "--checkpoint", "directory")
    check_ranges(args, NUMBER_RANGES)
    check_shard_size(args.checkpoint_shard_size)
    if args.simulate_world_size is not None:
        simulation.parse_world_sizes(args.simulate_world_size)
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise UserError("--simulate_world_size plays every rank from one process: run it with plain python")
        if not set(modes) & set(SIMULABLE):
            raise UserError(f"--simulate_world_size: none of --modes can be simulated ({', '.join(modes)} "
                            f"{NEEDS_PEERS}); choose among {', '.join(SIMULABLE)}")
    return modes


def check_shard_size(text: str) -> None:
    """As transformers will read it when it writes the checkpoint: an integer and a unit."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise UserError(f"--checkpoint_shard_size: expected a positive integer and a unit (2GB, 500MiB), got {text!r}")


def files_written(args: argparse.Namespace, modes: list[str]) -> list[str]:
    """loading_summary.json and the traces of every mode and rank this launch may write (refuse_foreign)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.simulate_world_size:
        places = [(simulation.world_size_dir(args.output_dir, n), r) for n in
                  simulation.parse_world_sizes(args.simulate_world_size) for r in (0, n - 1)]
    else:
        places = [(args.output_dir, r) for r in range(world)]
    return [os.path.join(args.output_dir, "loading_summary.json"),
            *(trace_file(where, mode, r) for where, r in places for mode in modes)]


def config_mode(config: accelerate_config.ConfigOptions | None) -> dict:
    """What loading_summary.json records of the user's accelerate config: the mode that loads as it does (every
    rank's ``from_pretrained`` unless it asks for accelerate's CPU-RAM-efficient loading)."""
    summary = accelerate_config.summary_of(config, {})
    if config is not None:
        summary["mode"] = "accelerate" if config.cpu_ram_efficient_loading else "naive"
        summary["not_measured"] += ["the FSDP2 and layout options (loading shards with fully_shard's defaults "
                                    "over every rank)"]
    return summary


def validate(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str], ModelFacts, Checkpoint | None]:
    """Everything loading.py refuses, in one line, before any process or file exists: a given
    checkpoint's every file is opened (headers read, ``.bin`` files mapped) here."""
    launcher_keeps_to_one_thread()  # before this process computes anything: it forks the children
    args = parse_args(argv)
    check_releases()
    check_launcher_env()
    modes = check_args(args)
    config = accelerate_config.read(args.config_file)
    args.options_from = config_mode(config)
    device_type = pick_device(args.device).type
    check_output_dir(args.output_dir, "loading_summary.json")
    refuse_foreign(files_written(args, modes), "--output_dir")
    checkpoint = Checkpoint(args.checkpoint) if args.checkpoint else None
    facts = model_facts(args.model or args.checkpoint or default_model(device_type), args.seed)
    check_wrapped_classes(config, facts.layer_classes)
    if checkpoint is not None:
        checkpoint.check_against(facts.named_shapes)
    check_host_fits(args, modes, facts, checkpoint, device_type)
    if not (args.model or args.checkpoint):
        say_default_loading_model(device_type)
    return args, modes, facts, checkpoint


def check_host_fits(args: argparse.Namespace, modes: list[str], facts: ModelFacts, checkpoint: Checkpoint | None,
                    device_type: str) -> None:
    """A launch whose largest host peak (writing the checkpoint, or a mode at one of its N) exceeds the host's
    memory is refused before anything is built: the kernel would kill it minutes in, with no line."""
    simulated = args.simulate_world_size is not None
    sizes = simulation.parse_world_sizes(args.simulate_world_size) if simulated else \
        [int(os.environ.get("WORLD_SIZE", 1))]
    local = 1 if simulated else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    stored = checkpoint.bytes() if checkpoint else \
        facts.num_parameters * CHECKPOINT_DTYPES[args.checkpoint_dtype].itemsize
    ran = [m for m in modes if m in SIMULABLE] if simulated else modes
    need, what = host_need(ran, sizes, local, facts.num_parameters, stored, device_type, checkpoint is None)
    total, available = local * HOST_RUNTIME + need, host_memory_for_launch()
    if total > available:
        raise UserError(f"--model {facts.name} needs about {total / GIB:.1f} GiB of host memory at its peak ({what}: "
                        f"{need / GIB:.1f} GiB, beside {counted(local, 'process')} of {HOST_RUNTIME / GIB:.0f} GiB); "
                        f"{available / GIB:.1f} GiB are available: leave that out (--modes, --checkpoint of one "
                        f"already written), or run on a larger host")


# This script's own run without --model on the CPU, measured: torchrun --nproc_per_node 2 loading.py --device cpu,
# every mode, from launch to exit, on 2 cores shared with other work
CPU_DEFAULT_RUN = "13 s with torchrun --nproc_per_node 2 on 2 cores"


def say_default_loading_model(device_type: str) -> None:
    """That a launch without --model or --checkpoint loads the default model; on the CPU, said in one line with this
    script's own time (main.py's training run is another run, and takes minutes)."""
    say_default_model(device_type, f"No --model given and no GPU: loading.py loads the {CPU_DEFAULT_MODEL} model, a "
                                   f"functional run of seconds ({CPU_DEFAULT_RUN}). The real one on the CPU: add "
                                   f"--model {GPU_DEFAULT_MODEL}.")


def run(argv: list[str] | None = None) -> int:
    args, modes, facts, given = validate(argv)
    s = open_session(facts, args.device, args.output_dir, "loading_summary.json")
    said = args.options_from
    if s.rank == 0 and said["config"]:
        efficient = "true" if said["mode"] == "accelerate" else "false"
        print(f"Options from {said['config']}: it loads as the {said['mode']} mode (fsdp_cpu_ram_efficient_loading "
              f"{efficient}); not mirrored: {'; '.join(said['not_measured'])}", flush=True)
    options = LoadConfig(args.output_dir, args.seed, args.log_interval, args.checkpoint_dtype,
                         args.checkpoint_shard_size, args.checkpoint_format, s.run_id)
    summary_path = os.path.join(args.output_dir, "loading_summary.json")
    try:
        path, write_s = (args.checkpoint, None) if given else write_checkpoint(s, options, facts.name)
    except Interrupted as exc:
        return say_interrupted(s, exc, " while writing the checkpoint; nothing was loaded, and the incomplete "
                                       "checkpoint was removed")
    try:
        checkpoint = given or Checkpoint(path)
        summary = {"run_id": s.run_id, "model": facts.name, "world_size": s.world_size, "device": s.device.type,
                   "model_bytes": s.model_bytes, "modes": {}, "options_from": args.options_from,
                   "checkpoint": {"path": path, "format": checkpoint.format, "dtype": checkpoint.dtype_name(),
                                  "bytes": checkpoint.bytes(), "write_s": write_s}}
        if args.simulate_world_size:
            run_simulated(s, modes, simulation.parse_world_sizes(args.simulate_world_size), checkpoint, options,
                          summary, summary_path)
        else:
            run_modes(s, modes, checkpoint, options, summary, summary_path)
        leave_together(s.store, s.rank, s.world_size)
    except Interrupted as exc:  # the summary marks the mode it stopped and those never started
        return say_interrupted(s, exc, f"; {summary_path} has every mode's status and the finished ones' figures")
    if s.rank != 0:
        return 0
    if args.simulate_world_size:
        print_simulated(summary)
    else:
        print_table(summary)
    found = list(summary["modes"].items()) + \
        [(f"{mode} at N = {n}", m) for n, by_mode in summary.get("simulated", {}).items()
         for mode, m in by_mode.items() if not m["status"].startswith("skipped")]
    wrong = [f"{mode}: {m['status'] if m['status'] != 'ok' else 'its shards differ from the checkpoint'}"
             for mode, m in found if m["status"] != "ok" or not m["weights_match"]]
    if wrong:
        print(f"FAILED: {'; '.join(wrong)}", file=sys.stderr, flush=True)
    missing = unwritten()
    if missing:  # last: what the run could not keep
        print(missing, file=sys.stderr, flush=True)
    return 1 if missing or wrong else 0


def run_modes(s: Session, modes: list[str], checkpoint: Checkpoint, options: LoadConfig, summary: dict,
              summary_path: str) -> None:
    """Each mode on every rank, one after the other; rank 0 rewrites the summary after each."""
    records: dict = {}

    def keep() -> None:
        summary["modes"] = summarise(records)
        save_summary(summary_path, summary)

    for mode in modes:
        if s.rank == 0:
            print(f"[{mode}] loading on {counted(s.world_size, 'rank')}...", flush=True)
        with kept_when_interrupted(records, mode, modes, keep if s.rank == 0 else None):
            records[mode] = load_mode(s, mode, checkpoint, options, s.world_size, simulated=False)
        if s.rank == 0:
            keep()


def run_simulated(s: Session, modes: list[str], sizes: list[int], checkpoint: Checkpoint, options: LoadConfig,
                  summary: dict, summary_path: str) -> None:
    """Rank 0 of each N, played alone, for each mode that needs nothing from the other ranks."""
    summary["simulated"] = {}
    for i, n in enumerate(sizes):
        os.makedirs(simulation.world_size_dir(options.output_dir, n), exist_ok=True)
        records: dict = {m: f"skipped: {NEEDS_PEERS}" for m in modes if m not in SIMULABLE}

        def keep() -> None:
            summary["simulated"][str(n)] = summarise({m: records[m] for m in modes if m in records})
            summary["simulated"].update({str(later): {m: {"status": "not run"} for m in modes} for later in sizes[i + 1:]})
            save_summary(summary_path, summary)

        for mode in (m for m in modes if m in SIMULABLE):
            print(f"[{mode}] loading as rank 0 of a simulated {n}...", flush=True)
            with kept_when_interrupted(records, mode, modes, keep):
                records[mode] = load_mode(s, mode, checkpoint, options, n, simulated=True)
            keep()


@contextlib.contextmanager
def kept_when_interrupted(records: dict, mode: str, modes: list[str], keep: Callable[[], None] | None):
    """An interrupt during ``mode`` marks it and the modes after it in ``records`` and, on rank 0 (``keep``),
    writes the summary with them: the summary the last line names exists, whole, whatever stopped."""
    try:
        yield
    except Interrupted:
        records[mode] = "interrupted"
        records.update({m: "not run" for m in modes if m not in records})
        if keep is not None:
            keep()
        raise


def load_mode(s: Session, mode: str, checkpoint: Checkpoint, options: LoadConfig, world_size: int,
              simulated: bool) -> str | list[dict]:
    """One mode in its own processes, on every rank of the launch or as rank 0 of a simulated
    ``world_size`` played alone: rank 0 gets every rank's record, or why the mode failed."""
    name = f"{mode}-N{world_size}" if simulated else mode
    ranks = [0] if simulated else list(range(s.world_size))
    with node_copy_file(s, name, mode == "shared_memory") as shared:
        job = LoadJob(mode, options, s.device, s.config, s.layer_classes, checkpoint, 0 if simulated else s.rank,
                      world_size, StoreKeys(f"load-{name}"), node_copy=shared, simulated=simulated)
        failure, = run_isolated([Piece(load_process, (job,), job.keys)], s.rank, ranks, s.store, s.device)
    if failure:
        return f"failed: {failure}"
    return gather_records(s.store, job.keys, ranks) if s.rank == 0 else []


@contextlib.contextmanager
def node_copy_file(s: Session, name: str, wanted: bool):
    """For a ``shared_memory`` load (``wanted``), the node's shared file: made by the first local
    rank's launcher process, found by the others through the store (None where no memfd can be made:
    the load then fails with its reason). It is closed, and its memory freed, once every rank has
    finished the load."""
    if not wanted:
        yield None
        return
    key = StoreKeys(f"node-copy/{name}/{socket.gethostname()}").prefix
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    made = weights.create() if first else None
    if first:
        s.store.set(key, f"{made.pid}:{made.fd}" if made else "none")
    try:
        wait_for_keys(s.store, [key])
        found = s.store.get(key).decode()
        yield None if found == "none" else weights.SharedWeights(*map(int, found.split(":")))
        s.store.set(f"{key}/done/{s.rank}", "yes")
        if first:
            wait_for_keys(s.store, [f"{key}/done/{r}" for r in range(s.world_size)])
    finally:
        if made is not None:
            os.close(made.fd)


def main() -> None:
    exit_with(run)


if __name__ == "__main__":
    main()
