"""How a generic family (models.generic) splits over ranks beyond its plan's translation: its
block's tensor-parallel plan without its mixture of experts (router, experts and shared experts kept
whole on every tp rank, as the hand-written Qwen3-MoE and Mixtral specs keep theirs; a dense layer's
MLP under the same module name, as a first-k-dense stack has, whole too), why tp > 1 is
refused, which experts module expert parallelism shards (where the model matrix held it:
scripts/model_matrix.py --ep), and the family's own expert counts (its config's, not model.* keys)."""

from __future__ import annotations

import os

from raytrain_hybrid.models import (
    generic,
    generic_check,
    generic_weights,
)  # (generic imports this module: names read at call time)


def moe_children(model_type: str) -> frozenset[str]:
    """The block children that hold a mixture of experts (transformers' plan gives their experts
    ``moe_tp_experts``): kept whole on every tp rank, router, experts and shared experts alike, as
    the hand-written MoE specs keep theirs. Their gradients come out equal on every tp rank (they
    see the whole activations); attention, and dense MLPs of other layers, stay tensor-parallel."""
    return frozenset(path.split(".")[0] for path in _expert_paths(model_type))


def _expert_paths(model_type: str) -> list[str]:
    """The experts modules' paths under a block: the plan's ``moe_tp_experts`` patterns."""
    layers = generic.pp_names(model_type)[1]
    raw = generic._tp_plan_raw(model_type)
    return [p.removeprefix(f"{layers}.*.") for p, style in raw.items() if style == "moe_tp_experts"]


def expert_module(model_type: str) -> str | None:
    """The experts module of a block (its plan's ``moe_tp_experts`` path) that expert parallelism
    shards (distributed.expert_parallel: transformers' stacked experts, forward(hidden, indices,
    weights)), where the model matrix held the family with ep (its row's ``ep``) or while it redoes
    the verdicts; None otherwise (a dense family, or ep refused with the matrix's reason)."""
    paths = _expert_paths(model_type)
    held = (generic.verified().get(model_type) or {}).get("ep") or os.environ.get("RAYTRAIN_MODEL_MATRIX")
    return paths[0] if len(paths) == 1 and held else None


def experts_of(model_type: str, m) -> tuple[int, int]:
    """(routed experts, experts a token is routed to) of the family's transformers config: a
    checkpoint's config.json as data where it says both (no transformers import), else the class's."""
    from types import SimpleNamespace

    from raytrain_hybrid.models.hf_checkpoint import is_set, read_config_json

    if is_set(m.pretrained):
        conf = read_config_json(m.pretrained, m.pretrained_revision)
        count = generic_weights.experts(conf)
        if count and isinstance(conf.get("num_experts_per_tok"), int):
            return count, conf["num_experts_per_tok"]
    config = generic.hf_config(model_type, SimpleNamespace(model=m))
    count = next((getattr(config, k) for k in generic_check.EXPERT_KEYS if getattr(config, k, None)), 0)
    return int(count), int(getattr(config, "num_experts_per_tok", 0) or 0)


def block_tp_plan(model_type: str) -> dict[str, str]:
    """transformers' plan of a block (module path under a block -> transformers' style), without
    patterns outside the blocks (an embedding's) or under a mixture of experts (moe_children)."""
    layers, moe = generic.pp_names(model_type)[1], moe_children(model_type)
    plan = {}
    for pattern, style in generic._tp_plan_raw(model_type).items():
        module = pattern.removeprefix(f"{layers}.*.")
        if module != pattern and module.split(".")[0] not in moe:
            plan[module] = style
    return plan


def tp_refusal(model_type: str, known: dict | None) -> str | None:
    """Why ``model_type`` is refused tp > 1 (None: it is not); ``known``: its model matrix row."""
    plan = block_tp_plan(model_type)
    if not plan:  # (LFM2, gpt-oss: the embedding; DeepSeek-V3: its experts)
        why = "has a tensor-parallel plan with no entry for its layers outside its experts (each rank would run"
        why += " every block whole)"
        return f"{why}; use parallelism.tp=1"
    if known and known.get("tp_reason"):
        return f"{known['tp_reason']}; use parallelism.tp=1"
    if known and known.get("status") == "passed" and known.get("tp") is False:
        return "was held to the one-process reference at tp=1 only (scripts/model_matrix.py); use parallelism.tp=1"
    odd = sorted({s for s in plan.values() if s not in generic._STYLES})
    if odd:
        return f"has tensor-parallel styles the engine cannot honour ({', '.join(odd)}); use parallelism.tp=1"
    return None
