"""A generic mixture of experts' router auxiliary loss (engine.loss.RouterLoss), as data.

A family whose causal LM adds transformers' ``load_balancing_loss_func`` to its loss (when its config
sets ``output_router_logits``) records its routers' logits with an ``OutputRecorder`` (its
``_can_record_outputs["router_logits"]``: the router's class and the index of the logits in its
output). ``find`` reads that off the family's classes and a tiny model built on the meta device: the
router's path under a block, the index, and the block child that holds the mixture of experts (whose
output carries the auxiliary loss's gradient). The model matrix (scripts/model_matrix.py --aux)
holds each such family to transformers' loss with it and records what ``find`` said in the family's
row; ``router`` reads the row, so resolving a config imports no modeling code.
"""

from __future__ import annotations

import os

from raytrain_hybrid.models import generic, generic_split  # (generic imports this module: read at call time)

# Why a family has no router loss to weigh because transformers adds none (any other reason: one it adds)
NO_LOSS = "adds no router auxiliary loss in transformers"


def router(model_type: str) -> dict | None:
    """{"router": path under a block, "logits": index in its output, "block": the MoE child} where the
    model matrix held the family with its router auxiliary loss (its row's ``aux``); else None."""
    row = generic.verified().get(model_type) or {}
    if row.get("aux") and row.get("aux_router"):
        return dict(row["aux_router"])
    if os.environ.get("RAYTRAIN_MODEL_MATRIX"):  # (while the matrix redoes the verdicts)
        return find(model_type)
    return None


def moe_spec(model_type: str) -> dict | None:
    """ArchSpec.moe of a generic family: its experts module where expert parallelism was held
    (generic_split.expert_module) and its router (``router``); None for neither."""
    experts, found = generic_split.expert_module(model_type), router(model_type)
    if experts is None and found is None:
        return None
    return ({"experts": experts} if experts else {}) | (found or {})


def refusal(model_type: str) -> str:
    """Why ``model.router_aux_loss_coef`` is refused for a family ``router`` has nothing for."""
    row = generic.verified().get(model_type) or {}
    return row.get("aux_reason") or "was not held to transformers' loss with its router auxiliary loss"


def default_coef(hf_config) -> float:
    """transformers' own weight of the loss for this config: its router_aux_loss_coef where it sets
    output_router_logits (as the family's causal LM adds it), else none."""
    if not getattr(hf_config, "output_router_logits", False):
        return 0.0
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)


def find(model_type: str) -> dict | None:
    """The family's router as its classes say it (see the module docstring), or None (``why``)."""
    return search(model_type)[0]


def search(model_type: str) -> tuple[dict | None, str | None]:
    """(the family's router, None), or (None, why it has none this engine can weigh)."""
    import inspect
    from types import SimpleNamespace

    import torch

    config_cls, lm_cls = generic.classes(model_type)
    if "load_balancing_loss_func" not in inspect.getsource(lm_cls.forward):
        return None, f"{NO_LOSS} (its causal LM calls no load_balancing_loss_func)"
    recorder = (getattr(lm_cls, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        return None, "records its router logits otherwise than from one router module, which the loss reads"
    moe = generic_split.moe_children(model_type)
    # (4 layers, as the model matrix's tiny models: a family's default dense first layers leave some MoE)
    sizes = dict(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
    config = config_cls(**generic.tiny_kwargs(SimpleNamespace(**sizes, head_dim=16, seq_len=32), model_type))
    with torch.device("meta"):
        model = lm_cls(config)
    layers = f"{generic.pp_names(model_type)[1]}."
    found = set()
    for name, module in model.named_modules():
        if isinstance(module, target) and layers in name:
            found.add(name.split(layers, 1)[1].split(".", 1)[1])  # (its path after the block's index)
    # The MoE block is the plan's (moe_children); a family whose TP plan names no experts (gpt-oss's
    # shards the embedding only) has its one router's parent as the block.
    paths = sorted(p for p in found if not moe or p.split(".")[0] in moe)
    if len(paths) != 1 or len(found) != 1:
        where = ", ".join(sorted(found)) or "no module of the matrix's tiny model"
        return None, f"records its router logits from {where}, not from one router inside its mixture of experts"
    index = int(getattr(recorder, "index", 0))
    return {"router": paths[0], "logits": index, "block": paths[0].split(".")[0]}, None
