"""The generic decoder's stage forward (models.generic): what a pipeline stage of any transformers
decoder family runs, the way transformers' own decoders do: embed (and any multiplier the base
model applies), rotary tables and masks per attention type (``layer_types``: full, sliding, a
sparse attention that reads its mask, linear; a type whose ``rope_parameters`` entry is None takes
no rotary tables), the blocks the stage holds, the final norm, and the head through the causal LM's own forward, so the
family's logit scaling and soft-capping are transformers' code."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from raytrain_hybrid.models import generic_facts

if TYPE_CHECKING:
    import torch

# Attributes a base model multiplies its token embeddings by (first stage only), by name.
_EMBEDDING_MULTIPLIERS = ("embedding_multiplier", "embedding_scale")


def per_layer_modules(config_cls) -> tuple[str, ...]:
    """The base model's modules that make per-layer inputs (Gemma 4's embeddings per layer, their
    projection and norm), where its class computes them: they live on the first stage."""
    from transformers import AutoModel

    try:
        base = AutoModel._model_mapping[config_cls]
    except KeyError:  # a causal LM registered without a base model class
        return ()
    if not hasattr(base, "get_per_layer_inputs"):
        return ()
    return ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


def layer_type(config, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _mask(kind: str, config, positions: torch.Tensor, packed: bool, dtype):
    """The mask of one attention type ([rows, 1, s, s]): SDPA's boolean one, or None (causal over
    the row, for full and sliding attention); for transformers' eager attention, which adds its mask
    to the scores, an additive one."""
    import torch

    from raytrain_hybrid.models.packed import document_mask

    if kind == "conv":  # (LFM2's short convolutions take a padding mask only: there is no padding)
        return None
    window = getattr(config, "sliding_window", None) if kind == "sliding_attention" else None
    if window and window >= positions.shape[-1]:  # (Mistral's 4096 over shorter rows: SDPA's causal path)
        window = None
    eager = config._attn_implementation == "eager"
    # Another attention type (DeepSeek's sparse "indexed_attention") reads the mask beside its
    # attention, as transformers' base models give it: always a tensor. (Linear attention, which
    # takes only a padding mask, gets none: there is no padding.)
    other = kind not in ("full_attention", "sliding_attention", "linear_attention")
    if not packed and not window and not eager and not other:
        return None
    seq = positions.shape[-1]
    if packed:
        mask = document_mask(positions)
    else:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()[None, None]
    if window:
        idx = torch.arange(seq, device=positions.device)
        mask = mask & ((idx[:, None] - idx[None, :]) < window)
    if eager:
        blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=positions.device)
        return torch.where(mask, torch.zeros((), dtype=dtype, device=positions.device), blocked)
    return mask


def _nope(config, kind: str) -> bool:
    """A layer type without rotary embeddings: its entry of per-type ``rope_parameters`` is None, or
    (a convolution layer) per-type parameters do not name it."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return False
    if kind in params:
        return params[kind] is None
    return kind == "conv" and all(v is None or isinstance(v, dict) for v in params.values())


def _rotary(inner, h, positions, kinds: set[str]):
    """{layer type: (cos, sin)} (one table for every type, or the family's per-type tables; None
    for a type without rotary embeddings)."""
    # (LFM2's MoE names it pos_emb: else the base model's module of a rotary class)
    rotary = getattr(inner, "rotary_emb", None) or next(
        (m for m in inner.children() if type(m).__name__.endswith("RotaryEmbedding")), None
    )
    if rotary is None:
        return dict.fromkeys(kinds)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return {k: None if _nope(inner.config, k) else rotary(h, positions, layer_type=k) for k in kinds}
    table = rotary(h, positions)
    return dict.fromkeys(kinds, table)


def _attention_scaling(inner, block, positions, kind: str) -> dict:
    """A position-dependent query scale for the layers without rotary embeddings, where the family
    has one (its modeling module's ``compute_attention_scaling``, a block taking ``attention_scaling``)."""
    if not _nope(inner.config, kind) or "attention_scaling" not in inspect.signature(block.forward).parameters:
        return {}
    scale = getattr(inspect.getmodule(type(inner)), "compute_attention_scaling", None)
    return {"attention_scaling": scale(positions)} if scale else {}


class _Hidden:
    """Stands in for the base model inside the causal LM's own forward: hands it the stage's hidden
    states, so the head, logit scaling and soft-capping run as transformers wrote them."""

    def __init__(self) -> None:
        self.value = None

    def __call__(self, *args, **kwargs):
        from transformers.modeling_outputs import MoeModelOutputWithPast

        # (A mixture of experts' head reads router_logits: none, its auxiliary loss is not added;
        # Gemma 4's reads shared_kv_states: none, no cache is kept.)
        out = MoeModelOutputWithPast(last_hidden_state=self.value, router_logits=None)
        out.__dict__["shared_kv_states"] = None
        return out


def stage_forward(stage, x: torch.Tensor, *carried: torch.Tensor):
    """A pipeline stage: embed (first), the blocks it holds, the final norm and head (last).
    ``carried``, passed on beside the hidden states from stage to stage, told apart by type:
    packed rows' per-example positions (data.packing, integers, as in models.llama.stage_forward)
    and a family's per-layer inputs (floats: Gemma 4's, computed from the token ids on the first
    stage, [batch, seq, layers, width], block i reading [:, :, i])."""
    import torch

    position_ids = next((c for c in carried if not c.is_floating_point()), None)
    per_layer = next((c for c in carried if c.is_floating_point()), None)
    inner, config = getattr(stage, stage._generic_prefix), stage.hf_config
    embed_name, layers_name, norm_name, head_name = stage._generic_names
    embed, layers, norm = (getattr(inner, n) for n in (embed_name, layers_name, norm_name))
    first = embed is not None
    h = x
    if first:
        h = embed(x)
        for name in _EMBEDDING_MULTIPLIERS:
            scale = getattr(inner, name, None)
            if isinstance(scale, (int, float)) and scale != 1:
                h = h * scale
        if generic_facts.pre_norm(config.model_type):  # (NanoChat's: the final norm, on every stage)
            h = norm(h)
        if getattr(inner, "hidden_size_per_layer_input", None):  # Gemma 4's per-layer embeddings
            per_layer = inner.project_per_layer_inputs(h, inner.get_per_layer_inputs(x, h))
    packed = position_ids is not None
    if packed:
        # A later stage's first call is the pipeline's shape inference, on uninitialised tensors:
        # positions a family indexes a table with (CodeGen's, GPT-J's) must lie in the row. Real
        # ones always do, so the clamp changes nothing else.
        positions = position_ids.clamp(0, position_ids.shape[-1] - 1)
    else:
        seq = h.shape[1] * getattr(stage, "seq_shards", 1)  # sequence parallelism: h holds 1/seq_shards
        start = seq * getattr(stage, "seq_chunk", 0)  # context parallelism: this rank's slice
        positions = torch.arange(start, start + seq, device=h.device).unsqueeze(0)
    ids = [int(i) for i in layers.keys()]
    kinds = {layer_type(config, i) for i in ids}
    # Context parallelism: the attention sees the whole sequence, so its masks (sliding windows,
    # packed documents) are the whole sequence's, from every cp rank's positions (``whole_positions``,
    # set by distributed.context_parallel); RoPE takes this rank's own positions.
    whole = getattr(stage, "whole_positions", None)
    mask_positions = whole(positions) if whole is not None else positions
    masks = {k: _mask(k, config, mask_positions, packed, h.dtype) for k in kinds}
    tables = _rotary(inner, h, positions, kinds)
    shared_kv: dict = {}  # keys and values a later layer of the stage reuses (Gemma 4), this call's
    for i, block in zip(ids, layers.values(), strict=True):
        kind = layer_type(config, i)
        kwargs: dict[str, Any] = {"attention_mask": masks[kind], "position_ids": positions}
        if tables[kind] is not None or _nope(inner.config, kind):
            kwargs["position_embeddings"] = tables[kind]
        kwargs.update(_attention_scaling(inner, block, positions, kind))
        if "shared_kv_states" in _parameters(block):
            kwargs["shared_kv_states"] = shared_kv
        out = block(h, per_layer[:, :, i], **kwargs) if per_layer is not None else block(h, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
    last = getattr(stage, head_name) is not None
    if norm is not None and last:
        h = norm(h)
    if last:
        lm = stage._generic_lm[0]
        hidden = getattr(lm, stage._generic_prefix)  # the base model's attribute: model, gpt_neox, ...
        hidden.value = h
        try:
            given = {"inputs_embeds": h} if _head_reads_input(type(lm)) else {}
            return lm(logits_to_keep=0, **given).logits
        finally:
            hidden.value = None
    out = (h, *(c for c in (position_ids, per_layer) if c is not None))
    return out if len(out) > 1 else h


@functools.cache
def _head_reads_input(lm_cls) -> bool:
    """Whether the causal LM's forward compares the hidden states' length with its input's (Gemma 4's
    heads): then the stage's hidden states are given as the input (read in its source)."""
    return "inputs_embeds).shape" in inspect.getsource(lm_cls.forward)


def _parameters(block) -> dict:
    """A block's forward's parameters (through an activation-checkpoint wrapper)."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return inspect.signature(inner.forward).parameters


def on_stage(prefix: str, names: tuple[str, str, str, str], stage, model) -> None:
    """After build_stage re-parents ``model``'s children into ``stage``: keep the causal LM (its
    head's forward runs on the last stage) unregistered, its base model replaced by ``_Hidden``
    (its modules are the stage's own, so nothing is held twice)."""
    model._modules.pop(prefix, None)
    object.__setattr__(model, prefix, _Hidden())
    stage._generic_prefix = prefix
    held = getattr(getattr(stage, prefix), names[2], None)  # (a final norm every stage holds: pre_norm)
    if getattr(stage, names[3]) is None and held is not None and any(True for _ in held.parameters()):
        raise NotImplementedError(f"{prefix}.{names[2]} is applied on the first and last stage and has weights")
    stage._generic_names = names  # (embedding, block list, final norm) of the base model, the head
    stage._generic_lm = [model]


def experts_always_used(model, hf_config) -> None:
    """LongCat-Flash routes tokens to zero-computation experts too: a step whose tokens all go there
    leaves a layer's expert weights without a gradient on that rank, while data parallelism's
    gradient reduction (FSDP) needs the same gradients on every rank. A zero-weighted term of the
    weights keeps them in every step's graph: values and gradients are unchanged."""
    if not getattr(hf_config, "zero_expert_num", None):
        return

    def hook(module, args, out):
        return out + sum(p.sum() for p in module.parameters(recurse=False)) * 0

    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_hook(hook)


def learnt_activations(block, tp: int) -> None:
    """An activation with learnt parameters (Apertus's xIELU scalars) that runs between a
    column-sharded projection and its row-sharded partner, in no TP plan: replicated, its input
    the column shard, its gradient summed over tp (the engine's ``headnorm`` style)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = next((p.device_mesh for p in block.parameters() if isinstance(p, DTensor)), None)
    if mesh is None or tp == 1:
        return
    for name, module in block.named_modules():
        learnt = any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))
        if learnt and type(module).__module__ == "transformers.activations":
            # The column shard is the last dimension of [batch, seq, ffn / tp].
            parallelize_module(block, mesh, {name: SequenceParallel(sequence_dim=2, use_local_output=True)})
