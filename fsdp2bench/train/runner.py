"""Training one variant on one rank, inside the fresh process isolation.py starts for it."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import utils
from fsdp2bench.memory import snapshots
from fsdp2bench.memory.accounting import (account, applied_setup, gathered_block_bytes, local_tensor, moments_kept,
                                          output_itemsize)
from fsdp2bench.names import ACCELERATE, MICROBATCH_PHASE, rank_file
from fsdp2bench.options import levers
from fsdp2bench.options.fsdp import FsdpOptions
from fsdp2bench.options.layout import Meshes
from fsdp2bench.options.links import Links
from fsdp2bench.options.step import kept_output_bytes
from fsdp2bench.options.tuning import LOW_BIT
from fsdp2bench.processes.child import TracedChild, run_traced_child
from fsdp2bench.processes.emulation import Tally, emulated
from fsdp2bench.processes.isolation import STAND_DOWN, StoreKeys, init_group, name_process, wait_at_gate
from fsdp2bench.processes.simulation import init_simulated_group
from fsdp2bench.train import throughput
from fsdp2bench.train.model import build_for_run
from fsdp2bench.train.progress import Progress
from fsdp2bench.train.throughput import DeviceShare
from fsdp2bench.train.weights import SharedWeights
from measure import MemoryTracker


@dataclass(frozen=True)
class FailureSpec:
    """``--inject_failure VARIANT:STEP:RANK[:kill|:oom]``: a test option to prove failures are contained."""
    name: str
    step: int
    rank: int
    how: str  # raise (an exception), kill (SIGKILL), oom (torch's out-of-memory error), thread (in the
    # tracker's thread) or nan (the model's first parameter becomes NaN: the run diverges)
    HOW = ("kill", "oom", "thread", "nan")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The options of a launch that reach the children."""
    seed: int
    learning_rate: float
    log_interval: float
    save_memory_snapshot: bool
    tracker_overhead: bool
    inject_failure: FailureSpec | None
    init_device: str  # "cpu" (the upstream's path: fully_shard moves the shards), "cuda" or "meta"
    build_threads: int  # this rank's share of the host's cores, for drawing the weights of a build on the CPU
    compute_threads: int  # intra-op threads of each variant's process: that share split among the variants at once
    weights: SharedWeights | None  # where this rank's variants share the weights of a CPU build (weights.py)
    quiet: bool  # no progress lines
    options: FsdpOptions = FsdpOptions()  # the FSDP2 options every variant applies
    allocator_limit: int | None = None  # bytes PyTorch may reserve on the GPU (--gpu_memory), None: all
    links: Links | None = None  # a simulated rank's collectives cost their time over these (--emulate_communication)


@dataclass(kw_only=True)
class Job:
    """Everything one rank needs to run one variant (inherited by a forked child, pickled for
    one from the fork server)."""
    name: str
    train: TrainConfig
    device: torch.device
    config: object
    batches: torch.Tensor  # (steps, sequences, block): data.rank_batches
    layer_classes: list
    meta: dict
    rank: int
    world_size: int
    keys: StoreKeys
    output_dir: str
    simulated: bool = False  # rank ``rank`` of ``world_size`` played alone on a fake process group
    position: int = 0  # among the variants running at the same time: the row of its progress bar
    gated: bool = False  # set up, it waits for its parent's go before the first step (isolation.wait_at_gate)
    at_go: Callable[[Job, int], Job] | None = None  # gated: this job at the value its go names (plan/shared.AtValue)


# --------------------------------------------------------------------------- training

class TrainStep:
    """One optimizer step at a time, queued; a call returns the loss still on the device (reading it
    would wait for the GPU): the microbatches' mean, as each was before the division by K.

    What the loop keeps is part of what a step costs (fsdp2bench/options/step.py). Under the upstream loop the
    outputs, logits included, stay alive through backward and the optimizer step, and on until the next
    forward has returned, as the upstream's loop variable keeps them: where they sit changes where the
    caching allocator puts the next step's blocks (1042 MiB of reserved memory at N = 1 for the 1.5B
    model). Under the Trainer's loop only the loss outlives the forward, as its ``compute_loss`` returns it.
    With K microbatches a step runs K forwards and backwards, each inside the variant's ``microbatch``
    context (which decides whether its gradients are reduced), then one optimizer step.
    """

    def __init__(self, prep: utils.Prepared, microbatches: int = 1, keeps_outputs: bool = True,
                 before_optimizer: Callable[[], None] | None = None):
        self.prep = prep
        self.before_optimizer = before_optimizer  # marks where the optimizer's share of a step starts
        self.microbatches = microbatches
        self.keeps_outputs = keeps_outputs
        self.outputs = None  # what the upstream loop keeps (the memory accounting counts it)

    def forward_backward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One microbatch; its loss, detached."""
        prep = self.prep
        with prep.inputs(input_ids) as inputs:
            if self.keeps_outputs:
                self.outputs = prep.forward(prep.model, inputs)  # the previous outputs go only now
                loss = self.outputs.loss
            else:
                loss = prep.forward(prep.model, inputs).loss  # the outputs are gone before backward
            prep.backward(loss)
        return loss.detach()

    def __call__(self, input_ids: torch.Tensor, *, before_zero_grad: Callable[[], None] | None = None,
                 between_microbatches: Callable[[], None] | None = None) -> torch.Tensor:
        prep, k = self.prep, self.microbatches
        if k == 1:
            loss = self.forward_backward(input_ids)
        else:
            losses = []
            for i, micro in enumerate(input_ids.chunk(k)):
                with prep.microbatch(i == k - 1):
                    losses.append(self.forward_backward(micro))
                if i == 0 and between_microbatches is not None:
                    between_microbatches()
            loss = torch.stack(losses).mean()
        if self.before_optimizer is not None:
            self.before_optimizer()
        prep.optimizer.step()
        if before_zero_grad is not None:
            before_zero_grad()
        prep.optimizer.zero_grad()
        return loss


class StepReadback:
    """Each step's loss and time (and the optimizer step's share of it), read one step late on a GPU.

    A step is bound by the host (docs/performance.md): reading its loss at once would make the host wait
    for the GPU's tail of the step before queueing the next one. Instead the loss is copied to pinned
    host memory behind the step, with an event, and the step's time is the device's time between two
    such events. Nothing here allocates device memory, so the memory figures do not change. The
    events block: a process waiting on one sleeps instead of spinning on a core, which the processes
    of the variants running beside it need. The optimizer's share (from the event before its step to the step's
    end) lets a layout search price K microbatches and one optimizer step from a run of one microbatch.
    """

    def __init__(self, device: torch.device, steps: int):
        self.cuda = device.type == "cuda"
        self.pinned: torch.Tensor | None = None
        self.losses: list[float] = []  # on the CPU, read at once: there is nothing to wait for
        self.clock: list[float] = [time.perf_counter()]
        self.optimizer_clock: list[float] = []
        self.optimizer_marks = 0
        self.events = [torch.cuda.Event(enable_timing=True, blocking=True)
                       for _ in range(steps + 1)] if self.cuda else []
        self.optimizer_events = [torch.cuda.Event(enable_timing=True) for _ in range(steps)] if self.cuda else []
        if self.cuda:
            self.events[0].record()

    def optimizer_starts(self) -> None:
        """Called by the step queued next, before its optimizer step."""
        if self.cuda:
            self.optimizer_events[self.optimizer_marks].record()
        else:
            self.optimizer_clock.append(time.perf_counter())
        self.optimizer_marks += 1

    def queued(self, step: int, loss: torch.Tensor) -> None:
        if not self.cuda:
            self.losses.append(loss.item())
            self.clock.append(time.perf_counter())
            return
        if self.pinned is None:  # in the loss's own dtype: a conversion would allocate on the device
            self.pinned = torch.empty(len(self.events) - 1, dtype=loss.dtype, pin_memory=True)
        self.pinned[step].copy_(loss, non_blocking=True)
        self.events[step + 1].record()

    def result(self, step: int) -> tuple[float, float, float]:
        """(loss, seconds, the optimizer's seconds) of ``step``, once the device has finished it."""
        if not self.cuda:
            return self.losses[step], self.clock[step + 1] - self.clock[step], \
                self.clock[step + 1] - self.optimizer_clock[step]
        self.events[step + 1].synchronize()
        return (self.pinned[step].item(), self.events[step].elapsed_time(self.events[step + 1]) / 1000,
                self.optimizer_events[step].elapsed_time(self.events[step + 1]) / 1000)


def injected_failure(job: Job, step: int, tracker: MemoryTracker, model: torch.nn.Module) -> None:
    spec = job.train.inject_failure
    if spec and spec.name == job.name and spec.step == step and spec.rank == job.rank:
        if spec.how == "nan":
            with torch.no_grad():
                local_tensor(next(model.parameters())).fill_(float("nan"))
            return
        if spec.how == "thread":
            tracker.fail_with = RuntimeError(f"injected failure at step {step} on rank {job.rank}")
            return
        if spec.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.how == "oom":
            raise torch.OutOfMemoryError(f"injected: Tried to allocate 1.00 GiB at step {step} on rank {job.rank}")
        raise RuntimeError(f"injected failure at step {step} on rank {job.rank}")


GC_EVERY_STEPS = 50


@contextlib.contextmanager
def collector_paused():
    """Python's garbage collector off for the loop, which collects young objects every
    ``GC_EVERY_STEPS`` steps instead.

    A step makes thousands of Python objects (hooks, autograd, modeling code), enough to start the
    collector every few milliseconds: 40 steps of the 1.5B model on 2x H200 ran 266 young collections
    and a full pass over the ~478k objects that torch and transformers hold, which took 0.31 s. The
    objects made before training are frozen out of its reach.
    """
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def host_batches(job: Job) -> torch.Tensor:
    """The batches in pinned memory on a GPU run: a copy from pageable memory waits for the device."""
    return job.batches.pin_memory() if job.device.type == "cuda" else job.batches


def build(job: Job, tracker: MemoryTracker):
    """The model with random fp32 weights, on the CPU (then ``fully_shard`` moves each rank's shard
    to the GPU, as in the upstream and most user code), directly on the GPU, or empty (meta) until sharded."""
    start = time.perf_counter()
    model, weights = build_for_run(job.config, job.train.init_device, job.device, job.train.seed,
                                   job.train.build_threads, job.train.weights, job.train.options.tuning)
    tracker.mark("model_built", build_device=next(model.parameters()).device.type,
                 build_s=time.perf_counter() - start, weights=weights)
    return model


def prepare(job: Job, tracker: MemoryTracker, meshes: Meshes | None) -> utils.Prepared:
    """The variant's model and optimizer, ready to train (the model built here goes with this frame)."""
    # accelerate under TP loads a model that transformers made tensor-parallel itself (utils.accelerate_fsdp2).
    own = job.name == ACCELERATE and job.train.options.layout.tensor_parallel
    model = None if own else build(job, tracker)
    ctx = utils.Context(job.device, meshes, job.train.learning_rate, job.layer_classes, tracker.mark,
                        job.train.options, job.config)
    return utils.VARIANTS[job.name](model, ctx)


def train(job: Job, tracker: MemoryTracker, meshes: Meshes | None, store: dist.Store) -> dict:
    """One variant on one rank, counted busy on its device all along (``throughput.DeviceShare``)."""
    share = DeviceShare(job.device, f"{job.meta['run_id']}/{job.keys.prefix}")
    share.enter()
    try:
        return train_busy(job, tracker, meshes, store, share)
    finally:
        share.leave()


def train_busy(job: Job, tracker: MemoryTracker, meshes: Meshes | None, store: dist.Store,
               share: DeviceShare) -> dict:
    """Build, prepare and train one variant; return this rank's record beyond the trace."""
    start, breaks_before = time.perf_counter(), levers.graph_breaks()
    prep = prepare(job, tracker, meshes)
    accounting = {"end_of_setup": account(prep.model, prep.optimizer)}
    applied = {**applied_setup(prep.model, job.layer_classes),
               "checkpointing_by": utils.checkpointing_by(job.name, job.train.options)}
    release_setup_cache(job.device)
    if job.gated and (job := wait_for_go(job, tracker, store, share)) is None:
        return {"wall_s": time.perf_counter() - start, "stood_down": True}
    batches = host_batches(job)  # before the clock of the first step starts
    tracker.mark("training_started")
    last = len(job.batches) - 1
    # Rank 0 of a real run shows it; a sweep's processes say which run they start instead.
    progress = Progress(job.name, len(job.batches), job.position,
                        enabled=job.rank == 0 and not job.simulated and not job.train.quiet)
    readback = StepReadback(job.device, len(job.batches))
    options = job.train.options
    train_step = TrainStep(prep, options.gradient_accumulation_steps, options.step.keeps_outputs,
                           readback.optimizer_starts)

    def held() -> dict:
        return account(prep.model, prep.optimizer, train_step.outputs)

    def read_back(step: int) -> None:
        loss, seconds, optimizer_s = readback.result(step)
        # Under a fake group no collective moves data, so the loss of a simulated rank means nothing.
        record = tracker.steps[step]
        # Other runs busy on the device when the step was queued, or when the device had finished it.
        record.update(loss=None if job.simulated else loss, step_time_s=seconds, optimizer_s=optimizer_s,
                      runs_beside=max(record["runs_beside"], share.others()))
        progress.update(step, record["loss"], record["peak_allocated_mib"], seconds)

    links = job.train.links if job.simulated else None
    with collector_paused(), emulated(links, job.device) as tally:
        for step, batch in enumerate(batches):
            injected_failure(job, step, tracker, prep.model)
            switched = switch_for(step, job, tracker, tally)
            counted = {phase: (lambda phase=phase: accounting.update({phase: held()})) if step == last else None
                       for phase in ("before_zero_grad", MICROBATCH_PHASE)}  # the last step's state, by phase
            readback.queued(step, train_step(batch.to(job.device, non_blocking=True),
                                             before_zero_grad=counted["before_zero_grad"],
                                             between_microbatches=counted[MICROBATCH_PHASE]))
            tracker.record_step(step).update(runs_beside=share.others(), **switched)
            if step > 0:
                read_back(step - 1)  # the previous step, while the device runs this one
            if step % GC_EVERY_STEPS == GC_EVERY_STEPS - 1:
                gc.collect(1)
        read_back(last)
    progress.close()
    tracker.mark("training_finished")
    found = {"wall_s": time.perf_counter() - start, "accounting": {**accounting, "end_of_training": held()},
             "expected_kept_output_bytes": expected_kept_outputs(job), "applied": applied}
    found["graph_breaks"] = levers.graph_breaks() - breaks_before if job.train.options.compile else None
    if job.train.options.tuning.optimizer in LOW_BIT:  # which moments torchao quantized, which it left plain
        found["low_bit_moments"] = moments_kept(prep.optimizer)
    return {**found, **trained_figures(job, prep.model, tracker, tally)}


def switch_for(step: int, job: Job, tracker: MemoryTracker, tally: Tally | None) -> dict:
    """Before ``step``: whether the tracker polls (--tracker_overhead pauses it every other step, or every other pair of
    steps where the communication is emulated every other step, so that paused steps fall alike among the compute-only
    and the emulated ones) and whether its collectives are emulated; what its record says of that."""
    pairs = 2 if tally is not None else 1
    tracker.polling = not (job.train.tracker_overhead and (step // pairs) % 2)
    return {} if tally is None else {"communication_emulated": tally.step_starts(step)}


def trained_figures(job: Job, model: torch.nn.Module, tracker: MemoryTracker, tally: Tally | None) -> dict:
    """What a finished variant measured beyond its state: gathered bytes, speed, emulated communication, the
    allocator's figures, and (where recorded) the tensors alive at its peak."""
    found = {"gathered_block_bytes": gathered_block_bytes(model, job.layer_classes),
             "speed": run_speed(job, model, tracker.steps, tally),
             "emulated": None if tally is None else tally.per_step(),
             "allocator": tracker.allocator_stats(), "counter_peaks": tracker.counter_peaks(),
             "polled_peaks": tracker.polled_peaks()}
    if records_history(job):  # while the model exists to name the blocks
        found["peak_tensors"] = snapshots.peak_tensors(torch.cuda.memory._snapshot(),
                                                       snapshots.parameter_sizes(model),
                                                       job.device.index or 0, HISTORY_ENTRIES)
    return found


def run_speed(job: Job, model: torch.nn.Module, steps: list[dict], tally: Tally | None) -> dict:
    return steps_speed(steps, job.batches.shape, job.train.options, model, job.config, job.device, job.simulated,
                       tally)


def steps_speed(steps: list[dict], batches_shape, options: FsdpOptions, model: torch.nn.Module, config,
                device: torch.device, simulated: bool, tally: Tally | None = None) -> dict:
    """Tokens per second per GPU and MFU of a run's clean steps (throughput.py), from its batches'
    (steps, sequences, block) and its model (main.py's runs and the bare loop alike); where its communication was
    emulated (``tally``), of its compute-only and its emulated steps apart."""
    _, sequences, block = batches_shape
    tokens = sequences * block / (options.layout.cp_size * options.layout.tp_size)
    flops = throughput.model_flops_per_token(sum(p.numel() for p in model.parameters()), config, block)
    return throughput.speed(steps, tokens, flops, gpu_name(device), options.compile, simulated,
                            None if tally is None else tally.per_step())


def gpu_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def release_setup_cache(device: torch.device) -> None:
    """The allocator's cache of the set-up (a model built on the GPU leaves all of it there) given back before
    the first step, so that a training peak of reserved memory counts training's blocks, whatever the init
    device (the counters are reset when training starts: measure.py)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def expected_kept_outputs(job: Job) -> int:
    """What the memory model says the loop keeps of a microbatch's outputs on this rank (step.py): its
    tokens (a cp rank's share of each sequence) times the vocabulary, in the dtype the model returns."""
    options = job.train.options
    sequences = job.batches.shape[1] // options.gradient_accumulation_steps
    tokens = sequences * (job.batches.shape[2] // options.layout.cp_size)
    return kept_output_bytes(options.step, tokens, job.config.vocab_size, output_itemsize(options))


def wait_for_go(job: Job, tracker: MemoryTracker, store: dist.Store, share: DeviceShare) -> Job | None:
    """plan.py's probes: set up, holding only the state, a probe waits until its parent has the room of its
    steps for it (so that the set-ups of some overlap the steps of others) and names the value it trains at
    (so that a search's next probe is set up before its value is known). Returns the job at that value, None
    where the probe is stood down instead. Waiting, it is not busy on the device."""
    start = time.perf_counter()
    share.leave()
    go = wait_at_gate(store, job.keys, torch.cuda.memory_reserved(job.device) if job.device.type == "cuda" else 0)
    share.enter()
    if go == STAND_DOWN:
        tracker.mark("stood_down", waited_s=time.perf_counter() - start)
        return None
    job = job.at_go(job, int(go)) if job.at_go is not None else job
    tracker.mark("gate_passed", waited_s=time.perf_counter() - start, go=go, batches=list(job.batches.shape))
    return job


# --------------------------------------------------------------------------- the process

def deterministic(device: torch.device) -> None:
    """Per process: a child of the fork server does not inherit it."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs it
    torch.use_deterministic_algorithms(True)
    # ...but without its side job of filling every new tensor with NaN: that is one extra kernel
    # per allocation (about 1,350 launches a step here) and changes no result of a correct program.
    torch.utils.deterministic.fill_uninitialized_memory = False


HISTORY_ENTRIES = 400_000  # allocator events kept (the oldest go first; peak_tensors says when some did)


def records_history(job: Job) -> bool:
    return job.train.save_memory_snapshot and job.device.type == "cuda"


def limit_allocator(device: torch.device, limit: int) -> None:
    """A smaller GPU made real: the allocator reserves at most ``limit`` bytes, and a step that needs
    more raises torch's out-of-memory error, as it would there."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)


def variant_process(job: Job) -> None:
    """Entry point of the child process: one variant on one rank."""
    run_variant_child(job, train)


def probe_process(job: Job) -> None:
    """Entry point of plan.py's fresh probe (``ps`` shows it as plan-probe)."""
    name_process("plan-probe")
    run_variant_child(job, train)


Body = Callable[[Job, MemoryTracker, "Meshes | None", dist.Store], dict]


def run_variant_child(job: Job, body: Body) -> None:
    """A child that plays ``job``'s rank: ``body`` does the work once its group (or fake group) is up, and
    returns what its trace adds."""
    # Processes side by side that each take every core spin against one another: under CPU offload
    # four AdamW steps on the host took 31-48 s a step instead of a few (1.5B, 16 cores, one H200).
    torch.set_num_threads(job.train.compute_threads)
    if job.train.allocator_limit is not None and job.device.type == "cuda":
        limit_allocator(job.device, job.train.allocator_limit)
    deterministic(job.device)
    child = TracedChild(job.keys, job.rank, job.device, job.train.log_interval,
                        os.path.join(job.output_dir, rank_file(job.name, "memory_usage.json", job.rank)),
                        {"meta": job.meta, "run_id": job.meta["run_id"]})

    def work(store, tracker: MemoryTracker) -> dict:
        if records_history(job):  # Python stacks only: C++ ones take minutes to resolve at the dump
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
        # accelerate builds its own mesh from its ParallelismConfig (utils.accelerate_scaling).
        degrees = None if job.name == ACCELERATE else job.train.options.layout.at(job.world_size)
        meshes = init_simulated_group(job.device, job.rank, job.world_size, degrees) if job.simulated else \
            init_group(job.device, job.keys, store, job.rank, job.world_size, degrees)
        tracker.mark("group_ready")
        extra = body(job, tracker, meshes, store)
        if records_history(job):
            torch.cuda.memory._dump_snapshot(os.path.join(job.output_dir,
                                                          rank_file(job.name, "memory_snapshot.pkl", job.rank)))
        extra["gpu_name"] = gpu_name(job.device)
        return extra

    run_traced_child(child, work)
