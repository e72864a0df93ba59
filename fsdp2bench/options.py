"""The FSDP2 options accelerate's ``FullyShardedDataParallelPlugin`` exposes, named as it names them.

One typed value (``FsdpOptions``) reaches every variant: the torch variants turn it into the
``fully_shard`` arguments and checkpoint wrapping that accelerate applies for the same option
(utils.py), the accelerate variant into its plugin. The named sets are the rows of a matrix
(matrix.py). No torch import at module level: the plots and the matrix launcher read the names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp2bench.cli import UserError, parse_names

# --mixed_precision_policy: accelerate's mixed_precision="bf16" (bf16 autocast, FSDP2 gathers and
# reduces in bf16; the upstream's), or an FSDP2 MixedPrecisionPolicy without autocast.
AUTOCAST = "bf16_autocast"
POLICY = "bf16_params_fp32_reduce"
MIXED_PRECISION = (AUTOCAST, POLICY)


@dataclass(frozen=True)
class FsdpOptions:
    reshard_after_forward: bool = True
    mixed_precision_policy: str = AUTOCAST
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = False  # needs activation_checkpointing, as accelerate enforces
    cpu_offload: bool = False  # CPUOffloadPolicy: parameters, gradients and AdamW live on the host

    def changed(self) -> dict:
        """The options that differ from the default (today's configuration, the upstream's)."""
        default = FsdpOptions()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def flags(self) -> list[str]:
        """main.py's command-line flags that select these options."""
        out = []
        for name, value in self.changed().items():
            if isinstance(value, bool) and name != "reshard_after_forward":
                out.append(f"--{name}")
            else:
                out += [f"--{name}", str(value).lower()]
        return out


# The rows of a matrix: each option alone, and all of them together (they all combine).
OPTION_SETS: dict[str, FsdpOptions] = {
    "default": FsdpOptions(),
    "no_reshard": FsdpOptions(reshard_after_forward=False),
    "mp_policy": FsdpOptions(mixed_precision_policy=POLICY),
    "ac": FsdpOptions(activation_checkpointing=True),
    "ac_offload": FsdpOptions(activation_checkpointing=True, activation_checkpointing_offload=True),
    "cpu_offload": FsdpOptions(cpu_offload=True),
    "all": FsdpOptions(reshard_after_forward=False, mixed_precision_policy=POLICY, activation_checkpointing=True,
                       activation_checkpointing_offload=True, cpu_offload=True),
}
EACH = "each"  # --option_sets each: every set above


def parse_bool(text: str) -> bool:
    """``true`` or ``false``, as accelerate's config files write them."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ValueError(text)
    return value == "true"


def from_args(args) -> FsdpOptions:
    """The options of a main.py command line, refused in one line where accelerate would refuse them."""
    options = FsdpOptions(args.reshard_after_forward, args.mixed_precision_policy, args.activation_checkpointing,
                          args.activation_checkpointing_offload, args.cpu_offload)
    check(options)
    return options


def check(options: FsdpOptions) -> None:
    if options.activation_checkpointing_offload and not options.activation_checkpointing:
        raise UserError("--activation_checkpointing_offload needs --activation_checkpointing (accelerate refuses "
                        "it alone)")
    check_libraries(options)


def check_libraries(options: FsdpOptions) -> None:
    """An option the installed torch or accelerate lacks is refused before any work starts."""
    import accelerate
    import torch.distributed.fsdp as fsdp
    from accelerate import FullyShardedDataParallelPlugin

    plugin_fields = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    for name, value in options.changed().items():
        if name not in plugin_fields:
            raise UserError(f"--{name}: accelerate {accelerate.__version__} has no such FSDP plugin option "
                            "(it came in accelerate 1.15)")
    if options.cpu_offload and not hasattr(fsdp, "CPUOffloadPolicy"):
        raise UserError("--cpu_offload: this torch has no torch.distributed.fsdp.CPUOffloadPolicy")
    if options.activation_checkpointing:
        try:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401
                checkpoint_wrapper, offload_wrapper)
        except ImportError:
            raise UserError("--activation_checkpointing: this torch has no checkpoint_wrapper") from None


def parse_sets(text: str) -> list[str]:
    """``--option_sets``: names of OPTION_SETS, or ``each`` for all of them."""
    if text.strip() == EACH:
        return list(OPTION_SETS)
    return parse_names(text, "--option_sets", list(OPTION_SETS), noun="option set")
