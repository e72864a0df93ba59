"""Tokens per second per GPU and MFU from a run's step times, as torchtitan reports them beside memory.

* Tokens per GPU per step: the tokens of a data-parallel rank's step (its microbatches' sequences x the block)
  over the ranks that share them, C x T (a cp rank holds 1/C of each sequence; tp ranks split the same tokens'
  work), so that the figure is comparable whatever the layout.
* Tokens per second: those over the median time of the steps after warm-up (step 0; under ``--compile`` steps 0
  and 1, which compile the blocks' forward and backward). The warm-up's time beyond that many median steps is the
  compile time, reported on its own.
* MFU: model FLOPs per token x tokens per second over the GPU's peak dense bf16 FLOP/s. Model FLOPs per token are
  6 x the parameters that take part in matmuls (all but the input embedding; the output head counted once, tied or
  not) plus 12 x layers x heads x head dim x sequence length for attention's two matmuls forward and backward
  (PaLM's and torchtitan's formula: causal masking is not subtracted, recomputation is not counted). float8 rows
  stay against the bf16 peak.

A step during which another run was busy on the same device (``runs_beside``) is not a speed figure: it is left
out, and where too few steps are left the figures are None with the reason. On a simulated rank (a fake process
group) no collective moves data: the figures are compute only, and say so. Under ``--emulate_communication`` every
other step of such a rank waits for its communication (processes/emulation.py): the medians of the compute-only and
of the emulated steps are taken apart, in one process, and their difference is the communication left exposed.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics

from fsdp2bench.names import counted

WARMUP_STEPS, COMPILE_WARMUP_STEPS = 1, 2
MIN_TIMED_STEPS = 2  # clean steps after warm-up that a median is taken of
# Peak dense bf16 tensor FLOP/s by device name (the vendors' datasheets; without sparsity). First match wins.
PEAK_BF16_TFLOPS = [
    (r"GH200|H200", 989.4), (r"H100.*PCIe", 756.0), (r"H100.*NVL", 835.0), (r"H100|H800", 989.4),
    (r"B200", 2250.0), (r"A100|A800", 312.0), (r"L40S", 362.1), (r"A10G", 70.0), (r"L4\b", 121.0),
]


def peak_flops(gpu_name: str | None) -> float | None:
    """The device's peak dense bf16 FLOP/s, None for a CPU or a device not in the table (never a guess)."""
    if not gpu_name:
        return None
    return next((tflops * 1e12 for pattern, tflops in PEAK_BF16_TFLOPS if re.search(pattern, gpu_name)), None)


def model_flops_per_token(num_parameters: int, config, sequence: int) -> int:
    """6 x the matmul parameters + the attention term (the module docstring says what is counted)."""
    embedding = config.vocab_size * config.hidden_size
    matmul_parameters = num_parameters - (0 if getattr(config, "tie_word_embeddings", False) else embedding)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * sequence
    return 6 * matmul_parameters + attention


def warmup_steps(compiled: bool) -> int:
    return COMPILE_WARMUP_STEPS if compiled else WARMUP_STEPS


def speed(steps: list[dict], tokens_per_step: float, flops_per_token: int, gpu_name: str | None, compiled: bool,
          simulated: bool, tally: dict | None = None) -> dict:
    """One run's speed figures from its step records (``step_time_s``, ``runs_beside``): compute only on a
    simulated rank. With its communication emulated every other step (``tally``, processes/emulation.py), the
    compute-only and the emulated steps apart, with the exposed communication (``emulation_figures``); the run's own
    figures are then its emulated steps' where they waited on the GPU, else its compute-only steps'."""
    warm, peak = warmup_steps(compiled), peak_flops(gpu_name)
    waited = bool(tally and tally["waited_on_the_gpu"])
    emulation = None if tally is None else emulation_figures(steps, compiled, tally, tokens_per_step, flops_per_token,
                                                             peak)
    own = median_figures(steps[warm:], len(steps), warm, tokens_per_step, flops_per_token, peak, "") if tally is None \
        else emulation["emulated" if waited else "compute_only"]
    figures = {"tokens_per_step_per_gpu": tokens_per_step, "model_flops_per_token": flops_per_token,
               "warmup_steps": warm, "compute_only": simulated and not waited, "emulated": waited,
               "peak_bf16_tflops": None if peak is None else peak / 1e12, **own, "compile_s": None}
    if compiled and figures["median_step_time_s"] is not None:  # the warm-up steps exist: clean steps came after
        figures["compile_s"] = max(0.0, sum(s["step_time_s"] or 0 for s in steps[:warm])
                                   - warm * figures["median_step_time_s"])
    return figures if emulation is None else {**figures, "emulation": emulation}


def median_figures(steps: list[dict], all_steps: int, warm: int, tokens_per_step: float, flops_per_token: int,
                   peak: float | None, kind: str) -> dict:
    """The median over ``steps`` (the ``kind`` steps after warm-up of a run of ``all_steps``, ``warm`` of them
    warm-up) that no other run shared the device with: step and optimizer time, tokens per second per GPU, MFU;
    None with the reason where too few."""
    timed = [s for s in steps if s.get("step_time_s") is not None]
    clean_steps = [s for s in timed if not s.get("runs_beside")]
    clean = [s["step_time_s"] for s in clean_steps]
    figures = {"timed_steps": len(clean), "shared_steps": len(timed) - len(clean), "median_step_time_s": None,
               "median_optimizer_s": None, "tokens_per_s_per_gpu": None, "mfu": None, "not_measured": None}
    if len(clean) < MIN_TIMED_STEPS:
        figures["not_measured"] = unmeasured_reason(all_steps, warm, len(timed) - len(clean), len(timed), kind)
        return figures
    median = statistics.median(clean)
    rate = tokens_per_step / median
    optimizer = [s["optimizer_s"] for s in clean_steps if s.get("optimizer_s") is not None]
    figures.update(median_step_time_s=median, tokens_per_s_per_gpu=rate,
                   median_optimizer_s=statistics.median(optimizer) if optimizer else None,
                   mfu=None if peak is None else rate * flops_per_token / peak)
    return figures


NOTHING_WAITED = ("a CPU waits for nothing: the communication is only priced, never overlapped, so none is measured "
                  "exposed")


def emulation_figures(steps: list[dict], compiled: bool, tally: dict, tokens_per_step: float, flops_per_token: int,
                      peak: float | None) -> dict:
    """One launch, both figures: the median of its compute-only steps (``compute_only``) and of its emulated steps
    (``emulated``) after warm-up, and what of the emulated communication the step left ``exposed`` (their
    difference, and its share of the emulated seconds a step) where the emulated steps waited on the GPU."""
    warm = warmup_steps(compiled)
    after = steps[warm:]
    halves = {label: median_figures([s for s in after if s.get("communication_emulated") == on], len(steps), warm,
                                    tokens_per_step, flops_per_token, peak, kind)
              for label, on, kind in (("compute_only", False, "compute-only "), ("emulated", True, "emulated "))}
    communication = tally["emulated_s_per_step"]
    compute, emulated = halves["compute_only"]["median_step_time_s"], halves["emulated"]["median_step_time_s"]
    exposed = {"s": None, "share": None, "emulated_s_per_step": communication, "not_measured": None}
    if not tally["waited_on_the_gpu"]:
        exposed["not_measured"] = NOTHING_WAITED
    elif compute is None or emulated is None:
        exposed["not_measured"] = halves["compute_only"]["not_measured"] or halves["emulated"]["not_measured"]
    else:
        exposed.update(s=emulated - compute, share=(emulated - compute) / communication if communication else None)
    return {"steps": alternating_steps_said(steps, compiled), "waited_on_the_gpu": tally["waited_on_the_gpu"],
            **halves, "exposed": exposed}


def alternating_steps_said(steps: list[dict], compiled: bool) -> str:
    """Which steps of this run were warm-up (left out of both figures), which had their communication emulated and
    which were compute only, by number, as the step records say."""
    warm = warmup_steps(compiled)
    emulated = [i for i, s in enumerate(steps) if i >= warm and s.get("communication_emulated")]
    alone = [i for i, s in enumerate(steps) if i >= warm and not s.get("communication_emulated")]
    return (f"{numbers_said(list(range(min(warm, len(steps)))))} warm-up{', compiling' if compiled else ''} (left "
            f"out); {numbers_said(emulated)} emulated; {numbers_said(alone)} compute only")


def numbers_said(numbers: list[int]) -> str:
    """Step numbers as a sentence says them: "step 0", "steps 2, 4 and 6", "steps 3, 5, ..., 99 (49 steps)"."""
    if not numbers:
        return "no step"
    if len(numbers) == 1:
        return f"step {numbers[0]}"
    if len(numbers) <= 5:
        return f"steps {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"
    return f"steps {numbers[0]}, {numbers[1]}, ..., {numbers[-1]} ({len(numbers)} steps)"


def unmeasured_reason(steps: int, warm: int, shared: int, timed: int, kind: str) -> str:
    """Why no median: steps shared with another run (counted among the ``timed`` ``kind`` steps the median was to
    be taken of, not the whole run's), or too few steps."""
    if shared:
        return (f"{shared} of the {counted(timed, kind + 'step')} after warm-up ran while another run was busy on the "
                f"same device, leaving {timed - shared} clean, fewer than the {MIN_TIMED_STEPS} a median needs; "
                "--concurrent_variants 1 runs this launch's variants one at a time, and a launch alone on the device "
                "shares it with none")
    return f"{counted(steps, 'step')}: a speed needs {warm} of warm-up and {MIN_TIMED_STEPS} more (--max_steps)"


def rate_said(figures: dict | None) -> str:
    """Tokens per second per GPU for a table cell: n/a where not measured, * where compute only, + where its
    communication was emulated."""
    if not figures or figures.get("tokens_per_s_per_gpu") is None:
        return "n/a"
    mark = "*" if figures["compute_only"] else "+" if figures.get("emulated") else ""
    return f"{figures['tokens_per_s_per_gpu']:.0f}{mark}"


def mfu_said(figures: dict | None) -> str:
    if not figures or figures.get("mfu") is None:
        return "n/a"
    return f"{figures['mfu']:.1%}"


class DeviceShare:
    """Which other runs are busy on this run's device, so that a step timed beside one is known as such.

    Each busy process (setting up or training; not waiting at a plan's gate) keeps a file named by its pid in a
    folder of this host's shared memory named by its device (the GPU's UUID; on the CPU, the host's cores), holding
    its run's identity and its start time. Another run is one whose process is alive (the same pid started at the
    same time: a pid is reused) and whose identity differs: a real run's own ranks on the CPU are one run; a process
    killed on the spot stops counting, and its file is removed by the next process that finds it.
    """

    def __init__(self, device, identity: str):
        import tempfile

        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.folder = os.path.join(root, f"fsdp2bench-busy-{os.getuid()}", device_key(device))
        self.path = os.path.join(self.folder, str(os.getpid()))
        self.identity = identity

    def enter(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(f"{started(os.getpid())}\n{self.identity}")

    def leave(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def others(self) -> int:
        """Runs other than this one busy on the device now."""
        found = set()
        for name in os.listdir(self.folder) if os.path.isdir(self.folder) else []:
            path = os.path.join(self.folder, name)
            start, _, identity = read_text(path).partition("\n")
            if not name.isdigit() or started(int(name)) != start:  # gone, or its pid reused since
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            elif identity != self.identity:
                found.add(identity)
        return len(found)


def device_key(device) -> str:
    if device.type != "cuda":
        return "cpu"
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"gpu-{uuid}" if uuid is not None else f"cuda{device.index or 0}"


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # gone meanwhile
        return ""


def started(pid: int) -> str:
    """A process's start time, which tells it from a later process given the same pid ("" where none runs)."""
    import psutil

    try:
        return repr(psutil.Process(pid).create_time())
    except psutil.Error:
        return ""
