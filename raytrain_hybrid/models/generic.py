"""Any Hugging Face decoder: an architecture spec derived from transformers' own classes and plans.

transformers ships, on a causal LM's config class, a tensor-parallel plan (``base_model_tp_plan``:
module pattern -> style) and a pipeline plan (``base_model_pp_plan``: the base model's embedding,
its block list and its final norm), and on the model class the head's (``_tp_plan``,
``_pp_plan``). A family with both is trained here as transformers builds it
(``AutoModelForCausalLM``'s class for its model_type), with no code of its own: the plans are
translated to the engine's TP styles (models.spec), the pipeline splits the plan's block list,
and one stage forward (``stage_forward``) runs what a stage holds the way transformers' decoders
do: embed, rotary tables and masks per attention type (``layer_types``), the blocks, the final
norm, and the head through the causal LM's own forward, so its logit scaling and soft-capping are
transformers' code.

What differs between families is read from the config and the modules: tied embeddings
(``tie_word_embeddings``: the engine keeps a head that starts equal to the embedding and whose
gradient is summed with it, engine.tied), an embedding multiplier the base model applies, per-head
query/key norms (their gradient summed over tp), sliding windows, biases. A family is refused
before workers start where a plan style has no translation or shards no layer (then tp must be 1),
where it has no pipeline plan (at pp > 1, or at all unless the matrix held it at pp=1), or where
the model is not a transformer decoder (``refusal``); families checked
against transformers' own are listed in assets/generic_families.json (scripts/model_matrix.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import (
    generic_check,
    generic_counts,
    generic_cp,
    generic_facts,
    generic_router,
    generic_sp,
    generic_split,
    generic_weights,
)
from raytrain_hybrid.models.generic_forward import (
    experts_always_used,
    learnt_activations,
    on_stage,
    per_layer_modules,
    stage_forward,
)
from raytrain_hybrid.models.spec import ArchSpec

# transformers' TP styles -> the engine's (distributed.tensor_parallel._style). "headnorm": a
# norm over each head of a column-sharded projection (its weight whole, its gradient summed).
_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
    "replicated_with_grad_allreduce": "headnorm",
    "embedding_rowwise": "embedding",
}
# Model types whose layers are not all attention blocks, or that are not decoders: refused by name.
_NOT_DECODERS = ("mamba", "rwkv", "xlstm", "linear", "hybrid", "recurrent", "ssm", "t5", "bart", "encoder")
# Dropout probabilities are set to 0: layouts would draw different masks.
DROPOUT_KEYS = ("dropout", "pdrop", "dropout_prob")
_VERIFIED = Path(__file__).parents[1] / "assets" / "generic_families.json"
NO_PP_PLAN = "has no pipeline plan in transformers (base_model_pp_plan), so its stages are not known"


@functools.lru_cache(maxsize=1)
def verified() -> dict[str, dict]:
    """{model_type: {"status": "passed" | "refused" | "hand-written", ...}} from the model matrix
    (which sets RAYTRAIN_MODEL_MATRIX while it redoes the verdicts)."""
    if os.environ.get("RAYTRAIN_MODEL_MATRIX"):
        return {}
    try:
        return json.loads(_VERIFIED.read_text())["families"]
    except (OSError, ValueError, KeyError):
        return {}


@functools.cache
def classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of a model_type, transformers' own or one registered with its
    Auto classes (models.custom.register_model); KeyError where there is none."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    return config_cls, AutoModelForCausalLM._model_mapping[config_cls]


def refusal(model_type: str, *, tp: int = 1, recorded: bool = True) -> str | None:
    """Why ``model_type`` cannot be trained here (None: it can), in words for a message;
    ``recorded``: with the model matrix's verdicts (scripts/model_matrix.py), not only the plans'."""
    if generic_facts.recorded(model_type) is None:
        try:
            classes(model_type)
        except (KeyError, ValueError):
            return f"is not a causal language model of transformers {generic_facts.version()} nor one registered"
    unknown = not recorded or generic_facts.recorded(model_type) is None  # (else its verdict says so)
    if any(w in model_type for w in _NOT_DECODERS) or unknown and generic_facts.state_space(classes(model_type)[0]):
        return "is not a transformer decoder (state-space, linear-attention or encoder-decoder layers)"
    if not _tp_plan_raw(model_type):
        return "has no tensor-parallel plan in transformers (base_model_tp_plan)"
    known = verified().get(model_type) if recorded else None
    held = (known or {}).get("status") == "passed" or os.environ.get("RAYTRAIN_MODEL_MATRIX")
    if known and known.get("status") == "refused":  # (the matrix's reason: more than a missing plan)
        return known["reason"]
    if not has_pp_plan(model_type) and not held:  # (held: at pp=1 with the usual names, pp_names)
        return NO_PP_PLAN
    try:
        pp_names(model_type)
    except (KeyError, StopIteration):
        return "has a pipeline plan that names no embedding, block list and final norm"
    if tp > 1:
        return generic_split.tp_refusal(model_type, known)
    return None


def is_generic(model_type: str) -> bool:
    try:
        return refusal(model_type) is None
    except Exception:  # noqa: BLE001 - an unknown name, a transformers without the family
        return False


def _fact(model_type: str, key: str, from_classes):
    """A fact of the family as recorded (models.generic_facts), else ``from_classes()``."""
    facts = generic_facts.recorded(model_type)
    return facts[key] if facts is not None else from_classes()


def _tp_plan_raw(model_type: str) -> dict[str, str]:
    return dict(_fact(model_type, "tp_plan", lambda: classes(model_type)[0].base_model_tp_plan or {}))


def _prefix(model_type: str) -> str:
    return _fact(model_type, "prefix", lambda: generic_facts.prefix_of(classes(model_type)[1]))


def supports_sdpa(model_type: str) -> bool:
    return _fact(model_type, "sdpa", lambda: bool(getattr(classes(model_type)[1], "_supports_sdpa", False)))


def per_layer_inputs(model_type: str) -> tuple[str, ...]:
    return tuple(_fact(model_type, "per_layer", lambda: per_layer_modules(classes(model_type)[0])))


@functools.cache
def pp_names(model_type: str) -> tuple[str, str, str]:
    """(embedding, block list, final norm) of the base model: recorded, or off its pipeline plan."""
    facts = generic_facts.recorded(model_type)
    if facts is None:
        return pp_names_of(model_type)
    if facts["pp_names"] is None:
        raise KeyError(facts.get("pp_error", model_type))
    return tuple(facts["pp_names"])


def pp_names_of(model_type: str) -> tuple[str, str, str]:
    """(embedding, block list, final norm) read off the pipeline plan: the module that takes
    input_ids, the one that takes the attention mask, and the last. Modules between them (an
    embedding dropout, at 0 here) are not run."""
    plan = dict(getattr(classes(model_type)[0], "base_model_pp_plan", None) or {})
    if not plan:  # (pp=1 only: models.generic_check)
        return "embed_tokens", "layers", generic_facts.final_norm_of(model_type)
    embed = next(k for k, (inputs, _) in plan.items() if "input_ids" in inputs)
    layers = "layers" if "layers" in plan else next(k for k, (inputs, _) in plan.items() if "attention_mask" in inputs)
    norm = list(plan)[-1]
    if norm in (embed, layers):
        raise KeyError(f"{model_type}'s pipeline plan names no final norm: {list(plan)}")
    return embed, layers, norm


def has_pp_plan(model_type: str) -> bool:
    return _fact(model_type, "pp_plan", lambda: bool(getattr(classes(model_type)[0], "base_model_pp_plan", None)))


def head_name(model_type: str) -> str:
    return _fact(model_type, "head", lambda: head_name_of(classes(model_type)[1]))


def head_name_of(lm_cls) -> str:
    """The causal LM's output head (``lm_head``; GPT-NeoX's ``embed_out``), from its pipeline plan."""
    return next(iter(getattr(lm_cls, "_pp_plan", None) or {}), "lm_head")


# ----------------------------------------------------------------- config


# Families whose config leaves layer_types unset though their model reads it per layer: each layer this
# kind in a random-weight model (as LFM2's own config makes every layer attention; its MoE's sets none).
EVERY_LAYER = {"lfm2_moe": "full_attention"}


def tiny_kwargs(m, model_type: str = "") -> dict:
    """The transformers config keywords of a model built from model.* sizes (no checkpoint)."""
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    every = {"layer_types": [EVERY_LAYER[model_type]] * m.num_layers} if model_type in EVERY_LAYER else {}
    return every | {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max(m.seq_len, 128),
        # The families' default special ids lie outside a small vocabulary.
        "pad_token_id": 0,
        "bos_token_id": 1 % m.vocab_size,
        "eos_token_id": 2 % m.vocab_size,
    }


def dropout_off(config) -> None:
    """Every dropout probability of a transformers config set to 0 (the engine's; and the oracle's
    reference, which must draw no masks either)."""
    for key, value in config.to_dict().items():
        if isinstance(value, float) and key.endswith(DROPOUT_KEYS):
            setattr(config, key, 0.0)


def hf_config(model_type: str, cfg):
    """The transformers config: the checkpoint's (every setting kept) or one from model.* sizes;
    dropout off, sdpa attention, no cache. Tied embeddings stay as the family has them."""
    from raytrain_hybrid.models.hf_checkpoint import is_set, read_config_json

    config_cls, _ = classes(model_type)
    m = cfg.model
    if is_set(m.pretrained):
        dropped = ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map")
        conf = {k: v for k, v in read_config_json(m.pretrained, m.pretrained_revision).items() if k not in dropped}
    else:
        conf = tiny_kwargs(m, model_type)
    config = config_cls(**conf)
    dropout_off(config)
    config.use_cache = False
    config._attn_implementation = attention_implementation(model_type)
    return config


def attention_implementation(model_type: str) -> str:
    """SDPA where the family takes it (causal without a mask tensor), else transformers' eager (also
    where the model matrix found SDPA's rounding beyond the oracle's bound and eager within it)."""
    if os.environ.get("RH_EAGER") or (verified().get(model_type) or {}).get("attention") == "eager":
        return "eager"
    return "sdpa" if supports_sdpa(model_type) else "eager"


def _conf_keys(conf: dict) -> dict:
    return {k: v for k, v in conf.items() if k not in ("architectures", "auto_map")}


def sizes_from_hf(model_type: str, conf: dict) -> dict:
    """A config.json's sizes as model.* keys: as recorded data where it can (models.generic_facts),
    else read through the config class (its attribute map and defaults)."""
    return generic_facts.sizes(model_type, conf) or sizes_from_class(model_type, conf)


def sizes_from_class(model_type: str, conf: dict) -> dict:
    config_cls, _ = classes(model_type)
    c = config_cls(**_conf_keys(conf))
    heads, ffn = c.num_attention_heads, getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    return {
        "num_layers": blocks(c),
        "hidden_size": int(c.hidden_size),
        "num_heads": int(heads),
        "num_kv_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_dim": int(_attr(c, "head_dim") or c.hidden_size // heads),
        "ffn_hidden_size": int(max(ffn) if isinstance(ffn, list) else ffn),  # (Gemma 3n's per layer: the widest)
        "vocab_size": int(c.vocab_size),
    }


def blocks(config) -> int:
    """The block list's length: num_hidden_layers, or a smaller ``num_layers`` where each block
    holds several attention sublayers that num_hidden_layers counts (LongCat-Flash: two)."""
    layers = int(config.num_hidden_layers)
    fewer = getattr(config, "num_layers", None)
    return int(fewer) if isinstance(fewer, int) and 0 < fewer < layers else layers


def _attr(config, name: str):
    """A config attribute, or None where it is missing or set per layer (Gemma 4's head widths)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error
        return None


def max_seq_len(conf: dict) -> int:
    # Sliding windows are computed (masks per layer type), so only the positions bound the length.
    return int(conf.get("max_position_embeddings") or 0)


def is_tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


# ----------------------------------------------------------------- build


@contextlib.contextmanager
def _params_on_meta():
    """Parameters go to the meta device as they are registered; buffers (rotary tables, an
    embedding scale) are computed for real on the CPU, where the engine keeps them (engine:
    restored after the stage is materialised). Parameters are allocated empty, never filled."""
    import torch
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register


def build(model_type: str, hf_config):
    """transformers' causal LM for ``hf_config``, parameters on the meta device, untied (a tied
    family's head starts equal to its embedding and stays so: engine.tied)."""
    import copy

    _, lm_cls = classes(model_type)
    config = copy.copy(hf_config)
    config.tie_word_embeddings = False
    with _params_on_meta():
        model = lm_cls(config)
    model.config = hf_config  # the head's forward reads the family's settings (soft-capping, scales)
    experts_always_used(model, hf_config)
    return model


# ----------------------------------------------------------------- checkpoints and counts


def spec(model_type: str) -> ArchSpec:
    """The spec of a transformers causal-LM family (see the module docstring)."""
    why = refusal(model_type)
    if why:
        raise ConfigError("model.arch", model_type, why)
    prefix = _prefix(model_type)
    embed, layers, norm = pp_names(model_type)
    head = head_name(model_type)
    tp_plan = {module: _STYLES.get(style, style) for module, style in generic_split.block_tp_plan(model_type).items()}
    return ArchSpec(
        name=model_type,
        hf_config=functools.partial(hf_config, model_type),
        build=functools.partial(build, model_type),
        hf_class=functools.partial(_hf_model, model_type),
        hf_model_types=(model_type,),
        sizes_from_hf=functools.partial(sizes_from_hf, model_type),
        max_seq_len=max_seq_len,
        from_hf=functools.partial(generic_weights.from_hf, model_type),
        default_ffn=lambda hidden: 32 * ((8 * hidden // 3 + 31) // 32),
        param_parts=functools.partial(generic_counts.param_parts, model_type),
        matmul_params=functools.partial(generic_counts.matmul_params, model_type),
        held_copies=functools.partial(generic_counts.held_copies, model_type),
        # MoE blocks and modules the plan leaves out: whole on each tp rank; ep divides the experts alone.
        expert_params=functools.partial(generic_counts.moe_params, model_type, "experts"),
        whole_params=functools.partial(generic_counts.moe_params, model_type, "rest"),
        **{key: functools.partial(getattr(generic_counts, key), model_type) for key in generic_counts.TP_WHOLE},
        # Expert parallelism and the router auxiliary loss where the model matrix held them.
        moe=generic_router.moe_spec(model_type),
        experts=functools.partial(generic_split.experts_of, model_type),
        layers=f"{prefix}.{layers}",
        first_stage=(f"{prefix}.{embed}", *(f"{prefix}.{n}" for n in per_layer_inputs(model_type))),
        last_stage=(*(() if generic_facts.pre_norm(model_type) else (f"{prefix}.{norm}",)), head),
        tp_plan=tp_plan,
        # Vocab-parallel embedding and head: a tied pair is sharded alike (engine.tied sums them).
        tp_plan_outer={f"{prefix}.{embed}": "embedding", head: "head"},
        # Sequence parallelism: each block's plan from its modules (models.generic_sp), the final norm.
        sp_block=None
        if generic_sp.refusal(model_type)
        else functools.partial(generic_sp.block_plan, generic_sp.reduced_children(tp_plan)),
        sp_plan_outer={f"{prefix}.{norm}": "seqnorm"},
        stage_forward=stage_forward,
        check=functools.partial(generic_check.check, model_type),
        # Context parallelism where the family's attention allows it (models.generic_cp; check refines
        # it with the checkpoint's own config: soft-capping, latent attention, linear layers).
        attention=None if generic_check.cp_static(model_type) else generic_cp.attention_path(model_type),
        tied=is_tied,
        on_stage=functools.partial(on_stage, prefix, (embed, layers, norm, head)),
        tp_adjust=learnt_activations,
    )


def _hf_model(model_type: str, config):
    """The unmodified transformers class ``export`` checks its output against."""
    return classes(model_type)[1](config)
