"""What a step trains, and with which optimizer: the whole model (full fine-tuning), or LoRA adapters over a frozen
base (``--peft lora``, with peft as fine-tuners apply it: ``get_peft_model``, then ``fully_shard``); and the
optimizer over the parameters that train: torch's AdamW, or torchao's low-bit AdamW (8-bit, 4-bit, fp8 states).
Those that do not run on FSDP2's DTensor parameters are refused with the reason (bitsandbytes' AdamW8bit,
transformers' Adafactor). Every variant applies the same (train/model.py adds the adapters, utils.py makes the
optimizer), so a difference between variants stays theirs. No torch at module level: the planner and the matrix
read it. docs/fine-tuning.md says what each costs and what was found.

Under ``--peft lora`` the base is cast to bf16, as fine-tuners load it (``torch_dtype=torch.bfloat16``), and peft's
default (``autocast_adapter_dtype``) leaves the adapters in fp32 beside it. FSDP2 shards both; what it all-gathers is
the policy's parameter dtype (bf16, the adapters cast too) or, under ``--mixed_precision_policy fp32``, each
parameter in its own dtype (bf16 base, fp32 adapters, gathered side by side).

Under ``--peft qlora`` the base's Linear layers (all but the head) are then 4-bit, as ``from_pretrained`` with the
QLoRA recipe's ``BitsAndBytesConfig`` leaves them (NF4, double quantization, bf16 compute), quantized by bitsandbytes
on the run's device, stored in ``--qlora_storage`` (bf16 by default: FSDP2 shards a floating parameter like any
other), and the adapters are bf16. uint8 storage is a known failure under FSDP2 (accelerate#3983), refused unless
``--allow_known_failure`` asks to measure it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from fsdp2bench.cli import UserError, quiet_imports

if TYPE_CHECKING:
    import torch
    from torch import nn

NO_PEFT, LORA, QLORA = "none", "lora", "qlora"
PEFT_MODES = (NO_PEFT, LORA, QLORA)
QLORA_STORAGES = ("bfloat16", "uint8")
# What a storage is known to do under FSDP2, said where it is refused.
KNOWN_FAILURES = {
    "uint8": "4-bit weights stored as uint8 are no floating tensor that FSDP2 can shard: QLoRA under FSDP2 then "
             "crashes or trains silently at loss 0 with a NaN gradient norm, and accelerate 1.15 leaves them out of "
             "sharding, whole on every rank (accelerate#3983); the fix: store them as bf16 (--qlora_storage bfloat16, "
             "bitsandbytes' bnb_4bit_quant_storage=torch.bfloat16, the default)",
}
BLOCKSIZE = 64  # bitsandbytes' 4-bit block: the fewest weights its quantization is asked of
# The attention and MLP projections of the built-in Qwen2 shapes (and of Llama-like decoders).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_DEFAULTS = {"lora_rank": 16, "lora_alpha": 32.0, "lora_dropout": 0.0, "lora_targets": ",".join(PROJECTIONS)}
PEFT_REQUIREMENTS = "requirements-peft.txt"
LOW_BIT_REQUIREMENTS = "requirements-float8.txt"  # torchao, which --float8 uses too

ADAMW, ADAMW8BIT, ADAMW4BIT, ADAMW_FP8 = "adamw", "adamw8bit", "adamw4bit", "adamw_fp8"
BNB_ADAMW8BIT, ADAFACTOR = "bnb_adamw8bit", "adafactor"
OPTIMIZERS = (ADAMW, ADAMW8BIT, ADAMW4BIT, ADAMW_FP8, BNB_ADAMW8BIT, ADAFACTOR)
# Found on the CPU (2 gloo ranks, torch 2.13, bitsandbytes 0.50.2, transformers 5.24): neither runs on DTensors.
REFUSED_OPTIMIZERS = {
    BNB_ADAMW8BIT: "bitsandbytes' AdamW8bit keeps its state in plain tensors, which FSDP2's DTensor parameters cannot "
                   "meet (on the CPU: optimizer_update_8bit_blockwise got mixed torch.Tensor and DTensor; on GPUs an "
                   "illegal memory access, bitsandbytes#1633); torchao's --optimizer adamw8bit runs on them",
    ADAFACTOR: "transformers' Adafactor keeps its factored row and column statistics in plain tensors, which FSDP2's "
               "DTensor gradients cannot meet (aten.add_.Tensor got mixed torch.Tensor and DTensor); factored "
               "statistics of a parameter sharded by rows would need an all-reduce per parameter (pytorch#109581)",
}


# Found on the CPU (torch 2.13) and on an H100 (torch 2.11), torchao 0.18: its quantized states implement no
# aten.view(dtype), which its compiled step calls for a bf16 DTensor parameter (a plain bf16 tensor and fp32 DTensors
# run); QLoRA's adapters are bf16, LoRA's fp32.
LOW_BIT_ON_BF16 = ("torchao 0.18's quantized optimizer states implement no aten.view(dtype), which its compiled step "
                   "calls on FSDP2's bf16 parameters such as QLoRA's adapters (NotImplementedError in OptimState8bit, "
                   "OptimState4bit and OptimStateFp8 dispatch, on the CPU and on an H100); --peft lora (fp32 adapters) "
                   "runs with it, and --optimizer adamw runs with QLoRA")


class LowBit(NamedTuple):
    """How a torchao optimizer stores a moment of a parameter's local chunk: quantized in blocks where the chunk
    holds at least ``QUANTIZED_FROM`` elements and a whole number of blocks (codes, one fp32 scale a block, and its
    own fp32 lookup table), else as a plain tensor like the parameter (``quantizes``)."""
    cls: str
    code_bits: int
    block: int
    table: int  # fp32 entries of the lookup table of each quantized moment
    codes: str  # what a quantized moment's elements are, for a sentence


LOW_BIT = {ADAMW8BIT: LowBit("AdamW8bit", 8, 256, 256, "8 bits"), ADAMW4BIT: LowBit("AdamW4bit", 4, 128, 16, "4 bits"),
           ADAMW_FP8: LowBit("AdamWFp8", 8, 256, 0, "fp8")}
# torchao 0.18's _AdamBase._new_buffer, after bitsandbytes: smaller chunks keep plain moments.
QUANTIZED_FROM = 4096
MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq
STEP_BYTES = 4  # every AdamW's per-parameter fp32 step counter, a host tensor


@dataclass(frozen=True, kw_only=True)
class Tuning:
    peft: str = NO_PEFT
    lora_rank: int = LORA_DEFAULTS["lora_rank"]
    lora_alpha: float = LORA_DEFAULTS["lora_alpha"]
    lora_dropout: float = LORA_DEFAULTS["lora_dropout"]
    lora_targets: str = LORA_DEFAULTS["lora_targets"]  # comma-separated module names, as peft's target_modules
    qlora_storage: str = QLORA_STORAGES[0]  # the dtype bitsandbytes packs the 4-bit weights in
    optimizer: str = ADAMW

    @property
    def adapters(self) -> bool:
        return self.peft != NO_PEFT

    @property
    def targets(self) -> list[str]:
        return [name.strip() for name in self.lora_targets.split(",") if name.strip()]

    def said(self) -> str | None:
        return what_trains(asdict(self))


TUNING_DEFAULTS = asdict(Tuning())  # as summary.json's meta writes them
ADAPTER_NAMES = {LORA: "LoRA", QLORA: "QLoRA"}


def what_trains(tuned: dict) -> str | None:
    """What trains and with which optimizer (``tuned``: a Tuning as summary.json and plan.json write it), where it is
    not the whole model with AdamW: a run's console and a plan's first line say it."""
    if not tuned or tuned == TUNING_DEFAULTS:
        return None
    base = f"4-bit NF4 base packed in {tuned['qlora_storage']}" if tuned["peft"] == QLORA else "bf16 base"
    trained = (f"{ADAPTER_NAMES[tuned['peft']]} adapters (rank {tuned['lora_rank']}, alpha {tuned['lora_alpha']:g}, "
               f"dropout {tuned['lora_dropout']:g}, over {tuned['lora_targets']}) on a frozen {base}"
               if tuned["peft"] != NO_PEFT else "the whole model")
    return f"{trained}, optimizer {tuned['optimizer']}"


# --------------------------------------------------------------------------- the optimizer's state

def quantizes(optimizer: str, numel: int) -> bool:
    """Whether ``optimizer`` quantizes the moments of a local chunk of ``numel`` elements: torchao's low-bit ones
    do where the chunk holds at least ``QUANTIZED_FROM`` elements and a whole number of blocks, and keep the rest
    plain, in the parameter's dtype, in silence."""
    low = LOW_BIT.get(optimizer)
    return low is not None and numel >= QUANTIZED_FROM and numel % low.block == 0


def moment_bytes(optimizer: str, numel: int, itemsize: int) -> int:
    """Bytes of one AdamW moment of a local chunk of ``numel`` elements whose parameter has ``itemsize`` bytes."""
    if not quantizes(optimizer, numel):
        return numel * itemsize
    low = LOW_BIT[optimizer]
    return numel * low.code_bits // 8 + 4 * (numel // low.block) + 4 * low.table


def state_bytes(optimizer: str, numel: int, itemsize: int) -> int:
    """What ``optimizer`` holds for one parameter whose local chunk has ``numel`` elements: two moments and a
    step counter."""
    return MOMENTS * moment_bytes(optimizer, numel, itemsize) + STEP_BYTES


def make_optimizer(params: list, tuning: Tuning, learning_rate: float) -> torch.optim.Optimizer:
    """The optimizer asked for, over ``params`` (the trainable ones), with the run's learning rate."""
    import torch

    if tuning.optimizer == ADAMW:
        return torch.optim.AdamW(params, lr=learning_rate)
    import torch._functorch.config

    with quiet_imports():
        import torchao.optim

    # torch's cache of compiled autograd graphs cannot tell torchao's state classes apart under DTensor: a process
    # that stepped AdamW8bit leaves a graph that a later AdamW4bit or AdamWFp8 process is served (torch 2.13,
    # torchao 0.18: "wrong number of dimensions" or "object has no attribute 'qmap'").
    torch._functorch.config.enable_autograd_cache = False
    return getattr(torchao.optim, LOW_BIT[tuning.optimizer].cls)(params, lr=learning_rate)


# --------------------------------------------------------------------------- the adapters

def add_adapters(model: nn.Module, tuning: Tuning, seed: int, device: torch.device | None = None) -> nn.Module:
    """The model as a fine-tuner hands it to FSDP2: unchanged for full fine-tuning; under LoRA the base cast to bf16
    and frozen, adapters over the targets (drawn from ``seed``: the same on every rank and in every variant); under
    QLoRA the base 4-bit first, quantized on ``device`` (the run's; by default the model's), and bf16 adapters."""
    if not tuning.adapters:
        return model
    import warnings

    import torch

    with quiet_imports():
        from peft import LoraConfig, get_peft_model
    check_targets(model, tuning.targets)
    for param in model.parameters():  # the buffers (rotary frequencies) stay fp32, as a bf16 load leaves them
        param.data = param.data.to(torch.bfloat16)
    if tuning.peft == QLORA:
        four_bit_base(model, getattr(torch, tuning.qlora_storage), device or next(model.parameters()).device)
    torch.manual_seed(seed)
    config = LoraConfig(r=tuning.lora_rank, lora_alpha=tuning.lora_alpha, lora_dropout=tuning.lora_dropout,
                        target_modules=tuning.targets, bias="none")
    with warnings.catch_warnings():  # peft asks transformers a question that transformers 5 says it will rename
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(model, config, autocast_adapter_dtype=tuning.peft == LORA)
    if tuning.peft == QLORA:  # the QLoRA recipe's bf16 adapters (peft leaves them fp32 beside a uint8 storage)
        for param in (p for p in model.parameters() if p.requires_grad):
            param.data = param.data.to(torch.bfloat16)
    return model


# --------------------------------------------------------------------------- the 4-bit base (QLoRA)

def four_bit_base(model: nn.Module, storage: torch.dtype, device: torch.device) -> None:
    """Every Linear layer but the head replaced by bitsandbytes' ``Linear4bit`` (NF4, double quantization, bf16
    compute: the QLoRA recipe) and quantized on ``device``. On the meta device, which cannot quantize, each weight
    is an empty ``Params4bit`` of the packed shape and storage (what the memory model reads), quantized later block
    by block (``quantize_drawn``). The model is marked 4-bit, as a 4-bit ``from_pretrained`` marks it, so that peft
    wraps these layers in its own 4-bit LoRA layers."""
    from torch import nn

    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module is not head:
            model.set_submodule(name, quantized(module, storage, device))
    model.is_loaded_in_4bit = True


def packed_shape(numel: int, storage: torch.dtype) -> tuple[int, int]:
    """What bitsandbytes stores a 4-bit weight of ``numel`` elements as: two codes a byte, in ``storage`` items."""
    return (numel + 1) // (2 * storage.itemsize), 1


def four_bit_weight(data: torch.Tensor, storage: torch.dtype, module: nn.Module) -> torch.Tensor:
    """``data`` as an unquantized 4-bit parameter of ``module``: quantized when it moves to a device."""
    from bitsandbytes.nn import Params4bit

    return Params4bit(data, requires_grad=False, compress_statistics=True, quant_type="nf4", quant_storage=storage,
                      module=module)


def quantized(linear: nn.Linear, storage: torch.dtype, device: torch.device) -> nn.Module:
    import torch
    from bitsandbytes.nn import Linear4bit

    four_bit = Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                          quant_storage=storage, device="meta")
    four_bit.bias = linear.bias
    if device.type == "meta":
        packed = torch.empty(packed_shape(linear.weight.numel(), storage), dtype=storage, device="meta")
        four_bit.weight = four_bit_weight(packed, storage, four_bit)
        return four_bit
    four_bit.weight = four_bit_weight(linear.weight.data, storage, four_bit)
    return four_bit.to(device)


def quantize_drawn(module: nn.Module, draw: Callable[[tuple[int, int]], torch.Tensor]) -> None:
    """A 4-bit layer built on meta (``four_bit_base``) quantized from the bf16 weight ``draw`` gives it, on that
    weight's device; any other module left as it is."""
    weight = module._parameters.get("weight")  # its own: peft's LoRA layers show their base layer's as theirs
    if type(weight).__name__ == "Params4bit" and weight.is_meta:
        drawn = draw((module.out_features, module.in_features))
        module.weight = four_bit_weight(drawn, weight.dtype, module).to(drawn.device)


def selects(target: str, name: str) -> bool:
    """peft's rule for a list of ``target_modules`` (``check_target_module_exists``): a module is adapted where its
    full name is the target, or ends with a dot and the target (``q_proj``, ``self_attn.q_proj``,
    ``model.layers.0.mlp.down_proj``)."""
    return name == target or name.endswith(f".{target}")


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Each name of ``--lora_targets`` selects Linear layers of the model by peft's rule, and only those; none is
    given twice or selects only layers that the others select. peft takes a repeated or redundant target in
    silence, and one that matches nothing where another matches."""
    from torch import nn

    modules = dict(model.named_modules())
    linear = [name for name, module in modules.items() if isinstance(module, nn.Linear)]
    flag = f"--lora_targets {','.join(targets)}"
    chosen = [[name for name in modules if selects(target, name)] for target in targets]
    for target, names in zip(targets, chosen):
        other = next((n for n in names if n not in linear), None)
        if other is not None:
            raise UserError(f"{flag}: {target} matches {other} ({type(modules[other]).__name__}), not a Linear layer "
                            f"(LoRA is measured on Linear layers); {linear_names_said(linear)}")
    missing = [target for target, names in zip(targets, chosen) if not names]
    if missing:
        raise UserError(f"{flag}: {', '.join(missing)} matches no Linear layer of this model; "
                        f"{linear_names_said(linear)}")
    check_targets_distinct(flag, targets, chosen)


def check_targets_distinct(flag: str, targets: list[str], chosen: list[list[str]]) -> None:
    """A target given twice, or one whose layers the other targets all select already, adds nothing: refused, so
    that the line names what is adapted once."""
    twice = next((target for i, target in enumerate(targets) if target in targets[:i]), None)
    if twice is not None:
        raise UserError(f"{flag}: {twice} is given twice")
    for i, (target, names) in enumerate(zip(targets, chosen)):
        by_others = {name for j, other in enumerate(chosen) if j != i for name in other}
        if set(names) <= by_others:
            covering = [t for j, t in enumerate(targets) if j != i and set(chosen[j]) & set(names)]
            raise UserError(f"{flag}: {target} adds no layer: its {len(names)} layer(s) are selected by "
                            f"{', '.join(covering)} already")


def linear_names_said(linear: list[str]) -> str:
    """The model's Linear layers for a refusal: the last part of their names, and one whole name."""
    if not linear:
        return "it has no Linear layer"
    last = sorted({name.rsplit(".", 1)[-1] for name in linear})
    return (f"its Linear layers are named {', '.join(last)} (a target matches a layer whose full name is it or ends "
            f"with '.' and it, peft's rule: e.g. {linear[0]})")


# --------------------------------------------------------------------------- checks

def check(tuning: Tuning) -> None:
    """What cannot run anywhere with the installed packages, refused in one line with the reason, before the model
    is built."""
    packages = {"peft": tuning.adapters, "bitsandbytes": tuning.peft == QLORA}
    for package in (name for name, needed in packages.items() if needed):
        try:
            with quiet_imports():
                __import__(package)
        except ImportError as exc:
            raise UserError(f"--peft {tuning.peft}: {package} cannot be imported ({exc}); install it with pip "
                            f"install -r {PEFT_REQUIREMENTS}") from None
    if tuning.optimizer in REFUSED_OPTIMIZERS:
        raise UserError(f"--optimizer {tuning.optimizer}: {REFUSED_OPTIMIZERS[tuning.optimizer]}")
    if tuning.optimizer in LOW_BIT and tuning.peft == QLORA:
        raise UserError(f"--optimizer {tuning.optimizer} with --peft qlora: {LOW_BIT_ON_BF16}")
    if tuning.optimizer in LOW_BIT:
        try:
            with quiet_imports():
                import torchao.optim  # noqa: F401
        except ImportError as exc:
            raise UserError(f"--optimizer {tuning.optimizer}: torchao cannot be imported ({exc}); install it with pip "
                            f"install -r {LOW_BIT_REQUIREMENTS}") from None


def check_known_failure(tuning: Tuning, allowed: bool) -> None:
    """A QLoRA storage known to fail under FSDP2 is refused before any step, with the reason and the fix, unless
    the run asks to measure it (then the end-of-run checks say what happened)."""
    known = KNOWN_FAILURES.get(tuning.qlora_storage) if tuning.peft == QLORA else None
    if known and not allowed:
        raise UserError(f"--qlora_storage {tuning.qlora_storage}: {known}; --allow_known_failure runs it anyway")
    if allowed and not known:
        raise UserError("--allow_known_failure: nothing in this command line is a known failure (it runs --peft "
                        f"qlora --qlora_storage {', '.join(KNOWN_FAILURES)})")


def check_device(tuning: Tuning, device_type: str) -> None:
    """torchao's optimizers compile each parameter's step (inductor: C++ on the CPU); QLoRA quantizes on the run's
    device, where bitsandbytes must have 4-bit kernels."""
    from fsdp2bench.options.levers import check_cpp_compiler

    if tuning.optimizer in LOW_BIT and device_type == "cpu":
        check_cpp_compiler(f"--optimizer {tuning.optimizer}: torchao compiles each parameter's step with inductor, "
                           "which builds C++ on the CPU")
    if tuning.peft == QLORA:
        check_four_bit_kernels(device_type)


def check_four_bit_kernels(device_type: str) -> None:
    """A 4-bit quantization of a few weights on the CPU, asked of the installed bitsandbytes (releases before 0.46
    had CUDA kernels alone); a GPU's are its CUDA build's."""
    if device_type != "cpu":
        return
    import bitsandbytes
    import torch

    try:
        with quiet_imports():
            bitsandbytes.functional.quantize_4bit(torch.ones(BLOCKSIZE, dtype=torch.bfloat16), quant_type="nf4")
    except Exception as exc:  # noqa: BLE001 - whatever the release raises where it has no CPU kernel
        raise UserError(f"--peft qlora on the CPU: bitsandbytes {bitsandbytes.__version__} cannot quantize there "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}); run it on a "
                        "GPU") from None
