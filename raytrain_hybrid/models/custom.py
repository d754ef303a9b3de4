"""Your own model: a transformers-compatible causal LM, registered from Python.

A model that is not on the Hub trains like any transformers decoder when it is written the way
transformers' own are (a ``PretrainedConfig`` with a ``model_type``, ``base_model_tp_plan`` and
``base_model_pp_plan``; a ``PreTrainedModel`` causal LM whose base model holds the embedding, the
block list and the final norm the pipeline plan names) and registered with transformers' Auto
classes, which ``register_model`` does. The registration is recorded by the classes' import paths,
and every Ray Train worker makes it again before it reads the run's config (launch.runtime.entry), so the
classes must live in a module the workers can import (not ``__main__``).
"""

from __future__ import annotations

import importlib

from raytrain_hybrid.errors import ConfigError

_REGISTERED: dict[str, tuple[str, str, str, str]] = {}


def _where(cls: type) -> tuple[str, str]:
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ConfigError(
            "register_model",
            cls.__qualname__,
            "must be defined at the top level of an importable module (workers import it by name), "
            "not in __main__ or inside a function",
        )
    return cls.__module__, cls.__qualname__


def register_model(config_class: type, model_class: type) -> str:
    """Register a causal LM with transformers' Auto classes for training; returns its model_type.

    Args:
        config_class: a ``transformers.PretrainedConfig`` subclass with a ``model_type`` and the
            ``base_model_tp_plan`` / ``base_model_pp_plan`` its model follows.
        model_class: the ``transformers.PreTrainedModel`` causal LM built from it.

    Returns:
        The model_type: ``model.arch`` for random weights, or a checkpoint's config.json names it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    if not (isinstance(config_class, type) and issubclass(config_class, PretrainedConfig)):
        raise ConfigError("register_model", repr(config_class), "config_class must be a PretrainedConfig subclass")
    if not (isinstance(model_class, type) and issubclass(model_class, PreTrainedModel)):
        raise ConfigError("register_model", repr(model_class), "model_class must be a PreTrainedModel subclass")
    model_type = getattr(config_class, "model_type", "")
    if not model_type:
        raise ConfigError("register_model", config_class.__qualname__, "has no model_type")
    entry = (*_where(config_class), *_where(model_class))
    AutoConfig.register(model_type, config_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    _REGISTERED[model_type] = entry
    _forget(model_type)
    from raytrain_hybrid.models import generic

    why = generic.refusal(model_type)
    if why:
        raise ConfigError("register_model", model_type, why)
    return model_type


def _forget(model_type: str) -> None:
    """Caches that may have seen the name before it was registered."""
    from raytrain_hybrid.models import generic, generic_facts, get_arch

    generic_facts.overridden(model_type)
    generic.classes.cache_clear()
    generic.pp_names.cache_clear()
    generic_facts.pre_norm.cache_clear()
    get_arch.cache_clear()


def registered() -> list[tuple[str, str, str, str]]:
    """What this process registered, by import path: what workers register again (launch.runtime.entry)."""
    return list(_REGISTERED.values())


def restore(entries) -> None:
    """Register again, in this process, what ``registered()`` listed in another."""
    for config_module, config_name, model_module, model_name in entries or ():
        config_class = _load(config_module, config_name)
        model_class = _load(model_module, model_name)
        register_model(config_class, model_class)


def _load(module: str, qualname: str) -> type:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
