"""Every command line of every entry script either is accepted or is refused in one line that names
what is wrong, before any process or file exists: a property, drawn by hypothesis.

Each option is drawn either sane (valid whatever the other options are) or hostile (invalid whatever
they are: inf, nan, huge and negative numbers, floats where integers go, empty strings, unicode, a
file where a directory goes and the reverse, missing paths, malformed and non-causal configs). A
command line must be accepted exactly when every option in it is sane. The validation layer of each
script (``validate``) is called in-process for the many draws; a few draws are launched for real.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import psutil
import pytest
from conftest import ROOT, refusal, run_script
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loading
import matrix
import speed
import visualize
from fsdp2bench.cli import UserError
from fsdp2bench.options.fsdp import OPTION_SETS
from fsdp2bench.options.layout import Layout
from fsdp2bench.run import arguments

os.environ["HF_HUB_OFFLINE"] = "1"  # a name that is neither a preset nor a directory is asked of the Hub
EXAMPLES = 500
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def make_world() -> dict[str, str]:
    """Paths of every kind the strategies draw, made once: valid ones and hostile ones."""
    root = tempfile.mkdtemp(prefix="fsdp2bench cmdline ")  # a space in every path
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # made at import, for the strategies: gone at exit
    paths = {name: os.path.join(root, name) for name in
             ("a dir", "a file", "missing", "text.txt", "short.txt", "model", "bad json", "no type", "t5", "tree")}
    for name in ("a dir", "model", "bad json", "no type", "t5", "tree"):
        os.makedirs(paths[name])
    with open(paths["a file"], "w") as f:
        f.write("not a directory")
    with open(paths["text.txt"], "w") as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 2000)
    with open(paths["short.txt"], "w") as f:
        f.write("too short")
    config = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "tie_word_embeddings": True}
    for name, content in (("model", json.dumps(config)), ("bad json", "{not json"), ("no type", "{}"),
                          ("t5", json.dumps({"model_type": "t5"}))):
        with open(os.path.join(paths[name], "config.json"), "w") as f:
            f.write(content)
    with open(os.path.join(paths["tree"], "main.py"), "w") as f:
        f.write("")
    make_checkpoints(paths, root, json.dumps(config))
    return paths


def make_checkpoints(paths: dict[str, str], root: str, config: str) -> None:
    """Checkpoint directories, each with the tiny config: the config's model in both formats, and
    broken in every way a checkpoint can be, in both formats alike (legacy .bin, corrupt files, an
    index that names a missing file, is not JSON or misplaces a tensor, a tensor missing, of another
    shape or not floating point)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(config)))
    state = {name: p.detach().clone() for name, p in model.named_parameters()}  # tied ones once
    first = next(iter(state))
    broken = {"missing tensor": {k: v for k, v in state.items() if k != first},
              "wrong shape": {**state, first: torch.zeros(3, 3)},
              "int tensor": {**state, first: torch.zeros(state[first].shape, dtype=torch.int32)}}
    writers = {"st": (lambda d, f: save_file(d, f), "model.safetensors", "model.safetensors.index.json"),
               "bin": (lambda d, f: torch.save(d, f), "pytorch_model.bin", "pytorch_model.bin.index.json")}
    for kind, (save, single, index) in writers.items():
        cases = {f"ckpt {kind}": state, f"ckpt {kind} index": None, f"ckpt {kind} index missing": None,
                 f"ckpt {kind} index bad": None, f"ckpt {kind} index wrong": None, f"ckpt corrupt {kind}": None,
                 **{f"ckpt {kind} {what}": d for what, d in broken.items()}}
        for name, content in cases.items():
            paths[name] = os.path.join(root, name)
            os.makedirs(paths[name])
            with open(os.path.join(paths[name], "config.json"), "w") as f:
                f.write(config)
            if content is not None:
                save(content, os.path.join(paths[name], single))
        part = "part." + single.rsplit(".", 1)[1]
        save(state, os.path.join(paths[f"ckpt {kind} index"], part))
        save(state, os.path.join(paths[f"ckpt {kind} index wrong"], part))
        with open(os.path.join(paths[f"ckpt corrupt {kind}"], single), "wb") as f:
            f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{not a header")
        for name, weight_map in ((f"ckpt {kind} index", dict.fromkeys(state, part)),
                                 (f"ckpt {kind} index missing", dict.fromkeys(state, "gone." + part)),
                                 (f"ckpt {kind} index wrong", {**dict.fromkeys(state, part), first: "other." + part})):
            with open(os.path.join(paths[name], index), "w") as f:
                json.dump({"weight_map": weight_map}, f)
        with open(os.path.join(paths[f"ckpt {kind} index bad"], index), "w") as f:
            f.write("{not json")
    paths["ckpt legacy"] = os.path.join(root, "ckpt legacy")
    os.makedirs(paths["ckpt legacy"])
    with open(os.path.join(paths["ckpt legacy"], "config.json"), "w") as f:
        f.write(config)
    torch.save(state, os.path.join(paths["ckpt legacy"], "pytorch_model.bin"), _use_new_zipfile_serialization=False)


WORLD = make_world()


def snapshot() -> list[str]:
    root = os.path.dirname(WORLD["a dir"])
    return sorted(os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files)


# --------------------------------------------------------------------------- values

def integers(low: int, high: int) -> tuple:
    """(sane, hostile) strategies of an integer option valid in [low, high]."""
    hostile = st.sampled_from([str(low - 1), str(high + 1), str(10**30), str(-(10**30)), "2.5", "nan", "inf",
                               "", "é", "1e3", "0x10", " "])
    return st.integers(low, min(high, low + 1000)).map(str), hostile


def floats(low: float, high: float) -> tuple:
    hostile = st.sampled_from(["nan", "inf", "-inf", "-1", str(high * 2), str(low / 2 if low else -1e-9), "1e400",
                               "", "é", "one"])
    return st.floats(max(low, 1e-9), high, allow_nan=False).map(repr), hostile


def choice(sane: list[str], hostile: list[str]) -> tuple:
    return st.sampled_from(sane), st.sampled_from(hostile)


OUTPUT_DIRS = choice([os.path.join(WORLD["a dir"], "out put"), WORLD["a dir"]],
                     [WORLD["a file"], os.path.join(WORLD["a file"], "out"), ""])
MODELS = choice(["tiny", WORLD["model"]],
                [WORLD["missing"], WORLD["a file"], WORLD["bad json"], WORLD["no type"], WORLD["t5"], "qwen9-huge"])
VARIANTS = "torch_optimizer_after_fsdp,torch_optimizer_before_fsdp_not_fixed,torch_optimizer_before_fsdp_fixed,accelerate"

MAIN = {
    "--batch_size": integers(1, 8)[0], "--block_size": integers(2, 256)[0],
    "--max_steps": integers(1, 10_000_000)[0], "--seed": integers(0, 2**32 - 1)[0],
    "--dataset_fraction": (st.floats(0.5, 1.0).map(repr), floats(1e-9, 1.0)[1]),
    "--learning_rate": floats(1e-12, 10.0), "--log_interval": floats(0.001, 60.0),
    "--concurrent_variants": (st.sampled_from(["auto", "1", "3", "1000"]), st.sampled_from(["0", "-1", "x", "", "2.5"])),
    "--variants": choice(["torch_optimizer_after_fsdp", VARIANTS, "accelerate,torch_optimizer_after_fsdp"],
                         ["deepspeed", "", "accelerate,accelerate", "é"]),
    "--simulate_world_size": choice(["2", "1,8", "3,64"], ["0", "-2", "x", "2,2", "65537", "1e3", ""]),
    "--dataset": choice([WORLD["text.txt"]], [WORLD["missing"], WORLD["a dir"], WORLD["short.txt"]]),
    "--model": MODELS, "--output_dir": OUTPUT_DIRS,
    "--device": choice(["cpu"], ["tpu", ""]), "--init_device": choice(["cpu"], ["gpu"]),
    "--mixed_precision_policy": choice(["bf16_autocast", "bf16_params_fp32_reduce"], ["fp8", ""]),
    "--reshard_after_forward": choice(["true", "false", "TRUE"], ["maybe", "1", ""]),
    "--gradient_accumulation_steps": (st.sampled_from(["1", "2", "4"]), integers(1, 1 << 16)[1]),
    # Sane at every world size drawn (1, or the simulated 2, 1,8 and 3,64): one replica.
    "--dp_replicate_size": (st.just("1"), integers(1, 1 << 16)[1]),
    "--requires_all_reduce": (st.just("true"), st.sampled_from(["maybe", "", "false"])),
    # The levers: every K-th block needs full checkpointing (not drawn here); float8 needs a GPU.
    "--ac_every": (st.just("1"), st.sampled_from(["0", "nan", "65537", "x"])),
    "--compile": choice(["true", "false"], ["maybe", ""]),
    "--float8": (st.just("false"), st.sampled_from(["true", "maybe", ""])),
}
# Integer options: the sane strategy above, the hostile one from the same helper.
for flag, (low, high) in {"--batch_size": (1, 1 << 16), "--block_size": (2, 1 << 20), "--max_steps": (1, 10_000_000),
                          "--seed": (0, 2**32 - 1)}.items():
    MAIN[flag] = (MAIN[flag], integers(low, high)[1])


@st.composite
def command_line(draw, options: dict, fixed: list[str] | None = None) -> tuple[list[str], bool]:
    """(argv, whether every option in it is sane)."""
    argv, sane = list(fixed or []), True
    for flag in draw(st.lists(st.sampled_from(sorted(options)), unique=True, max_size=6)):
        good, bad = options[flag]
        hostile = draw(st.booleans())
        argv += [flag, draw(bad if hostile else good)]
        sane = sane and not hostile
    return argv, sane


SCALING_FLAGS = ("--gradient_accumulation_steps", "--dp_replicate_size", "--requires_all_reduce")
FLAT_SETS = sorted(n for n, o in OPTION_SETS.items() if o.layout == Layout() and not o.float8)  # float8: a GPU
HSDP_SETS = sorted(n for n, o in OPTION_SETS.items() if o.hsdp)
# Both models drawn have 4 heads, 2 key/value heads and an even MLP width. TP is sane where T divides
# every N; CP never is on the CPU.
PARALLEL_GOOD = [["--simulate_world_size", "2,8", "--tp_size", "2"],
                 ["--simulate_world_size", "4", "--tp_size", "2", "--dp_shard_size", "2"]]
PARALLEL_BAD = [["--tp_size", "2"], ["--simulate_world_size", "4", "--tp_size", "4"],
                ["--simulate_world_size", "6", "--tp_size", "3"], ["--simulate_world_size", "2", "--cp_size", "2"],
                ["--cp_comm_strategy", "alltoall"], ["--tp_size", "0"], ["--tp_size", "nan"],
                ["--simulate_world_size", "8", "--tp_size", "2", "--dp_shard_size", "3"],
                ["--cp_comm_strategy", "ring"]]
# Each refused whatever else is given (no other scaling flag, one real rank): an option that changes
# nothing, the third way without HSDP, a replicate or shard size that does not divide the world.
SCALING_BAD = [["--sync_each_batch", "true"], ["--sync_each_batch", "false"],
               ["--requires_all_reduce", "false", "--gradient_accumulation_steps", "2", "--sync_each_batch", "true"],
               ["--dp_shard_size", "8"], ["--dp_replicate_size", "2"],
               ["--dp_replicate_size", "2", "--dp_shard_size", "1"], ["--dp_replicate_size", "1", "--dp_shard_size", "2"],
               ["--dp_shard_size", "0"], ["--dp_shard_size", "nan"], ["--dp_shard_size", "65537"]]


@st.composite
def main_command_line(draw) -> tuple[list[str], bool]:
    argv, sane = draw(command_line(MAIN, ["--device", "cpu"]))
    extra = draw(st.sampled_from(["none", "fsdp", "fsdp_bad", "failure", "failure_bad", "rank_alone", "hsdp",
                                  "scaling_bad", "parallel", "parallel_bad"]))
    scaling_given = any(flag in argv for flag in SCALING_FLAGS)
    if extra == "fsdp" and not scaling_given:
        argv += OPTION_SETS[draw(st.sampled_from(FLAT_SETS))].flags()
    elif extra == "hsdp" and not scaling_given and "--simulate_world_size" not in argv:
        argv += ["--simulate_world_size", "8,16", *OPTION_SETS[draw(st.sampled_from(HSDP_SETS))].flags()]
    elif extra == "scaling_bad" and not scaling_given and "--simulate_world_size" not in argv:
        argv, sane = argv + draw(st.sampled_from(SCALING_BAD)), False
    elif extra == "parallel" and not scaling_given and "--simulate_world_size" not in argv:
        argv += draw(st.sampled_from(PARALLEL_GOOD))
    elif extra == "parallel_bad" and not scaling_given and "--simulate_world_size" not in argv:
        argv, sane = argv + draw(st.sampled_from(PARALLEL_BAD)), False
    elif extra == "fsdp_bad":
        argv, sane = argv + ["--activation_checkpointing_offload"], False
    elif extra == "failure" and "--variants" not in argv and "--max_steps" not in argv:
        argv += ["--inject_failure", "torch_optimizer_after_fsdp:0:0"]
    elif extra == "failure_bad":
        argv, sane = argv + ["--inject_failure", draw(st.sampled_from(["accelerate:0:7", "x:0:0", "accelerate:-1:0",
                                                                        "accelerate:999999999:0"]))], False
    elif extra == "rank_alone" and "--simulate_world_size" not in argv:
        argv, sane = argv + ["--simulate_rank", "0,1"], False
    return argv, sane


# --------------------------------------------------------------------------- the property

def check(validate, argv: list[str], sane: bool) -> None:
    before = snapshot()
    line = refusal(validate, argv)
    assert snapshot() == before, argv  # nothing written, refused or not
    if sane:
        assert line is None, (argv, line)
        return
    assert line is not None, f"accepted a hostile command line: {argv}"
    assert line.startswith("error: ") and "\n" not in line and "Traceback" not in line, line
    named = [tok for tok in argv if tok.startswith("--") and len(tok) > 2] + [tok for tok in argv if os.sep in tok]
    assert any(tok in line for tok in named), (argv, line)


@SETTINGS
@given(main_command_line())
def test_main_accepts_exactly_the_sane_command_lines(case):
    check(arguments.validate, *case)


LOADING = {
    "--seed": MAIN["--seed"], "--log_interval": MAIN["--log_interval"], "--output_dir": OUTPUT_DIRS,
    # The checkpoints hold the model of WORLD["model"]'s config: another shape (tiny) is refused beside them.
    "--model": (st.just(WORLD["model"]), MODELS[1]), "--device": MAIN["--device"],
    "--checkpoint_shard_size": choice(["2GB", "500MiB", "1KB"], ["2.5GB", "0GB", "x", "", "-1GB", "2TB"]),
    "--modes": choice(["naive", "naive,sharded_read"], ["nope", "naive,naive", ""]),
    "--checkpoint": choice([WORLD["ckpt st"], WORLD["ckpt bin"], WORLD["ckpt st index"], WORLD["ckpt bin index"]],
                           [WORLD["missing"], WORLD["a file"], WORLD["model"], WORLD["ckpt legacy"],
                            *(WORLD[f"ckpt {kind} {what}"] for kind in ("st", "bin")
                              for what in ("index missing", "index bad", "index wrong", "missing tensor",
                                           "wrong shape", "int tensor")),
                            WORLD["ckpt corrupt st"], WORLD["ckpt corrupt bin"]]),
    "--checkpoint_dtype": choice(["bfloat16", "float32"], ["int4", ""]),
    "--checkpoint_format": choice(["safetensors", "bin"], ["pt", "", "BIN"]),
    "--simulate_world_size": choice(["2", "8,32", "3,128"], ["0", "-2", "x", "2,2", "65537", ""]),
}


@SETTINGS
@given(command_line(LOADING, ["--device", "cpu"]))
def test_loading_accepts_exactly_the_sane_command_lines(case):
    argv, sane = case
    if "--model" not in argv and "--checkpoint" not in argv:
        argv += ["--model", "tiny"]  # its default is the 1.5B shape: valid, only slower to check
    check(loading.validate, argv, sane)


VISUALIZE = {
    "--dir": choice([WORLD["a dir"]], [WORLD["missing"], WORLD["a file"], ""]),
    "--memory_threshold": floats(0.0, 1e7), "--filter_partition": floats(1e-3, 1e6),
}


@SETTINGS
@given(command_line(VISUALIZE, ["--dir", WORLD["a dir"]]))
def test_visualize_accepts_exactly_the_sane_command_lines(case):
    check(visualize.validate, *case)


SPEED = {
    "--nproc_per_node": (integers(1, 8)[0], integers(1, 4096)[1]),
    "--json": choice([os.path.join(WORLD["a dir"], "speed out.json")],
                     [WORLD["a dir"], os.path.join(WORLD["a file"], "speed.json"), ""]),
    "--baseline": choice([WORLD["tree"]], [WORLD["missing"], WORLD["a dir"], WORLD["a file"], "", " "]),
    "--output_dir": OUTPUT_DIRS,
}


@SETTINGS
@given(command_line(SPEED), st.sampled_from(["sane", "hostile"]), st.data())
def test_speed_accepts_exactly_the_sane_command_lines(case, forwarded, data):
    argv, sane = case
    flag = data.draw(st.sampled_from(["--batch_size", "--learning_rate", "--model"]))
    value = data.draw(MAIN[flag][forwarded == "hostile"])
    check(speed.validate, [*argv, "--", "--device", "cpu", "--model", "tiny", flag, value],
          sane and forwarded == "sane")


MATRIX = {
    "--option_sets": choice(["every_set", "default", "ac,cpu_offload,all"], ["fast", "ac,ac", "", "every_set,ac", "each"]),
    "--nproc_per_node": (integers(1, 8)[0], integers(0, 4096)[1]),
    "--output_dir": OUTPUT_DIRS,
    "--batch_size": MAIN["--batch_size"], "--model": MODELS,
    "--cpu_offload": (st.nothing(), st.just("--cpu_offload")),
}


@st.composite
def matrix_command_line(draw) -> tuple[list[str], bool]:
    argv, sane = [], True
    for flag in draw(st.lists(st.sampled_from(sorted(MATRIX)), unique=True, max_size=5)):
        good, bad = MATRIX[flag]
        hostile = flag == "--cpu_offload" or draw(st.booleans())
        argv += [flag] if flag == "--cpu_offload" else [flag, draw(bad if hostile else good)]
        sane = sane and not hostile
    sweep = draw(st.sampled_from(["none", "sane", "bad_steps", "steps_alone"]))
    if sweep == "sane":
        argv += ["--simulate_world_size", "2,8", "--sweep_steps", str(draw(st.integers(1, 20)))]
    elif sweep == "bad_steps":
        argv, sane = argv + ["--simulate_world_size", "2", "--sweep_steps", draw(integers(1, 10_000_000)[1])], False
    elif sweep == "steps_alone":
        argv, sane = argv + ["--sweep_steps", "3"], False
    return argv + ["--device", "cpu"], sane


@SETTINGS
@given(matrix_command_line())
def test_matrix_accepts_exactly_the_sane_command_lines(case):
    argv, sane = case
    check(lambda a: matrix.check(*matrix.parse_args(a)), argv, sane)


# --------------------------------------------------------------------------- real launches

@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(main_command_line())
def test_a_launch_runs_or_refuses_in_one_line_and_leaves_nothing_behind(case):
    """A few draws launched for real: exit 0 with summary.json, or exit 2 with one line and nothing
    written; never a traceback, and no process left behind."""
    argv, sane = case
    with tempfile.TemporaryDirectory(prefix="fsdp2bench launch ") as out:
        launch_and_check(argv, out)


def launch_and_check(argv: list[str], out: str) -> None:
    """One drawn command line launched with its output in ``out`` (removed after it by the caller)."""
    # The run's shape is fixed last (the last value wins) to one that shows within a dozen steps that the
    # model trains, so that a run that is accepted passes its checks; the in-process test covers the rest.
    argv = [*argv, "--max_steps", "12", "--learning_rate", "1e-3", "--batch_size", "2", "--block_size", "64",
            "--seed", "421", "--dataset_fraction", "1.0", "--variants", "torch_optimizer_after_fsdp",
            "--output_dir", os.path.join(out, "run")]
    argv = [tok for i, tok in enumerate(argv) if not (tok == "--inject_failure" or argv[i - 1] == "--inject_failure")]
    proc = run_script(["main.py", *argv], nproc=None, timeout=300)
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-3000:]
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if out in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left running: {left}"
    if proc.returncode == 2:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and not os.path.exists(os.path.join(out, "run")), output[-3000:]
    else:
        assert proc.returncode == 0, output[-3000:]
        assert os.path.isfile(os.path.join(out, "run", "summary.json"))


def test_a_parameter_tied_across_two_blocks_is_refused():
    """A config cannot tie two blocks' tensors, but a model can: the check reads the model."""
    from torch import nn

    from fsdp2bench.train.model import check_units_own_their_parameters

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    model = nn.Sequential(Block(), Block())
    check_units_own_their_parameters("mine", model, ["Block"])
    model[1].proj.weight = model[0].proj.weight
    with pytest.raises(UserError, match="--model mine: a parameter is tied across the units 0, 1"):
        check_units_own_their_parameters("mine", model, ["Block"])


# --------------------------------------------------------------------------- the tests on a shared machine

def pytest_session(args: list[str], given_tmp: str, cwd=ROOT, **env: str) -> subprocess.CompletedProcess:
    """A test session of its own, as a user starts one with ``given_tmp`` as the machine's temp dir (TMPDIR)."""
    shell = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env={**shell, "TMPDIR": given_tmp, **env}, capture_output=True, text=True, timeout=600)


def not_pytests(directory) -> list[str]:
    """What is in ``directory`` besides pytest's own folders (which pytest keeps and removes)."""
    return sorted(n for n in os.listdir(directory) if not n.startswith("pytest-of-"))


def test_a_test_session_leaves_nothing_in_the_temp_dir_it_is_given(tmp_path):
    """This module builds a model as it is collected (torch makes its compiled-kernel cache then): every process
    of a session writes its temp files in the session's own dir, which is gone when the session ends."""
    given = tmp_path / "given"
    given.mkdir()
    proc = pytest_session(["tests/test_command_lines.py", "-k", "tied_across_two_blocks"], str(given))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not_pytests(given) == []


def test_what_other_jobs_write_in_the_machines_temp_dir_is_not_the_tests(tmp_path):
    """Another job's files appearing in the machine's temp dir during a session (a shared machine) are not
    counted against the tests."""
    given, tests = tmp_path / "given", tmp_path / "tests"
    given.mkdir()
    tests.mkdir()
    (tests / "test_another_job.py").write_text(
        "import os\n\n\ndef test_another_job_writes_beside_the_tests():\n"
        "    for name in ('tmp.another_job', 'torchelastic_another_job', 'fsdp2bench another job', 'pymp-x'):\n"
        "        os.mkdir(os.path.join(os.environ['MACHINE_TMP'], name))\n")
    proc = pytest_session(["-p", "conftest", str(tests)], str(given), cwd=tmp_path, MACHINE_TMP=str(given),
                          PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not_pytests(given) == ["fsdp2bench another job", "pymp-x", "tmp.another_job", "torchelastic_another_job"]
