"""The FSDP2 options every variant applies, named as accelerate names them.

Three accelerate objects take them: its ``FullyShardedDataParallelPlugin`` (resharding, mixed
precision, activation checkpointing, CPU offload), its ``GradientAccumulationPlugin`` (the
microbatches per optimizer step and whether each is reduced) and its ``ParallelismConfig`` (HSDP's
replicate x shard mesh). One typed value (``FsdpOptions``) reaches every variant: the torch variants
turn it into the ``fully_shard`` arguments, the mesh and the gradient-sync calls that accelerate
makes for the same option (utils.py), the accelerate variant into its objects. One option is torch's
alone (``requires_all_reduce``): accelerate does not offer it. The named sets are the rows of a
matrix (matrix.py). No torch import at module level: the plots and the matrix launcher read the names.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from fsdp2bench.cli import UserError, parse_names
from fsdp2bench.options import tuning
from fsdp2bench.options.layout import CP_STRATEGIES, Layout
from fsdp2bench.options.step import Step
from fsdp2bench.options.tuning import LORA_DEFAULTS, Tuning

# --mixed_precision_policy: accelerate's mixed_precision="bf16" (bf16 autocast, FSDP2 gathers and
# reduces in bf16; the upstream's), an FSDP2 MixedPrecisionPolicy without autocast, or accelerate's
# mixed_precision="no" (fp32 throughout: no autocast, no policy).
AUTOCAST = "bf16_autocast"
POLICY = "bf16_params_fp32_reduce"
FP32 = "fp32"
MIXED_PRECISION = (AUTOCAST, POLICY, FP32)
# --activation_checkpointing: none, each block whole (accelerate's, or every K-th block with --ac_every K), or
# op-level selective checkpointing inside each block (fsdp2bench/options/levers.py says which ops it keeps).
NO_AC, FULL_AC, SELECTIVE_AC = "none", "full", "selective"
AC_MODES = (NO_AC, FULL_AC, SELECTIVE_AC)


@dataclass(frozen=True, kw_only=True)
class FsdpOptions:
    reshard_after_forward: bool = True
    mixed_precision_policy: str = AUTOCAST
    activation_checkpointing: str = NO_AC  # AC_MODES
    ac_every: int = 1  # under full checkpointing: only every K-th block (the K-th, 2K-th...) is checkpointed
    activation_checkpointing_offload: bool = False  # needs activation_checkpointing, as accelerate enforces
    cpu_offload: bool = False  # CPUOffloadPolicy: parameters, gradients and AdamW live on the host
    # GradientAccumulationPlugin: microbatches per optimizer step, and whether each is reduce-scattered
    # (False, accelerate's default: the gradients stay unsharded on every rank until the last one).
    gradient_accumulation_steps: int = 1
    sync_each_batch: bool = False
    # torch's FSDPModule.set_requires_all_reduce: False reduce-scatters every microbatch under HSDP but
    # all-reduces across the replicas only on the last one. Not offered by accelerate.
    requires_all_reduce: bool = True
    # The levers beyond accelerate's plugin (fsdp2bench/options/levers.py): each block compiled by inductor, and torchao's
    # float8 training of the blocks' Linear layers with FSDP2's float8 all-gather.
    compile: bool = False
    float8: bool = False
    # ParallelismConfig: how the ranks split into replicas, shards, context and tensor groups.
    layout: Layout = Layout()
    # The training step (fsdp2bench/options/step.py): not an FSDP2 option, but applied by every variant alike.
    step: Step = Step()
    # What the step trains and with which optimizer (fsdp2bench/options/tuning.py): every variant alike.
    tuning: Tuning = Tuning()

    def changed(self) -> dict:
        """The options that differ from the default (today's configuration, the upstream's), by flag name:
        the layout's sizes and the step's loop and loss among them."""
        out = {}
        for here, default in ((self, FsdpOptions()), (self.layout, Layout()), (self.step, Step()),
                              (self.tuning, Tuning())):
            out.update({f.name: getattr(here, f.name) for f in dataclasses.fields(here)
                        if f.name not in NESTED and getattr(here, f.name) != getattr(default, f.name)})
        return out

    def flags(self) -> list[str]:
        """main.py's command-line flags that select these options (a name keeps its case: --lora_targets names
        the model's modules)."""
        out = []
        for name, value in self.changed().items():
            if isinstance(value, bool) and name not in VALUED_BOOLS:
                out.append(f"--{name}")
            else:
                out += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
        return out

    def over(self, changes: dict) -> "FsdpOptions":
        """These options with ``changes`` (flag names, as ``changed`` gives them) put over them: an option set
        applied to the options of a user's config."""
        def part(value, fields):
            return dataclasses.replace(value, **{k: v for k, v in changes.items() if k in fields})
        return dataclasses.replace(part(self, OWN_FIELDS), layout=part(self.layout, LAYOUT_OPTIONS),
                                   step=part(self.step, STEP_OPTIONS), tuning=part(self.tuning, TUNING_OPTIONS))

    @property
    def checkpoints(self) -> bool:
        return self.activation_checkpointing != NO_AC

    @property
    def hsdp(self) -> bool:
        return self.layout.hsdp

    @property
    def accumulates(self) -> bool:
        return self.gradient_accumulation_steps > 1


NESTED = ("layout", "step", "tuning")  # the fields that group options of their own
# Booleans whose main.py flag takes a value ({true,false}) rather than standing alone.
VALUED_BOOLS = ("reshard_after_forward", "sync_each_batch", "requires_all_reduce")
# The options accelerate's FullyShardedDataParallelPlugin takes; the others go to its other objects.
LAYOUT_OPTIONS = tuple(f.name for f in dataclasses.fields(Layout))
STEP_OPTIONS = tuple(f.name for f in dataclasses.fields(Step))
TUNING_OPTIONS = tuple(f.name for f in dataclasses.fields(Tuning))
OWN_FIELDS = tuple(f.name for f in dataclasses.fields(FsdpOptions) if f.name not in NESTED)
PLUGIN_OPTIONS = ("reshard_after_forward", "mixed_precision_policy", "activation_checkpointing",
                  "activation_checkpointing_offload", "cpu_offload")
LEVER_OPTIONS = ("ac_every", "compile", "float8")  # applied by the suite to every variant alike


ACCUMULATION_STEPS, NODE_RANKS = 4, 8  # a matrix's K, and HSDP's shards: the ranks of one node
# The rows of a matrix: each plugin option alone, and all of them together (they all combine); then
# accumulation each way, HSDP over nodes of 8 ranks, and both; then tensor and context parallelism.
OPTION_SETS: dict[str, FsdpOptions] = {
    "default": FsdpOptions(),
    "no_reshard": FsdpOptions(reshard_after_forward=False),
    "mp_policy": FsdpOptions(mixed_precision_policy=POLICY),
    "ac": FsdpOptions(activation_checkpointing=FULL_AC),
    "ac_offload": FsdpOptions(activation_checkpointing=FULL_AC, activation_checkpointing_offload=True),
    "cpu_offload": FsdpOptions(cpu_offload=True),
    "all": FsdpOptions(reshard_after_forward=False, mixed_precision_policy=POLICY, activation_checkpointing=FULL_AC,
                       activation_checkpointing_offload=True, cpu_offload=True),
    "accumulate": FsdpOptions(gradient_accumulation_steps=ACCUMULATION_STEPS),
    "accumulate_sync": FsdpOptions(gradient_accumulation_steps=ACCUMULATION_STEPS, sync_each_batch=True),
    "hsdp": FsdpOptions(layout=Layout(dp_shard_size=NODE_RANKS)),
    "hsdp_accumulate": FsdpOptions(layout=Layout(dp_shard_size=NODE_RANKS),
                                   gradient_accumulation_steps=ACCUMULATION_STEPS),
    "hsdp_accumulate_sync": FsdpOptions(layout=Layout(dp_shard_size=NODE_RANKS),
                                        gradient_accumulation_steps=ACCUMULATION_STEPS, sync_each_batch=True),
    "hsdp_all_reduce_last": FsdpOptions(layout=Layout(dp_shard_size=NODE_RANKS),
                                        gradient_accumulation_steps=ACCUMULATION_STEPS, sync_each_batch=True,
                                        requires_all_reduce=False),
    "tp2": FsdpOptions(layout=Layout(tp_size=2)),
    "tp4": FsdpOptions(layout=Layout(tp_size=4)),
    "cp2": FsdpOptions(layout=Layout(cp_size=2)),
    "cp4": FsdpOptions(layout=Layout(cp_size=4)),
    "tp2_cp2": FsdpOptions(layout=Layout(tp_size=2, cp_size=2)),
    "cp2_accumulate": FsdpOptions(layout=Layout(cp_size=2), gradient_accumulation_steps=ACCUMULATION_STEPS),
    # The levers people pull for memory and speed, in the order well-kept projects stack them.
    "ac_every2": FsdpOptions(activation_checkpointing=FULL_AC, ac_every=2),
    "selective": FsdpOptions(activation_checkpointing=SELECTIVE_AC),
    "compile": FsdpOptions(compile=True),
    "selective_compile": FsdpOptions(activation_checkpointing=SELECTIVE_AC, compile=True),
    "selective_compile_float8": FsdpOptions(activation_checkpointing=SELECTIVE_AC, compile=True, float8=True),
}
EACH = "every_set"  # --option_sets every_set: every set above (the set named all turns every plugin option on)
LEVER_SETS = [name for name, o in OPTION_SETS.items() if o.ac_every > 1 or o.activation_checkpointing == SELECTIVE_AC
              or o.compile or o.float8]
PLUGIN_SETS = [name for name, o in OPTION_SETS.items()  # the plugin's
               if not o.accumulates and o.layout == Layout() and name not in LEVER_SETS]
PARALLEL_SETS = [name for name, o in OPTION_SETS.items() if o.layout.tensor_parallel or o.layout.context_parallel]


def parse_bool(text: str) -> bool:
    """``true`` or ``false``, as accelerate's config files write them."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value == "true"


def parse_checkpointing(text: str) -> str:
    """``--activation_checkpointing``: a mode, or ``true``/``false`` as an accelerate config writes it (whole
    blocks, as accelerate's plugin checkpoints them, or none)."""
    value = text.strip().lower()
    modes = {"true": FULL_AC, "false": NO_AC, **{mode: mode for mode in AC_MODES}}
    if value not in modes:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(AC_MODES)} (or true, false), got {text!r}")
    return modes[value]


def from_args(args) -> FsdpOptions:
    """The options of a main.py command line, refused in one line where accelerate would refuse them
    or where one would change nothing (``--sync_each_batch`` given without accumulation)."""
    if args.sync_each_batch is not None and args.gradient_accumulation_steps == 1:
        raise UserError("--sync_each_batch needs --gradient_accumulation_steps above 1 (with one microbatch per "
                        "step every step is reduced)")
    if args.cp_comm_strategy is not None and args.cp_size == 1:
        raise UserError("--cp_comm_strategy needs --cp_size above 1 (without context parallelism nothing is passed "
                        "between ranks for attention)")
    layout = Layout(dp_replicate_size=args.dp_replicate_size, dp_shard_size=args.dp_shard_size, cp_size=args.cp_size,
                    tp_size=args.tp_size, cp_comm_strategy=args.cp_comm_strategy or CP_STRATEGIES[0])
    options = FsdpOptions(reshard_after_forward=args.reshard_after_forward,
                          mixed_precision_policy=args.mixed_precision_policy,
                          activation_checkpointing=args.activation_checkpointing, ac_every=args.ac_every,
                          activation_checkpointing_offload=args.activation_checkpointing_offload,
                          compile=args.compile, float8=args.float8, cpu_offload=args.cpu_offload,
                          gradient_accumulation_steps=args.gradient_accumulation_steps,
                          sync_each_batch=bool(args.sync_each_batch), requires_all_reduce=args.requires_all_reduce,
                          layout=layout, step=Step(loop=args.loop, loss=args.loss), tuning=tuning_of(args))
    check(options)
    return options


def tuning_of(args) -> Tuning:
    """``--peft`` and its knobs, and ``--optimizer``; a knob of the adapters without adapters is refused (it would
    change nothing)."""
    given = [name for name in LORA_DEFAULTS if getattr(args, name) is not None]
    if given and args.peft == Tuning().peft:
        raise UserError(f"--{given[0]} needs --peft lora or qlora (without adapters there is no LoRA to shape)")
    if args.qlora_storage is not None and args.peft != tuning.QLORA:
        raise UserError(f"--qlora_storage needs --peft qlora (the {args.peft} base is not 4-bit)")
    knobs = {name: default if getattr(args, name) is None else getattr(args, name)
             for name, default in LORA_DEFAULTS.items()}
    return Tuning(peft=args.peft, optimizer=args.optimizer, qlora_storage=args.qlora_storage or Tuning().qlora_storage,
                  **knobs)


def check(options: FsdpOptions) -> None:
    if options.activation_checkpointing_offload and options.activation_checkpointing != FULL_AC:
        raise UserError("--activation_checkpointing_offload needs --activation_checkpointing full (accelerate refuses "
                        "it alone, and offloads the inputs of whole blocks only)")
    if options.ac_every > 1 and options.activation_checkpointing != FULL_AC:
        raise UserError(f"--ac_every {options.ac_every} needs --activation_checkpointing full: it checkpoints whole "
                        f"blocks, one in every {options.ac_every}")
    if options.float8 and options.mixed_precision_policy == FP32:
        raise UserError("--float8 with --mixed_precision_policy fp32: float8 training computes the blocks' matmuls in "
                        "float8 and the rest in bf16 (accelerate's mixed_precision fp8 is bf16 besides float8)")
    if options.float8 and options.layout.tensor_parallel:
        raise UserError(f"--float8 with --tp_size {options.layout.tp_size}: torchao's float8 under tensor "
                        "parallelism needs its own float8 TP styles, which the suite does not mirror")
    check_tuning(options)
    if not options.requires_all_reduce and not (options.hsdp and options.accumulates and options.sync_each_batch):
        raise UserError("--requires_all_reduce false needs HSDP (--dp_replicate_size or --dp_shard_size), "
                        "--gradient_accumulation_steps above 1 and --sync_each_batch true: it holds back the "
                        "all-reduce across replicas of the microbatches that are reduce-scattered")
    check_libraries(options)


def check_tuning(options: FsdpOptions) -> None:
    """Adapters where the suite does not mirror what a user would need to make them meet the other option."""
    peft = options.tuning.peft
    if options.tuning.adapters and options.layout.tensor_parallel:
        raise UserError(f"--peft {peft} with --tp_size {options.layout.tp_size}: the model's tensor-parallel plan "
                        "names the base model's layers, which peft's wrappers rename and split into base and adapters; "
                        "the suite does not mirror a plan for them")
    if options.tuning.adapters and options.float8:
        raise UserError(f"--peft {peft} with --float8: float8 training converts the blocks' Linear layers, the "
                        "adapters' among them, and a frozen base gains nothing from float8 weight gradients; the suite "
                        "does not measure the pair")
    tuning.check(options.tuning)


def check_libraries(options: FsdpOptions) -> None:
    """An option the installed torch or accelerate lacks is refused before any work starts."""
    import accelerate
    import torch.distributed.fsdp as fsdp
    from accelerate import FullyShardedDataParallelPlugin

    plugin_fields = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    for name in options.changed():
        if name in PLUGIN_OPTIONS and name not in plugin_fields:
            raise UserError(f"--{name}: accelerate {accelerate.__version__} has no such FSDP plugin option "
                            "(it came in accelerate 1.15)")
    check_scaling_libraries(options)
    if options.cpu_offload and not hasattr(fsdp, "CPUOffloadPolicy"):
        raise UserError("--cpu_offload: this torch has no torch.distributed.fsdp.CPUOffloadPolicy")
    if options.checkpoints:
        try:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401
                checkpoint_wrapper, offload_wrapper)
        except ImportError:
            raise UserError("--activation_checkpointing: this torch has no checkpoint_wrapper") from None


def check_scaling_libraries(options: FsdpOptions) -> None:
    """Accumulation and HSDP need accelerate's GradientAccumulationPlugin and ParallelismConfig and
    FSDP2's gradient-sync switches; a release without one is refused before any work starts."""
    import accelerate
    import accelerate.utils
    from torch.distributed.fsdp import FSDPModule

    if options.accumulates and "sync_each_batch" not in \
            {f.name for f in dataclasses.fields(accelerate.utils.GradientAccumulationPlugin)}:
        raise UserError(f"--gradient_accumulation_steps: accelerate {accelerate.__version__}'s "
                        "GradientAccumulationPlugin has no sync_each_batch")
    if options.accumulates and not hasattr(FSDPModule, "set_requires_gradient_sync"):
        raise UserError("--gradient_accumulation_steps: this torch's FSDPModule has no set_requires_gradient_sync")
    if options.hsdp and not hasattr(accelerate, "ParallelismConfig"):
        raise UserError(f"--dp_replicate_size/--dp_shard_size: accelerate {accelerate.__version__} has no "
                        "ParallelismConfig, through which it sets up HSDP")
    check_parallel_libraries(options.layout)
    if not options.requires_all_reduce and not hasattr(FSDPModule, "set_requires_all_reduce"):
        raise UserError("--requires_all_reduce: this torch's FSDPModule has no set_requires_all_reduce")


def parse_sets(text: str, flag: str = "--option_sets") -> list[str]:
    """``flag`` (matrix.py's ``--option_sets``, plan.py's ``--sets``): names of OPTION_SETS, or ``each`` for all."""
    if text.strip() == EACH:
        return list(OPTION_SETS)
    return parse_names(text, flag, list(OPTION_SETS), noun="option set")


def check_parallel_libraries(layout: Layout) -> None:
    """TP and CP need torch's tensor-parallel and context-parallel APIs and accelerate's ParallelismConfig
    with their sizes; a release without one is refused before any work starts."""
    import accelerate
    import torch

    needs = []
    if layout.tensor_parallel:
        needs.append(("--tp_size", "torch.distributed.tensor.parallel", "parallelize_module", "tp_size"))
    if layout.context_parallel:
        needs.append(("--cp_size", "torch.distributed.tensor.experimental", "context_parallel", "cp_size"))
    for flag, module, name, field in needs:
        try:
            getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            raise UserError(f"{flag}: torch {torch.__version__} has no {module}.{name}") from None
        config = getattr(accelerate, "ParallelismConfig", None)
        if config is None or field not in {f.name for f in dataclasses.fields(config)}:
            raise UserError(f"{flag}: accelerate {accelerate.__version__} has no ParallelismConfig.{field}")
