"""The user's accelerate config is what is measured (fsdp2bench/options/accelerate_config.py): under ``accelerate
launch`` and with ``--config_file``, each field reaches every variant (read back from the prepared models), a
flag wins over the file, and what the suite cannot mirror is refused in one line before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

import loading
import plan
from conftest import ACCELERATE_LAUNCH, VARIANTS, load, refusal, run_script
from fsdp2bench.cli import UserError
from fsdp2bench.run import arguments

FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2,
                                                     "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}
RUN = ["--model", "tiny", "--device", "cpu", "--max_steps", "2", "--quiet"]


def config_file(tmp_path: Path, name: str = "fsdp2.yaml", fsdp: dict | None = None, **top) -> str:
    """An accelerate config as ``accelerate config`` writes one: FSDP2 with transformer-block wrapping, then
    the FSDP fields and the top-level fields given."""
    import yaml

    config = {**FSDP2, **top, "fsdp_config": {**FSDP2["fsdp_config"], **(fsdp or {})}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def applied(summary: dict, variant: str) -> dict:
    return summary["variants"][variant]["applied"][0]


def test_accelerate_launch_with_a_config_trains_every_variant_as_the_file_says_and_a_flag_wins(tmp_path):
    """The issue's file, launched by accelerate on 2 CPU processes, with the accumulation steps that
    ``Accelerator`` reads from the environment: each field read back from all four prepared models (the
    unreduced gradients between microbatches counted to the byte); --activation_checkpointing false on the
    command line wins over the file's true."""
    path = config_file(tmp_path, fsdp={"fsdp_reshard_after_forward": False, "fsdp_activation_checkpointing": True,
                                       "fsdp_offload_params": True},
                       mixed_precision="no", use_cpu=True, num_processes=2)
    out = tmp_path / "out"
    proc = run_script(["main.py", *RUN, "--output_dir", str(out), "--activation_checkpointing", "false"],
                      launcher=[ACCELERATE_LAUNCH, "--config_file", path], ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = load(out / "summary.json")
    said = summary["meta"]["options_from"]
    assert said["config"] == "accelerate launch's environment"
    assert {k: said["sources"][k] for k in ("reshard_after_forward", "cpu_offload", "mixed_precision_policy",
                                            "activation_checkpointing", "gradient_accumulation_steps", "tp_size")} == \
        {"reshard_after_forward": "config", "cpu_offload": "config", "mixed_precision_policy": "config",
         "activation_checkpointing": "flag", "gradient_accumulation_steps": "config", "tp_size": "default"}
    assert summary["meta"]["per_optimizer_step"]["microbatches"] == 2
    assert "--activation_checkpointing none (the config: full)" in " ".join(proc.stdout.split())
    for variant in VARIANTS:
        entry = summary["variants"][variant]
        assert len(entry["applied"]) == 2 and entry["applied_matches_options"], variant
        assert {k: applied(summary, variant)[k] for k in ("reshard_after_forward", "param_dtype", "reduce_dtype",
                                                           "activation_checkpointing", "cpu_offload", "fsdp_mesh")} \
            == {"reshard_after_forward": False, "param_dtype": "float32", "reduce_dtype": "float32",
                "activation_checkpointing": "none", "cpu_offload": True, "fsdp_mesh": [2]}, variant
        assert entry["accounting_matches_expected"], variant  # fp32 outputs kept: 4 bytes a logit
    assert summary["checks"]["options_applied"]["ok"] and summary["checks"]["intended_losses_match"]["ok"]


def test_a_config_file_sets_the_layout_and_precision_of_a_simulated_rank(tmp_path):
    """``--config_file`` without a launcher: HSDP of 2 replicas x 2 shards and bf16 from the file, one rank of
    N = 4 played; every variant's FSDP units are on the 2 x 2 mesh, under the bf16 policy."""
    path = config_file(tmp_path, "hsdp.yaml", mixed_precision="bf16",
                       parallelism_config={"parallelism_config_dp_replicate_size": 2,
                                           "parallelism_config_dp_shard_size": 2})
    out = tmp_path / "out"
    proc = run_script(["main.py", *RUN, "--output_dir", str(out), "--config_file", path,
                       "--simulate_world_size", "4"], nproc=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Options from hsdp.yaml:" in proc.stdout and "dp_replicate_size 2" in proc.stdout
    summary = load(out / "summary.json")
    assert summary["meta"]["fsdp_options"]["layout"]["dp_replicate_size"] == 2
    assert summary["meta"]["options_from"]["sources"]["mixed_precision_policy"] == "config"
    for variant in VARIANTS:
        entry = summary["simulated"]["4"]["0"][variant]
        assert entry["applied"][0]["fsdp_mesh"] == [2, 2] and entry["applied"][0]["param_dtype"] == "bfloat16"
        assert entry["applied_matches_options"] and entry["accounting_matches_expected"], variant


def refused(tmp_path: Path, path: str) -> str:
    """main.py's checks of a run with this config, in this process: the line it refuses it with."""
    said = refusal(arguments.validate, ["--config_file", path, *RUN, "--output_dir", str(tmp_path / "out")])
    assert said is not None and not (tmp_path / "out").exists()
    return said.removeprefix("error: ")


@pytest.mark.parametrize("fsdp, top, said", [
    ({"fsdp_version": 1}, {}, "fsdp_version 1: the suite measures FSDP2"),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000}, {},
     "fsdp_auto_wrap_policy SIZE_BASED_WRAP: the suite measures one FSDP unit per transformer block"),
    ({"fsdp_auto_wrap_policy": "NO_WRAP"}, {}, "fsdp_auto_wrap_policy NO_WRAP"),
    ({"fsdp_reshard_after_forward": "maybe"}, {}, "fsdp_reshard_after_forward must be true or false, got 'maybe'"),
    ({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, {},
     "fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer: the suite shards this model by its blocks, "
     "Qwen2DecoderLayer"),
    ({}, {"mixed_precision": "fp16"}, "mixed_precision fp16: the suite runs 'no' (fp32), bf16 and fp8"),
    ({}, {"distributed_type": "MULTI_GPU"}, "distributed_type MULTI_GPU: the suite measures FSDP2"),
    ({}, {"parallelism_config": {"parallelism_config_tp_size": "two"}},
     "parallelism_config_tp_size must be a positive integer, got 'two'"),
    ({}, {"parallelism_config": {"parallelism_config_dp_shard_size": 1, "parallelism_config_sp_size": 2}},
     "parallelism_config_sp_size 2: sequence parallelism"),
    ({"fsdp_reshard_after_foward": False}, {}, "fsdp_config: fsdp_reshard_after_foward: not a field accelerate knows"),
    ({}, {"parallelism_config": [1, 2]}, "parallelism_config must be a mapping of fields"),
    ({}, {"mixed_precision": False}, "mixed_precision false: YAML reads an unquoted no, off or false as false; "
                                     "write mixed_precision: 'no'"),
    ({}, {"mixed_precision": True}, "mixed_precision true: YAML reads an unquoted yes, on or true as true, which is "
                                    "no precision; write mixed_precision: bf16"),
    ({"fsdp_ignored_modules": "lm_head"}, {}, "fsdp_ignored_modules lm_head: the suite shards every module"),
    ({}, {"num_processes": 8}, "num_processes 8, but this launch has 1 rank: launch 8 (torchrun --nproc_per_node "
                               "8, or accelerate launch --config_file fsdp2.yaml), or play rank 0 of 8 on one GPU with "
                               "--simulate_world_size 8"),
    ({}, {"parallelism_config": {"parallelism_config_cp_size": 2}},
     "--cp_size 2: context parallelism does not run on the CPU with torch"),
    ({}, {"num_processes": "two", "parallelism_config": {"parallelism_config_dp_shard_size": 4}},
     "--dp_shard_size 4 is not the world size 1 (--dp_replicate_size is fsdp2.yaml "
     "parallelism_config_dp_replicate_size 1; --dp_shard_size is fsdp2.yaml parallelism_config_dp_shard_size 4)"),
])
def test_what_cannot_be_mirrored_is_refused_naming_the_file_and_field(tmp_path, fsdp, top, said):
    message = refused(tmp_path, config_file(tmp_path, fsdp=fsdp, **top))
    assert "fsdp2.yaml" in message and said in message, message


def config_line(tmp_path: Path, path: str, *extra: str, **env: str) -> tuple[str, object]:
    """The line main.py says of where its options came from, and what it checked, for this config (in-process,
    with ``env`` set in this process's environment for the call)."""
    from fsdp2bench.cli import environment_changed

    with environment_changed(env):
        checked = arguments.validate(["--config_file", path, *RUN, "--output_dir", str(tmp_path / "out"), *extra])
        line = arguments.accelerate_config.said(checked.config, checked.args.option_sources, checked.args)
    return " ".join(line.split()), checked


def test_every_word_about_a_config_is_true_of_what_accelerate_does_with_it(tmp_path):
    """A field written without its fsdp_ prefix is one (accelerate's launcher adds it); a size quoted in the file is
    one accelerate reads; FSDP1's sharding strategy and a deepspeed_config's accumulation, which accelerate's FSDP2
    launch does not apply, are named; the environment's accumulation steps are said as the environment's."""
    path = config_file(tmp_path, fsdp={"reshard_after_forward": False, "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
                       deepspeed_config={"gradient_accumulation_steps": 4},
                       parallelism_config={"parallelism_config_dp_shard_size": "2"})
    line, checked = config_line(tmp_path, path, "--simulate_world_size", "2")
    assert checked.fsdp_options.reshard_after_forward is False and checked.fsdp_options.layout.dp_shard_size == 2
    assert "fsdp_sharding_strategy SHARD_GRAD_OP (FSDP1's: accelerate's FSDP2 plugin does not read it" in line
    assert "deepspeed_config gradient_accumulation_steps 4 (accelerate launch applies a deepspeed_config only under " \
           "distributed_type DEEPSPEED" in line
    assert checked.fsdp_options.gradient_accumulation_steps == 1
    line, checked = config_line(tmp_path, config_file(tmp_path), ACCELERATE_GRADIENT_ACCUMULATION_STEPS="3")
    assert checked.fsdp_options.gradient_accumulation_steps == 3
    assert checked.args.option_sources["gradient_accumulation_steps"] == "environment"
    assert "gradient_accumulation_steps 3 from ACCELERATE_GRADIENT_ACCUMULATION_STEPS=3 in the environment" in line
    assert "Options from fsdp2.yaml: " in line and "fsdp2.yaml: gradient" not in line
    assert "gradient_accumulation_steps 3," not in line.split(";")[0]  # not among the file's own
    _, checked = config_line(tmp_path, config_file(tmp_path), "--gradient_accumulation_steps", "2",
                             ACCELERATE_GRADIENT_ACCUMULATION_STEPS="3")
    assert checked.fsdp_options.gradient_accumulation_steps == 2  # a flag wins


def test_the_environments_accumulation_steps_apply_without_a_config_and_are_named_when_refused(tmp_path, monkeypatch):
    """accelerate's Accelerator reads ACCELERATE_GRADIENT_ACCUMULATION_STEPS under torchrun or plain python too:
    every variant applies it, the line says where it came from, and a refusal names the variable."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    checked = arguments.validate([*RUN, "--output_dir", str(tmp_path / "out")])
    assert checked.fsdp_options.gradient_accumulation_steps == 2
    assert arguments.accelerate_config.said(None, checked.args.option_sources, checked.args) == \
        "Options from the environment: gradient_accumulation_steps 2 from ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2 " \
        "in the environment (accelerate's Accelerator reads it)"
    said = refusal(arguments.validate, [*RUN, "--output_dir", str(tmp_path / "out"), "--sync_each_batch", "true",
                                        "--requires_all_reduce", "false"])
    assert said is not None and "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2 in the environment" in said, said
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "x")
    assert refusal(arguments.validate, [*RUN, "--output_dir", str(tmp_path / "out")]) == \
        "error: ACCELERATE_GRADIENT_ACCUMULATION_STEPS in the environment must be a positive integer, got 'x'"


def test_a_file_accelerate_cannot_read_is_one_line(tmp_path):
    (tmp_path / "broken.yaml").write_text("distributed_type: FSDP\nfsdp_config: [1, 2\n")
    assert "broken.yaml: not an accelerate config accelerate can read: while parsing" in \
        refused(tmp_path, str(tmp_path / "broken.yaml"))
    (tmp_path / "unknown.yaml").write_text("distributed_type: FSDP\nfsdp_confg: {}\n")
    assert "had unknown keys (['fsdp_confg'])" in refused(tmp_path, str(tmp_path / "unknown.yaml"))
    (tmp_path / "empty.yaml").write_text("")
    assert refused(tmp_path, str(tmp_path / "empty.yaml")).startswith("empty.yaml: ")
    assert refused(tmp_path, str(tmp_path / "missing.yaml")).endswith("no such file or directory, not a file")
    assert refused(tmp_path, str(tmp_path)).endswith("a directory, not a file")
    (tmp_path / "v.yaml").write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: "
                                     "TRANSFORMER_BASED_WRAP\n")
    assert "v.yaml: no fsdp_version (accelerate then takes 1)" in refused(tmp_path, str(tmp_path / "v.yaml"))


def test_a_refused_config_exits_2_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_script(["main.py", *RUN, "--output_dir", str(out), "--config_file",
                       config_file(tmp_path, fsdp={"fsdp_version": 1})], nproc=None)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().count("\n") == 0 and "fsdp_version 1" in proc.stderr, proc.stderr


def test_plan_matrix_and_loading_read_the_same_file(tmp_path):
    """plan.py puts each set over the file's options; matrix.py forwards the file to each launch and still owns
    the options its sets change; loading.py names the mode the file loads as."""
    path = config_file(tmp_path, fsdp={"fsdp_activation_checkpointing": True, "fsdp_cpu_ram_efficient_loading": True},
                       mixed_precision="no")
    checked = plan.validate(["--config_file", path, "--device", "cpu", "--sets", "default,no_reshard",
                             "--world_size", "2", "--output_dir", str(tmp_path / "plan")])
    assert checked.base.activation_checkpointing == "full" and checked.base.mixed_precision_policy == "fp32"
    assert plan.set_options(checked.base, "no_reshard").reshard_after_forward is False
    assert plan.set_options(checked.base, "no_reshard").activation_checkpointing == "full"
    args, _, _, _ = loading.validate(["--config_file", path, "--device", "cpu", "--output_dir", str(tmp_path / "l")])
    assert args.options_from["config"] == "fsdp2.yaml" and args.options_from["mode"] == "accelerate"
    import matrix

    sets, _, options_from = matrix.check(*matrix.parse_args(["--config_file", path, "--option_sets", "default", *RUN,
                                               "--output_dir", str(tmp_path / "m")]))
    assert sets == ["default"] and options_from["config"] == "fsdp2.yaml"
    with pytest.raises(UserError, match="--activation_checkpointing is set by matrix.py"):
        matrix.check(*matrix.parse_args(["--config_file", path, "--activation_checkpointing", *RUN]))


def test_each_refusal_names_its_cause_and_source_at_the_world_size_each_launch_will_have(tmp_path):
    """matrix.py checks the options it forwards at its launches' world size (--nproc_per_node, or the sweeps' N), not
    its own process's 1; CP on a CPU rank is refused as CP on the CPU before its size is checked against N, as the
    flag or as the config's field; plan.py blames the config's layout where that is what fits no N."""
    import matrix

    hsdp = config_file(tmp_path, "hsdp.yaml", parallelism_config={"parallelism_config_dp_shard_size": 2})
    out = ["--output_dir", str(tmp_path / "m")]
    for launches in (["--nproc_per_node", "2"], ["--nproc_per_node", "0", "--simulate_world_size", "2"]):
        sets, _, _ = matrix.check(*matrix.parse_args(["--config_file", hsdp, "--option_sets", "default", *RUN,
                                                      *launches, *out]))
        assert sets == ["default"], launches
    with pytest.raises(UserError) as refused_at_1:
        matrix.check(*matrix.parse_args(["--config_file", hsdp, "--option_sets", "default", *RUN, *out]))
    assert "world size 1" in str(refused_at_1.value) and "hsdp.yaml parallelism_config_dp_shard_size 2" in \
        str(refused_at_1.value)
    cpu_cp = "context parallelism does not run on the CPU"
    said = refusal(arguments.validate, [*RUN, "--cp_size", "2", "--output_dir", str(tmp_path / "out")])
    assert said.startswith(f"error: --cp_size 2: {cpu_cp}"), said
    cp = config_file(tmp_path, "cp.yaml", parallelism_config={"parallelism_config_cp_size": 2})
    said = refused(tmp_path, cp)
    assert said.startswith(f"--cp_size 2: {cpu_cp}") and said.endswith("(--cp_size is cp.yaml parallelism_config_cp_size 2)")
    said = refusal(plan.validate, ["--config_file", cp, "--device", "cpu", "--world_size", "2", "--output_dir",
                                   str(tmp_path / "p")])
    assert said.startswith(f"error: --cp_size 2: {cpu_cp}") and "cp.yaml parallelism_config_cp_size 2" in said
    shards = config_file(tmp_path, "shards.yaml", parallelism_config={"parallelism_config_dp_shard_size": 4})
    said = refusal(plan.validate, ["--config_file", shards, "--device", "cpu", "--world_size", "2,6", "--output_dir",
                                   str(tmp_path / "p")])
    assert said.startswith("error: shards.yaml: its layout (") and "parallelism_config_dp_shard_size 4" in said \
        and "fits none of --world_size 2,6" in said and "--sets" not in said, said
