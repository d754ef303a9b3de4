"""How deep a parsed file nests, found without recursion: a TOML config or a JSON manifest nested
thousands deep would make any recursive walk of it (the credential check, a merge, a compare)
end in a RecursionError instead of a refusal."""

from __future__ import annotations

from typing import Any

# A config is sections of keys whose values are at most lists of scalars; a manifest nests a few
# levels more (config, its sections, files). Far below Python's recursion limit.
MAX_DEPTH = 32


def too_deep(tree: Any, limit: int = MAX_DEPTH) -> str | None:
    """The dotted path (list items as [i]) to the first value nested more than ``limit`` deep
    in dicts and lists, or None."""
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > limit:
            return where or "<top>"
        if isinstance(node, dict):
            stack += [(v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node)]
    return None
