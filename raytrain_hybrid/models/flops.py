"""Model FLOPs per token and device peaks, for TFLOP/s and MFU in the step metrics.

FLOPs per token follow the usual accounting (Kaplan et al. 2020; Chowdhury/PaLM
appendix B): 6 per parameter of the matmuls (forward 2, backward 4) plus the
attention score and value products, 12 * layers * heads * head width * seq_len. Recomputation
under activation checkpointing is not counted: MFU measures useful work.
"""

from __future__ import annotations

from raytrain_hybrid.models import get_arch

# Dense bf16 tensor-core peaks per device, TFLOP/s (vendor datasheets: NVIDIA H100 SXM5
# 989.4, A100 SXM4 312). fp32 runs use the same peak: MFU then shows what bf16 would gain.
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L4": 121.0, "A10G": 70.0}


def matmul_params(model) -> int:
    """Parameters that take part in matmuls: everything but norms, biases and lookup tables."""
    return get_arch(model.arch).matmul_params(model)


def tokens_per_row(model) -> int:
    """Tokens of one sample: a window, or every text field of a row."""
    return get_arch(model.arch).text_fields * model.seq_len


def attention_width(model) -> int:
    """Width of the queries (and of the attention's output): heads times the head width, which a
    Llama-family checkpoint may set apart from hidden_size (Qwen3-MoE: 32 heads of 128 at width 2048)."""
    return model.num_heads * (model.head_dim or model.hidden_size // model.num_heads)


def flops_per_token(model) -> float:
    return 6.0 * matmul_params(model) + 12.0 * model.num_layers * attention_width(model) * model.seq_len


def device_peak_tflops(device) -> float | None:
    """Known peak of a CUDA device, or None (CPUs and unknown GPUs: MFU is not reported)."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)
