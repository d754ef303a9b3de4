"""The run's input on the driver: resolve data.path, check the files, build the Ray Datasets.

data.ray_data is imported where it is used: it imports ray.train, which must come after
launch.session.use_train_v2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.checks import check_tokenizer, schema_check
from raytrain_hybrid.data.prepare import builtin_dataset

# Ray Data's Parquet reader (datasource V2) starts RAY_DATA_PARQUET_FOOTER_NUM_ACTORS (32)
# footer-reading actors, a Python process each, every time a dataset is executed, i.e. once
# per replica leader. For a handful of files that is most of the data path's start-up on a
# small machine; scale them with the files (a user's own setting wins).
_FOOTER_ACTORS = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


def reader_env(cfg: Config) -> dict[str, str]:
    if cfg.data.path == "memory":
        return {}
    if _FOOTER_ACTORS in os.environ:
        return {_FOOTER_ACTORS: os.environ[_FOOTER_ACTORS]}
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
    return finish_input(*check_input(cfg, say), say)


def finish_input(cfg: Config, whole: bool, say=print) -> Config:
    """What check_input left for Ray (``whole``: nothing): the shipped corpus prepared, the rows checked."""
    if whole:
        return cfg
    if cfg.data.path == "builtin":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=builtin_dataset(cfg)))
    schema_check(cfg, say)
    return cfg


def check_input(cfg: Config, say=print) -> tuple[Config, bool]:
    """The input's checks that need no Ray, the same for `check` and for `train` before Ray starts:
    data.path resolved (a classifier's "builtin": the shipped rows), its files, columns and types,
    the tokenizer. Returns the config and whether the check is whole; what is left needs Ray: the
    shipped corpus prepared the first time (its tokenizer is checked here), or the rows of a chat
    data set too large to encode in this process (its columns and tokenizer are checked here)."""
    if cfg.data.text_columns and cfg.data.path in ("builtin", "memory"):  # a classifier: the shipped rows
        from raytrain_hybrid.data.rows import BUILTIN_TRAIN, BUILTIN_VAL

        path = cfg.data.path if cfg.data.path == "memory" else str(BUILTIN_TRAIN)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path))
        if not cfg.data.val_path:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_path=str(BUILTIN_VAL)))
    if cfg.data.path == "memory":
        return cfg, True
    if cfg.data.path == "builtin":
        check_tokenizer(cfg)  # the corpus is tokenized with it
        made = builtin_dataset(cfg, make=False)
        if made is None:
            return cfg, False
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=made))
    return cfg, schema_check(cfg, say, encode_here=False) is not None


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
