"""The parallel layout: how a world of N ranks splits into replicas, shards, context and tensor groups.

One request (``Layout``, from the command line or an option set: no world size in it, so that a sweep
resolves one command line at many N) and one resolved form (``Degrees``, at a given N), read by every
part of the benchmark: the variants, the mesh, the data split, the memory model, the matrix, the planner.
The axes and their order are accelerate's (``ParallelismConfig``) and torchtitan's: dp_replicate,
dp_shard, cp, tp, with tp innermost, so that a rank's tensor-parallel peers are its neighbours. FSDP2
shards over dp_shard x cp (accelerate's "dp_shard_cp") and replicates over dp_replicate; the ranks of one
cp and tp group train on the same batch. No torch at module level: the matrix launcher reads it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from fsdp2bench.cli import UserError, quietly_import_models

AXES = ("dp_replicate", "dp_shard", "cp", "tp")
FSDP_SHARD_AXIS = "dp_shard_cp"  # dp_shard and cp flattened: the ranks one FSDP2 group shards over
CP_STRATEGIES = ("allgather", "alltoall")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The sizes asked for, under accelerate's names; None: the ranks left over (flat FSDP if both are)."""
    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    cp_size: int = 1
    tp_size: int = 1
    cp_comm_strategy: str = "allgather"  # how CP's ring attention passes keys and values

    def at(self, world_size: int) -> "Degrees":
        """The degrees at ``world_size`` ranks; refused in one line, naming the flags, where they do not fit."""
        inner = self.cp_size * self.tp_size
        if world_size % inner:
            raise UserError(f"--cp_size {self.cp_size} x --tp_size {self.tp_size} = {inner} does not divide the "
                            f"world size {world_size}")
        data = world_size // inner
        r, s = self.dp_replicate_size, self.dp_shard_size
        said = f"the world size {world_size}" if inner == 1 else \
            f"the {data} data-parallel ranks (world size {world_size} / {inner})"
        if r is not None and s is not None and r * s != data:
            raise UserError(f"--dp_replicate_size {r} x --dp_shard_size {s} is not {said}")
        if r is None and s is None:
            r, s = 1, data
        elif r is not None and data % r:
            raise UserError(f"--dp_replicate_size {r} does not divide {said}")
        elif s is not None and data % s:
            raise UserError(f"--dp_shard_size {s} does not divide {said}")
        r, s = (r, data // r) if s is None else (data // s, s)
        return Degrees(replicate=r, shard=s, cp=self.cp_size, tp=self.tp_size)

    def fits(self, world_size: int) -> bool:
        """Whether the sizes fit a world of ``world_size`` ranks (the matrix runs a set only where they do)."""
        try:
            self.at(world_size)
        except UserError:
            return False
        return True

    @property
    def hsdp(self) -> bool:
        """Whether a replicate dimension is asked for (it may still be 1 at some world sizes)."""
        return self.dp_shard_size is not None or (self.dp_replicate_size or 1) > 1

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def context_parallel(self) -> bool:
        return self.cp_size > 1

    @property
    def sequence_divisor(self) -> int:
        """What every sequence length must be a multiple of: CP's load balancing cuts it into 2C chunks."""
        return 2 * self.cp_size if self.context_parallel else 1

    def check_model(self, config, block_size: int) -> None:
        """What the model and the sequence must allow, refused in one line before anything runs."""
        if self.tensor_parallel:
            check_tensor_parallel(config, self.tp_size)
        if self.context_parallel:
            check_context_parallel(config, self.cp_size, block_size)


# The styles of a model's tensor-parallel plan the torch variants apply, and the dim of the weight each
# splits: colwise, a Linear's output features (dim 0) and its bias; rowwise, its input features (dim 1);
# embedding_rowwise, an Embedding's rows, the vocabulary (dim 0; transformers adds it to a plan where the
# word embeddings are tied to the head, which then splits with them).
TP_STYLES = {"colwise": 0, "rowwise": 1, "embedding_rowwise": 0}


def tensor_parallel_plan(config) -> dict[str, str]:
    """The model's own plan (its config's ``base_model_tp_plan``): module pattern under the base model,
    ``*`` for a block's index, to style."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def planned_style(module_name: str, plan: dict[str, str]) -> str | None:
    """The plan's style for a module of the base model (``layers.3.mlp.up_proj``), or None."""
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), module_name):
            return style
    return None


def tensor_parallel_dim(param_name: str, plan: dict[str, str], base_prefix: str) -> int | None:
    """The dim of a parameter the plan splits over the tp ranks; None where it keeps it whole (embeddings,
    norms, the head, a rowwise layer's bias). ``param_name`` as the causal LM names it."""
    module, _, kind = param_name.rpartition(".")
    if base_prefix and module.startswith(base_prefix + "."):
        module = module[len(base_prefix) + 1:]
    style = planned_style(module, plan)
    if style not in TP_STYLES:  # unplanned, or a style --tp_size refuses (check_tensor_parallel)
        return None
    if kind == "bias":  # a colwise layer's bias is split with its outputs; a rowwise one's is added whole
        return 0 if style == "colwise" else None
    return TP_STYLES[style]


def check_tensor_parallel(config, tp: int) -> None:
    """TP needs the model's own plan, a mapping of module patterns to styles the torch variants apply, each
    entry splitting a module of the model; T must split every head count, the MLP width and each split weight
    evenly; and the split shapes must line up (checked by a forward on the meta device)."""
    where = config_file(config)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise UserError(f"--tp_size {tp}: {where} has no tensor-parallel plan (base_model_tp_plan)")
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise UserError(f"--tp_size {tp}: {where}: base_model_tp_plan must map module patterns to styles "
                        f"({{\"layers.*.mlp.up_proj\": \"colwise\", ...}}), got {_short(plan)}")
    unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unknown:
        raise UserError(f"--tp_size {tp}: the {config.model_type} plan uses {', '.join(unknown)}; the torch variants "
                        f"apply {' and '.join(TP_STYLES)} only ({where})")
    sizes = {"attention heads (num_attention_heads)": config.num_attention_heads,
             "key/value heads (num_key_value_heads)": getattr(config, "num_key_value_heads", None)
             or config.num_attention_heads,
             "MLP width (intermediate_size)": config.intermediate_size}
    for what, size in sizes.items():
        if size % tp:
            raise UserError(f"--tp_size {tp} does not divide the model's {size} {what}")
    check_plan_on_the_model(config, plan, tp, where)


def config_file(config) -> str:
    """The config.json a model was read from, or what the config is (a preset's has no file)."""
    directory = getattr(config, "_name_or_path", "") or ""
    return os.path.join(directory, "config.json") if directory and os.path.isdir(directory) else \
        f"the {config.model_type} config"


def _short(value) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Each style splits these kinds of module (torch's ColwiseParallel and RowwiseParallel, as the variants apply them)
SPLITS = {"colwise": ("Linear",), "rowwise": ("Linear",), "embedding_rowwise": ("Embedding",)}


def check_plan_on_the_model(config, plan: dict[str, str], tp: int, where: str) -> None:
    """Every entry splits a module it can split, by T evenly; then the model's forward on the meta device with each
    planned weight cut to one rank's part: an entry whose neighbours are left whole fails there, not in a run."""
    base = _meta_base_model(config)
    if base is None:  # a config transformers cannot build: the model's own check says so
        return
    for pattern, style in plan.items():
        matched = [(name, m) for name, m in base.named_modules() if name and planned_style(name, {pattern: style})]
        if not matched:
            raise UserError(f"--tp_size {tp}: {where}: base_model_tp_plan entry \"{pattern}\" matches no module of "
                            f"the model (e.g. {_module_example(base)}), so it would split nothing")
        for name, module in matched:
            _check_kind(module, name, pattern, style, tp, where)
    whole = _meta_forward(base)
    for name, module in base.named_modules():
        if name and (style := planned_style(name, plan)):
            _cut_to_one_rank(module, style, tp)
    failed = _meta_forward(base)
    if failed is not None and whole is None:
        scope, why = failed
        if not any(n.startswith(scope + ".") for n, _ in base.named_modules()):  # a leaf: the block around it
            scope = scope.rpartition(".")[0] or scope
        entries = [p for p in plan if any(planned_style(n, {p: plan[p]}) for n, _ in base.named_modules()
                                          if n.startswith(scope + ".") or n == scope)]
        named = ("entry " if len(entries) == 1 else "entries ") + ", ".join(f'"{e}"' for e in entries)
        raise UserError(f"--tp_size {tp}: {where}: base_model_tp_plan {named} split{'s' if len(entries) == 1 else ''} "
                        f"{scope} without what it feeds or is fed by: its shapes do not line up on {tp} ranks "
                        f"({why})")


def _meta_base_model(config):
    """The base model (what the plan's patterns name modules under) on the meta device, or None."""
    import torch
    from transformers import AutoModelForCausalLM

    quietly_import_models()  # a refusal of the plan below stays one line
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception:  # transformers cannot build it: model_facts refuses it in one line
        return None
    return model.get_submodule(model.base_model_prefix) if getattr(model, "base_model_prefix", "") else model


def _module_example(base) -> str:
    names = [n for n, m in base.named_modules() if type(m).__name__ == "Linear"]
    return '"' + re.sub(r"\.\d+\.", ".*.", names[0]) + '"' if names else "none is a Linear"


def _check_kind(module, name: str, pattern: str, style: str, tp: int, where: str) -> None:
    kind = type(module).__name__
    if kind not in SPLITS[style]:
        raise UserError(f"--tp_size {tp}: {where}: base_model_tp_plan entry \"{pattern}\": \"{style}\" splits "
                        f"{' or '.join(SPLITS[style])} modules, and {name} is a {kind}")


def _cut_to_one_rank(module, style: str, tp: int) -> None:
    """Rank 0's part of a planned weight (and a colwise bias), the larger of an uneven split, in place."""
    import torch

    dim = TP_STYLES[style]
    shape = list(module.weight.shape)
    shape[dim] = -(-shape[dim] // tp)
    module.weight = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
    if style == "colwise" and getattr(module, "bias", None) is not None:
        module.bias = torch.nn.Parameter(torch.empty(shape[0], device="meta"), requires_grad=False)


def _meta_forward(base, length: int = 8) -> tuple[str, str] | None:
    """The base model's forward on meta tensors (a causal mask given whole, so that nothing reads a value): None,
    or the innermost module running when it failed and the first line of why."""
    import torch

    running: list[str] = []
    names = {id(m): n for n, m in base.named_modules()}

    def enter(module, _args) -> None:
        running.append(names[id(module)])

    def leave(_module, _args, _output) -> None:
        running.pop()

    hooks = [m.register_forward_pre_hook(enter) for m in base.modules()]
    hooks += [m.register_forward_hook(leave) for m in base.modules()]
    try:
        with torch.no_grad():
            base(input_ids=torch.zeros(1, length, dtype=torch.long, device="meta"),
                 attention_mask=torch.zeros(1, 1, length, length, device="meta"),
                 position_ids=torch.zeros(1, length, dtype=torch.long, device="meta"))
        return None
    except Exception as exc:  # whatever a split that does not line up raises inside the model
        return (running[-1] if running else "the model"), (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    finally:
        for hook in hooks:
            hook.remove()


def check_context_parallel(config, cp: int, block_size: int) -> None:
    """CP runs torch's ring attention in place of SDPA on sequences cut into 2C chunks."""
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention != "sdpa":
        raise UserError(f"--cp_size {cp}: context parallelism replaces PyTorch's scaled_dot_product_attention, and "
                        f"this model's attention is {attention!r}, not 'sdpa'")
    if block_size % (2 * cp):
        raise UserError(f"--block_size {block_size}: --cp_size {cp} cuts each sequence into {2 * cp} chunks (two per "
                        f"rank, for the causal mask's balance), so it must be a multiple of {2 * cp}")


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """A layout resolved at a world size: R x S x C x T ranks."""
    replicate: int
    shard: int
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.cp * self.tp

    @property
    def fsdp_degree(self) -> int:
        """The ranks one parameter is sharded over by FSDP2: dp_shard x cp."""
        return self.shard * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks that train on different batches: dp_replicate x dp_shard."""
        return self.replicate * self.shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's place on each axis, tp innermost."""
        place, sizes = {}, dict(zip(AXES, (self.replicate, self.shard, self.cp, self.tp)))
        for axis in reversed(AXES):
            rank, place[axis] = divmod(rank, sizes[axis])
        return {axis: place[axis] for axis in AXES}

    def fsdp_index(self, rank: int) -> int:
        """Which of the ``fsdp_degree`` shards of each parameter this rank holds."""
        at = self.coordinates(rank)
        return at["dp_shard"] * self.cp + at["cp"]

    def data_rank(self, rank: int) -> int:
        """Which of the ``data_ranks`` batches this rank trains on (its cp and tp peers share it)."""
        at = self.coordinates(rank)
        return at["dp_replicate"] * self.shard + at["dp_shard"]

    def mesh_axes(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The axes the mesh has: dp_shard always (FSDP2 needs one to shard over), the others where above 1."""
        sizes = dict(zip(AXES, (self.replicate, self.shard, self.cp, self.tp)))
        names = tuple(a for a in AXES if a == "dp_shard" or sizes[a] > 1)
        return names, tuple(sizes[a] for a in names)

    def as_dict(self) -> dict[str, int]:
        """For summary.json: each axis under its one name."""
        return dict(zip(AXES, (self.replicate, self.shard, self.cp, self.tp)))

    def said(self) -> str:
        """"2 replicas x 4 shards x cp 2 x tp 2", the axes above 1 (or "1 rank")."""
        parts = [f"{n} {word}" for n, word in ((self.replicate, "replicas"), (self.shard, "shards"),
                                                (self.cp, "cp"), (self.tp, "tp")) if n > 1]
        return " x ".join(parts) or "1 rank"


@dataclass
class Meshes:
    """The device meshes one variant needs, all views of one world mesh."""
    fsdp: object  # fully_shard's: (dp_shard_cp,) or (dp_replicate, dp_shard_cp)
    tp: object | None  # parallelize_module's
    cp: object | None  # context_parallel's
    world: object


def build_meshes(device_type: str, degrees: Degrees) -> Meshes:
    """The one ``init_device_mesh`` of a variant, and the views cut from it. The default and HSDP layouts
    keep the 1-D and (dp_replicate, dp_shard) meshes FSDP2 had before TP and CP existed here."""
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = degrees.mesh_axes()
    world = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if degrees.cp > 1:
        world["dp_shard", "cp"]._flatten(FSDP_SHARD_AXIS)
        shard_axis = FSDP_SHARD_AXIS
    else:
        shard_axis = "dp_shard"
    fsdp = world["dp_replicate", shard_axis] if degrees.replicate > 1 else world[shard_axis]
    return Meshes(fsdp=fsdp, tp=world["tp"] if degrees.tp > 1 else None, cp=world["cp"] if degrees.cp > 1 else None,
                  world=world)
