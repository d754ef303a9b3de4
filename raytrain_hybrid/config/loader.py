"""A run's configuration: a TOML file plus repeatable ``--set key=value`` overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from raytrain_hybrid.config.coerce import build_section
from raytrain_hybrid.config.defaults import resolve_defaults
from raytrain_hybrid.config.nesting import MAX_DEPTH, too_deep
from raytrain_hybrid.config.placeholders import refuse_placeholders
from raytrain_hybrid.config.report import key_lines, located
from raytrain_hybrid.config.schema import Config
from raytrain_hybrid.config.validate import validate
from raytrain_hybrid.errors import ConfigError


def _set_nested(tree: dict[str, Any], dotted: str, value: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(dotted, value, f"{part} is a value, not a section")
        node = child
    node[parts[-1]] = value


_TOO_DEEP = f"nests arrays or tables deeper than a config does (at most {MAX_DEPTH} levels)"


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, item, "a --set needs the form key=value, e.g. parallelism.tp=2")
        key, value = item.split("=", 1)
        if key.count(".") >= MAX_DEPTH:  # a section.key is one dot; a merge of thousands would recurse
            raise ConfigError(f"{key[:80]}...", "", f"is not a key: {_TOO_DEEP}")
        _set_nested(tree, key.strip(), value.strip())
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, unverified: list[str] | None = None
) -> Config:
    """Read a TOML file (or the defaults), apply ``--set`` overrides, resolve the defaults that
    depend on other keys, validate everything.

    Args:
        path: a TOML config file; None for the built-in defaults (the tiny 3D-parallel example).
        overrides: ``KEY=VALUE`` strings, as the CLI's ``--set`` takes them.
        unverified: a list (for ``check``): what could not be read here (a checkpoint's
            config.json without a network or credentials) is noted there, and the rest
            validated, instead of refused.

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: every mistake of the file and the overrides at once, each where it was given.
    """
    data: dict[str, Any] = {}
    text = ""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config file", str(path), "does not exist; pass a TOML file or omit it for the defaults")
        try:
            text = path.read_text(encoding="utf-8")
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config file", str(path), f"is not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError("config file", str(path), f"is not UTF-8 text (TOML is): {exc}") from None
        except RecursionError:  # tomllib parses nested arrays and inline tables by recursion
            raise ConfigError("config file", str(path), _TOO_DEEP) from None
        if where := too_deep(data):
            raise ConfigError("config file", str(path), f"{_TOO_DEEP} (at {where[:200]})")
    data = _merge(data, parse_overrides(overrides or []))
    # Every mistake of the file and the --set values at once, each where it was given.
    errors: list[ConfigError] = []
    cfg = build_section(Config, data, prefix="", errors=errors)
    if errors:
        given = {item.split("=", 1)[0].strip() for item in overrides or []}
        raise located(errors, str(path) if path is not None else None, key_lines(text), given)
    # The model keys the file or --set name: each must agree with a pretrained checkpoint's.
    refuse_placeholders(cfg)  # before resolving reads model.pretrained: <path-to-model-dir> is no path
    cfg = resolve_defaults(cfg, given=set(data.get("model") or {}), unverified=unverified)
    validate(cfg)
    return cfg
