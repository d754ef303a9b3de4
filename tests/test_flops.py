"""FLOPs accounting used for TFLOP/s and MFU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_hybrid.config import load_config
from raytrain_hybrid.flops import flops_per_token, matmul_params
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.common import build_stage


@pytest.mark.parametrize("overrides", [["model.num_kv_heads=2"], ["model.arch=gpt2"]])
def test_matmul_params_counts_every_linear_weight(overrides):
    cfg = load_config(None, overrides)
    spec = get_arch(cfg.model.arch)
    model = build_stage(spec, spec.hf_config(cfg.model), list(range(cfg.model.num_layers)), first=True, last=True)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_params(cfg.model) == linear
    m = cfg.model
    assert flops_per_token(m) == 6 * linear + 12 * m.num_layers * m.hidden_size * m.seq_len


def test_cpu_has_no_mfu():
    from raytrain_hybrid.flops import device_peak_tflops

    assert device_peak_tflops(torch.device("cpu")) is None
