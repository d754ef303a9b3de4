"""FLOPs accounting used for TFLOP/s and MFU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_hybrid.config import load_config
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.common import build_stage
from raytrain_hybrid.models.flops import flops_per_token, matmul_params, tokens_per_row
from raytrain_hybrid.models.params import param_count


@pytest.mark.parametrize("overrides", [["model.num_kv_heads=2"], ["model.arch=gpt2"]])
def test_matmul_params_counts_every_linear_weight(overrides):
    cfg = load_config(None, overrides)
    spec = get_arch(cfg.model.arch)
    model = build_stage(spec, spec.hf_config(cfg), list(range(cfg.model.num_layers)), first=True, last=True)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_params(cfg.model) == linear
    m = cfg.model
    assert flops_per_token(m) == 6 * linear + 12 * m.num_layers * m.hidden_size * m.seq_len
    assert tokens_per_row(m) == m.seq_len
    # The spec's parameter parts add up to the built model (embeddings, blocks, final norm, head).
    assert param_count(m) == sum(p.numel() for p in model.parameters())


def test_cpu_has_no_mfu():
    from raytrain_hybrid.models.flops import device_peak_tflops

    assert device_peak_tflops(torch.device("cpu")) is None


def test_multimodal_counts_match_the_built_model():
    """Per encoder, the blocks' matmul weights (a row's tokens go through one encoder each);
    the planner's parameter count is every parameter of the built model (MiniLM's sizes)."""
    cfg = load_config(None, ["model.arch=multimodal-bert", "model.seq_len=64"])
    spec = get_arch(cfg.model.arch)
    blocks = list(range(spec.num_blocks(cfg.model)))
    model = build_stage(spec, spec.hf_config(cfg), blocks, first=True, last=True)
    in_blocks = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, nn.Linear))
    assert matmul_params(cfg.model) * 2 == in_blocks
    assert tokens_per_row(cfg.model) == 128
    assert param_count(cfg.model) == sum(p.numel() for p in model.parameters())
