"""The user's accelerate config, read as accelerate reads it, as the options every variant applies.

Two ways in. ``accelerate launch`` with an FSDP config puts it in each rank's environment (``FSDP_*``,
``PARALLELISM_CONFIG_*``, ``ACCELERATE_*``); ``--config_file PATH`` (torchrun users, plan.py) sends the
file through accelerate's own config loader and launcher code to the same variables. Either way
accelerate's own objects (its FSDP plugin, its ParallelismConfig) read the values from those variables,
and they become main.py's options; a flag on the command line wins over them (arguments.py). What the
suite cannot mirror is refused in one line; what does not change training memory is named as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from fsdp2bench.cli import UserError, environment_changed, quiet_imports
from fsdp2bench.files import expect_path
from fsdp2bench.names import counted
from fsdp2bench.options import levers
from fsdp2bench.options.fsdp import AUTOCAST, FP32, FULL_AC, NO_AC
from fsdp2bench.options.layout import CP_STRATEGIES

LAUNCH_SOURCE = "accelerate launch's environment"
PREFIXES = ("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_")
# accelerate's mixed_precision values and the suite's --mixed_precision_policy for each it runs (fp8 is bf16 besides
# the float8 matmuls: --float8).
PRECISIONS = {"no": FP32, "bf16": AUTOCAST, "fp8": AUTOCAST}
# The dynamo_config accelerate's regional compilation takes as the suite's --compile: each field's launcher variable
# and the one value that mirrors it (None: the field may be left out).
DYNAMO_AS_COMPILE = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "TRUE",
                     "ACCELERATE_DYNAMO_MODE": "DEFAULT", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "FALSE",
                     "ACCELERATE_DYNAMO_USE_DYNAMIC": "FALSE"}
# FSDP fields that do not change what a rank holds in training, each with what the suite does instead.
NOT_MEASURED = {
    "FSDP_STATE_DICT_TYPE": "how checkpoints are saved",
    "FSDP_SYNC_MODULE_STATES": "obsolete under FSDP2",
    "FSDP_USE_ORIG_PARAMS": "obsolete under FSDP2",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "loading, which loading.py measures",
    "FSDP_BACKWARD_PREFETCH": "FSDP1 only",
    "FSDP_FORWARD_PREFETCH": "FSDP1 only",
    "FSDP_MIN_NUM_PARAMS": "used by accelerate only under SIZE_BASED_WRAP",
}


# Each option a config sets, and the field that sets it (a refusal that names the option names the field too).
FIELDS = {"reshard_after_forward": "fsdp_reshard_after_forward",
          "activation_checkpointing": "fsdp_activation_checkpointing",
          "activation_checkpointing_offload": "fsdp_activation_checkpointing_offload",
          "cpu_offload": "fsdp_offload_params", "mixed_precision_policy": "mixed_precision",
          "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
          **{f"{size}_size": f"parallelism_config_{size}_size" for size in ("dp_replicate", "dp_shard", "cp", "tp")},
          "cp_comm_strategy": "parallelism_config_cp_comm_strategy",
          "compile": "dynamo_config dynamo_backend", "float8": "mixed_precision"}


@dataclass(frozen=True)
class ConfigOptions:
    """main.py's options as a config sets them (flag names), where they came from, and what is not mirrored."""
    source: str
    values: dict = field(default_factory=dict)
    not_measured: tuple[str, ...] = ()
    layer_classes: tuple[str, ...] | None = None  # fsdp_transformer_layer_cls_to_wrap, if the config names it
    cpu_ram_efficient_loading: bool = False
    num_processes: int | None = None  # a file's own (under accelerate launch, the launch's ranks are the config's)


def read(config_file: str | None) -> ConfigOptions | None:
    """The config this run measures: ``--config_file``, else the FSDP config ``accelerate launch`` passed in
    the environment, else None (the flags and the defaults alone)."""
    if config_file is not None:
        environment, written, file = file_environment(config_file)
        config = from_environment(environment, os.path.basename(config_file), written)
        config = dataclasses.replace(config, not_measured=(*config.not_measured, *ignored_by_launcher(file)),
                                     num_processes=whole_or_none(getattr(file, "num_processes", None)))
        if launched_with_fsdp():  # accelerate launch passed one too
            return dataclasses.replace(config, not_measured=(*config.not_measured, "the FSDP config accelerate "
                                                             "launch passed (--config_file is read instead)"))
        return config
    if launched_with_fsdp():
        return from_environment(dict(os.environ), LAUNCH_SOURCE)
    return None


def said(config: ConfigOptions | None, sources: dict, args) -> str | None:
    """The line that says where the options came from: the config's values, the flags over them, and the
    fields not mirrored; or that ``accelerate launch`` passed no FSDP config; None with neither."""
    from_env = "; ".join(f"{k} {text(getattr(args, k))} from {ENVIRONMENT_FIELDS[k]}={text(getattr(args, k))} in the "
                         f"environment (accelerate's Accelerator reads it)" for k, s in sources.items() if s == ENVIRONMENT)
    if config is None:
        if launched_without_fsdp():
            return ("accelerate launch without an FSDP config (distributed_type FSDP, fsdp_version 2): the options are "
                    "the command line's" + (f", the environment's ({from_env})" if from_env else "") + " and the defaults")
        return f"Options from the environment: {from_env}" if from_env else None
    line = f"Options from {config.source}: " + ", ".join(f"{k} {text(v)}" for k, v in config.values.items())
    over = [f"--{k} {text(getattr(args, k))} (the config: {text(v)})" for k, v in config.values.items()
            if sources.get(k) == "flag" and getattr(args, k) != v]
    if over:
        line += "; on the command line over it: " + ", ".join(over)
    if from_env:
        line += f"; {from_env}"
    if config.not_measured:
        line += ("; not mirrored (what accelerate's FSDP2 training does not apply, or what does not change its "
                 "memory): " + ", ".join(config.not_measured))
    return line


def fields_said(config: ConfigOptions | None, sources: dict, args=None) -> dict[str, str]:
    """For each option the config or the environment set (and no flag overrode), where it came from, as a user
    would find it: ``fsdp2.yaml parallelism_config_cp_size 2``, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4``."""
    said = {name: f"{ENVIRONMENT_FIELDS[name]}={text(getattr(args, name))} in the environment"
            for name, source in sources.items() if source == ENVIRONMENT}
    if config is None:
        return said
    return {**said, **{name: f"{ENVIRONMENT_FIELDS[name]}={text(value)} in {config.source}"
                       if name in ENVIRONMENT_FIELDS else f"{config.source} {FIELDS[name]} {text(value)}"
                       for name, value in config.values.items() if sources.get(name) == "config"}}


ENVIRONMENT = "environment"  # an option's source: a launcher variable the user set (accelerate reads it there)
ENVIRONMENT_FIELDS = {"gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"}


def environment_values() -> dict:
    """The options this process's environment sets as accelerate's ``Accelerator`` would read them, where no
    FSDP config of ``accelerate launch`` carries them already (``from_environment``): a torchrun or plain python
    launch, with or without ``--config_file``."""
    if launched_with_fsdp():
        return {}
    return {name: whole_number(os.environ, key) for name, key in ENVIRONMENT_FIELDS.items() if key in os.environ}


def with_fields(error: UserError, said: dict[str, str]) -> UserError:
    """A refusal that names options the config set, with the config's fields that set them."""
    named = [name for name in said if f"--{name}" in str(error) and said[name] not in str(error)]
    if not named:
        return error
    return UserError(f"{error} ({'; '.join(f'--{name} is {said[name]}' for name in named)})")


def check_num_processes(config: ConfigOptions | None, world_size: int) -> None:
    """A file's num_processes is the world it was written for: a launch of another size would measure another
    world without a word (under accelerate launch the file's is the launch's own)."""
    if config is None or config.num_processes is None or config.num_processes == world_size:
        return
    n = config.num_processes
    raise UserError(f"{config.source}: num_processes {n}, but this launch has {counted(world_size, 'rank')}: launch "
                    f"{n} (torchrun --nproc_per_node {n}, or accelerate launch --config_file {config.source}), or play "
                    f"rank 0 of {n} on one GPU with --simulate_world_size {n}")


def summary_of(config: ConfigOptions | None, sources: dict) -> dict:
    """What summary.json records of it: the config read (None without one) and each option's source."""
    return {"config": None if config is None else config.source, "sources": sources,
            "not_measured": [] if config is None else list(config.not_measured)}


def text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def launched_with_fsdp() -> bool:
    """Launched by ``accelerate launch`` with an FSDP config (it sets ACCELERATE_USE_FSDP then)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def launched_without_fsdp() -> bool:
    """Launched by ``accelerate launch`` with a config of another distributed type (or none)."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ and not launched_with_fsdp()


def file_environment(path: str) -> tuple[dict[str, str], set[str]]:
    """The variables ``accelerate launch --config_file PATH`` would give each rank, made by accelerate's
    own loader and launcher functions (without launching anything), and those the file's FSDP fields set."""
    expect_path(path, "--config_file", "file")
    config = load(path)
    name = os.path.basename(path)
    kind = str(getattr(config, "distributed_type", "")).rpartition(".")[2]
    if kind != "FSDP":
        raise UserError(f"{name}: distributed_type {kind or 'missing'}: the suite measures FSDP2 "
                        "(distributed_type: FSDP, fsdp_version: 2)")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parser = launch_command_parser()
    check_fields(config, name, {action.dest for action in parser._actions} | LAUNCHER_READS)
    if isinstance(config.mixed_precision, bool):  # YAML 1.1 reads an unquoted no, off, yes, on as booleans
        raise UserError(f"{name}: mixed_precision {text(config.mixed_precision)}: YAML reads an unquoted "
                        + ("no, off or false as false; write mixed_precision: 'no'" if not config.mixed_precision else
                           "yes, on or true as true, which is no precision; write mixed_precision: bf16 (or 'no')"))
    if config.mixed_precision is not None:  # else accelerate's launcher takes "no"
        check_precision(str(config.mixed_precision), name, "mixed_precision")
    # One machine, two processes and a free port: the launcher's checks of them do not concern the options.
    argv = ["--config_file", path, "--num_machines", "1", "--machine_rank", "0", "--main_process_port", "0",
            "--num_processes", "2", "main.py"]
    try:  # from the file alone: a variable of this process's own is not the file's (environment_values)
        with quietly(), environment_of({}):
            args = _validate_launch_command(parser.parse_args(argv))[0]
            environment = prepare_multi_gpu_env(args)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise UserError(f"{name}: accelerate refuses it: {first_line(exc)}") from None
    written = {"FSDP_" + launcher_field("fsdp_config", key).removeprefix("fsdp_").upper()
               for key in config.fsdp_config or {}}
    return {k: v for k, v in environment.items() if k.startswith(PREFIXES)}, written, config


# Fields accelerate's launcher reads from a config though it has no flag for them (prepare_multi_gpu_env's getattr).
LAUNCHER_READS = {"fsdp_ignored_modules"}


def launcher_field(section: str, key: str) -> str:
    """A field's name as accelerate's launcher takes it: inside fsdp_config it adds the fsdp_ prefix a field
    written without it lacks (``reshard_after_forward`` is ``fsdp_reshard_after_forward``)."""
    return key if section != "fsdp_config" or str(key).startswith("fsdp") else f"fsdp_{key}"


def whole_or_none(value) -> int | None:
    """A size or count a file gives, where it is a whole positive number as accelerate reads it (its launcher
    passes ``str(value)`` on, read back by ``int()``: 2 and "2", not 2.0 nor true); else None."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number >= 1 else None


def ignored_by_launcher(file) -> tuple[str, ...]:
    """What a file says that would change training memory but that accelerate launch does not apply under
    distributed_type FSDP (a deepspeed_config's accumulation): named, so that none passes without a word."""
    steps = (getattr(file, "deepspeed_config", None) or {}).get("gradient_accumulation_steps")
    if steps is None:
        return ()
    return (f"deepspeed_config gradient_accumulation_steps {steps} (accelerate launch applies a deepspeed_config only "
            f"under distributed_type DEEPSPEED: set --gradient_accumulation_steps {steps}, or "
            f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={steps})",)


def load(path: str):
    """The file through accelerate's config loader (YAML or JSON, its field names checked)."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        with quietly():
            return load_config_from_file(path)
    except (AttributeError, TypeError):  # yaml or json gave something other than a mapping
        raise UserError(f"{os.path.basename(path)}: not an accelerate config: its top level is not a mapping of "
                        "fields (an empty file, or a list)") from None
    except Exception as exc:  # noqa: BLE001 - yaml's, json's and accelerate's own errors: all a file it cannot read
        raise UserError(f"{os.path.basename(path)}: not an accelerate config accelerate can read: "
                        f"{first_line(exc)}") from None


def check_fields(config, name: str, known: set[str]) -> None:
    """The FSDP and parallelism sections are mappings of fields accelerate's launcher knows (it would ignore a
    misspelled one, and measure its default), and the sizes are whole positive numbers (it compares them
    unchecked)."""
    for section in ("fsdp_config", "parallelism_config"):
        fields = getattr(config, section) or {}
        if not isinstance(fields, dict):
            raise UserError(f"{name}: {section} must be a mapping of fields, got {fields!r}")
        unknown = sorted(str(key) for key in fields if launcher_field(section, key) not in known)
        if unknown:
            raise UserError(f"{name}: {section}: {', '.join(unknown)}: not a field accelerate knows "
                            "(accelerate launch would ignore it and take its default)")
    for key, value in (config.parallelism_config or {}).items():  # the launcher passes str(value) on, read by int()
        if str(key).endswith("_size") and whole_or_none(value) is None:
            raise UserError(f"{name}: {key} must be a positive integer, got {value!r}")


def check_precision(value: str, source: str, key: str) -> None:
    if value.lower() not in PRECISIONS:
        raise UserError(f"{source}: {key} {value}: the suite runs 'no' (fp32), bf16 and fp8 (torchao's float8 "
                        "training); fp16 is not measured")
    if value.lower() == "fp8":
        try:
            with quiet_imports():
                import torchao.float8  # noqa: F401
        except ImportError:
            raise UserError(f"{source}: {key} fp8 needs torchao, which cannot be imported here; install it with "
                            f"pip install -r {levers.FLOAT8_REQUIREMENTS}") from None


def lever_values(environment: dict[str, str], source: str) -> dict:
    """``--compile`` from a dynamo_config of accelerate's regional compilation with inductor, ``--float8`` from
    mixed_precision fp8 with torchao (accelerate's AO backend); what the suite cannot mirror refused naming the
    field."""
    values = {}
    if environment.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() != "NO":
        for key, mirrored in DYNAMO_AS_COMPILE.items():
            given = environment.get(key, mirrored).upper()
            if given != mirrored:
                raise UserError(f"{source}: dynamo_config {field_name(key)} {environment[key]}: the suite compiles "
                                f"each block with inductor as accelerate's regional compilation does (dynamo_backend "
                                f"INDUCTOR, dynamo_use_regional_compilation true, dynamo_mode default, no fullgraph, "
                                "no dynamic shapes)")
        values["compile"] = True
    if environment.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "fp8":
        backend = environment.get("ACCELERATE_FP8_BACKEND", "AO")
        if backend.upper() != "AO":
            raise UserError(f"{source}: fp8_config backend {backend}: the suite measures float8 through torchao "
                            "(backend AO), as torchtitan trains it")
        from accelerate.utils import str_to_bool

        if not str_to_bool(environment.get("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "true")):
            raise UserError(f"{source}: fp8_config enable_fsdp_float8_all_gather false: the suite's float8 gathers "
                            "the weights in float8 (accelerate's default)")
        values["float8"] = True
    return values


def from_environment(environment: dict[str, str], source: str, written: set[str] | None = None) -> ConfigOptions:
    """The options accelerate's plugin and ParallelismConfig read from these variables; ``written``: the
    variables the user's file set (None: all of them, as under ``accelerate launch``)."""
    version = environment.get("FSDP_VERSION")
    if version != "2":
        unnamed = version is None or (written is not None and "FSDP_VERSION" not in written)
        said = "no fsdp_version (accelerate then takes 1)" if unnamed else f"fsdp_version {version}"
        raise UserError(f"{source}: {said}: the suite measures FSDP2; set fsdp_version: 2")
    check_precision(environment.get("ACCELERATE_MIXED_PRECISION", "no"), source, "mixed_precision")
    check_booleans(environment, source)
    with environment_of(environment):
        plugin, parallelism = accelerate_objects(environment, source)
    values = {**plugin_values(plugin, environment, source), **layout_values(parallelism, source)}
    values["mixed_precision_policy"] = PRECISIONS[environment.get("ACCELERATE_MIXED_PRECISION", "no").lower()]
    values.update(lever_values(environment, source))
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in environment:
        values["gradient_accumulation_steps"] = whole_number(environment, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    classes = plugin.transformer_cls_names_to_wrap
    return ConfigOptions(source, values, (*not_measured(environment, written), *fsdp1_only(environment, written)),
                         tuple(classes) if classes else None, bool(plugin.cpu_ram_efficient_loading))


def fsdp1_only(environment: dict[str, str], written: set[str] | None) -> tuple[str, ...]:
    """fsdp_sharding_strategy, where a config gives one: FSDP1's field, which accelerate's FSDP2 plugin never reads
    (its launcher sets FULL_SHARD when none is given). Named with what sets the same under FSDP2."""
    strategy = environment.get("FSDP_SHARDING_STRATEGY")
    given = strategy is not None and ("FSDP_SHARDING_STRATEGY" in written if written is not None else
                                      strategy.upper() not in ("FULL_SHARD", "1"))
    if not given:
        return ()
    return (f"fsdp_sharding_strategy {strategy} (FSDP1's: accelerate's FSDP2 plugin does not read it; under FSDP2 "
            "fsdp_reshard_after_forward false is SHARD_GRAD_OP, and parallelism_config_dp_replicate_size HSDP)",)


def accelerate_objects(environment: dict[str, str], source: str):
    """accelerate's FSDP plugin and, where the config has one, its ParallelismConfig, built from the
    environment as ``Accelerator`` builds them; their own refusals said in one line."""
    from accelerate import FullyShardedDataParallelPlugin

    try:
        with quietly():
            plugin = FullyShardedDataParallelPlugin()
            parallelism = None
            if environment.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
                from accelerate import ParallelismConfig

                parallelism = ParallelismConfig()
    except (ValueError, TypeError, KeyError, ImportError) as exc:
        raise UserError(f"{source}: accelerate refuses it: {first_line(exc)}") from None
    return plugin, parallelism


def plugin_values(plugin, environment: dict[str, str], source: str) -> dict:
    """The FSDP2 plugin's fields the variants apply, after refusing what they cannot mirror."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin.auto_wrap_policy is not transformer_auto_wrap_policy:
        policy = environment.get("FSDP_AUTO_WRAP_POLICY")
        said = f"fsdp_auto_wrap_policy {policy}" if policy else \
            "no fsdp_auto_wrap_policy (accelerate then wraps nothing but the whole model)"
        raise UserError(f"{source}: {said}: the suite measures one FSDP unit per transformer block; set "
                        "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP (what accelerate config writes)")
    if plugin.ignored_modules:
        raise UserError(f"{source}: fsdp_ignored_modules {plugin.ignored_modules}: the suite shards every module")
    return {"reshard_after_forward": bool(plugin.reshard_after_forward),
            "activation_checkpointing": FULL_AC if plugin.activation_checkpointing else NO_AC,
            "activation_checkpointing_offload": bool(getattr(plugin, "activation_checkpointing_offload", False)),
            "cpu_offload": isinstance(plugin.cpu_offload, CPUOffloadPolicy)}


def layout_values(parallelism, source: str) -> dict:
    """ParallelismConfig's sizes as main.py's layout flags: all of them, so that they must multiply to the
    world size as accelerate requires."""
    if parallelism is None:
        return {}
    if getattr(parallelism, "sp_size", 1) > 1:
        raise UserError(f"{source}: parallelism_config_sp_size {parallelism.sp_size}: sequence parallelism "
                        "(DeepSpeed's) is not measured")
    values = {"dp_replicate_size": parallelism.dp_replicate_size, "dp_shard_size": parallelism.dp_shard_size,
              "cp_size": parallelism.cp_size, "tp_size": parallelism.tp_size}
    strategy = getattr(parallelism.cp_handler, "cp_comm_strategy", None) if parallelism.cp_size > 1 else None
    if strategy is not None:
        if strategy not in CP_STRATEGIES:
            raise UserError(f"{source}: parallelism_config_cp_comm_strategy {strategy}: one of "
                            f"{', '.join(CP_STRATEGIES)}")
        values["cp_comm_strategy"] = strategy
    return values


def check_booleans(environment: dict[str, str], source: str) -> None:
    """Each true/false field as accelerate's ``str_to_bool`` takes it, refused naming the field otherwise."""
    from accelerate.utils import str_to_bool

    for key in ("FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS", "FSDP_ACTIVATION_CHECKPOINTING",
                "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        if key in environment:
            try:
                str_to_bool(environment[key])
            except ValueError:
                raise UserError(f"{source}: {field_name(key)} must be true or false, got "
                                f"{environment[key]!r}") from None


def whole_number(environment: dict[str, str], key: str) -> int:
    """A launcher variable of a whole positive number (one ``Accelerator`` reads from the environment)."""
    try:
        value = int(environment[key])
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{key} in the environment must be a positive integer, got {environment[key]!r}")
    return value


def not_measured(environment: dict[str, str], written: set[str] | None) -> tuple[str, ...]:
    """The config's fields that the suite does not mirror because they do not change training memory."""
    return tuple(f"{field_name(key)} ({why})" for key, why in NOT_MEASURED.items()
                 if key in environment and (written is None or key in written))


def field_name(key: str) -> str:
    """The config file's name of a launcher variable (FSDP_RESHARD_AFTER_FORWARD: fsdp_reshard_after_forward)."""
    return key.removeprefix("ACCELERATE_").lower()


def first_line(exc: BaseException) -> str:
    """An error's message on one line (YAML's span several: what it expected, and where)."""
    said = " ".join(str(exc).split()) or type(exc).__name__
    return said if len(said) <= 240 else said[:237] + "..."


def environment_of(variables: dict[str, str]) -> contextlib.AbstractContextManager:
    """These launcher variables in place of this process's own while accelerate reads them."""
    return environment_changed({**{key: None for key in os.environ if key.startswith(PREFIXES)},
                                **{key: value for key, value in variables.items() if key.startswith(PREFIXES)}})


# What ``Accelerator()`` and its dynamo plugin would take from a launch's environment over the arguments the
# accelerate variant gives them (the gradient accumulation steps, a ParallelismConfig where it is given none, how
# to compile): the options already hold the config's values, with the flags over them.
OVERRIDING = ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_USE_PARALLELISM_CONFIG",
              *(f"ACCELERATE_DYNAMO_{name}" for name in ("BACKEND", "MODE", "USE_FULLGRAPH", "USE_DYNAMIC",
                                                         "USE_REGIONAL_COMPILATION")))


def options_alone() -> contextlib.AbstractContextManager:
    """Without the launcher's variables that ``Accelerator()`` would put over the options it is given."""
    return environment_changed(dict.fromkeys(OVERRIDING))


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """accelerate's warnings and prints about the launch it is not making."""
    import logging

    accelerate_log = logging.getLogger("accelerate")
    level = accelerate_log.level
    accelerate_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        accelerate_log.setLevel(level)
