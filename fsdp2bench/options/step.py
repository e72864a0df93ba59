"""The training step a user runs: which loop (what stays alive once the loss is computed) and which loss.

At long context these move a rank's peak by more than any FSDP2 option: at 32768 tokens and a vocabulary
of 128256 the fp32 logits alone are 16 GiB. Every variant runs the same step (utils.py applies it), so a
difference between variants stays theirs. No torch at module level: the planner and the matrix read it.

Loops (docs/step.md says which real loops each mirrors, read from their code):

* ``upstream``: the upstream benchmark's loop, whose loop variable keeps the model's outputs (the logits)
  through backward and the optimizer step until the next forward has returned;
* ``trainer``: the Hugging Face Trainer's ``training_step`` (and TRL's, torchtitan's): the loss alone is
  kept; the outputs are unreachable before backward.

Losses:

* ``model``: the model's own causal-LM loss (transformers upcasts the full logits to fp32);
* ``chunked``: the head and the cross entropy a chunk of ``CHUNK_TOKENS`` tokens at a time, each chunk's
  logits recomputed in backward, so that the full logits never exist (torch only);
* ``liger``: liger-kernel's fused linear cross entropy, applied as the Trainer's ``use_liger_kernel=True``
  applies it (by the model's type; its other kernels come with it). GPU only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp2bench.cli import UserError
from fsdp2bench.options.layout import Layout, planned_style, tensor_parallel_plan

UPSTREAM, TRAINER = "upstream", "trainer"
LOOPS = (UPSTREAM, TRAINER)
MODEL, CHUNKED, LIGER = "model", "chunked", "liger"
LOSSES = (MODEL, CHUNKED, LIGER)
CHUNK_TOKENS = 1024  # a chunk of the chunked loss: 0.5 GiB of fp32 logits at a vocabulary of 128256
LIGER_REQUIREMENTS = "requirements-liger.txt"
# Config fields of models that change the logits after the head (Gemma's soft-capping, Cohere's and
# Granite's scales): a loss that takes the head's output in chunks would skip that change.
# The value of each that changes nothing: no soft-capping at all; a scale of 1.
LOGIT_TRANSFORMS = {"final_logit_softcapping": (None,), "logit_scale": (None, 1), "logits_scaling": (None, 1)}


@dataclass(frozen=True, kw_only=True)
class Step:
    loop: str = UPSTREAM
    loss: str = MODEL

    @property
    def keeps_outputs(self) -> bool:
        """Whether the outputs outlive the loss: through backward, until the next forward returns."""
        return self.loop == UPSTREAM

    @property
    def builds_logits(self) -> bool:
        """Whether the step makes the full logits of a microbatch at once."""
        return self.loss == MODEL

    def said(self) -> str:
        return f"loop {self.loop}, loss {self.loss}"


def logits_tokens(step: Step, tokens: int, config) -> int:
    """The tokens whose logits exist at once when a microbatch of ``tokens`` on a rank computes its loss:
    all of them, a chunk, or liger's chunk (the tokens over ceil(V / H), rounded up to a power of two)."""
    if step.loss == MODEL:
        return tokens
    if step.loss == CHUNKED:
        return min(tokens, CHUNK_TOKENS)
    ratio = math.ceil(config.vocab_size / config.hidden_size)
    return min(tokens, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / ratio))))))


def logits_copies(step: Step) -> int:
    """Logits-sized blocks alive at the loss's peak: under the model's loss the fp32 logits, their gradient
    and the bf16 ones, less the fp32 copy the Trainer's loop has let go; a chunk in fp32, its gradient and
    bf16 copy; liger's chunk and its gradient, in place."""
    if step.loss == MODEL:
        return 3 if step.keeps_outputs else 2
    return 3 if step.loss == CHUNKED else 2


def largest_block_per_token(step: Step, config) -> int:
    """What one more token adds to a step's largest single allocation: its fp32 logits under the model's loss;
    under a chunked or fused loss, whose logits stop growing at a chunk, a bf16 row of the MLP's widest
    activation (the planner aims by it: a step near the cap fails once no free stretch of it is left)."""
    if step.builds_logits:
        return 4 * config.vocab_size
    return 2 * max(config.intermediate_size, config.hidden_size)


def kept_output_bytes(step: Step, microbatch_tokens: int, vocab_size: int, itemsize: int) -> int:
    """What the loop keeps of a microbatch's outputs after its loss, on a rank: the logits, in the dtype the
    model returns them, under the upstream loop and the model's loss; nothing otherwise (the chunked and fused
    losses return the loss alone)."""
    return microbatch_tokens * vocab_size * itemsize if step.keeps_outputs and step.builds_logits else 0


def head_split_by_tensor_parallel(config, layout: Layout) -> bool:
    """Whether TP splits the output head: tied to the word embeddings, which the model's plan splits."""
    if not layout.tensor_parallel or not getattr(config, "tie_word_embeddings", False):
        return False
    return planned_style("embed_tokens", tensor_parallel_plan(config)) is not None


def check(step: Step, config, layout: Layout, device_type: str) -> None:
    """A loss that cannot run here, refused in one line with the reason, before anything runs."""
    if step.loss == MODEL:
        return
    flag = f"--loss {step.loss}"
    if step.loss == LIGER:
        check_liger(config, device_type)
    changed = [name for name, none in LOGIT_TRANSFORMS.items() if getattr(config, name, None) not in none]
    if changed:
        raise UserError(f"{flag}: this {config.model_type} model changes its logits after the head "
                        f"({', '.join(changed)}), which a loss over the head's output in chunks would skip")
    if head_split_by_tensor_parallel(config, layout):
        raise UserError(f"{flag} with --tp_size {layout.tp_size}: this model's head is tied to its word embeddings, "
                        "which its tensor-parallel plan splits over the tp ranks; the loss takes the head's weight "
                        "whole (use --loss model, or a model with untied embeddings)")


def check_liger(config, device_type: str) -> None:
    """liger-kernel's kernels are Triton's: a GPU, the package, and kernels for this model's type."""
    if device_type != "cuda":
        raise UserError("--loss liger needs a GPU: liger-kernel's kernels are written in Triton, which runs on "
                        "CUDA devices only (on the CPU, --loss chunked also never builds the full logits)")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise UserError(f"--loss liger: liger-kernel cannot be imported ({exc}); install it with "
                        f"pip install -r {LIGER_REQUIREMENTS}") from None
    if config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UserError(f"--loss liger: liger-kernel has no kernels for a {config.model_type} model (the Trainer "
                        "would train it without them)")
