"""Where each variant's memory goes: bytes counted on every rank, and the same bytes predicted.

Measured (``account``): the storages actually held by the model's parameters (their local
shards: ``DTensor.numel()`` is the global size), their gradients, the optimizer's state, and
stale parameters (tensors the optimizer holds that the model no longer uses). Each storage
is counted once, whole, so padding and shared buffers are included.

Expected (``expected_state``): FSDP2 splits dim 0 of each parameter into N chunks of
ceil(d0 / N) rows. Every rank stores its chunk padded to that size; the optimizer's state
follows the unpadded local chunk; AdamW adds a 4-byte ``step`` per parameter. With
P = the model's parameter bytes:

* after / fixed / accelerate, held between steps: P/N (params) + 2P/N (AdamW moments)
* unfixed, held between steps: P (stale full params) + P/N (params) + P/N (grads never cleared)
* during a step every variant also holds its sharded gradients (P/N) until ``zero_grad``.

So at the peak the unfixed variant holds P + 2P/N against 4P/N: equal at N = 2, worse beyond.

Where it lives (``expected_device_bytes``): on a GPU run everything above is on the GPU except
AdamW's step counters (host tensors). Under ``cpu_offload`` the parameters, gradients and AdamW
state live on the host, but the unfixed variant's stale parameters do not: ``fully_shard`` moves
each managed parameter to the GPU in place before it shards and offloads, and the optimizer holds
those same parameter objects, so P stays on the GPU. The other options change no state byte:
``reshard_after_forward``, the mixed-precision policy (the sharded parameters stay fp32) and
activation checkpointing change what a step holds for a moment (gathered parameters,
activations), which the measured peaks show beyond the state.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2bench.names import UNFIXED
from fsdp2bench.options import FsdpOptions

ADAMW_MOMENTS = 2
STEP_BYTES = 4  # AdamW's per-parameter fp32 step counter
PROJECTION_WORLD_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


# --------------------------------------------------------------------------- measured

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())  # parameters() already skips tied duplicates


def account(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes held on this rank by parameters, gradients, optimizer state and stale parameters.

    ``device_bytes`` is the part of the total that lives on the accelerator (AdamW keeps its
    step counters on the host), used to explain measured allocated memory.
    """
    seen: set = set()
    device_total = 0

    def held(tensors) -> int:
        nonlocal device_total
        total = 0
        for t in tensors:
            storage = local_tensor(t).untyped_storage()
            key = (str(t.device), storage.data_ptr(), storage.nbytes())
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
            if t.device.type != "cpu":
                device_total += storage.nbytes()
        return total

    params = _unique_params(model)
    in_model = {id(p) for p in params}
    result = {
        "param_bytes": held(params),
        "grad_bytes": held(p.grad for p in params if p.grad is not None),
        "optimizer_state_bytes": held(v for state in optimizer.state.values() for v in state.values()
                                      if torch.is_tensor(v)),
        "stale_param_bytes": held(p for group in optimizer.param_groups for p in group["params"]
                                  if id(p) not in in_model),
    }
    return {**result, "device_bytes": device_total}


# --------------------------------------------------------------------------- expected

def param_shapes(model: nn.Module) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes per element) of each unique parameter of the unsharded model (a meta model will do)."""
    return [(tuple(p.shape), p.element_size()) for p in _unique_params(model)]


def model_bytes(shapes) -> int:
    """P: the bytes of the unsharded model's parameters, from ``param_shapes``."""
    return sum(math.prod(shape) * item for shape, item in shapes)


def shard_rows(d0: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows ``rank`` holds under FSDP2's Shard(0): chunks of ceil(d0 / N)."""
    chunk = math.ceil(d0 / world_size)
    start = min(d0, rank * chunk)
    return start, min(d0, start + chunk)


def _shard_bytes(shapes, world_size: int, rank: int) -> tuple[int, int, int]:
    """(padded shard bytes, unpadded shard bytes, full bytes) summed over parameters."""
    padded = local = full = 0
    for shape, item in shapes:
        d0 = shape[0] if shape else 1
        rest = math.prod(shape[1:]) * item
        start, stop = shard_rows(d0, world_size, rank)
        padded += math.ceil(d0 / world_size) * rest  # every rank stores its chunk padded to full size
        local += (stop - start) * rest
        full += d0 * rest
    return padded, local, full


def expected_state(shapes, world_size: int, rank: int, variant: str, phase: str) -> dict:
    """What ``account`` should find for ``variant`` at ``phase``.

    phase: "end_of_setup" (sharded, no step yet), "before_zero_grad" (after the last
    optimizer step) or "end_of_training" (after the last ``zero_grad``).
    """
    padded, local, full = _shard_bytes(shapes, world_size, rank)
    unfixed = variant == UNFIXED
    trained = phase != "end_of_setup"
    grads_alive = trained and (unfixed or phase == "before_zero_grad")
    return {
        "param_bytes": padded,
        "grad_bytes": padded if grads_alive else 0,
        "optimizer_state_bytes": ADAMW_MOMENTS * local + STEP_BYTES * len(shapes)
        if trained and not unfixed else 0,
        "stale_param_bytes": full if unfixed else 0,
    }


def expected_device_bytes(shapes, world_size: int, rank: int, variant: str, phase: str,
                          options: FsdpOptions, device_type: str) -> int:
    """The part of ``expected_state`` that ``account`` should find on the accelerator (see the module text)."""
    if device_type == "cpu":
        return 0
    state = expected_state(shapes, world_size, rank, variant, phase)
    if options.cpu_offload:
        return state["stale_param_bytes"]
    steps = STEP_BYTES * len(shapes) if state["optimizer_state_bytes"] else 0
    return sum(state.values()) - steps


def projection(shapes, variants: list[str], sizes: list[int] = PROJECTION_WORLD_SIZES) -> dict:
    """Per-rank state of each variant for larger clusters, between steps and at the step peak, on the
    worst rank: rank 0, whose chunk of every parameter is the largest (``shard_rows``)."""
    return {str(n): {name: {phase: sum(expected_state(shapes, n, 0, name, phase).values())
                            for phase in ("end_of_training", "before_zero_grad")} for name in variants}
            for n in sizes}


def first_world_size_where_unfixed_costs_more(table: dict, reference: str) -> int | None:
    """Smallest projected N at which the unfixed variant's state at the step peak exceeds ``reference``'s."""
    for n, row in table.items():
        if UNFIXED in row and reference in row and \
                row[UNFIXED]["before_zero_grad"] > row[reference]["before_zero_grad"]:
            return int(n)
    return None
