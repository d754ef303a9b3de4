"""The submit line in a jobs/ config's header, as a test reads it: the `ray job submit ...` command
the header shows (comment markers and line continuations dropped), its `--set` overrides, and
those with each `<...>` placeholder filled in as a user would (a bucket name for <your-bucket>)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from raytrain_hybrid.config.placeholders import PLACEHOLDER

# What a test writes where a header says <name>: a value of the right shape that is not a placeholder.
FILL = {"your-bucket": "example-bucket"}


def submit_argv(path: str | Path) -> list[str]:
    """The header's `ray job submit` command as argv (the comment lines from it to the first
    line without a trailing backslash; environment assignments before it dropped)."""
    lines = [ln.removeprefix("#").strip() for ln in Path(path).read_text().splitlines() if ln.startswith("#")]
    start = next((i for i, ln in enumerate(lines) if "ray job submit " in ln), None)
    assert start is not None, f"{path}: its header shows the `ray job submit` line that runs it"
    lines[start] = lines[start][lines[start].index("ray job submit ") :]
    command = []
    for line in lines[start:]:
        command.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(command))


def submit_sets(path: str | Path) -> list[str]:
    """The `--set key=value` overrides of the header's submit line, placeholders as written."""
    argv = submit_argv(path)
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]


def filled(value: str) -> str:
    """``value`` with every <name> replaced as a user would fill it in."""
    return PLACEHOLDER.sub(lambda m: FILL.get(m[1], f"filled-{m[1]}"), value)


def submit_overrides(path: str | Path) -> list[str]:
    """The header's --set overrides with the placeholders filled in: what a test passes to load
    a job file the way its documented submit line runs it."""
    return [filled(kv) for kv in submit_sets(path)]


def placeholder_keys(path: str | Path) -> set[str]:
    """The ``section.key`` names whose value in the file's TOML holds a <...> placeholder."""
    import tomllib

    data = tomllib.loads(Path(path).read_text())
    return {
        f"{section}.{key}"
        for section, values in data.items()
        for key, value in values.items()
        if re.search(PLACEHOLDER, str(value))
    }
