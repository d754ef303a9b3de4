"""Every mistake of a config at once: where each key was given (a TOML file's line, or ``--set``)
and the closest known key to a misspelt one."""

from __future__ import annotations

import difflib
import re

from raytrain_hybrid.errors import ConfigError

_TABLE = re.compile(r"^\[\[?\s*([^\]]+?)\s*\]\]?")
_KEY = re.compile(r"""^((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def _dotted(text: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in text.split("."))


def key_lines(text: str) -> dict[str, int]:
    """The line of each dotted key (and table) a TOML text sets, as a reader finds it; a key inside
    a multi-line string or array may be missed, never invented (those lines are not ``key =``)."""
    lines: dict[str, int] = {}
    table, open_brackets = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if open_brackets > 0:  # inside a multi-line array
            open_brackets += line.count("[") - line.count("]")
            continue
        if not line or line.startswith("#"):
            continue
        if match := _TABLE.match(line):
            table = _dotted(match.group(1))
            lines.setdefault(table, number)
            continue
        if match := _KEY.match(line):
            key = f"{table}.{_dotted(match.group(1))}" if table else _dotted(match.group(1))
            lines.setdefault(key, number)
            rest = line[match.end() :]
            open_brackets = max(0, rest.count("[") - rest.count("]"))
    return lines


def closest(name: str, known: list[str]) -> list[str]:
    """The known names closest to ``name`` (none when none is close: difflib's ratio under 0.6);
    of those equally close, the ones with its first letter (``dpp``: ``dp``, not ``pp``), else all."""
    found = difflib.get_close_matches(name, known, n=len(known) or 1)
    ratio = lambda k: difflib.SequenceMatcher(None, name, k).ratio()  # noqa: E731
    best = sorted(k for k in found if ratio(k) == ratio(found[0]))
    return [k for k in best if k[:1] == name[:1]] or best


class ConfigErrors(ConfigError):
    """Several mistakes, each with where it was given: the first one's key, value and fix are
    this error's (what code reading one error sees); its message lists them all."""

    def __init__(self, errors: list[ConfigError], where: list[str]) -> None:
        first = errors[0]
        super().__init__(first.key, first.value, first.fix)
        said = [f"{e} ({w})" if w else str(e) for e, w in zip(errors, where, strict=True)]
        if len(said) == 1:
            message = said[0]
        else:
            message = f"{len(said)} mistakes in the config:\n" + "\n".join(f"  {s}" for s in said)
        self.errors = errors
        self.args = (message,)


def located(errors: list[ConfigError], path: str | None, lines: dict[str, int], overridden: set[str]) -> ConfigErrors:
    """``errors`` with where each key was given: ``FILE:LINE`` (the key's own line, or its table's);
    nothing for a --set (the command line names it)."""
    where = []
    for err in errors:
        key = str(err.key)
        if key in overridden or any(key.startswith(f"{k}.") for k in overridden):
            where.append("")  # a --set: the command line names it
            continue
        parts = key.split(".")
        line = next((lines[".".join(parts[:n])] for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in lines), 0)
        where.append(f"{path}:{line}" if path and line else path or "")
    return ConfigErrors(errors, where)
