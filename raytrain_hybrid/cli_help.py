"""The command line's help text and argument types (kept apart from cli.py, which stays a thin
parser and one function per command)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Train PyTorch / Hugging Face transformers models with data, tensor and pipeline parallelism
(DP x TP x PP, ZeRO) on a Ray cluster, or on a private local Ray on one machine.
A run is a TOML config (or the built-in tiny example) plus --set KEY=VALUE overrides;
check and plan show where ranks go and what a layout costs before anything trains."""

EPILOG = """\
examples:
  raytrain-hybrid train                              # the built-in tiny 3D example, local Ray, CPU
  raytrain-hybrid train my_run.toml --set train.steps=50 --set run.output_dir=runs/a
  raytrain-hybrid check my_run.toml --topology 8,8 --hardware h100
  raytrain-hybrid plan --world-size 64 --gpus-per-node 8 --hardware h100 --top 5
  raytrain-hybrid prepare-data my_texts/ data/tokens --tokenizer /models/my-model
  raytrain-hybrid train --resume runs/a --set train.steps=100 --set run.output_dir=runs/a
  raytrain-hybrid export runs/a hf_model/
  ray job submit --address http://HEAD:8265 --working-dir . -- raytrain-hybrid train my_run.toml

Ray cluster: train, check, sweep and prepare-data join --address (or cluster.address), else
$RAY_ADDRESS (Ray sets it inside `ray job submit` jobs), else start a private local Ray.
That address is the cluster's GCS address (host:6379, or auto on one of its nodes), not the
dashboard's http://host:8265 that `ray job submit` takes.

exit codes:
  0  success
  1  the run failed (a worker, Ray, every sweep trial)
  2  bad input: a flag, config key, file, layout or address that cannot work
     (the message names it, its value and what would work)

run `raytrain-hybrid COMMAND --help` for a command's flags."""

ADDRESS_HELP = (
    "the Ray cluster to join: HOST:6379 (the head's GCS address), auto (the cluster this node is in) or "
    "local (a private local Ray); default: cluster.address, else $RAY_ADDRESS, else a private local Ray"
)


def version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("raytrain-hybrid")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def count(minimum: int):
    """An argparse type: an integer >= minimum (argparse reports anything else, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


def topology(text: str) -> list[int]:
    """An argparse type: workers per node, e.g. 4,4."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not workers per node, e.g. 4,4")
    return counts


def csv(counts: list[int]) -> str:
    """4,4 for [4, 4]."""
    return ",".join(map(str, counts))
