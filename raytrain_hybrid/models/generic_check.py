"""What ``check`` refuses of a generic decoder family (models.generic) before workers start: the
family itself, tensor parallelism where its plan or the model matrix says so, context parallelism
where its attention does not allow it (models.generic_cp), expert parallelism where the model matrix
did not hold it, and the expert keys (a family's experts are its transformers config's; the router
auxiliary loss's weight where the model matrix held the family with it: models.generic_router)."""

from __future__ import annotations

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import generic_cp

# A mixture of experts' expert count, by the names transformers' configs give it.
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
# A config switch that makes a family another model than the one the model matrix held (its tiny model
# takes the family's default), and why that one cannot be held: refused where a checkpoint turns it on.
SWITCHES = {
    "doge": (
        "is_moe",
        "turns on Doge's mixture of experts, which mixes router logits across a batch's tokens (transformers "
        "notes its routing is not causal), so no split of a batch over ranks or micro-batches trains the same model",
    ),
}


def check(model_type: str, cfg) -> None:
    """Refusals before workers start: a family the engine cannot run at this layout."""
    from raytrain_hybrid.models import generic, generic_split

    par = cfg.parallelism
    why = generic.refusal(model_type, tp=par.tp)
    if why:
        key = "parallelism.tp" if "parallelism.tp" in why else "model.arch"
        raise ConfigError(key, par.tp if key == "parallelism.tp" else model_type, f"{model_type} {why}")
    if par.pp > 1 and not generic.has_pp_plan(model_type):
        raise ConfigError("parallelism.pp", par.pp, f"{model_type} {generic.NO_PP_PLAN}; use parallelism.pp=1")
    if par.cp > 1:
        # The model matrix's cp=2 verdict where it has one (scripts/model_matrix.py --cp), else the rule.
        why = (generic.verified().get(model_type) or {}).get("cp_reason")
        why = why or generic_cp.cp_refusal(model_type, generic.hf_config(model_type, cfg))
        if why:
            raise ConfigError("parallelism.cp", par.cp, f"{model_type} {why}; use parallelism.cp=1")
    features(model_type, cfg)
    _switches(model_type, cfg.model)
    from raytrain_hybrid.models import generic_router

    m, defaults = cfg.model, type(cfg.model)()
    moe_keys = [k for k in ("num_experts", "experts_per_token") if getattr(m, k) != getattr(defaults, k)]
    # (0 is always allowed: no router loss is what a family without one trains with)
    if m.router_aux_loss_coef and not moe_keys and generic_router.router(model_type) is None:
        weighed = m.router_aux_loss_coef != defaults.router_aux_loss_coef  # (left at it: the checkpoint's own)
        moe_keys = ["router_aux_loss_coef"] if weighed else []
        if not weighed:  # (a weight set: refused below, naming the key)
            _unheld_router_loss(model_type, m)
    if generic_router.router(model_type) and par.tp > 1:
        tp_only = (generic.verified().get(model_type) or {}).get("aux_tp_reason")
        if tp_only and m.router_aux_loss_coef and _router_loss_on(m, defaults):
            raise ConfigError(
                "parallelism.tp", par.tp, f"{model_type} with its router loss {tp_only}; use parallelism.tp=1"
            )
    if par.ep == 1 and not moe_keys:
        return
    config = generic.hf_config(model_type, cfg)
    experts = next((k for k in EXPERT_KEYS if getattr(config, k, None)), None)
    if par.ep > 1 and not moe_keys:
        if not experts:
            raise ConfigError("parallelism.ep", par.ep, f"{model_type}'s model has no experts; use ep=1")
        if generic_split.expert_module(model_type) is None:
            row = generic.verified().get(model_type) or {}
            why = row.get("ep_reason") or "was not held to the one-process reference with expert parallelism"
            raise ConfigError("parallelism.ep", par.ep, f"{model_type} {why}; use parallelism.ep=1")
        tp_only = (generic.verified().get(model_type) or {}).get("ep_tp_reason")
        if par.tp > 1 and tp_only:
            raise ConfigError("parallelism.ep", par.ep, f"{model_type} with ep {tp_only}; use parallelism.tp=1 or ep=1")
        return  # (ep against dp and the expert count: config.validate, with spec.experts)
    key = moe_keys[0]
    where = f"{experts}={getattr(config, experts)}" if experts else "none: it has no experts"
    if key != "router_aux_loss_coef":
        why = f"takes its experts from its transformers config ({where})"
    else:
        why = generic_router.refusal(model_type) if experts else "has no experts, so no router auxiliary loss"
    raise ConfigError(f"model.{key}", getattr(m, key), f"{model_type} {why}; leave the key out")


def cp_static(model_type: str) -> bool:
    """Refused context parallelism whatever the checkpoint's config: no query projection in the
    plan, eager attention only, attention sinks (the planner then proposes no cp)."""
    from raytrain_hybrid.models import generic

    path = generic_cp.attention_path(model_type)
    return path is None or not generic.supports_sdpa(model_type) or generic_cp.adds_sinks(model_type)


def features(model_type: str, cfg) -> None:
    """Packing and LoRA where the model matrix held them to their references (scripts/model_matrix.py
    --packing, --lora): refused with its reason where it did not, or where packing cannot apply."""
    from raytrain_hybrid.models import generic

    row = generic.verified().get(model_type) or {}
    for key, name, off in (("data.packing", "packing", "false"), ("lora.rank", "lora", "0")):
        on = cfg.data.packing if name == "packing" else cfg.lora.rank
        if on and cfg.parallelism.tp > 1 and row.get(f"{name}_tp_reason"):  # held at tp=1 only
            why = f"with {key}={on} {row[f'{name}_tp_reason']}"
            raise ConfigError(key, on, f"{model_type} {why}; use parallelism.tp=1 or {key}={off}")
    if cfg.data.packing:
        why = row.get("packing_reason") if row.get("packing") is False else None
        why = why or packing_refusal(generic.hf_config(model_type, cfg))
        if why:
            raise ConfigError("data.packing", True, f"{model_type} {why}; use data.packing=false")
    if cfg.lora.rank:
        why = row.get("lora_reason") if row.get("lora") is False else None
        why = why or lora_refusal(generic.hf_config(model_type, cfg))
        if why:
            raise ConfigError("lora.rank", cfg.lora.rank, f"{model_type} {why}; use lora.rank=0")


def lora_refusal(hf_config) -> str | None:
    """LoRA adapts the linears of a family's TP plan; a mixture of experts' experts are transformers'
    stacked weights, which peft adapts and the engine does not (as for the hand-written ones)."""
    experts = next((k for k in EXPERT_KEYS if getattr(hf_config, k, None)), None)
    if experts and getattr(hf_config, "is_moe", None) is not False:  # (Doge's dense layers name a count too)
        return (
            f"is a mixture of experts ({experts}={getattr(hf_config, experts)}), whose experts LoRA does not adapt here"
        )
    return None


def packing_refusal(hf_config) -> str | None:
    """Packed rows keep their examples apart by the mask each attention layer is given: a layer type
    that attends otherwise (linear attention's recurrent state) would run across them."""
    masked = {*generic_cp._LAYER_TYPES, "indexed_attention"}  # (DeepSeek's sparse attention reads its mask)
    other = sorted(set(getattr(hf_config, "layer_types", None) or ()) - masked)
    if other:
        return f"has {', '.join(other)} layers, which carry state across a packed row's examples instead of a mask"
    return None


def _switches(model_type: str, m) -> None:
    """Refuse a checkpoint whose config.json turns on a switch of SWITCHES (read as data)."""
    from raytrain_hybrid.models.hf_checkpoint import is_set, read_config_json

    if model_type in SWITCHES and is_set(m.pretrained):
        key, why = SWITCHES[model_type]
        if read_config_json(m.pretrained, m.pretrained_revision).get(key):
            raise ConfigError("model.pretrained", m.pretrained, f"its config.json sets {key}, which {why}")


def _router_loss_on(m, defaults) -> bool:
    """The run weighs a router auxiliary loss: the key set, or left at its default and the
    checkpoint's config.json asking for one (output_router_logits, as transformers reads it)."""
    from types import SimpleNamespace

    from raytrain_hybrid.models.generic_router import default_coef
    from raytrain_hybrid.models.hf_checkpoint import is_set, read_config_json

    if m.router_aux_loss_coef != defaults.router_aux_loss_coef:
        return True
    conf = read_config_json(m.pretrained, m.pretrained_revision) if is_set(m.pretrained) else {}
    return default_coef(SimpleNamespace(**conf)) > 0  # (transformers' own weight, as the engine takes it)


def _unheld_router_loss(model_type: str, m) -> None:
    """Refuse a checkpoint whose config.json asks for a router auxiliary loss that the model matrix
    did not hold for its family (one it did not record, of another transformers or registered, or
    whose router it could not find: Doge's): trained without it, the run would silently differ from
    transformers' own. A family to which transformers adds no such loss trains as transformers does."""
    from raytrain_hybrid.models import generic, generic_router

    row = generic.verified().get(model_type)
    if row is not None and "aux" not in row:
        return  # (a dense family: the matrix's aux pass gives every family with experts a verdict)
    if (row or {}).get("aux_reason", "").startswith(generic_router.NO_LOSS) or not _router_loss_on(m, type(m)()):
        return
    raise ConfigError(
        "model.pretrained",
        m.pretrained,
        f"its config.json sets output_router_logits, a router auxiliary loss that was not held to "
        f"transformers' for {model_type}; set output_router_logits to false there, or "
        f"model.router_aux_loss_coef=0 to train without it",
    )
