"""Ray Datasets of the run's input, read in a defined order, and the DataConfig that hands every rank
an iterator over all of it (replica leaders read; see data.stream).
"""

from __future__ import annotations

from ray.train import DataConfig

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.tokenizer import end_of_text, resolve_tokenizer


def build_rows_dataset(cfg: Config, path: str):
    """Classifiers: the labelled rows of ``path``, tokenized and encoded in Ray Data's tasks."""
    import ray.data

    from raytrain_hybrid.data.rows import encode, encoder_kwargs

    d = cfg.data
    kwargs = encoder_kwargs(cfg)
    ds = ray.data.read_parquet(path).select_columns([*d.text_columns, *d.tabular_columns, d.label_column])
    return ds.map_batches(lambda b: encode(b, **kwargs), batch_format="numpy", batch_size=256)


def build_dataset(cfg: Config):
    """The Ray Dataset the trainer streams: documents with token ids (tokenized here if text)."""
    import ray.data

    from raytrain_hybrid.data.prepare import tokenize_batch

    d = cfg.data
    if d.text_columns:  # a classifier's rows (resolve_defaults() fills text_columns for those only)
        return build_rows_dataset(cfg, d.path)
    if d.format != "text":  # chat / prompt_completion: one example a row, with its label mask
        from raytrain_hybrid.data.chat import ExampleSpec, encode_table

        spec = ExampleSpec.of(cfg)
        ds = ray.data.read_parquet(d.path, include_paths=True).select_columns([*spec.columns, "path"])
        return ds.map_batches(encode_table, fn_kwargs={"spec": spec}, batch_format="pyarrow", batch_size=64)
    ds = ray.data.read_parquet(d.path, include_paths=True).select_columns([d.text_column or d.token_column, "path"])
    if d.text_column:
        tokenizer, eos = resolve_tokenizer(cfg), end_of_text(cfg)
        ds = ds.map_batches(
            lambda b: tokenize_batch(b, text_column=d.text_column, tokenizer=tokenizer, eos=eos).append_column(
                "path", b.column("path")
            ),
            batch_format="pyarrow",
            batch_size=256,
        )
    return ds


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
