"""``raytrain-hybrid``: train | check. Thin: parse, load the config, hand over."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

from raytrain_hybrid.config import LAYOUT_KEYS, load_config
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
    train.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from a checkpoint: a run directory (its newest checkpoint) or checkpoints/step_<N>; "
        "any layout, the same model",
    )
    train.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's own output (start-up notices, raylet warnings, Ray Data progress) on the terminal; "
        "by default it goes to <run.output_dir>/driver.log",
    )
    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoints/step_<N> directory, or a run directory (its newest)")
    export.add_argument("out_dir", help="new directory for config.json + model.safetensors")
    check = sub.add_parser("check", help="validate a config and show the rank layout, without training")
    _add_config_args(check)
    check.add_argument("--topology", help="workers per node, e.g. 4,4 (default: one node holding all workers)")
    check.add_argument("--json", action="store_true", help="print the layout as JSON")
    check.add_argument(
        "--hardware",
        default="",
        help="also print the planner's prediction on h100 | h100-96 | a100-80 | a100-40 | a profile",
    )
    plan = sub.add_parser("plan", help="rank layouts of N ranks by predicted tokens/s (cost model)")
    _add_config_args(plan)
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--gpus-per-node", type=int, required=True)
    plan.add_argument(
        "--hardware", default="h100", help="h100 | h100-96 | a100-80 | a100-40 | a profile file from calibrate"
    )
    plan.add_argument("--top", type=int, default=0, help="show only the best K (0: all)")
    plan.add_argument("--json", action="store_true")
    cal = sub.add_parser("calibrate", help="measure this machine (matmul, gloo) as a planner profile")
    cal.add_argument("--out", default="", help="profile file (default: ~/.cache/raytrain_hybrid/local.json)")
    cal.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    sw = sub.add_parser("sweep", help="run the planner's top layouts with Ray Tune and measure them")
    _add_config_args(sw)
    sw.add_argument("--world-size", type=int, required=True)
    sw.add_argument("--top", type=int, default=4)
    sw.add_argument("--steps", type=int, default=8)
    sw.add_argument("--hardware", default="", help="profile (default: the calibrated local one, else h100)")
    sw.add_argument(
        "--out",
        default="runs/sweep",
        help="directory or URI (s3://, gs://) for sweep.csv, sweep.json, sweep.png and the trials' runs",
    )
    prep = sub.add_parser("prepare-data", help="tokenize text files or Parquet into token Parquet (Ray Data)")
    prep.add_argument("source", help="text files (documents split by blank lines), Parquet, a directory or a glob")
    prep.add_argument("out_dir", help="directory or URI (s3://, gs://) for the Parquet shards")
    prep.add_argument("--text-column", default="text", help="text column of Parquet input (default: text)")
    prep.add_argument(
        "--tokenizer",
        default="",
        help="local tokenizer.json, or a Hugging Face tokenizer or model directory (its eos_token ends each "
        "document; default: the shipped BPE)",
    )
    return parser


def _prepare(args) -> int:
    import ray

    from raytrain_hybrid.data.prepare import prepare_data

    try:
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "")
            ray.init(
                address=address or "local", log_to_driver=False, **({} if address else {"include_dashboard": False})
            )
        stats = prepare_data(args.source, args.out_dir, text_column=args.text_column, tokenizer=args.tokenizer)
    except (FileNotFoundError, ConfigError) as exc:
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

    from raytrain_hybrid.launch.placement import predict_workers_per_node, worker_resources
    from raytrain_hybrid.launch.reach import cluster_reach
    from raytrain_hybrid.launch.session import resolve_use_gpu

    ray.init(address=address, log_to_driver=False)
    reach = cluster_reach(True, cfg.cluster.accelerator_type)  # with the nodes an autoscaler may add
    per_worker = worker_resources(cfg, resolve_use_gpu(cfg, world, reach.nodes))
    counts = predict_workers_per_node(reach.nodes, world, per_worker, cfg.cluster.placement_strategy)
    if counts is None:
        more = " with the nodes its autoscaler may add" if reach.added else " now"
        raise LayoutError(
            f"the cluster at {address} cannot hold {world} workers of {per_worker}{more}; "
            "pass --topology to check a placement you expect (e.g. 8,8)"
        )
    for line in reach.said():
        print(f"placement: {line}")
    return counts


def _auto_layout(args, cfg):
    """check with parallelism.layout=auto: the planner's pick for --topology's nodes (the workers
    each holds) or the connected cluster's; (config at the pick, workers per node)."""
    from raytrain_hybrid.launch.autolayout import pick_for_check

    held = None
    if args.topology:
        try:
            held = [int(c) for c in args.topology.split(",")]
        except ValueError:
            raise ConfigError("--topology", args.topology, "must be workers per node, e.g. 4,4") from None
    elif cfg.cluster.address or os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(address=cfg.cluster.address or os.environ["RAY_ADDRESS"], log_to_driver=False)
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)  # --json: stdout is the JSON
    return pick_for_check(cfg, held, say)


def _check(args, cfg) -> int:
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, placement_report

    counts, asked = None, cfg
    if cfg.parallelism.layout == "auto":  # the planner's pick, printed; then the usual check of it
        cfg, counts = _auto_layout(args, cfg)
    par = cfg.parallelism
    dims = ParallelDims.from_config(par)
    if counts is None and args.topology:
        try:
            counts = [int(c) for c in args.topology.split(",")]
        except ValueError:
            raise ConfigError("--topology", args.topology, "must be workers per node, e.g. 4,4") from None
        if sum(counts) != dims.world_size:
            raise ConfigError(
                "--topology", args.topology, f"places {sum(counts)} workers; the layout needs {dims.world_size}"
            )
    elif counts is None:
        counts = _live_topology(cfg, dims.world_size)
    report = placement_report(dims, counts)
    ranks, groups = report["ranks"], report["groups"]
    from raytrain_hybrid.config.elastic import describe, is_elastic, usable_dps

    if args.json:
        print(json.dumps({"ranks": ranks, "groups": groups, "dp_values": usable_dps(asked.parallelism)}))
        return 0
    print(f"layout ok: dp={par.dp} tp={par.tp} pp={par.pp} on {len(counts)} node(s) {counts}")
    if is_elastic(asked.parallelism):  # parallelism.min_dp: the dp values a start may take
        print(describe(asked))
    print(f"{'rank':>4} {'node':>8} {'pp':>3} {'dp':>3} {'tp':>3}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['node']:>8} {r['pp']:>3} {r['dp']:>3} {r['tp']:>3}")
    for axis, gs in groups.items():
        print(f"{axis} groups: {gs}")
    if args.hardware:
        from raytrain_hybrid.planner.hardware import load_hardware
        from raytrain_hybrid.planner.search import describe

        hw = load_hardware(args.hardware)
        if cfg.cluster.gpus_per_node:
            hw = dataclasses.replace(hw, gpus_per_node=cfg.cluster.gpus_per_node)
        print(f"planner: {describe(cfg, hw)}")
    return 0


def _train(cfg, resume: str | None = None, verbose: bool = False) -> int:
    import ray

    from raytrain_hybrid.launch.driver import run
    from raytrain_hybrid.launch.progress import quiet_driver
    from raytrain_hybrid.launch.rundir import RunDir, mirror_dir

    connected_before = ray.is_initialized()  # e.g. a notebook's or a test's own session
    log = mirror_dir(cfg.run.output_dir) / "driver.log"  # the run dir itself, unless it is a URI
    summary = None
    try:
        with quiet_driver(log, quiet=not verbose) as (out, err, live_log):
            try:
                summary = run(cfg, resume=resume, stream=out, driver_log=live_log)
            except (ConfigError, LayoutError):
                raise
            except Exception as exc:  # a worker failed: Ray's error carries its traceback
                print(f"error: training failed: {exc}", file=err)
                if not verbose:
                    print(f"Ray's output of this run: {log}", file=err)
                return 1
            finally:
                if ray.is_initialized() and not connected_before:
                    ray.shutdown()  # inside: Ray's listener threads print until they stop
    finally:
        if log.exists():  # the run started: its driver.log goes where its other files went
            RunDir.open(cfg.run.output_dir).sync()
    newest = f"; newest checkpoint {summary['checkpoints'][-1]['path']}" if summary["checkpoints"] else ""
    print(
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['mean_tokens_per_s']:,.0f} tokens/s -> {cfg.run.output_dir}{newest}"
        + ("" if verbose else f" (Ray's output: {log.name})")
    )
    return 0


def _plan(args, cfg) -> int:
    from raytrain_hybrid.planner.hardware import load_hardware
    from raytrain_hybrid.planner.search import plan

    hw = dataclasses.replace(load_hardware(args.hardware), gpus_per_node=args.gpus_per_node)
    rows = plan(cfg, args.world_size, hw)
    if not rows:
        raise ConfigError("--world-size", args.world_size, "no layout of that many ranks passes validation")
    shown = rows[: args.top] if args.top else rows
    if args.json:
        # The layout without sequence_parallel, as `plan --json` has always printed it.
        keep = (
            *(k for k in LAYOUT_KEYS if k != "sequence_parallel"),
            "feasible",
            "reason",
            "memory_bytes",
            "predicted_step_s",
            "predicted_tokens_per_s",
            "predicted_mfu",
            "bubble_fraction",
        )
        print(json.dumps([{k: r[k] for k in keep} for r in shown], indent=1))
        return 0
    from raytrain_hybrid.planner.search import format_table

    print(f"{len(rows)} layouts of {args.world_size} ranks on {hw.name}, best first:")
    print(format_table(shown))
    return 0


def _sweep(args, cfg) -> int:
    from raytrain_hybrid.planner.calibrate import default_profile
    from raytrain_hybrid.planner.hardware import load_hardware
    from raytrain_hybrid.storage import open_store
    from raytrain_hybrid.tools.sweep import OUT_KEY, set_line, sweep

    profile = default_profile()
    hw = load_hardware(args.hardware or (str(profile) if profile.exists() else "h100"))
    out = open_store(args.out, OUT_KEY)
    rows = sweep(cfg, args.world_size, hw, top=args.top, steps=args.steps, out_dir=out)
    for r in rows:
        measured = f"{r['measured_tokens_per_s']:,.0f}" if not r["failed"] else f"failed: {r['reason'][:80]}"
        print(f"{r['name']:>40}  predicted {r['predicted_tokens_per_s']:>12,.0f}  measured {measured}")
    ok = [r for r in rows if not r["failed"]]
    if not ok:
        print("error: every trial failed", file=sys.stderr)
        return 1
    best = max(ok, key=lambda r: r["measured_tokens_per_s"])
    print(f"best: {best['name']}  ({best['measured_tokens_per_s']:,.0f} tokens/s); results in {out.uri}")
    print(set_line(best))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "prepare-data":
        return _prepare(args)
    if args.command == "export":
        from raytrain_hybrid.checkpoint.export import export_hf

        try:
            out = export_hf(args.checkpoint, args.out_dir)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {out} (config.json, model.safetensors, tokenizer.json)")
        return 0
    if args.command == "calibrate":
        from pathlib import Path

        from raytrain_hybrid.planner.calibrate import calibrate, default_profile

        path = Path(args.out) if args.out else default_profile()
        profile = calibrate(path, threads=args.threads)
        print(
            f"wrote {path}: {profile['peak_tflops'] * 1e3:.1f} GFLOP/s matmul, "
            f"{profile['intra_node_gbps']:.2f} GB/s gloo all-reduce, {profile['latency_s'] * 1e6:.0f} us latency"
        )
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "check":
            return _check(args, cfg)
        if args.command == "plan":
            return _plan(args, cfg)
        if args.command == "sweep":
            return _sweep(args, cfg)
        return _train(cfg, args.resume, args.verbose)
    except (ConfigError, LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
