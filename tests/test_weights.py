"""Weights drawn once per rank (fsdp2bench/train/weights.py) are the weights a variant draws on its own."""

from __future__ import annotations

import os

import pytest
import torch

from fsdp2bench.train import weights
from fsdp2bench.train.model import build_model, load_config

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd on this platform")


def build(shared: weights.SharedWeights | None):
    return build_model(load_config("tiny"), torch.device("cpu"), 421, 2, shared)


def same_parameters(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_the_first_build_draws_later_ones_map_and_all_equal_a_build_of_its_own():
    own, source = build(None)
    assert source == "own"
    shared = weights.create()
    first, second = build(shared), build(shared)
    assert (first[1], second[1]) == ("drew", "mapped")
    assert same_parameters(first[0], own) and same_parameters(second[0], own)
    # tied embeddings stay one parameter, and a write stays in the process that makes it
    assert first[0].lm_head.weight is first[0].model.embed_tokens.weight
    with torch.no_grad():
        first[0].model.embed_tokens.weight.add_(1.0)
    assert same_parameters(build(shared)[0], own)


def test_a_draw_that_did_not_finish_is_drawn_again():
    shared = weights.create()
    own, _ = build(None)
    offset, nbytes = weights.layout(list(own.named_parameters()))[-1]
    size = offset + nbytes
    os.ftruncate(shared.fd, size + 1)  # what a drawer killed mid-draw leaves
    model, source = build(shared)
    assert source == "drew" and same_parameters(model, own)


def test_a_file_that_cannot_be_reached_leaves_the_variant_its_own_draw():
    shared = weights.create()
    os.close(shared.fd)  # as if the launcher's process were gone
    model, source = build(shared)
    assert source == "own" and same_parameters(model, build(None)[0])
