"""A Hugging Face checkpoint on disk, in either of its formats, read lazily.

safetensors files (``model.safetensors``, or shards with ``model.safetensors.index.json``), or
``pytorch_model.bin`` files (one, or shards with ``pytorch_model.bin.index.json``), which many
published checkpoints still are. Both are memory-mapped: a tensor, or a few rows of it, is read from
the file only when asked for, so a rank that wants its own rows reads only those. A ``.bin`` file
in torch's legacy (pre-zip) format cannot be mapped: it is refused rather than read whole.
"""

from __future__ import annotations

import glob
import json
import os
import zipfile

import torch

from fsdp2bench.cli import UserError, one_line

BIN_NAME, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
FORMATS = ("safetensors", "bin")
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
               torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def safetensors_names(file: str) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error type for a bad header or a short file
        raise UserError(f"--checkpoint: {file} is not a readable safetensors file ({one_line(exc)})") from None


def mapped_bin(file: str) -> dict[str, torch.Tensor]:
    """A ``.bin`` file's tensors, memory-mapped (nothing is read yet); refused in one line if it is not one."""
    if not zipfile.is_zipfile(file):
        with open(file, "rb") as f:
            pickled = f.read(1) == b"\x80"  # a bare pickle: what torch.save wrote before its zip format
        if pickled:
            raise UserError(f"--checkpoint: {file} is in torch's legacy format, which cannot be memory-mapped; "
                            f"save it again with torch.save")
        raise UserError(f"--checkpoint: {file} is not a readable pytorch_model.bin (not a zip archive)")
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # a pickle, zip or unpickling error of any kind: the file is not what it says
        raise UserError(f"--checkpoint: {file} is not a readable pytorch_model.bin ({one_line(exc)})") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"--checkpoint: {file} does not hold a state dict of tensors")
    return state


SAFETENSORS_NAME, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


def indexed_files(path: str, index_name: str, pattern: str) -> tuple[list[str], dict[str, str] | None]:
    """The files of one format in a checkpoint directory, and its index's ``tensor -> file`` map: those
    the index names (each must exist), or without an index every file of the format (``pattern``)."""
    index = os.path.join(path, index_name)
    if not os.path.exists(index):
        return sorted(glob.glob(os.path.join(path, pattern))), None
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"--checkpoint: {index} is not a readable index ({one_line(exc)})") from None
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise UserError(f"--checkpoint: {index} names {missing[0]}, which does not exist")
    return files, {name: os.path.join(path, file) for name, file in weight_map.items()}


def check_index(weight_map: dict[str, str] | None, found: dict[str, str]) -> None:
    """Every tensor the index names is in the file it names."""
    for name, file in (weight_map or {}).items():
        if found.get(name) != file:
            held = f"it is in {found[name]}" if name in found else "no file holds it"
            raise UserError(f"--checkpoint: the index puts {name} in {file}, but {held}")


class Checkpoint:
    """Tensor names and files of a checkpoint; every file's header is read at once, so that a corrupt
    or truncated one is refused before any load."""

    def __init__(self, path: str):
        self.path = path
        self.files: dict[str, str] = {}  # tensor name -> file
        self._mapped: dict[str, dict[str, torch.Tensor]] = {}  # .bin file -> its mapped tensors
        safetensors, weight_map = indexed_files(path, SAFETENSORS_INDEX, "*.safetensors")
        bins: list[str] = []
        if not safetensors:
            bins, weight_map = indexed_files(path, BIN_INDEX, BIN_NAME)
        if not safetensors and not bins:
            raise UserError(f"--checkpoint {path}: no *.safetensors or {BIN_NAME} files")
        self.format = "safetensors" if safetensors else "bin"
        for file in safetensors:
            self.files.update({name: file for name in safetensors_names(file)})
        for file in bins:
            self._mapped[file] = mapped_bin(file)
            self.files.update({name: file for name in self._mapped[file]})
        check_index(weight_map, self.files)

    def check_against(self, named_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        """The model's every parameter is in the checkpoint, with its shape, in a dtype that can be read."""
        for name, shape in named_shapes:
            if name not in self.files:
                raise UserError(f"--checkpoint {self.path}: no tensor {name}, which the model has")
            found = self.meta(name)
            if tuple(found.shape) != tuple(shape):
                raise UserError(f"--checkpoint {self.path}: {name} has shape {tuple(found.shape)}, the model's is "
                                f"{tuple(shape)}")
            if not found.dtype.is_floating_point:
                raise UserError(f"--checkpoint {self.path}: {name} is {found.dtype}, not a floating-point tensor")

    def __getstate__(self) -> dict:
        """Sent to a child without its mapped tensors (pickling them would copy them): it maps its own."""
        return {**self.__dict__, "_mapped": {}}

    def bytes(self) -> int:
        return sum(os.path.getsize(f) for f in set(self.files.values()))

    def dtype_name(self) -> str:
        """The dtype of the checkpoint's first tensor, as safetensors names it (BF16, F32...)."""
        name = next(iter(self.files))
        if self.format == "bin":
            dtype = self._bin(self.files[name])[name].dtype
            return DTYPE_NAMES.get(dtype, str(dtype))
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return str(f.get_slice(name).get_dtype())

    def tensor(self, name: str) -> torch.Tensor:
        """One whole tensor: read from a safetensors file, or mapped from a ``.bin`` one."""
        if self.format == "bin":
            return self._bin(self.files[name])[name]
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)

    def meta(self, name: str) -> torch.Tensor:
        """A tensor's shape and dtype, on the meta device: nothing is read."""
        if self.format == "bin":
            t = self._bin(self.files[name])[name]
            return torch.empty(t.shape, dtype=t.dtype, device="meta")
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            piece = f.get_slice(name)
            if piece.get_dtype() not in DTYPES:
                raise UserError(f"--checkpoint: {name} in {self.files[name]} is {piece.get_dtype()}, a dtype this "
                                "benchmark cannot read")
            return torch.empty(piece.get_shape(), dtype=DTYPES[piece.get_dtype()], device="meta")

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of one tensor: only those bytes are read."""
        if self.format == "bin":
            return self._bin(self.files[name])[name][start:stop]
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return f.get_slice(name)[start:stop]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.files}

    def _bin(self, file: str) -> dict[str, torch.Tensor]:
        if file not in self._mapped:
            self._mapped[file] = mapped_bin(file)
        return self._mapped[file]


def write_bin(state: dict[str, torch.Tensor], path: str, max_shard_bytes: int) -> None:
    """``state`` as transformers would save it in the ``.bin`` format (which transformers 5 no longer
    writes): files of at most ``max_shard_bytes`` (a tensor larger than that alone in its own), and
    an index when there are several. A tensor that shares its storage with an earlier one (tied
    weights) is saved once, under the earlier name."""
    unique, seen = {}, set()
    for name, tensor in state.items():
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            unique[name] = tensor.contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in unique.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    os.makedirs(path, exist_ok=True)
    if len(shards) == 1:
        torch.save(shards[0], os.path.join(path, BIN_NAME))
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, os.path.join(path, file))
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in unique.values())
    with open(os.path.join(path, BIN_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
