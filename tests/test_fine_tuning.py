"""Fine-tuning under FSDP2 (fsdp2bench/options/tuning.py, docs/fine-tuning.md): LoRA adapters over a frozen bf16 base
in all four variants (the intended ones train, the stale one does not, every byte counted, the base sharded 1/N with
no gradient and no optimizer state); the refusals of what cannot run, in one line, before anything is written; the
planner (plan.py) probing and searching with the same options, its estimate of a rank's state main.py's to the byte."""

from __future__ import annotations

import importlib.util
import math
import re
import shlex

import pytest

from conftest import TINY, VARIANTS, load, refusal, run_script
import plan
from fsdp2bench.cli import UserError
from fsdp2bench.names import size_said
from fsdp2bench.options import tuning
from fsdp2bench.options.levers import cpp_compiler
from fsdp2bench.plan.layout import search as layout_search
from fsdp2bench.plan.layout.candidates import TRAINED
from fsdp2bench.run import arguments
from fsdp2bench.train.model import PRESETS

UNFIXED = "torch_optimizer_before_fsdp_not_fixed"
LORA, QLORA = ["--peft", "lora"], ["--peft", "qlora"]
# The optional packages (requirements-peft.txt, requirements-float8.txt): where one is not installed its option is
# refused, which the last test checks everywhere by blocking it. torchao's optimizers compile each parameter's step
# (inductor builds C++ on the CPU).
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
needs_bitsandbytes = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                        reason="bitsandbytes is not installed")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None or cpp_compiler() is None,
                                   reason="torchao or a C++ compiler is missing")


def tiny_lora_shapes(rank: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The tiny preset's frozen base and its adapters at ``rank`` (the shape of every parameter), from the preset's
    sizes: every projection of both blocks adapted, A (rank x in) and B (out x rank)."""
    p = PRESETS["tiny"]
    h, i, layers, head = p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"], h_dim(p)
    kv = p["num_key_value_heads"] * head
    projections = [(h, h, True), (kv, h, True), (kv, h, True), (h, h, False), (i, h, False), (i, h, False),
                   (h, i, False)]  # (out, in, bias): q, k, v, o, gate, up, down; Qwen2's q, k, v have biases
    block = [shape for out, inp, bias in projections for shape in [(out, inp)] + ([(out,)] if bias else [])]
    base = [(p["vocab_size"], h)] + layers * (block + [(h,), (h,)]) + [(h,)]  # embeddings (tied head), norms
    adapters = layers * [shape for out, inp, _ in projections for shape in ((rank, inp), (out, rank))]
    return base, adapters


def tiny_lora_parameters(rank: int) -> tuple[list[tuple[int, ...]], int]:
    """The tiny preset's frozen base (the shape of every parameter) and its adapters' parameter count at ``rank``."""
    base, adapters = tiny_lora_shapes(rank)
    return base, sum(math.prod(shape) for shape in adapters)


def tiny_packed_base() -> list[tuple[int, ...]]:
    """The tiny preset's QLoRA base: every projection packed (two 4-bit codes a byte, (numel + 1) // 4 rows of one
    bf16), the embeddings (the tied head) and the norms and biases kept."""
    base, _ = tiny_lora_shapes(16)
    embeddings, rest = base[0], base[1:]
    return [((math.prod(s) + 1) // 4, 1) for s in rest if len(s) == 2] + [embeddings] + [s for s in rest if len(s) == 1]


def h_dim(preset: dict) -> int:
    return preset["hidden_size"] // preset["num_attention_heads"]


def padded_chunk_bytes(shapes: list[tuple[int, ...]], n: int, itemsize: int) -> int:
    """What FSDP2 stores of each parameter on every rank of n: ceil(d0 / n) rows."""
    return sum(math.ceil(s[0] / n) * math.prod(s[1:]) * itemsize for s in shapes)


@needs_peft
def test_lora_trains_every_intended_variant_and_the_stale_optimizer_holds_old_adapters(tmp_path):
    """2 ranks, rank 16 over every projection: the intended variants' losses fall (bit-equal), the unfixed one's
    does not; every byte of the state is the rule's; the bf16 base holds its padded half on each rank and never a
    gradient or optimizer state; the stale optimizer holds the whole fp32 adapters, and no state."""
    proc = run_script(["main.py", *TINY, *LORA, "--quiet", "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    checks = summary["checks"]
    for check in ("intended_variants_trained", "unfixed_did_not_train", "intended_losses_match",
                  "accounting_matches_expected", "frozen_base_sharded", "options_applied"):
        assert checks[check]["ok"] is True, (check, checks[check])
    base, adapters = tiny_lora_parameters(16)
    half = padded_chunk_bytes(base, 2, 2)
    for name in VARIANTS:
        entry = summary["variants"][name]
        for rank in entry["frozen_base"]:
            assert rank == {"frozen_param_bytes": half, "frozen_grad_bytes": 0, "frozen_state_bytes": 0}, name
        assert entry["expected_frozen_base"][0]["frozen_full_bytes"] == 2 * sum(math.prod(s) for s in base)
        for rank in entry["accounting"]:  # the adapters' fp32 chunks beside the base's bf16 ones
            assert rank["param_bytes"] > half and rank["before_zero_grad"]["grad_bytes"] < 4 * adapters
    for rank in summary["variants"][UNFIXED]["accounting"]:
        assert rank["stale_param_bytes"] == 4 * adapters and rank["optimizer_state_bytes"] == 0
    said = " ".join(proc.stdout.split())
    assert "Trained: LoRA adapters (rank 16" in said
    assert (f"The frozen base held, in each of the 4 variants, on ranks 0-1: {size_said(half)}, {size_said(half)} of "
            f"its {size_said(2 * sum(math.prod(s) for s in base))} (FSDP2's padded chunk), and at most 0 bytes of "
            "gradients and 0 bytes of optimizer state in any variant and rank.") in said
    assert summary["meta"]["fsdp_options"]["tuning"]["peft"] == "lora"


@needs_peft
def test_dotted_targets_adapt_the_layers_peft_matches_them_to(tmp_path):
    """--lora_targets as peft's target_modules: self_attn.q_proj (a suffix after a dot) adapts both blocks' q_proj,
    model.layers.0.mlp.down_proj (a full name) the first block's down_proj alone; every byte is the rule's, and the
    stale optimizer holds exactly those adapters (rank 16: A is 16 x in, B out x 16, fp32)."""
    proc = run_script(["main.py", *TINY, *LORA, "--lora_targets", "self_attn.q_proj,model.layers.0.mlp.down_proj",
                       "--quiet", "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    for check in ("intended_losses_match", "accounting_matches_expected", "frozen_base_sharded"):
        assert summary["checks"][check]["ok"] is True, (check, summary["checks"][check])
    p = PRESETS["tiny"]
    h, i = p["hidden_size"], p["intermediate_size"]
    adapters = 2 * (16 * h + h * 16) + (16 * i + h * 16)  # q_proj of both blocks, down_proj of the first
    for rank in summary["variants"][UNFIXED]["accounting"]:
        assert rank["stale_param_bytes"] == 4 * adapters


@needs_peft
def test_the_frozen_base_sentence_says_whose_ranks_it_lists_and_that_it_left_some_out(tmp_path):
    """5 ranks, two variants: the sentence lists the first four ranks' chunks of the base, says they are 4 of 5 and
    that both variants held them."""
    proc = run_script(["main.py", *TINY, *LORA, "--max_steps", "2", "--variants",
                       "torch_optimizer_after_fsdp,accelerate", "--quiet", "--output_dir", str(tmp_path)], nproc=5,
                      timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    base, _ = tiny_lora_parameters(16)
    chunk = size_said(padded_chunk_bytes(base, 5, 2))
    assert (f"The frozen base held, in each of the 2 variants, on ranks 0-3 of 5: {chunk}, {chunk}, {chunk}, {chunk}, "
            "... of its") in " ".join(proc.stdout.split())


@needs_peft
@needs_bitsandbytes
def test_qlora_trains_every_intended_variant_over_a_sharded_four_bit_base(tmp_path):
    """2 ranks, bitsandbytes' CPU kernels: every projection 4-bit (NF4, packed two codes a byte in bf16 storage,
    (numel + 1) // 4 rows of one bf16), bf16 adapters. The intended variants train and the stale one does not,
    every byte as the rule says, and each rank holds its padded chunk of the packed base and of the rest."""
    proc = run_script(["main.py", *TINY, *QLORA, "--quiet", "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    for check in ("intended_variants_trained", "unfixed_did_not_train", "intended_losses_match",
                  "accounting_matches_expected", "frozen_base_sharded"):
        assert summary["checks"][check]["ok"] is True, (check, summary["checks"][check])
    _, adapters = tiny_lora_parameters(16)
    for name in VARIANTS:
        held = summary["variants"][name]["frozen_base"]
        assert [r["frozen_param_bytes"] for r in held] == [padded_chunk_bytes(tiny_packed_base(), 2, 2)] * 2, name
    for rank in summary["variants"][UNFIXED]["accounting"]:
        assert rank["stale_param_bytes"] == 2 * adapters  # the whole adapters, bf16
    # Each 4-bit weight's statistics, whole on every rank: a uint8 absmax per 64 weights, the NF4 code (16 fp32), an
    # fp32 offset, and double quantization's fp32 absmax per 256 of those and its code (256 fp32).
    absmax = [math.ceil(math.prod(s) / 64) for s in tiny_lora_shapes(16)[0][1:] if len(s) == 2]
    statistics = sum(a + 16 * 4 + 4 + 4 * math.ceil(a / 256) + 256 * 4 for a in absmax)
    for name in VARIANTS:
        assert summary["variants"][name]["four_bit_statistics_bytes"] == [statistics] * 2, name
    said = " ".join(proc.stdout.split())
    assert "Trained: QLoRA adapters (rank 16" in said
    assert f"bitsandbytes' quantization statistics: {statistics / 1024:.2f} KiB a rank, whole on every rank" in said


@needs_peft
@pytest.mark.parametrize("peft", ["lora", pytest.param("qlora", marks=needs_bitsandbytes)])
def test_adapters_over_a_base_built_unit_by_unit_on_meta_train_and_hold_their_shards(tmp_path, peft):
    """--init_device meta: each unit drawn whole as it is sharded (under QLoRA quantized there), never the model:
    the adapters train, every byte is the rule's, and each rank holds its padded chunk of the base, as when the base
    is built whole first."""
    proc = run_script(["main.py", *TINY, "--peft", peft, "--init_device", "meta", "--variants",
                       "torch_optimizer_after_fsdp", "--quiet", "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    for check in ("intended_variants_trained", "accounting_matches_expected", "frozen_base_sharded"):
        assert summary["checks"][check]["ok"] is True, (check, summary["checks"][check])
    base, _ = tiny_lora_parameters(16)
    embeddings, rest = base[0], base[1:]
    packed = [((math.prod(s) + 1) // 4, 1) if len(s) == 2 else s for s in rest] if peft == "qlora" else rest
    held = summary["variants"]["torch_optimizer_after_fsdp"]["frozen_base"]
    assert [r["frozen_param_bytes"] for r in held] == [padded_chunk_bytes([embeddings] + packed, 2, 2)] * 2
    built = next(e for e in load(tmp_path / "torch_optimizer_after_fsdp_memory_usage_rank1.json")["events"]
                 if e["name"] == "model_built")
    assert built["build_device"] == "meta"


@needs_peft
@pytest.mark.parametrize("peft", ["lora", pytest.param("qlora", marks=needs_bitsandbytes)])
def test_a_simulated_sweep_says_what_it_trained_and_the_statistics_every_rank_holds(tmp_path, peft):
    """A sweep of simulated ranks (the way a base larger than the card is measured) says, as a real run does, what
    was trained over which base, and under QLoRA bitsandbytes' statistics beside the shards, the same at every N."""
    proc = run_script(["main.py", "--model", "tiny", "--peft", peft, "--init_device", "meta", "--variants",
                       "torch_optimizer_after_fsdp", "--simulate_world_size", "1,2", "--max_steps", "2",
                       "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    base = "4-bit NF4 base packed in bfloat16" if peft == "qlora" else "bf16 base"
    assert f"Trained: {'QLoRA' if peft == 'qlora' else 'LoRA'} adapters (rank 16, alpha 32, dropout 0, over " in said
    assert f"on a frozen {base}, optimizer adamw." in said
    statistics = {e["four_bit_statistics_bytes"][0] for n in (1, 2)
                  for e in load(tmp_path / "summary.json")["simulated"][str(n)]["0"].values()
                  if "four_bit_statistics_bytes" in e}
    assert len(statistics) == (1 if peft == "qlora" else 0)
    assert ("bitsandbytes' quantization statistics" in said) == (peft == "qlora")
    if statistics:
        assert f"quantization statistics: {statistics.pop() / 1024:.2f} KiB a rank, whole on every rank" in said


@needs_peft
@needs_bitsandbytes
def test_qlora_in_uint8_runs_only_when_asked_and_the_checks_catch_accelerates_whole_base(tmp_path):
    """uint8 storage (accelerate#3983), run anyway: on the CPU the torch variant shards it and trains, while
    accelerate 1.15 leaves every non-floating 4-bit weight out of sharding, whole on every rank, which the checks
    name; the run fails."""
    proc = run_script(["main.py", *TINY, *QLORA, "--qlora_storage", "uint8", "--allow_known_failure", "--quiet",
                       "--variants", "torch_optimizer_after_fsdp,accelerate", "--output_dir", str(tmp_path)])
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    checks = load(tmp_path / "summary.json")["checks"]
    assert checks["frozen_base_sharded"] == {"ok": False, "mismatched": ["accelerate"]}
    assert checks["accounting_matches_expected"] == {"ok": False, "mismatched": ["accelerate"]}
    variants = load(tmp_path / "summary.json")["variants"]
    chunk = variants["accelerate"]["expected_frozen_base"][0]["frozen_param_bytes"]
    assert all(r["frozen_param_bytes"] > chunk for r in variants["accelerate"]["frozen_base"])
    assert all(r["frozen_param_bytes"] == chunk for r in variants["torch_optimizer_after_fsdp"]["frozen_base"])
    assert "frozen_base_sharded failed" in proc.stderr


@needs_bitsandbytes
def test_qlora_where_bitsandbytes_cannot_quantize_on_the_cpu_is_refused(monkeypatch, tmp_path):
    """Releases before bitsandbytes 0.46 had CUDA kernels alone: asked, not assumed; by main.py and by both of the
    planner's modes, in one line, before anything is written."""
    import bitsandbytes.functional

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no CPU backend")

    monkeypatch.setattr(bitsandbytes.functional, "quantize_4bit", no_kernel)
    said = ("--peft qlora on the CPU: bitsandbytes .* cannot quantize there \\(NotImplementedError: no CPU backend\\); "
            "run it on a GPU")
    with pytest.raises(UserError, match=said):
        tuning.check_device(tuning.Tuning(peft="qlora"), "cpu")
    tuning.check_device(tuning.Tuning(peft="qlora"), "cuda")  # a GPU's kernels are its CUDA build's
    out = tmp_path / "out"
    for validate, argv in ((arguments.validate, ["--model", "tiny", "--device", "cpu"]), (plan.validate, PLAN[1:]),
                           (plan.validate, SEARCH[1:])):
        line = refusal(validate, [*argv, *QLORA, "--output_dir", str(out)])
        assert re.search(said, line or ""), line
    assert not out.exists()


# The optimizer state of every rank at LoRA rank 256 on the tiny model at N = 2, by the rule torchao keeps (a local
# chunk of at least 4096 elements and whole blocks is quantized: every adapter's here): 28 adapters of 294,400
# local elements in all, two moments each and a 4-byte step. 8-bit: a byte an element, a fp32 scale per 256 and a
# table of 256 fp32 per moment; 4-bit: half a byte, a scale per 128, a table of 16; fp8: a byte, a scale per 256.
ELEMENTS, ADAPTERS = 294_400, 28
LOW_BIT_STATE = {"adamw8bit": 2 * (ELEMENTS + 4 * ELEMENTS // 256 + ADAPTERS * 4 * 256) + 4 * ADAPTERS,
                 "adamw4bit": 2 * (ELEMENTS // 2 + 4 * ELEMENTS // 128 + ADAPTERS * 4 * 16) + 4 * ADAPTERS,
                 "adamw_fp8": 2 * (ELEMENTS + 4 * ELEMENTS // 256) + 4 * ADAPTERS}


@needs_peft
@needs_torchao
@pytest.mark.parametrize("optimizer", LOW_BIT_STATE)
def test_torchaos_low_bit_adamw_trains_lora_in_every_variant_with_its_state_counted(tmp_path, optimizer):
    """2 ranks, LoRA rank 256 (each rank's chunk of every adapter large enough to be quantized), 8 steps: the
    intended variants train, bit-equal, the stale one does not, and each rank's state is the quantized one's, to
    the byte (a quarter of AdamW's fp32 moments or less, where AdamW's would be 2 x 4 x 294,400 + 112 bytes)."""
    proc = run_script(["main.py", *TINY, *LORA, "--lora_rank", "256", "--optimizer", optimizer, "--max_steps", "8",
                       "--quiet", "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    for check in ("intended_variants_trained", "unfixed_did_not_train", "intended_losses_match",
                  "accounting_matches_expected", "frozen_base_sharded", "low_bit_moments_by_torchaos_rule"):
        assert summary["checks"][check]["ok"] is True, (check, summary["checks"][check])
    for name in ("torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_fixed", "accelerate"):
        held = [rank["before_zero_grad"]["optimizer_state_bytes"] for rank in summary["variants"][name]["accounting"]]
        assert held == [LOW_BIT_STATE[optimizer]] * 2, (name, held)
    assert LOW_BIT_STATE[optimizer] < (2 * 4 * ELEMENTS + 4 * ADAPTERS) / 3


# torchao's rule, read in its _AdamBase._new_buffer (torchao 0.18): a moment is quantized where the rank's local chunk
# holds at least 4096 elements and whole blocks (256 elements for 8-bit and fp8, 128 for 4-bit); else it is a plain
# tensor like the parameter (fp32 adapters: 4 bytes an element). Bytes of a quantized moment: codes, a fp32 scale a
# block, a fp32 table (256 entries for 8-bit, 16 for 4-bit, none for fp8).
LOW_BIT_RULE = {"adamw8bit": ("8 bits", 256, 1, 256), "adamw4bit": ("4 bits", 128, 0.5, 16),
                "adamw_fp8": ("fp8", 256, 1, 0)}


def tiny_adapter_chunks(rank: int, n: int) -> list[int]:
    """The local elements of every LoRA adapter of the tiny model on rank 0 of n: FSDP2's first chunk, ceil(d0 / n)
    rows (every rank's where n divides each d0)."""
    _, adapters = tiny_lora_shapes(rank)
    return [math.ceil(s[0] / n) * math.prod(s[1:]) for s in adapters]


def moments_by_rule(optimizer: str, chunks: list[int]) -> dict:
    """What torchao's rule makes of ``chunks``: per kind, the tensors, their elements and the state bytes (two
    moments and a 4-byte step each)."""
    _, block, code_bytes, table = LOW_BIT_RULE[optimizer]
    quantized = [c for c in chunks if c >= 4096 and c % block == 0]
    plain = [c for c in chunks if c not in quantized]
    return {"quantized": {"tensors": len(quantized), "elements": sum(quantized),
                          "state_bytes": sum(2 * int(c * code_bytes + 4 * c // block + 4 * table) + 4
                                             for c in quantized)},
            "full_precision": {"tensors": len(plain), "elements": sum(plain),
                               "state_bytes": sum(2 * 4 * c + 4 for c in plain)}}


@needs_peft
@needs_torchao
@pytest.mark.parametrize("optimizer, lora_rank, quantized", [("adamw8bit", 16, 0), ("adamw8bit", 128, 18),
                                                             ("adamw4bit", 128, 24)])
def test_torchaos_rule_leaves_small_chunks_in_full_precision_and_the_run_says_how_many(tmp_path, optimizer, lora_rank,
                                                                                       quantized):
    """torchao quantizes no moment of a chunk under 4096 elements or of a partial block, in silence. At LoRA rank 16
    every adapter's chunk on 2 ranks is under it (AdamW's state, to the byte); at rank 128 the 8-bit optimizer
    quantizes 18 of the 28 (k and v's B of 2048 elements and the 10,880-element chunks, 42.5 blocks of 256, stay
    fp32), the 4-bit one 24 (10,880 is 85 blocks of 128). The optimizer's own state says which, on every rank; the
    state bytes the summary reports are what it holds; the console says both counts in one sentence."""
    proc = run_script(["main.py", *TINY, *LORA, "--lora_rank", str(lora_rank), "--optimizer", optimizer,
                       "--max_steps", "2", "--variants", f"torch_optimizer_after_fsdp,{UNFIXED}", "--quiet",
                       "--output_dir", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    expected = moments_by_rule(optimizer, tiny_adapter_chunks(lora_rank, 2))
    assert expected["quantized"]["tensors"] == quantized
    entry = summary["variants"]["torch_optimizer_after_fsdp"]
    assert entry["low_bit_moments"] == [expected] * 2
    held = [rank["before_zero_grad"]["optimizer_state_bytes"] for rank in entry["accounting"]]
    assert held == [sum(kind["state_bytes"] for kind in expected.values())] * 2
    assert summary["variants"][UNFIXED]["low_bit_moments"][0]["full_precision"]["tensors"] == 0
    for check in ("accounting_matches_expected", "low_bit_moments_by_torchaos_rule"):
        assert summary["checks"][check]["ok"] is True, (check, summary["checks"][check])
    codes, block = LOW_BIT_RULE[optimizer][:2]
    q, f = expected["quantized"], expected["full_precision"]
    assert (f"{optimizer} kept in {codes} the moments of {quantized} of the 28 trained tensors ({q['elements']:,} "
            f"elements, {size_said(q['state_bytes'])} of state) and left {28 - quantized} in full precision "
            f"({f['elements']:,} elements, {size_said(f['state_bytes'])} of state), by torchao's rule: a rank's chunk "
            f"is quantized only from 4,096 elements and in whole blocks of {block} (rank 0 of "
            f"torch_optimizer_after_fsdp). In {codes}, per rank, ranks 0-1: {quantized} of 28, {quantized} of 28."
            ) in " ".join(proc.stdout.split())


@needs_peft
@needs_torchao
def test_a_sweep_says_per_simulated_run_how_many_tensors_torchao_quantized(tmp_path):
    """Simulated N = 2 and 8 at LoRA rank 128: rank 0 of N = 2 holds 18 of the 28 adapters' moments in 8 bits, of
    N = 8 none (every chunk under 4096 elements); each run's record is the rule's, its state bytes what it holds."""
    proc = run_script(["main.py", "--model", "tiny", *LORA, "--lora_rank", "128", "--optimizer", "adamw8bit",
                       "--variants", "torch_optimizer_after_fsdp", "--simulate_world_size", "2,8", "--max_steps", "2",
                       "--output_dir", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = load(tmp_path / "summary.json")
    for n, quantized in (("2", 18), ("8", 0)):
        entry = summary["simulated"][n]["0"]["torch_optimizer_after_fsdp"]
        expected = moments_by_rule("adamw8bit", tiny_adapter_chunks(128, int(n)))
        assert expected["quantized"]["tensors"] == quantized
        assert entry["low_bit_moments"] == [expected], n
        assert entry["accounting"][0]["before_zero_grad"]["optimizer_state_bytes"] == sum(
            kind["state_bytes"] for kind in expected.values()), n
    assert summary["checks"]["low_bit_moments_by_torchaos_rule"]["ok"] is True
    said = " ".join(proc.stdout.split())
    assert "adamw8bit kept in 8 bits the moments of 18 of the 28 trained tensors (" in said
    assert ("(N = 2 rank 0 of torch_optimizer_after_fsdp). In 8 bits, per run: N = 2 rank 0 18 of 28, N = 8 rank 0 0 "
            "of 28.") in said


@needs_peft
def test_the_matrix_gives_lora_to_every_launch_and_skips_the_sets_it_cannot_run(tmp_path):
    """matrix.py passes --peft on like any main.py option; a set whose layout LoRA is not measured under (TP) is
    skipped, said with the reason, and the others run it: the base sharded at simulated N = 4."""
    out = tmp_path / "matrix"
    proc = run_script(["matrix.py", "--option_sets", "default,tp2", "--nproc_per_node", "0", "--simulate_world_size",
                       "4", "--sweep_steps", "2", "--device", "cpu", "--model", "tiny", "--variants",
                       "torch_optimizer_after_fsdp", *LORA, "--output_dir", str(out)], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--peft lora with --tp_size 2" in " ".join(proc.stdout.split())
    summary = load(out / "default" / "sweep" / "summary.json")
    assert summary["meta"]["fsdp_options"]["tuning"]["peft"] == "lora"
    assert summary["checks"]["frozen_base_sharded"] == {"ok": True, "mismatched": []}
    assert not (out / "tp2").exists()


# One step of each optimizer on an nn.Linear sharded by FSDP2 over 2 gloo ranks: what it says, on rank 0.
PROBE = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
model = fully_shard(torch.nn.Sequential(torch.nn.Linear(64, 512)))
bf16 = fully_shard(torch.nn.Sequential(torch.nn.Linear(64, 512, dtype=torch.bfloat16)))
def make(name, params):
    if name == "torchao_bf16":
        from torchao.optim import AdamW8bit
        global model
        model = bf16
        return AdamW8bit(list(bf16.parameters()), lr=1e-3)
    if name == "bitsandbytes":
        import bitsandbytes
        return bitsandbytes.optim.AdamW8bit(params, lr=1e-3)
    if name == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False)
    return torch.optim.AdamW(params, lr=1e-3)
for name in sys.argv[1:]:
    optimizer = make(name, list(model.parameters()))
    model(torch.ones(2, 64, dtype=next(model.parameters()).dtype)).sum().backward()
    try:
        optimizer.step()
        said = "runs"
    except Exception as exc:
        said = "fails: " + str(exc).splitlines()[0]
    if dist.get_rank() == 0:
        print(f"probe {name} {said}", flush=True)
"""


@needs_bitsandbytes
def test_the_refused_optimizers_still_fail_on_fsdp2s_dtensor_parameters(tmp_path):
    """Why --optimizer bnb_adamw8bit and adafactor are refused, asked of the installed releases: a step of either on
    FSDP2's DTensor parameters meets a plain tensor of its own state (torch's AdamW, beside them, runs). Where a
    release runs them, this fails, and the refusal is to be lifted."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = run_script([str(script), "adamw", "bitsandbytes", "adafactor"])
    said = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("probe "))
    assert said["adamw"] == "runs", proc.stdout + proc.stderr[-2000:]
    for name in ("bitsandbytes", "adafactor"):
        assert said[name].startswith("fails: ") and "got mixed torch.Tensor and DTensor" in said[name], said


@needs_torchao
def test_torchaos_low_bit_states_still_fail_on_bf16_dtensor_parameters(tmp_path):
    """Why a torchao optimizer is refused with --peft qlora (bf16 adapters): its quantized state on FSDP2's bf16
    DTensor parameter meets aten.view(dtype), which it does not implement (a plain bf16 tensor and fp32 DTensors
    run). Where a release runs it, this fails, and the refusal is to be lifted."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = run_script([str(script), "torchao_bf16"], timeout=600)
    said = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("probe "))
    assert said["torchao_bf16"].startswith("fails: "), proc.stdout + proc.stderr[-2000:]
    assert "aten.view" in said["torchao_bf16"] or "view" in said["torchao_bf16"], said


# What main.py and plan.py both refuse, with the same line (tuning.py's checks).
BAD_TUNING = [
    ([*LORA, "--lora_rank", "0"], "--lora_rank must be in [1, 65536], got 0"),
    ([*LORA, "--lora_rank", "-4"], "--lora_rank must be in [1, 65536], got -4"),
    ([*LORA, "--lora_rank", str(10**12)], "--lora_rank must be in [1, 65536]"),
    ([*LORA, "--lora_rank", "nan"], "--lora_rank: invalid int value: 'nan'"),
    ([*LORA, "--lora_alpha", "nan"], "--lora_alpha must be in"),
    ([*LORA, "--lora_alpha", "-1"], "--lora_alpha must be in"),
    ([*LORA, "--lora_dropout", "1"], "--lora_dropout must be in [0, 0.99]"),
    ([*LORA, "--lora_targets", "q_proj,qkv_proj"], "--lora_targets q_proj,qkv_proj: qkv_proj matches no Linear layer"),
    ([*LORA, "--lora_targets", ","], "--lora_targets ,: an empty item between commas"),
    ([*LORA, "--lora_targets", "q_proj,,v_proj"], "--lora_targets q_proj,,v_proj: an empty item between commas"),
    ([*LORA, "--lora_targets", "q_proj,v_proj,q_proj"], "--lora_targets q_proj,v_proj,q_proj: q_proj is given twice"),
    ([*LORA, "--lora_targets", "self_attn.q_proj,q_proj"], "--lora_targets self_attn.q_proj,q_proj: self_attn.q_proj "
                                                            "adds no layer: its 2 layer(s) are selected by q_proj already"),
    ([*LORA, "--lora_targets", "elf_attn.q_proj"], "--lora_targets elf_attn.q_proj: elf_attn.q_proj matches no Linear "
                                                   "layer of this model; its Linear layers are named down_proj, "
                                                   "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    ([*LORA, "--lora_targets", "q_proj,mlp"], "--lora_targets q_proj,mlp: mlp matches model.layers.0.mlp (Qwen2MLP), "
                                              "not a Linear layer"),
    ([*LORA, "--lora_targets", "embed_tokens"], "embed_tokens matches model.embed_tokens (Embedding), not a Linear"),
    (["--lora_rank", "8"], "--lora_rank needs --peft lora"),
    (["--optimizer", "sgd"], "--optimizer: invalid choice: 'sgd'"),
    (["--optimizer", "bnb_adamw8bit"], "--optimizer bnb_adamw8bit: bitsandbytes' AdamW8bit keeps its state in plain"),
    (["--optimizer", "adafactor"], "--optimizer adafactor: transformers' Adafactor keeps its factored row and column"),
    pytest.param([*QLORA, "--optimizer", "adamw8bit"], "--optimizer adamw8bit with --peft qlora: torchao 0.18's "
                 "quantized optimizer states implement no aten.view(dtype)", marks=needs_bitsandbytes),
    (["--peft", "dora"], "--peft: invalid choice: 'dora'"),
    pytest.param([*QLORA, "--qlora_storage", "uint8"],
                 "--qlora_storage uint8: 4-bit weights stored as uint8 are no floating tensor that FSDP2 can shard",
                 marks=needs_bitsandbytes),
    pytest.param([*QLORA, "--qlora_storage", "uint8"], "(accelerate#3983); the fix: store them as bf16 "
                                                       "(--qlora_storage bfloat16", marks=needs_bitsandbytes),
    ([*LORA, "--qlora_storage", "bfloat16"], "--qlora_storage needs --peft qlora"),
    pytest.param([*QLORA, "--allow_known_failure"], "--allow_known_failure: nothing in this command line is a known "
                                                    "failure", marks=needs_bitsandbytes),
    ([*QLORA, "--qlora_storage", "int4"], "--qlora_storage: invalid choice: 'int4'"),
]


@pytest.mark.parametrize("argv, said", [
    *BAD_TUNING,
    ([*LORA, "--simulate_world_size", "2", "--tp_size", "2"], "--peft lora with --tp_size 2"),
    ([*LORA, "--init_device", "meta"], "--init_device meta: the model exists only as each rank's shards"),
])
@needs_peft
def test_a_bad_fine_tuning_option_is_refused_in_one_line(tmp_path, argv, said):
    line = refusal(arguments.validate, ["--model", "tiny", "--device", "cpu", "--output_dir", str(tmp_path), *argv])
    assert line is not None and said in line, line


# A script (the argument after the names) launched with the named packages made unimportable first, as if they were
# not installed.
WITHOUT = ("import runpy, sys\n"
           "for name in sys.argv[1].split(','): sys.modules[name] = None\n"
           "sys.argv = sys.argv[2:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("blocked, argv, said", [
    ("peft", LORA, "error: --peft lora: peft cannot be imported (import of peft halted; None in sys.modules); "
                   "install it with pip install -r requirements-peft.txt"),
    ("bitsandbytes", QLORA, "error: --peft qlora: bitsandbytes cannot be imported (import of bitsandbytes halted; "
                            "None in sys.modules); install it with pip install -r requirements-peft.txt"),
    ("torchao.optim", ["--optimizer", "adamw8bit"], "error: --optimizer adamw8bit: torchao cannot be imported "
                                                    "(import of torchao.optim halted; None in sys.modules); install it "
                                                    "with pip install -r requirements-float8.txt"),
    pytest.param("none", [*LORA, "--lora_targets", "wq"], "error: --lora_targets wq: wq matches no Linear layer",
                 marks=needs_peft),
    ("none", [*LORA, "--lora_rank", "0"], "error: --lora_rank must be in [1, 65536], got 0"),
])
def test_a_launch_refused_says_one_line_and_writes_nothing(tmp_path, blocked, argv, said):
    out = tmp_path / "out"
    proc = run_script(["-c", WITHOUT, blocked, "main.py", *TINY, *argv, "--output_dir", str(out)], nproc=None)
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said), lines


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_a_low_bit_optimizer_on_the_cpu_is_refused_where_cxx_names_no_compiler(tmp_path):
    """torchao's step is compiled by inductor, which builds with the compiler CXX names (tests/test_levers.py)."""
    out = tmp_path / "out"
    proc = run_script(["main.py", *TINY, "--optimizer", "adamw8bit", "--output_dir", str(out)], nproc=None,
                      CXX="/nothere/g++")
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    assert proc.stderr.strip() == ("error: --optimizer adamw8bit: torchao compiles each parameter's step with "
                                   "inductor, which builds C++ on the CPU, and CXX='/nothere/g++' names no C++ "
                                   "compiler that runs"), proc.stderr


# --------------------------------------------------------------------------- the planner (plan.py)

PLAN = ["plan.py", "--device", "cpu", "--world_size", "2"]
SEARCH = [*PLAN, "--find", "layout", "--block_size", "64", "--global_batch", "2", "--levers", "none,model"]


@needs_peft
def test_the_batch_planner_probes_lora_each_probe_holding_the_adapters_and_its_chunk_of_a_frozen_base(tmp_path):
    """plan.py --peft lora --lora_rank 8: every probe (the shared process and the fresh ones) trains the adapters
    over the frozen bf16 base; each fresh probe that fit held, on its rank 0 of 2, its padded half of the base and
    no gradient or state of it, and the gradients of the fp32 adapters alone; a set LoRA is not measured under (TP)
    is skipped with the reason."""
    out = tmp_path / "plan"
    proc = run_script([*PLAN, "--sets", "default,tp2", "--variants", "torch_optimizer_after_fsdp", "--inject_oom_above",
                       "3", *LORA, "--lora_rank", "8", "--output_dir", str(out)], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Skipped: tp2: not planned (--peft lora with --tp_size 2" in proc.stdout
    # The first line names what every probe trains and the optimizer, beside the model; one answer, one shared process
    said = " ".join(proc.stdout.split())
    assert (f"Planning 1 answer for tiny, LoRA adapters (rank 8, alpha 32, dropout 0, over {tuning.PROJECTIONS[0]},"
            in said and "on a frozen bf16 base, optimizer adamw (batch_size per option set" in said)
    assert " in 1 shared process, in " in said and "1 shared processes" not in said
    result = load(out / "plan.json")
    base, adapters = tiny_lora_shapes(8)
    assert result["meta"]["tuning"] == {**tuning.TUNING_DEFAULTS, "peft": "lora", "lora_rank": 8}
    assert result["meta"]["trainable_parameters"] == sum(math.prod(s) for s in adapters) == 18_400
    answer, = result["answers"]
    assert answer["largest"] == 3 and [o["fits"] for o in answer["outcomes"]] == [True, False]
    fit = answer["outcomes"][0]
    assert fit["accounting_matches_expected"] and fit["frozen_base_as_expected"]
    assert fit["frozen_base"] == {"frozen_param_bytes": padded_chunk_bytes(base, 2, 2), "frozen_grad_bytes": 0,
                                  "frozen_state_bytes": 0}
    assert fit["state_bytes"]["grad_bytes"] == padded_chunk_bytes(adapters, 2, 4)  # the adapters', fp32
    traces = list((out / "probes").glob("*/*memory_usage.json"))
    assert len(traces) == 3  # the shared process and two fresh probes, each with the run's fine-tuning
    for trace in map(load, traces):
        question = trace["meta"].get("probe") or trace["meta"]["shared"]
        assert question["base"]["tuning"] == result["meta"]["tuning"]


@needs_peft
@needs_bitsandbytes
def test_the_planner_builds_a_base_the_host_cannot_hold_on_meta_and_its_probes_draw_it_unit_by_unit(tmp_path,
                                                                                                   monkeypatch):
    """A base larger than the card and the host (Llama-3.1-70B: 282 GB in fp32) is planned from its shards: auto
    picks meta where the fp32 build fits neither and only the variant built from shards is planned (the four
    variants keep the host's refusal); each probe then builds on meta, each block quantized as it is sharded, and
    its accounting and frozen base are the rule's."""
    from fsdp2bench.memory import estimate
    from fsdp2bench.plan import checks

    argv = [*PLAN[1:], "--model", "tiny", "--sets", "default", *QLORA, "--output_dir", str(tmp_path / "x")]
    for module in (checks, estimate):  # the tiny model, as if its fp32 build were 70B's
        monkeypatch.setattr(module, "built_bytes", lambda shapes: 282 << 30)
    line = refusal(plan.validate, argv)
    assert line is not None and "GiB of host memory for one probe" in line, line
    checked = plan.validate([*argv, "--variants", TRAINED])
    assert checked.args.init_device == "meta"
    monkeypatch.undo()
    out = tmp_path / "plan"
    proc = run_script([*PLAN, "--model", "tiny", "--sets", "default", "--variants", TRAINED, "--inject_oom_above", "3",
                       *QLORA, "--init_device", "meta", "--output_dir", str(out)], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = load(out / "plan.json")
    assert result["meta"]["init_device"] == "meta"
    answer, = result["answers"]
    fit = answer["outcomes"][0]
    assert answer["largest"] == 3 and fit["accounting_matches_expected"] and fit["frozen_base_as_expected"]
    for trace in map(load, (out / "probes").glob("*/*memory_usage.json")):
        built = next(e for e in trace["events"] if e["name"] == "model_built")
        assert built["build_device"] == "meta"


def searched_state(out, result: dict) -> list[tuple[dict, dict]]:
    """(the memory model's claim, main.py's measurement) of rank 0's state after its last step, for each candidate
    a timing ran (one simulated rank of its layout)."""
    rows = {c["name"]: c for c in result["candidates"]}
    pairs = []
    for i, timing in enumerate(result["timings"]):
        entry = load(out / "timings" / f"t{i}" / "summary.json")["simulated"]["2"]["0"][TRAINED]
        assert entry["status"] == "ok" and entry["accounting_matches_expected"], timing
        pairs.append((rows[timing["candidate"]]["memory"]["state_bytes"], entry["accounting"][0]["before_zero_grad"]))
    return pairs


@needs_peft
@pytest.mark.parametrize("argv, rank, itemsize", [([*LORA, "--lora_rank", "8"], 8, 4),  # fp32 adapters, bf16 ones
                                                  pytest.param(QLORA, 16, 2, marks=needs_bitsandbytes)],
                         ids=["lora", "qlora"])
def test_the_layout_search_claims_the_state_main_py_measures_to_the_byte_and_its_commands_carry_the_tuning(
        tmp_path, argv, rank, itemsize):
    """plan.py --find layout with adapters at N = 2 (TP left out, said): the memory model's claim of rank 0's state
    (the part of each candidate's estimate that is exact) is what main.py counts, to the byte, on the simulated rank
    of each timing and on rank 0 of the sharded candidate's torchrun line run on 2 gloo ranks: the gradients the
    adapters' alone, the frozen base sharded with none. The winner's printed check carries the fine-tuning and runs
    as printed (where timings shared this host with other runs no winner is named, and said why: then the sharded
    candidate's check, as the search would print it)."""
    out = tmp_path / "search"
    proc = run_script([*SEARCH, "--max_timings", "2", *argv, "--output_dir", str(out)], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert f"Left out: tp 2: --peft {argv[1]} with --tp_size 2" in said
    adapters_of = {"lora": "LoRA adapters (rank 8", "qlora": "QLoRA adapters (rank 16"}[argv[1]]
    assert f"{len(load(out / 'plan.json')['candidates'])} candidates of N = 2 for tiny, {adapters_of}" in said
    result = load(out / "plan.json")
    assert result["meta"]["tuning"]["peft"] == argv[1] and result["meta"]["timings"] == 2
    assert {c["name"].split()[0] for c in result["candidates"]} == {"R1xS2xC1xT1", "R2xS1xC1xT1"}
    for claim, measured in searched_state(out, result):
        assert claim == measured
    _, adapters = tiny_lora_shapes(rank)
    assert result["meta"]["trainable_parameters"] == sum(math.prod(s) for s in adapters)
    search = plan.validate([*SEARCH[1:], *argv, "--output_dir", str(tmp_path / "again")])
    sharded = next(c for c in search.candidates if c.degrees.shard == 2)
    claim = next(c for c in result["candidates"] if c["name"] == sharded.name)["memory"]["state_bytes"]
    assert claim["grad_bytes"] == padded_chunk_bytes(adapters, 2, itemsize)  # the adapters' alone
    commands = layout_search.commands(sharded, search.setup)
    torchrun = shlex.split(commands["torchrun"])
    real = run_script([*torchrun[torchrun.index("main.py"):], "--device", "cpu", "--quiet", "--output_dir",
                       str(tmp_path / "real")], timeout=600)
    assert real.returncode == 0, real.stderr[-2000:]
    summary = load(tmp_path / "real" / "summary.json")
    assert summary["variants"][TRAINED]["accounting"][0]["before_zero_grad"] == claim
    assert summary["checks"]["frozen_base_sharded"]["ok"] and summary["meta"]["fsdp_options"]["tuning"]["peft"] == \
        argv[1]
    if result["winner"] is None:
        assert " ".join(result["meta"]["unclean_timings"].split()) in said
    else:
        commands = result["winner"]["commands"]
        assert commands["one_gpu_check"] in proc.stdout
    check = shlex.split(commands["one_gpu_check"])
    assert " ".join(argv) in commands["one_gpu_check"] and " ".join(argv) in commands["torchrun"]
    ran = run_script([*check[1:], "--device", "cpu", "--output_dir", str(tmp_path / "check")], nproc=None)
    assert ran.returncode == 0, ran.stderr[-2000:]


@pytest.mark.parametrize("find", [[], ["--find", "layout", "--global_batch", "2"]], ids=["batch", "layout"])
@pytest.mark.parametrize("argv, said", [
    *BAD_TUNING,
])
@needs_peft
def test_the_planner_refuses_a_bad_fine_tuning_option_as_main_py_does_in_one_line(tmp_path, find, argv, said):
    line = refusal(plan.validate, [*PLAN[1:], *find, *argv, "--output_dir", str(tmp_path / "out")])
    assert line is not None and said in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("blocked, argv, said", [
    ("peft", LORA, "error: --peft lora: peft cannot be imported (import of peft halted; None in sys.modules); "
                   "install it with pip install -r requirements-peft.txt"),
    ("bitsandbytes", QLORA, "error: --peft qlora: bitsandbytes cannot be imported"),
    ("torchao.optim", ["--optimizer", "adamw4bit"], "error: --optimizer adamw4bit: torchao cannot be imported"),
    pytest.param("none", [*LORA, "--lora_targets", "wq"], "error: --lora_targets wq: wq matches no Linear layer",
                 marks=needs_peft),
])
def test_a_plan_refused_for_its_fine_tuning_says_one_line_and_writes_nothing(tmp_path, blocked, argv, said):
    out = tmp_path / "out"
    proc = run_script(["-c", WITHOUT, blocked, *SEARCH, *argv, "--output_dir", str(out)], nproc=None)
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said), lines
