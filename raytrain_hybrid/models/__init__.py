"""Architecture registry: per architecture, data (TP plan, stage boundaries) and a stage forward.

Model code stays the unmodified ``transformers`` modules; parallelism is applied
from outside, driven by the :class:`ArchSpec` of the architecture.
"""

from __future__ import annotations

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models.spec import ArchSpec


def _registry() -> dict[str, ArchSpec]:
    from raytrain_hybrid.models import gpt2, llama, multimodal_bert

    return {"llama": llama.SPEC, "gpt2": gpt2.SPEC, "multimodal-bert": multimodal_bert.SPEC}


def get_arch(name: str) -> ArchSpec:
    registry = _registry()
    if name not in registry:
        raise ConfigError("model.arch", name, f"must be one of {sorted(registry)}")
    return registry[name]


__all__ = ["ArchSpec", "get_arch"]
