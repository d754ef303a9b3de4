"""``raytrain-hybrid``: train | check. Thin: parse, load the config, hand over."""

from __future__ import annotations

import argparse
import json
import os
import sys

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError, LayoutError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (default: the embedded 3D-parallel example)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set parallelism.tp=2 (repeatable)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-hybrid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train on Ray (starts a local cluster when none is running)")
    _add_config_args(train)
    check = sub.add_parser("check", help="validate a config and show the rank layout, without training")
    _add_config_args(check)
    check.add_argument("--topology", help="workers per node, e.g. 4,4 (default: one node holding all workers)")
    check.add_argument("--json", action="store_true", help="print the layout as JSON")
    prep = sub.add_parser("prepare-data", help="tokenize text files or Parquet into token Parquet (Ray Data)")
    prep.add_argument("source", help="text files (documents split by blank lines), Parquet, a directory or a glob")
    prep.add_argument("out_dir", help="directory (or URI) for the Parquet shards")
    prep.add_argument("--text-column", default="text", help="text column of Parquet input (default: text)")
    prep.add_argument("--tokenizer", default="", help="local tokenizer.json (default: the shipped BPE)")
    return parser


def _prepare(args) -> int:
    import ray

    from raytrain_hybrid.data_prep import prepare_data

    try:
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "")
            ray.init(
                address=address or "local", log_to_driver=False, **({} if address else {"include_dashboard": False})
            )
        stats = prepare_data(args.source, args.out_dir, text_column=args.text_column, tokenizer=args.tokenizer)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {stats['tokens']:,} tokens to {stats['out_dir']}")
    return 0


def _live_topology(cfg, world: int) -> list[int]:
    """Workers per node that a placement on the running cluster would give; one node without one."""
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if not address:
        return [world]
    import ray

    from raytrain_hybrid.launcher import _use_gpu
    from raytrain_hybrid.placement import live_node_totals, predict_workers_per_node, worker_resources

    ray.init(address=address, log_to_driver=False)
    per_worker = worker_resources(cfg, _use_gpu(cfg, world))
    counts = predict_workers_per_node(live_node_totals(), world, per_worker, cfg.cluster.placement_strategy)
    if counts is None:
        raise LayoutError(
            f"the cluster at {address} cannot hold {world} workers of {per_worker} now; "
            "pass --topology to check a placement you expect (e.g. 8,8)"
        )
    return counts


def _check(args, cfg) -> int:
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks, axis_groups

    par = cfg.parallelism
    dims = ParallelDims(dp=par.dp, tp=par.tp, pp=par.pp, zero=par.zero)
    if args.topology:
        try:
            counts = [int(c) for c in args.topology.split(",")]
        except ValueError:
            raise ConfigError("--topology", args.topology, "must be workers per node, e.g. 4,4") from None
        if sum(counts) != dims.world_size:
            raise ConfigError(
                "--topology", args.topology, f"places {sum(counts)} workers; the layout needs {dims.world_size}"
            )
    else:
        counts = _live_topology(cfg, dims.world_size)
    nodes = [f"node{i}" for i, c in enumerate(counts) for _ in range(c)]
    arrangement = arrange_ranks(dims, nodes)
    ranks = []
    for slot, rank in enumerate(arrangement):
        ranks.append({"rank": rank, "node": nodes[rank], **dims.coords(slot)})
    ranks.sort(key=lambda r: r["rank"])
    groups = axis_groups(dims, arrangement)
    if args.json:
        print(json.dumps({"ranks": ranks, "groups": groups}))
        return 0
    print(f"layout ok: dp={par.dp} tp={par.tp} pp={par.pp} on {len(counts)} node(s) {counts}")
    print(f"{'rank':>4} {'node':>8} {'pp':>3} {'dp':>3} {'tp':>3}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['node']:>8} {r['pp']:>3} {r['dp']:>3} {r['tp']:>3}")
    for axis, gs in groups.items():
        print(f"{axis} groups: {gs}")
    return 0


def _train(cfg) -> int:
    from raytrain_hybrid.launcher import run

    try:
        summary = run(cfg)
    except (ConfigError, LayoutError):
        raise
    except Exception as exc:  # a worker failed: Ray's error carries its traceback
        print(f"error: training failed: {exc}", file=sys.stderr)
        return 1
    print(
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['mean_tokens_per_s']:,.0f} tokens/s -> {cfg.run.output_dir}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "prepare-data":
        return _prepare(args)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "check":
            return _check(args, cfg)
        return _train(cfg)
    except (ConfigError, LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
