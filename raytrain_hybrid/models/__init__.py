"""Architecture registry: per architecture, data (TP plan, stage boundaries) and a stage forward.

Model code stays the unmodified ``transformers`` modules; parallelism is applied
from outside, driven by the :class:`ArchSpec` of the architecture.
"""

from __future__ import annotations

import functools
import importlib

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models.spec import ArchSpec

# Architecture name -> the module that defines its SPEC. A module is imported when its
# architecture is first asked for (GPT-2's and the classifier's import torch and transformers; the
# Llama family's name its transformers classes, see spec.TransformersClass), so the names cost nothing.
_MODULES = {
    "llama": "llama",
    "qwen3-moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gpt2": "gpt2",
    "multimodal-bert": "multimodal_bert",
}


ARCH_NAMES = tuple(_MODULES)
# The checkpoint model_types the hand-written language-model specs read (each spec's hf_model_types,
# held equal by a test): a checkpoint's family is found without importing every spec (GPT-2's
# imports torch and transformers, seconds of a `check`).
HAND_MODEL_TYPES = {
    "llama": "llama",
    "qwen3_moe": "qwen3-moe",
    "mixtral": "mixtral",
    "gpt2": "gpt2",
}

# The model matrix (scripts/model_matrix.py) holds the hand-written families on the generic path
# too, to show it gives their result: this variable names the model types it trains so. Users have
# no reason to set it (a hand-written spec resolves a config without importing torch or transformers).
GENERIC_PATH_ENV = "RAYTRAIN_GENERIC_PATH"


def _hand(name: str) -> bool:
    import os

    return name in _MODULES and name not in os.environ.get(GENERIC_PATH_ENV, "").split(",")


def hand_arch_of(model_type: str) -> str | None:
    """The hand-written architecture that trains checkpoints of ``model_type`` (None: the generic
    path does, or the family is none of ours)."""
    name = HAND_MODEL_TYPES.get(model_type)
    return name if name is not None and _hand(name) else None


def is_arch(name: str) -> bool:
    """A hand-written architecture, or a transformers decoder family the generic path trains."""
    if _hand(name):
        return True
    from raytrain_hybrid.models import generic

    return generic.is_generic(name)


def arch_refusal(name: str) -> str | None:
    """Why ``name`` is no architecture here (the family's own reason where transformers has it), with
    what would work; None: it is one."""
    if _hand(name):
        return None
    from raytrain_hybrid.models import generic

    try:
        why = generic.refusal(name)
    except Exception:  # noqa: BLE001 - not a name transformers knows
        why = "is not a transformers model_type"
    if not why:
        return None
    return f"{why}; use one of {sorted(_MODULES)} or a transformers decoder model_type (docs/models.md)"


def get_arch(name: str) -> ArchSpec:
    return _get_arch(name, _hand(name))


get_arch.cache_clear = lambda: _get_arch.cache_clear()  # (models.custom: a registered family anew)


@functools.cache
def _get_arch(name: str, hand: bool) -> ArchSpec:
    if hand:
        return importlib.import_module(f"raytrain_hybrid.models.{_MODULES[name]}").SPEC
    why = arch_refusal(name)
    if why:
        raise ConfigError("model.arch", name, why)
    from raytrain_hybrid.models import generic

    return generic.spec(name)


def arch_names(task: str) -> tuple[str, ...]:
    """The architectures of one task ("lm" or "classify"), in registry order."""
    return tuple(name for name in ARCH_NAMES if get_arch(name).task == task)


__all__ = [
    "ARCH_NAMES",
    "HAND_MODEL_TYPES",
    "ArchSpec",
    "arch_names",
    "arch_refusal",
    "get_arch",
    "hand_arch_of",
    "is_arch",
]
