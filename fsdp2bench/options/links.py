"""The cluster's links, and what a collective over a group of ranks costs on them: a ring over the group's shape.

Within a node a GPU moves ``within_gbps`` per direction (NVLink 4 on H100 and H200 SXM: 900 GB/s both ways). Across
nodes every GPU has a NIC of its own (``across_gbps``, 400 Gb/s RDMA: 50 GB/s), one rail per local GPU, and NCCL
runs a ring channel per rail: a group that holds k GPUs of each node it spans crosses between nodes on k NICs at
once (k x ``across_gbps``, capped by NVLink), while a group of one GPU per node (HSDP's replicas) has one NIC.
Each ring step adds a latency: ``latency_within_us`` inside a node, ``latency_across_us`` between nodes
(assumed, of the order NCCL's own tuning model gives its ring's per-hop latency on NVLink and on a network).

A ring all-gather or reduce-scatter of a whole of B bytes over G ranks moves (G-1)/G B into each rank in G-1 steps;
an all-reduce twice that. NCCL switches to trees at large G and small messages, and to NVLS on NVSwitch systems;
neither is modelled (docs/links.md). No torch here: the planner and the command lines import it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import Sequence

from fsdp2bench.cli import UserError
from fsdp2bench.files import expect_path

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST = "all_gather", "reduce_scatter", "all_reduce", "broadcast"
ALL_TO_ALL, SEND = "all_to_all", "send"
DTENSOR = " (DTensor)"  # a functional collective's tally is kept apart: it waits whole on the compute stream
# How many times the whole a ring moves into each rank, over (G-1)/G: an all-reduce is a reduce-scatter and an
# all-gather; a broadcast (pipelined along the ring) about one whole; an all-to-all sends (G-1)/G of each rank's
# whole away (its G-1 pieces, one a step). A send (a permute's: each rank's whole to one other) is one hop.
RING_WHOLES = {ALL_GATHER: 1, REDUCE_SCATTER: 1, ALL_REDUCE: 2, BROADCAST: 1, ALL_TO_ALL: 1}


@dataclass(frozen=True)
class Links:
    """GB/s (1e9 bytes) per direction per GPU within a node of ``node_size`` GPUs and per NIC across nodes, and the
    latency of one ring step in microseconds; the CTAs (NCCL's channels) a collective's kernel holds. The defaults:
    8-GPU H100 or H200 SXM nodes, one 400 Gb/s NIC a GPU, 16 channels (what NCCL's logs show on such nodes)."""
    node_size: int = 8
    within_gbps: float = 450.0
    across_gbps: float = 50.0
    latency_within_us: float = 1.0
    latency_across_us: float = 5.0
    channels: int = 16  # CTAs a collective's kernel holds on the GPU while it runs (0: none, a sleep)

    def group_gbps(self, ranks: Sequence[int]) -> float:
        """A ring over ``ranks``: NVLink inside one node; across nodes one rail per member of the group in the node
        that holds fewest of them (the ring is as fast as its slowest crossing), capped by NVLink."""
        nodes = members_per_node(ranks, self.node_size)
        if len(nodes) <= 1:
            return self.within_gbps
        return min(self.within_gbps, min(nodes.values()) * self.across_gbps)

    def gbps(self, group: int, span: int) -> float:
        """The same for a group of ``group`` ranks evenly spread over ``span`` consecutive ranks (rank 0's groups
        in a layout: tp innermost, then cp, then the shards, then the replicas)."""
        return even_group_gbps(self, group, span)

    def collective_s(self, kind: str, whole_bytes: int, ranks: Sequence[int]) -> float:
        """Seconds of one ring collective over ``ranks`` of a whole of ``whole_bytes`` (the gathered output, the
        reduce-scattered input, the all-reduced, broadcast, all-to-all or sent tensor)."""
        g = len(ranks)
        if g <= 1:
            return 0.0
        crosses = len(members_per_node(ranks, self.node_size)) > 1
        latency = (self.latency_across_us if crosses else self.latency_within_us) * 1e-6
        steps = 1 if kind == SEND else (g - 1) * RING_WHOLES[kind]  # a send is one hop
        return wire_bytes(kind, whole_bytes, g) / (self.group_gbps(ranks) * 1e9) + steps * latency


def wire_bytes(kind: str, whole_bytes: int, group: int) -> float:
    """The bytes a ring collective moves into each of ``group`` ranks (a send: the whole, once)."""
    if group <= 1:
        return 0.0
    if kind == SEND:
        return float(whole_bytes)
    return RING_WHOLES[kind] * (group - 1) / group * whole_bytes


@functools.cache
def even_group_gbps(links: Links, group: int, span: int) -> float:
    """``Links.gbps``, once per shape: the layout search prices tens of thousands of candidates' collectives over a
    few shapes, and counting a group of N ranks node by node takes O(N)."""
    return links.group_gbps(range(0, span, max(1, span // group)))


def links_said(links: Links) -> str:
    """The links in words, for the lines that give figures priced over them."""
    return (f"{links.within_gbps:g} GB/s within a node of {links.node_size} and {links.across_gbps:g} GB/s across "
            f"nodes (a NIC a GPU), a ring step {links.latency_within_us:g} us within a node and "
            f"{links.latency_across_us:g} us across, {links.channels} channels (the CTAs a collective holds on a GPU)")


def members_per_node(ranks: Sequence[int], node_size: int) -> dict[int, int]:
    """How many of ``ranks`` each node holds (node n holds ranks n x node_size to (n + 1) x node_size - 1)."""
    counts: dict[int, int] = {}
    for rank in ranks:
        counts[rank // node_size] = counts.get(rank // node_size, 0) + 1
    return counts


def parse_links(text: str | None, flag: str = "--links") -> Links:
    """WITHIN,ACROSS in GB/s, or a JSON file of ``Links``' fields (node_size, within_gbps, across_gbps, and the
    latencies where other than the defaults). A value with a comma, or a number, is meant as the pair; anything
    else as a file, and one that is not there is said to be missing."""
    if text is None:
        return Links()
    if os.path.lexists(text) or not ("," in text or _is_number(text)):
        expect_path(text, flag, "file")
        return links_from_file(text, flag)
    try:
        within, across = (float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected WITHIN,ACROSS in GB/s per direction (450,50) or a JSON "
                        "file with node_size, within_gbps and across_gbps") from None
    return checked_links(Links(within_gbps=within, across_gbps=across), f"{flag} {text}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


REQUIRED = ("node_size", "within_gbps", "across_gbps")  # a file's latencies may be left at the defaults


def links_from_file(path: str, flag: str) -> Links:
    try:
        with open(path) as f:
            fields = json.load(f)
        missing = [k for k in REQUIRED if k not in fields]
        if missing:
            raise UserError(f"{flag} {path}: no {', '.join(missing)} (a file gives {', '.join(REQUIRED)})")
        links = Links(**{k: fields[k] for k in fields})
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{flag} {path}: not a JSON object of node_size, within_gbps and across_gbps "
                        f"({type(exc).__name__}: {exc})") from None
    return checked_links(links, f"{flag} {path}")


# What a field of ``Links`` can be, by the unit its name ends in: a rate from 10 MB/s (a slow network) to 100 TB/s
# (beyond any NVLink), a ring step's latency up to a second; a count a whole number: node_size up to 1024 GPUs,
# channels (the CTAs a collective holds) up to 64, 0 allowed (none: a sleep).
UNIT_BOUNDS = {"_gbps": (0.01, 100_000.0, "GB/s"), "_us": (0.0, 1_000_000.0, "us")}
MAX_CHANNELS = 64  # NCCL's own ceiling (NCCL_MAX_NCHANNELS) is 32 on Hopper; a bound, not a recommendation
COUNT_BOUNDS = {"node_size": (1, 1024, ""), "channels": (0, MAX_CHANNELS, "")}


def field_bounds(field: dataclasses.Field) -> tuple[float, float, str]:
    """The closed range of a field of ``Links`` and its unit: a count where its default is a whole number, else by
    the unit its name ends in."""
    if isinstance(field.default, int):
        return COUNT_BOUNDS[field.name]
    return next(bounds for unit, bounds in UNIT_BOUNDS.items() if field.name.endswith(unit))


def checked_links(links: Links, said: str) -> Links:
    """Every field in its range (a NaN or an infinity in none), a count a whole number: a rate of almost nothing or
    a latency of hours would price a step at infinity, or at hundreds of digits of milliseconds."""
    for field in dataclasses.fields(Links):
        value = getattr(links, field.name)
        low, high, unit = field_bounds(field)
        whole = isinstance(field.default, int)
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) \
                or not low <= value <= high:
            raise UserError(f"{said}: {field.name} must be {'a whole number ' if whole else ''}in "
                            f"[{low:.10g}, {high:.10g}]{' ' + unit if unit else ''}, got {value!r}")
    return links


def check_nodes_fit(links: Links, world_size: int, said: str) -> None:
    """Nodes of ``node_size`` GPUs must make up N (or N one part of a node)."""
    if world_size > links.node_size and world_size % links.node_size:
        raise UserError(f"{said}: nodes of {links.node_size} GPUs do not make up N = {world_size}")
