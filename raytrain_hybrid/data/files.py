"""The input's Parquet files opened for its checks (data.checks, data.example_checks), with what is
wrong said in plain words."""

from __future__ import annotations

import pyarrow as pa


def open_parquet(key: str, path: str):
    """``path`` (data.path, data.val_path) as a pyarrow dataset of at least one Parquet file, or a
    ConfigError that says in plain words what is wrong: it does not exist, it holds no Parquet, or
    its files are not Parquet."""
    import os

    import pyarrow.dataset as pads

    from raytrain_hybrid.errors import ConfigError, storage_reason
    from raytrain_hybrid.storage import is_uri

    local = path[len("file://") :] if path.startswith("file://") else None if is_uri(path) else path
    if local is not None and not os.path.exists(local):
        where = f" (relative to {os.getcwd()})" if not os.path.isabs(local) else ""
        raise ConfigError(
            key,
            path,
            f"does not exist{where}; give a Parquet file or a directory of them "
            "(`raytrain-hybrid prepare-data` makes one from text files)",
        )
    try:
        if local is None:  # an object store, asked with bounded waits: one that does not answer is
            # said in seconds (check: "not verified"), not after the SDK's minutes of retries
            import pyarrow.fs as pafs

            from raytrain_hybrid.models.hf_checkpoint import bounded_waits

            fs, root = pafs.FileSystem.from_uri(path)
            fs = bounded_waits(fs, request_s=10)  # footers and listings are small
            dataset = pads.dataset(root, format="parquet", filesystem=fs)
        else:
            dataset = pads.dataset(path, format="parquet")
        files = dataset.files
    except (OSError, pa.ArrowInvalid) as exc:
        reason = storage_reason(exc) if local is None else exc  # (a cloud SDK's error in a line)
        raise ConfigError(key, path, f"cannot be read as Parquet: {reason}") from exc
    if not files:
        raise ConfigError(key, path, "holds no Parquet files")
    return dataset


def columns_fix(names: list[str], path: str) -> str:
    """A column a key names is not in ``path``: ``is not a column of x.parquet, which has columns a, b``."""
    return f"is not a column of {path}, which has columns {', '.join(names) or '(none)'}; name one of them"
