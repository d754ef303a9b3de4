"""Build one pipeline stage of a model on the meta device, and initialise weights.

A stage keeps the transformers module tree and its parameter names
(``model.layers.3.mlp.up_proj.weight`` on whichever stage holds block 3), so a
checkpoint written under one layout loads under another. Blocks a stage does not
own are dropped, not renumbered; so are embeddings and head on middle stages.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from raytrain_hybrid.models.spec import ArchSpec


class StageModule(nn.Module):
    """The model's top-level children, re-parented so parameter names stay unchanged."""

    def __init__(self, model: nn.Module, spec: ArchSpec, hf_config) -> None:
        super().__init__()
        for name, child in model._modules.items():  # None entries too: pruned modules
            self.add_module(name, child)
        self._spec = spec
        self.hf_config = hf_config  # read by stage forwards (multimodal-bert: its encoder depth)

    def forward(self, *xs: torch.Tensor):
        return self._spec.stage_forward(self, *xs)


def _set_submodule(root: nn.Module, path: str, value) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, value)


def build_stage(spec: ArchSpec, hf_config, layer_ids: list[int], first: bool, last: bool) -> StageModule:
    """The stage holding blocks ``layer_ids`` (global indices), on the meta device."""
    with torch.device("meta"):
        model = spec.build(hf_config)
    blocks = model.get_submodule(spec.layers)
    # A ModuleDict keyed by the global index keeps "layers.<i>" names after pruning.
    _set_submodule(model, spec.layers, nn.ModuleDict({str(i): blocks[i] for i in layer_ids}))
    for path in spec.first_stage if not first else ():
        _set_submodule(model, path, None)
    for path in spec.last_stage if not last else ():
        _set_submodule(model, path, None)
    for path, block in spec.anchors(hf_config).items():
        if block not in layer_ids:
            _set_submodule(model, path, None)
    stage = StageModule(model, spec, hf_config)
    if spec.on_stage is not None:
        spec.on_stage(stage, model)
    return stage


def param_kinds(module: nn.Module) -> dict[str, str]:
    """Parameter name -> "normal" | "zeros" | "ones", read off module types (any device)."""
    kinds = {}
    for mod_name, mod in module.named_modules():
        for p_name, param in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(mod, (nn.Linear, nn.Embedding)) or p_name == "weight" and mod.__class__.__name__ == "Conv1D":
                kinds[full] = "normal" if p_name == "weight" else "zeros"
            elif param.dim() >= 2:  # matrices outside nn.Linear: a router's, experts' stacked 3D weights
                kinds[full] = "normal"
            elif p_name == "bias":
                kinds[full] = "zeros"
            else:  # norm scales (LayerNorm, RMSNorm)
                kinds[full] = "ones"
    return kinds


def init_value(name: str, shape: torch.Size, kind: str, seed: int, std: float) -> torch.Tensor:
    """A parameter's full initial value, a function of (seed, name) only, so every layout agrees."""
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * std


def full_init_state_dict(module: nn.Module, seed: int, std: float, shapes: dict[str, torch.Size]) -> dict:
    kinds = param_kinds(module)
    return {name: init_value(name, shapes[name], kinds[name], seed, std) for name in shapes}
