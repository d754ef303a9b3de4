"""Ray Datasets of the run's input, read in a defined order, and the DataConfig that hands every rank
an iterator over all of it (replica leaders read; see data.stream).
"""

from __future__ import annotations

from ray.train import DataConfig

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.forms import row_form


def build_rows_dataset(cfg: Config, path: str):
    """Classifiers: the labelled rows of ``path`` (data.val_path), encoded in Ray Data's tasks."""
    return build_dataset(cfg, path)


def build_dataset(cfg: Config, path: str | None = None):
    """The Ray Dataset the trainer streams from data.path (or ``path``), in data.forms' form:
    documents with token ids (tokenized here if text), examples or labelled rows, encoded here."""
    import ray.data

    form = row_form(cfg)
    ds = ray.data.read_parquet(path or cfg.data.path, include_paths=form.paths)
    ds = ds.select_columns([*form.columns, *(["path"] if form.paths else [])])
    if form.encode is None:
        return ds
    return ds.map_batches(form.encode, batch_format=form.batch_format, batch_size=form.batch_size)


class ReplicaDataConfig(DataConfig):
    """Every rank gets an iterator over the whole ordered dataset; only replica leaders use it
    (see the module docstring). Nothing is split here: the split is by position in the stream."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        out = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            for rank in range(world_size):
                out[rank][name] = ordered_iterator(ds)
        return out


def ordered_iterator(ds):
    """An iterator over ``ds`` in its defined order: the order is what defines the batches."""
    ds = ds.copy(ds)
    ds.context.execution_options.preserve_order = True
    return ds.iterator()
