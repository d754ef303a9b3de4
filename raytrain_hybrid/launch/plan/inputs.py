"""The run's input on the driver: resolve data.path, check the files, build the Ray Datasets.

data.ray_data is imported where it is used: it imports ray.train, which must come after
launch.runtime.session.use_train_v2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.checks import check_tokenizer, schema_check
from raytrain_hybrid.data.files import open_parquet
from raytrain_hybrid.data.prepare import builtin_dataset, builtin_path
from raytrain_hybrid.launch.plan.run_plan import DataSource

# Ray Data's Parquet reader (datasource V2) starts RAY_DATA_PARQUET_FOOTER_NUM_ACTORS (32)
# footer-reading actors, a Python process each, every time a dataset is executed, i.e. once
# per replica leader. For a handful of files that is most of the data path's start-up on a
# small machine; scale them with the files (a user's own setting wins).
_FOOTER_ACTORS = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


def reader_env(cfg: Config, files: int | None = None) -> dict[str, str]:
    """Ray Data's readers' environment for data.path's ``files`` (None: listed here)."""
    if cfg.data.path == "memory":
        return {}
    if _FOOTER_ACTORS in os.environ:
        return {_FOOTER_ACTORS: os.environ[_FOOTER_ACTORS]}
    if files is None:
        import pyarrow.dataset as pads

        files = len(pads.dataset(cfg.data.path, format="parquet").files)
    return {_FOOTER_ACTORS: str(min(32, max(1, math.ceil(files / 64))))}


def build_datasets(cfg: Config, env: dict[str, str]) -> dict:
    """TorchTrainer's ``datasets`` and ``dataset_config``, built with the readers' ``env`` set
    in this process too: Ray Data reads it where a dataset is built, here on the driver."""
    if cfg.data.path == "memory":
        return {}
    from raytrain_hybrid.data.ray_data import ReplicaDataConfig, build_dataset, build_rows_dataset

    with _environment(env):
        datasets = {"train": build_dataset(cfg)}
        if cfg.data.val_path:
            datasets["val"] = build_rows_dataset(cfg, cfg.data.val_path)
    return {"datasets": datasets, "dataset_config": ReplicaDataConfig()}


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def prepare_input(cfg: Config, say=print) -> Config:
    """Resolve data.path ("builtin" is prepared once) and check the files before workers start;
    ``say`` gets the check's warnings (rows of chat / prompt_completion data cut or dropped)."""
    cfg, source = check_input(cfg, say)
    finish_input(cfg, source, say)
    return cfg


def finish_input(cfg: Config, source: DataSource, say=print) -> None:
    """What check_input left for Ray (``source.checked``: nothing): the shipped corpus prepared
    into the path the plan names (data.prepare.builtin_path), the rows checked."""
    if source.checked:
        return
    if source.shipped:
        builtin_dataset(cfg)
    schema_check(cfg, say)


def check_input(cfg: Config, say=print) -> tuple[Config, DataSource]:
    """The input's checks that need no Ray, the same for `check` and for `train` before Ray starts:
    data.path resolved (a classifier's "builtin": the shipped rows), its files, columns and types,
    the tokenizer. Returns the config and the input as checked; what is left needs Ray
    (``checked`` false): the shipped corpus prepared the first time (its tokenizer is checked
    here, and data.path is already where it goes), or the rows of a chat data set too large to
    encode in this process (its columns and tokenizer are checked here)."""
    if cfg.data.text_columns and cfg.data.path in ("builtin", "memory"):  # a classifier: the shipped rows
        from raytrain_hybrid.data.rows import BUILTIN_TRAIN, BUILTIN_VAL

        path = cfg.data.path if cfg.data.path == "memory" else str(BUILTIN_TRAIN)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path))
        if not cfg.data.val_path:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_path=str(BUILTIN_VAL)))
    if cfg.data.path == "memory":
        return cfg, DataSource("memory", cfg.data.format)
    if cfg.data.path == "builtin":
        check_tokenizer(cfg)  # the corpus is tokenized with it
        made = builtin_dataset(cfg, make=False)
        if made is None:
            # Prepared into its cache once Ray is up (Ray Data tokenizes it); one Ray Data write of
            # the shipped corpus (650 KB) is one Parquet file.
            path = str(builtin_path(cfg))
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path))
            return cfg, DataSource(path, cfg.data.format, files=1, checked=False, shipped=True)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=made))
    rows = schema_check(cfg, say, encode_here=False)
    dataset = open_parquet("data.path", cfg.data.path)  # its footers read by the check just made
    columns = tuple(dataset.schema.names)
    return cfg, DataSource(cfg.data.path, cfg.data.format, columns, rows, len(dataset.files), rows is not None)


def steps_to_train(cfg: Config) -> int:
    """train.steps, or fewer where data.epochs passes over a classifier's rows hold fewer global
    batches (data.rows.steps_in_passes): known before the run, so that the last step evaluates
    and the progress counts to it.
    A language model's windows are known only as its documents are tokenized and packed; its
    run ends at the first step with no batch (engine.worker.StepLoop)."""
    d = cfg.data
    if not (d.epochs and d.text_columns):
        return cfg.train.steps
    import pyarrow.dataset as pads

    from raytrain_hybrid.data.rows import BUILTIN_TRAIN, steps_in_passes  # "memory", "builtin": the shipped rows

    path = str(BUILTIN_TRAIN) if d.path in ("memory", "builtin") else d.path
    rows = pads.dataset(path, format="parquet").count_rows()
    return min(cfg.train.steps, steps_in_passes(rows, d.epochs, cfg.train.global_batch_size))
