"""Typed values from TOML or ``--set`` strings, checked against a section's annotations."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from raytrain_hybrid.errors import ConfigError, has_credentials, redact


def choices(values) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def divisors(n: int, limit: int = 1 << 16) -> list[int]:
    """The divisors of ``n`` up to ``limit`` (and ``n`` itself): what an error suggests. Bounded,
    so a huge value in a config (or a checkpoint's) is refused at once, not after 2**63 steps."""
    small = [d for d in range(1, min(n, limit) + 1) if n % d == 0]
    return small + ([n] if n > limit else [])


def _section_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check (and, for strings from --set, convert) one value against its annotation."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(key, value, f"must be one of {choices(allowed)}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", "auto"))):
            return None
        if len(args) == 1 and not (optional and args[0] is bool):
            return _coerce(key, value, args[0])
        # A choice between types (bool | Literal["selective"]): the first that takes the value.
        for arg in args:
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        named = [v for a in args for v in ((False, True) if a is bool else typing.get_args(a))]
        named += ["auto"] if optional else []
        raise ConfigError(key, value, f"must be one of {choices(str(v).lower() for v in named)}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(key, value, "must be a boolean (true or false)")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(key, value, "must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(key, value, "must be an integer")
    if annotation is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(key, value, "must be a number")
        if not math.isfinite(number):  # TOML's nan/inf, --set x=nan: a NaN trains to NaN weights
            raise ConfigError(key, value, "must be a finite number (nan and inf are refused)")
        return number
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "must be a string")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, str):  # from --set: "a,b" or "[a, b]"
            text = value.strip().removeprefix("[").removesuffix("]")
            value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(key, value, "must be a list, e.g. [a, b] in TOML or a,b with --set")
        return [_coerce(key, v, item) for v in value]
    raise TypeError(f"unsupported annotation {annotation!r} for {key}")


MAX_VALUE_CHARS = 65_536  # a path or URI is at most 4,096 on Linux; no config value comes near


def refuse_credentials(key: str, value: Any) -> None:
    """A URI holding credentials (``s3://KEY:SECRET@bucket``, ``?X-Amz-Signature=``) in any value,
    nested ones included: refused naming the key, the URI shown without them. Credentials come
    from the environment (AWS_ACCESS_KEY_ID, ..., instance roles), never from a config: a config
    is copied into config.json, the checkpoint manifests, the tracker's params and errors.
    A string longer than any the trainer takes is refused first, by its length, not shown."""
    if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
        raise ConfigError(
            key,
            f"<{len(value):,} characters>",
            f"is longer than any value the trainer takes (at most {MAX_VALUE_CHARS:,})",
        )
    if isinstance(value, str) and has_credentials(value):
        raise ConfigError(
            key,
            redact(value),
            "holds credentials in the URI (user:password@ or a secret parameter), which would be copied into "
            "logs and the files a run writes (config.json, checkpoint manifests); remove them and give them in "
            "the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, an instance role, "
            "GOOGLE_APPLICATION_CREDENTIALS)",
        )
    if isinstance(value, dict):
        for k, v in value.items():
            refuse_credentials(f"{key}.{k}", v)
    elif isinstance(value, list):
        for v in value:
            refuse_credentials(key, v)


def build_section(cls: type, data: dict[str, Any], prefix: str, errors: list[ConfigError] | None = None):
    """``cls`` built from ``data``. ``errors`` (a list): every mistake is appended there and the
    section built from the keys that work (their defaults for the others), so that a config's
    mistakes are said at once; without it the first is raised."""
    collect: list[ConfigError] = [] if errors is None else errors
    before = len(collect)
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "<config>", data, "must be a table of keys")
    hints = _section_types(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        try:
            refuse_credentials(full, value)  # first: no other error may show the value
            if key not in known:
                raise ConfigError(full, value, _unknown(key, prefix, known))
            annotation = hints[key]
            if dataclasses.is_dataclass(annotation):
                kwargs[key] = build_section(annotation, value, f"{full}.", errors)
            else:
                kwargs[key] = _coerce(full, value, annotation)
        except ConfigError as exc:
            if errors is None:
                raise
            collect.append(exc)
    while True:  # the section's own checks (__post_init__): each field that fails is said, then left out
        try:
            section = cls(**kwargs)
            break
        except ConfigError as exc:
            if errors is None:
                raise
            collect.append(exc)
            name = str(exc.key).removeprefix(prefix)
            if name not in kwargs:  # a check across the section's keys: the section's defaults
                kwargs = {}
            kwargs.pop(name, None)
    if errors is None and len(collect) > before:
        raise collect[before]
    return section


def _unknown(key: str, prefix: str, known: set[str]) -> str:
    """What an unknown key is told: the closest known key of its section, else the section's keys."""
    from raytrain_hybrid.config.report import closest

    near = closest(key, sorted(known))
    if near:
        return f"is not a known key; did you mean {' or '.join(prefix + k for k in near)}?"
    return f"is not a known key; known keys here: {choices(sorted(known))}"
