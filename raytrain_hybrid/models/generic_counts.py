"""Parameter and FLOP counts of a generic family (models.generic), for the planner and MFU, as
transformers builds the model: read off a checkpoint's safetensors headers, or for model.* sizes
from the family's recorded count polynomials, else counted on the model built on the meta device
from its config (seconds: torch and the family's modeling code are imported)."""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction

from raytrain_hybrid.models import (  # (generic imports these: names read at call time)
    generic,
    generic_facts,
    generic_split,
)


@functools.lru_cache(maxsize=64)
def _counts(model_type: str, sizes: tuple) -> tuple[int, int, int, int, int]:
    """(per block, embedding, final norm + head, head, tied) parameters: off a checkpoint's headers,
    the family's count polynomials, else the model built on the meta device."""
    m = dict(sizes)
    if _checkpoint(m):
        counted = from_headers(model_type, m)
    else:
        counted = from_polynomials(model_type, m)
    return counted or built_counts(model_type, m)


def _checkpoint(m: dict) -> bool:
    """model.pretrained names a checkpoint ("none", as "", is random weights)."""
    from raytrain_hybrid.models.hf_checkpoint import is_set

    return is_set(m.get("pretrained") or "")


def built_counts(model_type: str, m: dict) -> tuple[int, int, int, int, int]:
    """_counts of the model transformers builds (on the meta device) from the config."""
    blocks, embed, rest, head, tied = built_parts(model_type, m)
    return sum(blocks) // max(1, len(blocks)), embed, rest + head, head, tied


def built_parts(model_type: str, m: dict) -> tuple[list[int], int, int, int, int]:
    """(each block, embedding, the rest: final norm and anything else, head, tied) parameters of the
    model transformers builds on the meta device from the checkpoint's config or model.* sizes."""
    model, inner, tied = _built(model_type, m)

    def count(mod) -> int:
        return sum(p.numel() for p in mod.parameters()) if mod is not None else 0

    embed_name, layers_name, _ = generic.pp_names(model_type)
    layers = getattr(inner, layers_name)
    embed = count(getattr(inner, embed_name))
    head = count(getattr(model, generic.head_name(model_type)))
    rest = count(model) - count(layers) - embed - head  # the final norm and anything else
    return [count(b) for b in layers], embed, rest, head, int(tied)


def _built(model_type: str, m: dict):
    """(the causal LM on the meta device, its base model, whether its config ties the head) from
    the checkpoint's config or model.* sizes (built untied: the head counted apart)."""
    import torch

    config_cls, lm_cls = generic.classes(model_type)
    if _checkpoint(m):
        from raytrain_hybrid.models.hf_checkpoint import read_config_json

        conf = {
            k: v
            for k, v in read_config_json(m["pretrained"], m.get("pretrained_revision", "")).items()
            if k not in ("architectures", "auto_map", "torch_dtype", "dtype")
        }
    else:
        conf = generic.tiny_kwargs(_Sizes(**m), model_type)
    config = config_cls(**conf)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    config.tie_word_embeddings = False
    with torch.device("meta"):
        model = lm_cls(config)
    return model, getattr(model, generic_facts.prefix_of(lm_cls)), tied


def moe_params(model_type: str, part: str, m) -> int:
    """A block's parameters of its mixture of experts (models.generic_split.moe_children), averaged over
    the blocks as param_parts's per-block count is: ``part`` "experts", its experts module (which
    expert parallelism shards), or "rest" (router, shared experts); both whole on every tp rank.
    0 for a dense family."""
    if not generic_split.moe_children(model_type):
        return 0
    experts, whole = _moe_params(model_type, _size_key(m))
    return experts if part == "experts" else whole - experts


@functools.lru_cache(maxsize=64)
def _moe_params(model_type: str, sizes: tuple) -> tuple[int, int]:
    """(experts module, whole MoE block) parameters a block, averaged: off a checkpoint's headers
    (tensors named <prefix>.<layers>.<i>.<child>.; dense blocks hold none), else counted on the
    model built on the meta device."""
    from raytrain_hybrid.models.hf_checkpoint import tensor_sizes

    m, moe = dict(sizes), generic_split.moe_children(model_type)
    experts = generic_split.expert_module(model_type) or f"{next(iter(moe))}.experts"
    facts = generic_facts.recorded(model_type)
    if (
        _checkpoint(m)
        and facts
        and facts["pp_names"]
        and (named := _parameters(model_type, tensor_sizes(m["pretrained"])))
    ):
        at = f"{facts['prefix']}.{facts['pp_names'][1]}."
        inside = {name.removeprefix(at): n for name, n in named.items() if name.startswith(at)}
        # (the blocks the model builds: a next-token prediction layer past them left out, as from_headers does)
        inside = {name: n for name, n in inside.items() if name.split(".")[0].isdigit()}
        inside = {name: n for name, n in inside.items() if int(name.split(".")[0]) < m["num_layers"]}
        blocks = len({name.split(".")[0] for name in inside})
        whole = sum(n for name, n in inside.items() if name.split(".")[1] in moe)
        # (a checkpoint stores each expert apart: <child>.experts.<e>.<projection>.weight)
        held = sum(n for name, n in inside.items() if ".".join(name.split(".")[1:]).startswith(experts + "."))
        if blocks and held:  # (else the files name them otherwise, Mixtral's block_sparse_moe: built)
            return held // blocks, whole // blocks
    _, inner, _ = _built(model_type, m)
    layers = list(getattr(inner, generic.pp_names(model_type)[1]))
    children = [child for b in layers for name, child in b.named_children() if name in moe]
    whole = sum(p.numel() for child in children for p in child.parameters())
    held = sum(p.numel() for b in layers for p in (b.get_submodule(experts).parameters() if _has(b, experts) else ()))
    return held // max(1, len(layers)), whole // max(1, len(layers))


# ArchSpec's counts of what tensor parallelism leaves whole, each (model_type, model config) -> number.
TP_WHOLE = ("tp_whole_params", "tp_whole_attention", "tp_whole_mlp")


def tp_whole_params(model_type: str, m) -> int:
    """A block's parameters, averaged over the blocks, that no tensor-parallel style splits
    (models.generic_facts.tp_whole: MiniMax's linear attention): whole on every tp rank.
    0 where the plan splits every matrix outside a mixture of experts."""
    if not generic_facts.tp_whole(model_type):
        return 0
    return _tp_whole(model_type, _size_key(m))[0]


def tp_whole_attention(model_type: str, m) -> float:
    """The share of blocks whose attention (or state-space mixer) output projection (``o_proj``,
    ``out_proj``, ``o_b_proj``) no tensor-parallel style splits: that attention runs whole on each tp
    rank, with no all-reduce of its own (Youtu's latent attention: all of them; MiniMax's
    linear-attention layers)."""
    if not generic_facts.tp_whole(model_type):
        return 0.0
    return _tp_whole(model_type, _size_key(m))[1]


def tp_whole_mlp(model_type: str, m) -> float:
    """Likewise the share of blocks whose dense MLP (not a mixture of experts) the plan leaves whole
    (``down_proj``, ``fc2``, ``w2``: Hunyuan's dense MLP, LFM2's feed-forward)."""
    if not generic_facts.tp_whole(model_type):
        return 0.0
    return _tp_whole(model_type, _size_key(m))[2]


# A block's output projections by name: the mixer's (attention's, or a state-space layer's) and a
# dense MLP's. A weight of one the plan leaves whole means that module runs whole, with no all-reduce.
_MLP = re.compile(r"\.(mlp|feed_forward|shared_mlp)\.")
_MIXER_OUT = re.compile(r"\.(o_proj|out_proj|o_b_proj)(\.|$)")
_MLP_OUT = re.compile(r"\.(down_proj|fc2|w2|output_linear)(\.|$)")


@functools.lru_cache(maxsize=64)
def _tp_whole(model_type: str, sizes: tuple) -> tuple[int, float, float]:
    """(tp_whole_params, tp_whole_attention, tp_whole_mlp) off a checkpoint's headers (its tensors under those
    modules), else counted on the model built on the meta device."""
    from fnmatch import fnmatchcase

    from raytrain_hybrid.models.hf_checkpoint import tensor_sizes

    m, whole = dict(sizes), generic_facts.tp_whole(model_type)
    blocks = m["num_layers"]
    facts = generic_facts.recorded(model_type)
    if _checkpoint(m) and facts and (named := _parameters(model_type, tensor_sizes(m["pretrained"]))):
        at, index = [f"{facts['prefix']}.{pattern}" for pattern in whole], len(facts["prefix"].split(".")) + 1
        # (the blocks the model builds: a next-token prediction layer past them left out, as from_headers does)
        inside = {k: n for k, n in named.items() if _block_of(k, index) < blocks}
        held = {name: n for name, n in inside.items() if any(fnmatchcase(name, p) for p in at)}
        if held:  # (else the files name them otherwise: built)
            return sum(held.values()) // blocks, *_shares(held, index, blocks)
    _, inner, _ = _built(model_type, m)
    layers = generic.pp_names(model_type)[1]
    built = len(getattr(inner, layers))
    held = {name: p.numel() for name, p in inner.named_parameters() if any(fnmatchcase(name, w) for w in whole)}
    return sum(held.values()) // max(1, built), *_shares(held, 1, built)


def _shares(whole: dict[str, int], index: int, blocks: int) -> tuple[float, float]:
    """The shares of ``blocks`` whose mixer and whose dense MLP hold a whole output projection
    among the ``whole`` names (a mixture of experts' are not a dense MLP's)."""
    dense = [name for name in whole if "expert" not in name]
    mixer = {_block_of(n, index) for n in dense if _MIXER_OUT.search(n) and not _MLP.search(n)}
    mlp = {_block_of(n, index) for n in dense if _MLP.search(n) and _MLP_OUT.search(n)}
    return tuple(len({b for b in at if b < blocks}) / max(1, blocks) for at in (mixer, mlp))


def _block_of(name: str, at: int) -> int | float:
    """The block index a tensor's name gives at its ``at``-th part (inf: none)."""
    parts = name.split(".")
    return int(parts[at]) if len(parts) > at and parts[at].isdigit() else math.inf


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


# The sizes a recorded count polynomial is written in (scripts/generic_facts.py fits them): V vocab,
# H hidden, F ffn, N heads, K kv heads, D head_dim, L layers, P max_position_embeddings, read off the
# keywords generic.tiny_kwargs gives the config class (its defaults for head_dim and kv heads).
_VARIABLES = {
    "V": "vocab_size",
    "H": "hidden_size",
    "F": "intermediate_size",
    "N": "num_attention_heads",
    "K": "num_key_value_heads",
    "D": "head_dim",
    "L": "num_hidden_layers",
    "P": "max_position_embeddings",
}


def variables(m: dict) -> dict[str, int]:
    kwargs = generic.tiny_kwargs(_Sizes(**m))
    return {v: kwargs[key] for v, key in _VARIABLES.items()}


def evaluate(terms: list, x: dict[str, int]) -> Fraction:
    """A polynomial recorded as [[coefficient, "monomial"], ...] ("HND": H*N*D; a coefficient an int
    or "p/q") at the sizes ``x``."""
    return sum((Fraction(c) * math.prod(x[v] for v in mono) for c, mono in terms), Fraction(0))


def from_polynomials(model_type: str, m: dict) -> tuple[int, int, int, int, int] | None:
    """_counts of model.* sizes from the family's recorded polynomials (no torch, no modeling code:
    what `check --hardware` of a random-weight run needs); None where none is recorded (blocks that
    differ from each other, a count no polynomial gives) or where the class would refuse the sizes."""
    poly = (generic_facts.recorded(model_type) or {}).get("counts")
    if not poly:
        return None
    x = variables(m)
    if any(not isinstance(v, int) or v <= 0 for v in x.values()) or x["N"] % x["K"]:
        return None
    got = [evaluate(poly[part], x) for part in ("block", "embed", "rest", "head")]
    if any(v.denominator != 1 or v < 0 for v in got):
        return None
    block, embed, rest, head = (int(v) for v in got)
    return block, embed, rest + head, head, int(poly["tied"])


def from_headers(model_type: str, m: dict) -> tuple[int, int, int, int, int] | None:
    """The counts of _counts read off the checkpoint's safetensors headers (no torch, no modeling
    code: what resolving and planning a checkpoint of a generic family need; models.generic_facts
    for the names): its blocks' tensors (those past the blocks the model builds, a next-token
    prediction layer, left out), its embedding, its head (a tied family's is the embedding's
    shape), and the rest under the base model (the final norm). None where the files do not name
    them so (another layout of names, a Hub id): the model is built on the meta device instead."""
    from raytrain_hybrid.models.hf_checkpoint import read_config_json, tensor_sizes

    facts = generic_facts.recorded(model_type)
    sizes = _parameters(model_type, tensor_sizes(m["pretrained"])) if facts and facts["pp_names"] else None
    if not sizes:
        return None
    conf = read_config_json(m["pretrained"], m.get("pretrained_revision", ""))
    try:  # (as data where the facts allow, else through the config class)
        shape = generic_facts.sizes(model_type, conf) or generic.sizes_from_class(model_type, conf)
    except Exception:  # noqa: BLE001 - a config the class refuses: the build below says so
        return None
    prefix, (embed_name, layers_name, _), head_name = facts["prefix"], facts["pp_names"], facts["head"]
    blocks = [0] * shape["num_layers"]
    embed = head = rest = 0
    for name, n in sizes.items():
        if name.startswith(f"{prefix}.{layers_name}."):
            index = name.split(".")[len(prefix.split(".")) + len(layers_name.split("."))]
            if index.isdigit() and int(index) < len(blocks):
                blocks[int(index)] += n
        elif name.startswith(f"{prefix}.{embed_name}."):
            embed += n
        elif name.startswith(f"{head_name}."):
            head += n
        elif name.startswith(f"{prefix}."):
            rest += n
    if "tie_word_embeddings" not in conf:  # (the class's default decides: read it there)
        return None
    tied = bool(conf["tie_word_embeddings"])
    if tied and not head:
        head = shape["vocab_size"] * shape["hidden_size"]
    if not embed or not head or not all(blocks):
        return None
    return sum(blocks) // len(blocks), embed, rest + head, head, int(tied)


def _parameters(model_type: str, sizes: dict[str, int] | None) -> dict[str, int] | None:
    """A checkpoint's tensor sizes less the family's buffers that its files hold beside the
    parameters (models.generic_facts.buffers): transformers counts parameters only."""
    from fnmatch import fnmatchcase

    skip = generic_facts.buffers(model_type) if sizes else []
    return {k: n for k, n in sizes.items() if not any(fnmatchcase(k, p) for p in skip)} if skip else sizes


class _Sizes:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def _size_key(m) -> tuple:
    keys = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    keys += ("seq_len", "pretrained", "pretrained_revision")
    return tuple((k, getattr(m, k)) for k in keys)


def param_parts(model_type: str, m) -> tuple[int, int, int]:
    """(per block, first stage extra, last stage extra). A tied head is counted once, as
    transformers counts it (the engine's copy of it on the last stage is the planner's to add)."""
    per_block, embed, last, head, tied = _counts(model_type, _size_key(m))
    return per_block, embed, last - head * tied


def matmul_params(model_type: str, m) -> int:
    per_block, embed, last, head, tied = _counts(model_type, _size_key(m))
    # A token meets its top-k experts only, not the block's every expert.
    if experts := moe_params(model_type, "experts", m):
        count, per_token = generic_split.experts_of(model_type, m)
        per_block -= round(experts * (1 - per_token / max(count, 1)))
    # Norm weights and biases are a rounding error here; the embedding lookup is no matmul, the head is.
    return m.num_layers * per_block + head


def held_copies(model_type: str, m) -> int:
    """A tied head's parameters: the engine's copy of the embedding on the last stage."""
    per_block, embed, last, head, tied = _counts(model_type, _size_key(m))
    return head * tied
