"""Where a generic family's parameters lie in its Hugging Face checkpoint.

transformers 5 builds some modules in another layout than its checkpoints store (a mixture of
experts' stacked ``experts.gate_up_proj`` [E, 2F, H] is every expert's ``gate_proj`` and
``up_proj`` in the files; Mixtral's ``block_sparse_moe`` is ``mlp`` in the model) and converts on
load, by the family's conversion mapping (``transformers.conversion_mapping``). The engine reads
each rank's slices straight from the files, so it runs the mapping backwards: renamings undone,
and a stacked weight read as one slice per expert and source (``MergeModulelist`` along the
experts, ``Concatenate`` of the sources along dim 1). A mapping with other operations is not
read here: its tensors are not found, and loading says so naming the tensor.
"""

from __future__ import annotations

import functools
import re

# config.json keys that count a mixture of experts' routed experts, by family.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_SIMPLE = re.compile(r"^\^?(?:[\w.]|\\\.)+$")  # a regex that is a literal dotted name


def _literal(pattern: str) -> str | None:
    """The text a simple regex matches (``\\.`` unescaped, ``^`` dropped), or None."""
    return pattern.lstrip("^").replace("\\.", ".") if _SIMPLE.match(pattern) else None


@functools.cache
def _mapping(model_type: str) -> tuple:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversion mappings: names are the files'
        return ()
    return tuple(get_checkpoint_conversion_mapping(model_type) or ())


def _renamings(model_type: str) -> list[tuple[str, str]]:
    """(model text, checkpoint text) pairs of the mapping's plain renamings."""
    out = []
    for conv in _mapping(model_type):
        if type(conv).__name__ != "WeightRenaming":
            continue
        for src, dst in zip(conv.source_patterns, conv.target_patterns, strict=False):
            a, b = _literal(dst), _literal(src)
            if a and b:
                out.append((a, b))
    return out


def checkpoint_names(model_type: str, name: str) -> tuple[str, ...]:
    """``name`` as the files may spell it: itself, and with each renaming undone."""
    names = [name]
    for model_text, file_text in _renamings(model_type):
        if model_text in name:
            names.append(name.replace(model_text, file_text))
    return tuple(dict.fromkeys(names))


def experts(conf: dict) -> int:
    return next((int(conf[k]) for k in _EXPERT_KEYS if conf.get(k)), 0)


def stacked(model_type: str, name: str, conf: dict) -> list | None:
    """A stacked weight's pieces [(checkpoint key, (expert, rows))], or None: not a stacked one."""
    for conv in _mapping(model_type):
        if type(conv).__name__ != "WeightConverter":
            continue
        ops = [type(op).__name__ for op in conv.operations]
        if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            continue
        for target in conv.target_patterns:
            tail = _literal(target)
            if not tail or not name.endswith(tail.lstrip(".")):
                continue
            prefix = name[: len(name) - len(tail.lstrip("."))].rstrip(".")
            sources = list(conv.source_patterns)
            pieces = []
            for e in range(experts(conf)):
                for j, src in enumerate(sources):
                    key = f"{prefix}.{src.lstrip('.').replace('*', str(e))}"
                    rows = ("split", j, len(sources)) if len(sources) > 1 else slice(None)
                    pieces.append((checkpoint_names(model_type, key)[-1], (e, rows)))
            return pieces
    return None
