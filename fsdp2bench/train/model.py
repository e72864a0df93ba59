"""Built-in model shapes (no run needs the Hub) and building a model from a config."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

import utils
from fsdp2bench.cli import UserError, from_hub, one_line, quietly_import_models, say
from fsdp2bench.files import expect_path, looks_like_a_path
from fsdp2bench.options.tuning import Tuning, add_adapters
from fsdp2bench.train.weights import SharedWeights, give_weights

# Built-in model shapes, so that no run needs the Hub: each its model type and the published config's shapes.
PRESETS: dict[str, dict] = {
    # tiny: odd sizes on purpose, so that sharding needs padding at any N > 1.
    "tiny": dict(vocab_size=509, hidden_size=64, intermediate_size=170, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 max_position_embeddings=2048),
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True,
                  max_position_embeddings=4096),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                       max_position_embeddings=32768),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False,
                        max_position_embeddings=32768),
    "qwen2.5-72b": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
                        max_position_embeddings=32768),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False, max_position_embeddings=131072),
    "llama-3.1-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          tie_word_embeddings=False, max_position_embeddings=131072),
}
COMMON = {  # what a model type's published configs share
    "qwen2": dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, hidden_act="silu", use_cache=False),
    "llama": dict(head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5, hidden_act="silu", use_cache=False,
                  attention_bias=False, mlp_bias=False, rope_scaling={
                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
}


def preset_config(name: str):
    from transformers import AutoConfig

    fields = dict(PRESETS[name])
    model_type = fields.pop("model_type", "qwen2")
    return AutoConfig.for_model(model_type, **fields, **COMMON[model_type])


def load_config(model: str):
    """A preset name, a local directory with config.json, or a Hub id (needs the network)."""
    from transformers import AutoConfig

    if model in PRESETS:
        return preset_config(model)
    if looks_like_a_path(model):
        expect_path(model, "--model", "directory")
    if os.path.isdir(model):
        check_config_file(model)
        try:
            config = AutoConfig.from_pretrained(model)
        except Exception as exc:  # an unknown model_type, a field transformers refuses...
            raise UserError(f"--model {model}: transformers cannot read its config.json ({one_line(exc)})") from None
    else:
        config = from_hub(AutoConfig.from_pretrained, model, "--model",
                          f"not a preset ({', '.join(PRESETS)}), not a local directory", "config.json")
    check_causal_lm(model, config)
    config.use_cache = False
    return config


def check_config_file(directory: str) -> None:
    """What transformers would report with a traceback: no file, no JSON, no model type."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--model {directory}: directory has no config.json")
    try:
        with open(path) as f:
            fields = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--model {directory}: config.json is not valid JSON ({one_line(exc)})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise UserError(f"--model {directory}: config.json has no model_type")


def check_causal_lm(model: str, config) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"--model {model}: a {config.model_type} model is not a causal language model "
                        "(transformers has no AutoModelForCausalLM for it)")


def build_model(config, device: torch.device, seed: int, threads: int = 1, weights: SharedWeights | None = None,
                tuning: Tuning = Tuning(), run_device: torch.device | None = None) -> tuple[nn.Module, str]:
    """Random fp32 weights, built directly on ``device``: same seed, same weights on every rank; then the adapters
    ``tuning`` asks for (tuning.add_adapters; a QLoRA base quantized on ``run_device``, by default ``device``). On
    the CPU the weights are drawn on ``threads`` threads (``random_init``), once per rank where ``weights`` is given
    (weights.py). Also returns where the weights came from: "drew", "mapped" (drawn by an earlier variant of this
    rank) or "own"."""
    model, source = build_base_model(config, device, seed, threads, weights)
    return add_adapters(model, tuning, seed, run_device or device), source


def build_base_model(config, device: torch.device, seed: int, threads: int,
                     weights: SharedWeights | None) -> tuple[nn.Module, str]:
    from transformers import AutoModelForCausalLM

    quietly_import_models()
    torch.manual_seed(seed)
    if device.type != "cpu":
        with device:
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32), "own"
    model = build_empty(config)  # drawn into below, or mapped from the weights an earlier variant drew

    def draw(named: list) -> None:
        random_init(named, getattr(config, "initializer_range", 0.02), seed, threads)

    source = give_weights(model, weights, draw, threads) if weights is not None else None
    if source is None:
        materialize(model, device)
        draw(list(model.named_parameters()))
    return model, source or "own"


def build_empty(config) -> nn.Module:
    """Parameters on the meta device, no memory (buffers such as rotary frequencies computed on the CPU): sharded
    first, then only each rank's shards get storage (``utils.materialize_shards``, ``loading``'s modes)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    quietly_import_models()
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # re-registering parameters on meta unties them; FSDP2 must see one shared tensor
    return model


def build_for_run(config, init_device: str, device: torch.device, seed: int, threads: int,
                  weights: SharedWeights | None, tuning: Tuning = Tuning()) -> tuple[nn.Module, str]:
    """The model as ``--init_device`` asks: on the CPU, on the GPU, or empty on meta (then sharded, and each rank
    draws its own shards; with adapters each unit drawn whole as it is sharded: ``utils.unit_by_unit``); with the
    adapters ``tuning`` asks for, a QLoRA base quantized on ``device`` (under meta, unit by unit)."""
    if init_device == "meta":
        torch.manual_seed(seed)
        return add_adapters(build_empty(config), tuning, seed, torch.device("meta")), "own"
    return build_model(config, device if init_device == "cuda" else torch.device("cpu"), seed, threads, weights,
                       tuning, device)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Memory for the meta parameters (untouched pages: no RSS until written), buffers kept."""
    utils.give_shards_storage(model, device)
    model.tie_weights()  # to_empty gives tied parameters separate storage


INIT_CHUNK = 1 << 24  # elements drawn by one task: one generator per chunk keeps the result thread-independent


def random_init(named: list, std: float, seed: int, threads: int) -> None:
    """transformers' initialisation of these decoders (weights ~ N(0, std), norm scales 1, biases 0)
    into ``named``, a model's (name, parameter) pairs in ``named_parameters`` order, or views in that
    order. Drawn in parallel: one thread draws about 140 M numbers a second, so 1.5 B parameters took
    20-26 s with the one thread torchrun gives a process. Each chunk has its own generator, seeded
    from the parameter's and the chunk's index, so the weights do not depend on ``threads``."""
    tasks = []
    with torch.no_grad():
        for index, (name, param) in enumerate(named):
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                flat = param.view(-1)
                tasks += [(index, start, flat[start:start + INIT_CHUNK]) for start in range(0, flat.numel(), INIT_CHUNK)]

    def draw(task) -> None:
        index, start, chunk = task
        generator = torch.Generator().manual_seed((seed * 1_000_003 + index) * 1_000_003 + start // INIT_CHUNK)
        with torch.no_grad():
            chunk.normal_(0.0, std, generator=generator)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(draw, tasks))


def layer_class_names(model: nn.Module) -> list[str]:
    """The transformer block classes to shard one by one (what accelerate's auto-wrap uses too)."""
    names = sorted(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise UserError(f"{type(model).__name__} names no transformer block class (_no_split_modules), so "
                        "FSDP2 cannot shard it block by block")
    return names


def check_units_own_their_parameters(name: str, model: nn.Module, layer_classes: list[str]) -> None:
    """Each parameter in one FSDP2 unit (a block, or the root for everything outside the blocks): a
    tensor tied across two units cannot be sharded by both (tied embeddings both sit in the root)."""
    blocks = [prefix for prefix, m in model.named_modules() if type(m).__name__ in layer_classes]
    units: dict[int, set[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        unit = max((b for b in blocks if param_name.startswith(b + ".")), key=len, default="the root")
        units.setdefault(id(param), set()).add(unit)
    shared = next((sorted(u) for u in units.values() if len(u) > 1), None)
    if shared:
        raise UserError(f"--model {name}: a parameter is tied across the units {', '.join(shared)}; FSDP2 shards "
                        "each unit's parameters separately and cannot shard one tensor in two units")


def build_meta_model(name: str, config, seed: int, tuning: Tuning = Tuning()) -> nn.Module:
    """The model's shapes without its memory (adapters included); a config transformers cannot build is the user's
    to fix."""
    try:
        return build_model(config, torch.device("meta"), seed, tuning=tuning)[0]
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"--model {name}: transformers cannot build it ({one_line(exc)})") from None


def max_positions(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 0)


GPU_DEFAULT_MODEL, CPU_DEFAULT_MODEL = "qwen2.5-1.5b", "tiny"


def default_model(device_type: str) -> str:
    """The upstream's model on GPUs; on a CPU run a model that runs in minutes (``say_default_model``)."""
    return GPU_DEFAULT_MODEL if device_type == "cuda" else CPU_DEFAULT_MODEL


def say_default_model(device_type: str, said: str | None = None) -> None:
    """That a CPU run took the small default model, in one line from the first rank (by default main.py's): once the
    command line is accepted, so that a refusal stays its own one line."""
    if device_type != "cuda" and os.environ.get("RANK", "0") == "0":
        say(said or f"No --model given and no GPU: main.py takes the {CPU_DEFAULT_MODEL} model, a functional run of a "
            f"few minutes on 2 cores (measured and dated: docs/results-overview.md). The real one on the CPU (hours): "
            f"add --model {GPU_DEFAULT_MODEL}.")
        sys.stdout.flush()
