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
import json
import re

# config.json keys that count a mixture of experts' routed experts, by family.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_SIMPLE = re.compile(r"^\^?(?:[\w.]|\\\.)+$")  # a regex that is a literal dotted name


def _literal(pattern: str) -> str | None:
    """The text a simple regex matches (``\\.`` unescaped, ``^`` dropped), or None."""
    return pattern.lstrip("^").replace("\\.", ".") if _SIMPLE.match(pattern) else None


@functools.cache
def _mapping(model_type: str) -> tuple:
    """The family's conversion mapping, looked up as transformers does: by the causal LM's class
    name first (GPT-NeoX's head), then by model_type."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversion mappings: names are the files'
        return ()
    from raytrain_hybrid.models.generic import classes

    try:
        lm_name = classes(model_type)[1].__name__
    except (KeyError, ValueError):
        lm_name = None
    found = get_checkpoint_conversion_mapping(lm_name) if lm_name else None
    return tuple(found if found is not None else get_checkpoint_conversion_mapping(model_type) or ())


@functools.cache
def _reverse_renamings(model_type: str) -> tuple:
    """The mapping's renamings run backwards (model name -> file name), last first: what
    transformers' own save applies, so chained and anchored regexes come out as its files spell them."""
    out = []
    for conv in reversed(_mapping(model_type)):
        if type(conv).__name__ == "WeightRenaming":
            try:
                out.append(conv.reverse_transform())
            except (ValueError, NotImplementedError):  # a renaming transformers cannot reverse either
                continue
    return tuple(out)


def checkpoint_names(model_type: str, name: str) -> tuple[str, ...]:
    """``name`` as the files may spell it: itself, and with the family's renamings undone."""
    renamed = name
    for renaming in _reverse_renamings(model_type):
        renamed, _ = renaming.rename_source_key(renamed)
    return tuple(dict.fromkeys((name, renamed)))


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
            # As many experts as the model's tensor stacks (LongCat-Flash's gate_up_proj also
            # holds rows for its zero-computation experts, which the files keep too).
            shape = _shapes(model_type, json.dumps(conf, sort_keys=True)).get(name)
            for e in range(shape[0] if shape else experts(conf)):
                for j, src in enumerate(sources):
                    key = f"{prefix}.{src.lstrip('.').replace('*', str(e))}"
                    rows = ("split", j, len(sources)) if len(sources) > 1 else slice(None)
                    pieces.append((checkpoint_names(model_type, key)[-1], (e, rows)))
            return pieces
    return None


def split_block(model_type: str, name: str, conf: dict) -> tuple | None:
    """A block of a fused checkpoint tensor that transformers splits on load by each target's size
    (``Split`` along dim 0: Sarvam-MoE's ``query_key_value`` into q/k/v_proj): (file names, False,
    offset), the offset the sizes of the targets before it; or None: not such a block."""
    for conv in _mapping(model_type):
        ops = [type(op).__name__ for op in getattr(conv, "operations", ())]
        if type(conv).__name__ != "WeightConverter" or ops != ["Split"] or len(conv.source_patterns) != 1:
            continue
        source, targets = _literal(conv.source_patterns[0]), [_literal(t) for t in conv.target_patterns]
        if conv.operations[0].dim != 0 or not source or not all(targets):
            continue
        hit = next((t for t in targets if f".{t}." in f".{name}"), None)
        if hit is None:
            continue
        shapes = _shapes(model_type, json.dumps(conf, sort_keys=True))
        before = sum(shapes[name.replace(hit, t)][0] for t in targets[: targets.index(hit)])
        offset = (before,) + (0,) * (len(shapes[name]) - 1)
        return checkpoint_names(model_type, name.replace(hit, source)), False, offset
    return None


@functools.lru_cache(maxsize=8)
def _shapes(model_type: str, conf_json: str) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the model ``conf`` describes (built on the meta device)."""
    import torch

    from raytrain_hybrid.models.generic import _conf_keys, classes

    config_cls, lm_cls = classes(model_type)
    with torch.device("meta"):
        model = lm_cls(config_cls(**_conf_keys(json.loads(conf_json))))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def from_hf(model_type: str, name: str, conf: dict):
    """Engine names are transformers' module names; the files' names are those run back through
    the family's conversion mapping (below); a tied checkpoint may have no head:
    it is the embedding (an untied one must have its own)."""
    from raytrain_hybrid.models import generic

    prefix = generic._prefix(model_type)
    head = f"{generic.head_name(model_type)}.weight"
    if name == head:
        files = checkpoint_names(model_type, head)
        if not generic.is_tied(generic.classes(model_type)[0](**generic._conf_keys(conf))):
            return files, False, ()
        return (*files, f"{prefix}.{generic.pp_names(model_type)[0]}.weight"), False, ()
    pieces = stacked(model_type, name, conf)
    if pieces is not None:
        return pieces
    block = split_block(model_type, name, conf)
    if block is not None:
        return block
    return checkpoint_names(model_type, name), False, ()
