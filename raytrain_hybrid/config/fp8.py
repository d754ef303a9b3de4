"""train.fp8 across keys: what the float8 linears compose with, and where they can run."""

from __future__ import annotations

import importlib.util

from raytrain_hybrid.errors import ConfigError


def check_fp8(cfg) -> None:
    train = cfg.train
    if train.fp8 == "off":
        if train.fp8_emulate:
            raise ConfigError("train.fp8_emulate", True, 'emulates train.fp8, which is "off"; set train.fp8 too')
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "train.fp8", train.fp8, 'needs torchao: pip install "raytrain-hybrid[fp8]" (or torchao>=0.18)'
        )
    # Rowwise scales are per row of each shard: the plain TP styles serve (TorchTitan's way).
    # Tensorwise wants torchao's float8 TP styles (scales across the shards, float8 all-gathers).
    if cfg.parallelism.tp > 1 and train.fp8 == "tensorwise":
        raise ConfigError(
            "train.fp8",
            train.fp8,
            f"is not supported with tensor parallelism yet (parallelism.tp={cfg.parallelism.tp}); use "
            'train.fp8="rowwise" with tp > 1, or tp=1',
        )
    if cfg.lora.rank:
        raise ConfigError(
            "train.fp8", train.fp8, f'is not supported with LoRA (lora.rank={cfg.lora.rank}); use train.fp8="off"'
        )
    if cfg.cluster.use_gpu is False and not train.fp8_emulate:
        raise ConfigError(
            "train.fp8",
            train.fp8,
            "needs NVIDIA GPUs of compute capability >= 8.9 and cluster.use_gpu=false trains on CPUs; use "
            'train.fp8="off", or train.fp8_emulate=true to check the setup (emulated casts, no speed-up)',
        )
