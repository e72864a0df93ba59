"""The training step as a measured axis (fsdp2bench/options/step.py): the Trainer's loop against the upstream's, the
chunked loss against the model's own, the refusals, and the planner's and the matrix's pass-through."""

from __future__ import annotations

import json

import pytest
import torch

import utils
from conftest import TINY, load, refusal, run_script
from fsdp2bench.cli import UserError
from fsdp2bench.options import step
from fsdp2bench.run import arguments
from fsdp2bench.train.model import build_model, load_config

AFTER = "torch_optimizer_after_fsdp"
POLICY = ["--mixed_precision_policy", "bf16_params_fp32_reduce"]


def tiny_model(seed: int = 3):
    config = load_config("tiny")
    model, _ = build_model(config, torch.device("cpu"), seed)
    return config, model


def loss_and_grads(model, forward, inputs: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = forward(model, inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shifted", [False, True])
def test_the_chunked_loss_equals_the_models_own_in_loss_and_gradients(shifted):
    """Three chunks of 256 tokens and a short last one, some labels ignored, in fp32: only the order of the sums
    differs. ``shifted``: the labels already shifted, as context parallelism passes them."""
    _, model = tiny_model()
    torch.manual_seed(0)
    ids = torch.randint(0, 509, (2, 400))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    inputs["labels"][0, 100:140] = utils.IGNORE_INDEX
    reference, reference_grads = loss_and_grads(model, utils.model_loss, inputs)
    if shifted:
        inputs["shift_labels"] = utils.next_token_labels(inputs)
    utils.loss_in_head(model, chunk=256)
    loss, grads = loss_and_grads(model, utils.chunked_loss, inputs)
    assert model.get_output_embeddings().next_token_labels is None  # the labels are the head's for one forward
    assert torch.allclose(loss, reference, rtol=1e-6, atol=0)
    assert grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        assert grad.abs().max() > 0 and torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-7), name


def test_the_chunked_head_without_labels_is_the_plain_head():
    _, model = tiny_model()
    ids = torch.randint(0, 509, (1, 20))
    expected = model(input_ids=ids).logits
    utils.loss_in_head(model)
    assert torch.equal(model(input_ids=ids).logits, expected)


def run(tmp_path, name: str, *flags: str, steps: str = "12") -> dict:
    out = tmp_path / name
    proc = run_script(["main.py", *TINY, "--max_steps", steps, "--output_dir", str(out), *flags], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = load(out / "summary.json")
    summary["console"] = proc.stdout
    return summary


def test_the_trainers_loop_trains_bit_for_bit_as_the_upstreams_and_keeps_no_outputs(tmp_path, suite):
    """Against the shared 2-rank run of the four variants (the upstream loop, the default)."""
    out, proc = suite
    upstream = {**load(out / "summary.json"), "console": proc.stdout}
    trainer = run(tmp_path, "trainer", "--loop", "trainer", "--variants",  # the three compared
                  "torch_optimizer_after_fsdp,torch_optimizer_before_fsdp_not_fixed,accelerate")
    logits = 2 * 128 * 509 * 2  # batch x block x vocab, bf16 (the dtype the model returns)
    for name in ("torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_not_fixed", "accelerate"):
        assert trainer["variants"][name]["losses"] == upstream["variants"][name]["losses"], name
        for summary, kept in ((upstream, logits), (trainer, 0)):
            for rank in summary["variants"][name]["kept_output_bytes"]:
                assert rank == {"end_of_setup": 0, "before_zero_grad": kept, "end_of_training": kept}
    for summary, loop in ((upstream, "upstream"), (trainer, "trainer")):
        assert summary["checks"]["accounting_matches_expected"]["ok"]
        assert (summary["meta"]["loop"], summary["meta"]["loss"]) == (loop, "model")
        assert summary["meta"]["fsdp_options"]["step"] == {"loop": loop, "loss": "model"}
        assert f"Step: loop {loop} (" in summary["console"]


def test_the_chunked_loss_trains_as_the_models_own_over_two_chunks_with_accumulation(tmp_path):
    """1024-token blocks, two per microbatch: two chunks; K = 2 keeps the last microbatch's outputs."""
    flags = [*POLICY, "--block_size", "1024", "--batch_size", "2", "--gradient_accumulation_steps", "2",
             "--variants", f"{AFTER},accelerate"]
    model = run(tmp_path, "model", *flags, steps="3")
    chunked = run(tmp_path, "chunked", *flags, "--loss", "chunked", steps="3")
    for name in (AFTER, "accelerate"):
        expected, got = model["variants"][name]["losses"], chunked["variants"][name]["losses"]
        assert got[0] == pytest.approx(expected[0], rel=1e-6)  # the same weights: fp32 sums in another order
        assert got == pytest.approx(expected, rel=1e-4)
        assert chunked["variants"][name]["kept_output_bytes"][0]["between_microbatches"] == 0
        assert model["variants"][name]["kept_output_bytes"][0]["between_microbatches"] == 2 * 1024 * 509 * 2  # a microbatch: B x L x V, bf16
    assert chunked["checks"]["accounting_matches_expected"]["ok"] and model["checks"]["accounting_matches_expected"]["ok"]
    assert chunked["meta"]["loss"] == "chunked"


def validate(tmp_path, *flags: str, model: str = "tiny"):
    return arguments.validate(["--device", "cpu", "--model", model, *flags, "--output_dir", str(tmp_path / "out")])


def test_liger_is_refused_on_the_cpu_in_one_line(tmp_path):
    proc = run_script(["main.py", *TINY, "--loss", "liger", "--output_dir", str(tmp_path / "out")], nproc=None)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == [
        "error: --loss liger needs a GPU: liger-kernel's kernels are written in Triton, which runs on CUDA devices "
        "only (on the CPU, --loss chunked also never builds the full logits)"]


def test_liger_not_installed_names_the_requirements_file(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as if not installed
    with pytest.raises(UserError, match=r"liger-kernel cannot be imported .*pip install -r requirements-liger.txt"):
        step.check_liger(load_config("tiny"), "cuda")


def model_dir(tmp_path, **fields) -> str:
    config = load_config("tiny")
    config.update(fields)
    directory = tmp_path / "model"
    config.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("loss", ["chunked", "liger"])
def test_a_loss_that_takes_the_head_whole_is_refused_with_a_split_head(monkeypatch, loss):
    monkeypatch.setattr(step, "check_liger", lambda config, device_type: None)  # as on a GPU with liger-kernel
    config = load_config("tiny")  # tied; a plan that splits the embeddings, as transformers 5.17 makes it
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    layout = arguments.options.Layout(tp_size=2)
    with pytest.raises(UserError, match=f"--loss {loss} with --tp_size 2: this model's head is tied to its word "
                                        "embeddings, which its tensor-parallel plan splits"):
        step.check(step.Step(loss=loss), config, layout, "cuda")
    step.check(step.Step(loss=loss), load_config("tiny"), layout, "cuda")  # the head whole: runs


@pytest.mark.parametrize("field,value", [("logit_scale", 0.5), ("final_logit_softcapping", 30.0),
                                         ("final_logit_softcapping", 1.0), ("logits_scaling", 2)])
def test_the_chunked_loss_refuses_a_model_that_changes_its_logits_after_the_head(tmp_path, field, value):
    with pytest.raises(UserError, match=f"--loss chunked: this qwen2 model changes its logits after the head "
                                        f"[(]{field}[)]"):
        validate(tmp_path, "--loss", "chunked", model=model_dir(tmp_path, **{field: value}))


@pytest.mark.parametrize("flag,value", [("--loop", "Trainer"), ("--loop", ""), ("--loss", "fused"),
                                        ("--loss", "model,chunked")])
def test_an_unknown_loop_or_loss_is_one_line(tmp_path, flag, value):
    """Asked of main.py's checks in this process (the parser's one line and exit code 2; a launch refused by its
    parser: test_faults.py's "bad flag")."""
    line = refusal(arguments.validate, [*TINY, flag, value, "--output_dir", str(tmp_path / "out")])
    assert line is not None and f"{flag}: invalid choice: '{value}'" in line, line
    assert not (tmp_path / "out").exists()


def test_the_planner_passes_the_step_to_its_probes(tmp_path):
    kept = {}
    for loop in ("upstream", "trainer"):
        out = tmp_path / loop
        proc = run_script(["plan.py", "--device", "cpu", "--world_size", "2", "--sets", "default", "--variants", AFTER,
                           "--inject_oom_above", "2", "--loop", loop, "--loss", "chunked" if loop == "trainer" else
                           "model", "--output_dir", str(out)], nproc=None, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        plan = load(out / "plan.json")
        assert (plan["meta"]["loop"], plan["meta"]["loss"]) == (loop, "chunked" if loop == "trainer" else "model")
        answer, = plan["answers"]
        assert answer["largest"] == 2
        kept[loop] = {o["value"]: o["kept_output_bytes"] for o in answer["outcomes"] if o["fits"]}
    assert kept == {"upstream": {2: 2 * 128 * 509 * 2}, "trainer": {2: 0}}


def test_the_matrix_forwards_the_step_to_every_launch(tmp_path):
    out = tmp_path / "matrix"
    proc = run_script(["matrix.py", "--option_sets", "default,ac", "--nproc_per_node", "0", "--simulate_world_size",
                       "4", "--sweep_steps", "2", "--device", "cpu", "--model", "tiny", "--variants", AFTER,
                       "--loop", "trainer", "--output_dir", str(out)], nproc=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("default", "ac"):
        summary = load(out / name / "sweep" / "summary.json")
        assert summary["meta"]["loop"] == "trainer"
        entry = summary["simulated"]["4"]["0"][AFTER]
        assert entry["kept_output_bytes"][0]["before_zero_grad"] == 0 and entry["accounting_matches_expected"]
    assert json.loads((out / "matrix.json").read_text())


def test_a_logit_scale_of_one_changes_nothing_and_is_not_refused(tmp_path):
    validate(tmp_path, "--loss", "chunked", model=model_dir(tmp_path, logit_scale=1.0, logits_scaling=1))
