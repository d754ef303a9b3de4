"""Hardware profiles the cost model prices a layout on: shipped ones, or a calibrated JSON file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from raytrain_hybrid.errors import ConfigError

GiB = 1024**3


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    gpus_per_node: int
    memory_bytes: float  # per device
    peak_tflops: float  # dense, in the training dtype
    efficiency: float  # fraction of peak a well-fed matmul-heavy step reaches
    intra_node_gbps: float  # GB/s per device per direction (NVLink / shared memory)
    inter_node_gbps: float  # GB/s per device per direction (InfiniBand / network)
    latency_s: float = 10e-6  # per collective or P2P message
    # CPU profiles (calibrate): cores the ranks share (0: one device per rank), and the
    # measured cost of one TP column/row pair beyond its compute (DTensor dispatch + gloo).
    cores: int = 0
    tp_pair_overhead_s: float = 0.0


# NVIDIA datasheets: H100 SXM5 989 TFLOP/s dense BF16, 80 GB HBM3, NVLink 4 900 GB/s
# bidirectional (450 per direction); DGX H100: 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU).
# A100 SXM4 312 TFLOP/s dense BF16, NVLink 3 600 GB/s bidirectional (300 per direction);
# DGX A100: 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU). Efficiency 0.5: Megatron-LM reports
# 44-52 % of peak on large GPT runs (Narayanan et al. 2021, table 1).
PROFILES = {
    "h100": Hardware(
        name="H100-80GB SXM",
        gpus_per_node=8,
        memory_bytes=80e9,
        peak_tflops=989.0,
        efficiency=0.5,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
    ),
    # torchtitan's published runs (Grand Teton): H100 with 96 GB HBM2e (95 GiB usable), 500 W,
    # 400 Gb/s RDMA per GPU (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md).
    "h100-96": Hardware(
        name="H100-96GB HBM2e",
        gpus_per_node=8,
        memory_bytes=95 * 1024**3,
        peak_tflops=989.0,
        efficiency=0.5,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
    ),
    "a100-80": Hardware(
        name="A100-80GB SXM",
        gpus_per_node=8,
        memory_bytes=80e9,
        peak_tflops=312.0,
        efficiency=0.5,
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
    ),
    "a100-40": Hardware(
        name="A100-40GB SXM",
        gpus_per_node=8,
        memory_bytes=40e9,
        peak_tflops=312.0,
        efficiency=0.5,
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
    ),
}


def load_hardware(name: str) -> Hardware:
    if name in PROFILES:
        return PROFILES[name]
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            "--hardware",
            name,
            f"is neither a built-in profile {sorted(PROFILES)} nor a file (make one with `raytrain-hybrid calibrate`)",
        )
    return Hardware(**json.loads(path.read_text()))
