"""raytrain_hybrid: DP x TP x PP training of transformers models, orchestrated by Ray.

Public API: :func:`load_config`, :class:`Config`, :func:`train` (launch on Ray),
:class:`ParallelDims`. Everything else is internal and free to change.
"""

from raytrain_hybrid.config import Config, load_config
from raytrain_hybrid.distributed.parallel_dims import ParallelDims
from raytrain_hybrid.errors import ConfigError, LayoutError

__all__ = ["Config", "ConfigError", "LayoutError", "ParallelDims", "load_config", "train"]
__version__ = "0.1.0"


def train(cfg: Config):
    """Run ``cfg`` on Ray Train and return the run summary (see launcher.run)."""
    from raytrain_hybrid.launcher import run

    return run(cfg)
