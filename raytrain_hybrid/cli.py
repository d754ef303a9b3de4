"""``raytrain-hybrid``: the command line. Parse, load the config, call one function per command."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

from raytrain_hybrid.cli_help import ADDRESS_HELP, DESCRIPTION, EPILOG, count, topology, version
from raytrain_hybrid.config import LAYOUT_KEYS, load_config
from raytrain_hybrid.errors import ConfigError, LayoutError, redact


def _add_config_args(p: argparse.ArgumentParser, address: bool = True) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (default: the built-in tiny 3D-parallel example)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set parallelism.tp=2 (repeatable)",
    )
    if address:
        p.add_argument("--address", default="", metavar="ADDRESS", help=f"{ADDRESS_HELP}; sets cluster.address")


def _command(sub, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text)


def _add_resume_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from a checkpoint: a run directory (its newest checkpoint) or checkpoints/step_<N>; "
        "any layout, the same model",
    )
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: let this key differ from the checkpoint's on purpose (repeatable, or KEY,KEY): "
        "train.global_batch_size, train.seed, train.lr, train.min_lr_ratio, train.warmup_steps, data.path, "
        "data.tokenizer, data.shuffle_seed, ...; a data or batch-size change starts the data from its beginning",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raytrain-hybrid",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}", help="print the version")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    train = _command(sub, "train", "train on Ray (join a cluster, or start a local one), or under torchrun without Ray")
    _add_config_args(train)
    _add_resume_args(train)
    train.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's own output (start-up notices, raylet warnings, Ray Data progress) on the terminal; "
        "by default it goes to <run.output_dir>/driver.log",
    )
    export = _command(sub, "export", "write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoints/step_<N> directory, or a run directory (its newest)")
    export.add_argument("out_dir", help="new directory for config.json + model.safetensors")
    export.add_argument(
        "--merge",
        action="store_true",
        help="of a LoRA run (lora.rank > 0): write the pretrained model with the adapters merged into its "
        "weights, which transformers loads alone (default: a PEFT adapter directory, adapter_config.json + "
        "adapter_model.safetensors, for peft.PeftModel.from_pretrained on the base model)",
    )
    check = _command(
        sub, "check", "validate a config, show where each rank goes and how train would start, without training"
    )
    _add_config_args(check)
    check.add_argument(
        "--topology",
        metavar="N,N,...",
        type=topology,
        help="workers per node, e.g. 4,4 (default: the joined cluster's placement, else one node holding all)",
    )
    _add_resume_args(check)
    check.add_argument("--json", action="store_true", help="print the ranks, groups and the run plan as JSON on stdout")
    check.add_argument(
        "--hardware",
        default="",
        help="also print the planner's prediction on h100 | h100-96 | a100-80 | a100-40 | a profile",
    )
    plan = _command(sub, "plan", "rank the layouts of N ranks by predicted tokens/s (the planner's cost model)")
    _add_config_args(plan, address=False)
    plan.add_argument(
        "--world-size", type=count(1), required=True, metavar="N", help="number of ranks (GPUs) to lay out"
    )
    plan.add_argument(
        "--gpus-per-node",
        type=count(1),
        required=True,
        metavar="N",
        help="GPUs per node (TP groups stay inside a node)",
    )
    plan.add_argument(
        "--hardware", default="h100", help="h100 | h100-96 | a100-80 | a100-40 | a profile file from calibrate"
    )
    plan.add_argument(
        "--top", type=count(0), default=0, metavar="K", help="show only the best K layouts (default 0: all)"
    )
    plan.add_argument("--json", action="store_true", help="print the layouts as a JSON list instead of a table")
    cal = _command(sub, "calibrate", "measure this machine (matmul, gloo) as a planner hardware profile")
    cal.add_argument("--out", default="", help="profile file (default: ~/.cache/raytrain_hybrid/local.json)")
    cal.add_argument("--threads", type=count(1), default=1, metavar="N", help="torch threads per worker (default 1)")
    sw = _command(sub, "sweep", "train the planner's top layouts briefly with Ray Tune and measure them")
    _add_config_args(sw)
    sw.add_argument("--world-size", type=count(1), required=True, metavar="N", help="number of workers each trial uses")
    sw.add_argument(
        "--top", type=count(1), default=4, metavar="K", help="how many of the best predicted layouts to run (4)"
    )
    sw.add_argument("--steps", type=count(1), default=8, metavar="N", help="training steps per trial (default 8)")
    sw.add_argument("--hardware", default="", help="profile (default: the calibrated local one, else h100)")
    sw.add_argument(
        "--out",
        default="runs/sweep",
        help="directory or URI (s3://, gs://) for sweep.csv, sweep.json, sweep.png and the trials' runs",
    )
    lh = _command(
        sub, "lighthouse", "run the torchft Lighthouse that a fault-tolerant run's replica groups meet at, until Ctrl-C"
    )
    lh.add_argument("--port", type=count(0), default=29510, metavar="N", help="port to listen on (default 29510)")
    lh.add_argument(
        "--min-replicas",
        type=count(1),
        default=1,
        metavar="N",
        help="the fewest replica groups a quorum is formed with (default 1; see fault_tolerance.min_replicas)",
    )
    lh.add_argument(
        "--join-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="how long a quorum waits for groups that are up but have not asked to join (default 60)",
    )
    lh.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=5.0,
        metavar="S",
        help="a group not heard from for this long is out of the next quorum (default 5)",
    )
    prep = _command(sub, "prepare-data", "tokenize text files or Parquet into token Parquet shards (Ray Data)")
    prep.add_argument("source", help="text files (documents split by blank lines), Parquet, a directory or a glob")
    prep.add_argument("out_dir", help="directory or URI (s3://, gs://) for the Parquet shards")
    prep.add_argument("--text-column", default="text", help="text column of Parquet input (default: text)")
    prep.add_argument(
        "--tokenizer",
        default="",
        help="local tokenizer.json, or a Hugging Face tokenizer or model directory (its eos_token ends each "
        "document; default: the shipped BPE)",
    )
    prep.add_argument("--address", default="", metavar="ADDRESS", help=ADDRESS_HELP)
    prep.add_argument(
        "--verbose", action="store_true", help="show Ray's own output on the terminal (default: a log file)"
    )
    return parser


def _prepare(args) -> int:
    from raytrain_hybrid.launch.runtime.quiet_run import prepare_command

    kw = {"text_column": args.text_column, "tokenizer": args.tokenizer, "address": args.address}
    return prepare_command(args.source, args.out_dir, verbose=args.verbose, **kw)


def _say(args):
    """print, on stderr with --json (its stdout is the JSON)."""
    return functools.partial(print, file=sys.stderr if args.json else sys.stdout)


def _check(args, cfg, unverified: list[str] | None = None) -> int:
    from raytrain_hybrid.config.elastic import describe, is_elastic, usable_dps
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, placement_lines, placement_report
    from raytrain_hybrid.launch.runtime.startcheck import check_layout, check_plan

    for note in unverified or ():  # what could not be read here (no network, no credentials)
        _say(args)(redact(f"not verified: {note}"))
    if cfg.fault_tolerance.enabled:  # a launch is one replica group, or every group: checked as train does
        from raytrain_hybrid.launch.runtime.ft_groups import describe, group_resume
        from raytrain_hybrid.launch.runtime.lighthouse import group_launch

        every = cfg.fault_tolerance.replica_group < 0
        if every:
            _say(args)(describe(cfg))
            args.resume = group_resume(args.resume, 0)  # group 0's, as train gives it (refused as there)
        cfg = group_launch(cfg, None, "", every=every)
    asked = cfg
    cfg, counts, reach = check_layout(cfg, args.topology, _say(args))  # layout=auto: the planner's pick, printed
    par = cfg.parallelism
    report = placement_report(ParallelDims.from_config(par), counts)
    notes, said = [], []  # the driver's start plan, made as it would make it; refused where it would refuse
    plan = check_plan(cfg, asked, args.topology, args.resume, args.allow_change, notes, said.append, reach)
    for note in notes:
        _say(args)(redact(f"not verified: {note}"))
    if args.json:
        for line in said:
            _say(args)(line)
        start = {"line": plan.lines()[0], **plan.facts()}
        dps = usable_dps(asked.parallelism)
        # "plan": the whole RunPlan train would run (launch.runtime.start.RunPlan.to_json)
        listed = {k: report[k] for k in ("ranks", "groups", "totals")}  # (a huge layout's: summarized)
        print(json.dumps({**listed, "dp_values": dps, "start": start, "plan": plan.to_json()}))
        return 0
    cp = f" cp={par.cp}" if par.cp > 1 else ""
    cp += f" ep={par.ep}" if par.ep > 1 else ""  # expert parallelism: experts over ep of the dp replicas
    print(f"layout ok: dp={par.dp}{cp} tp={par.tp} pp={par.pp} on {len(counts)} node(s) {counts}")
    if "cp_placement" in report:
        print(report["cp_placement"])
    if "hsdp_placement" in report:  # parallelism.replicate: the shard and replica groups
        print(report["hsdp_placement"])
    if is_elastic(asked.parallelism):  # parallelism.min_dp: the dp values a start may take
        print(describe(asked))
    if cfg.train.fp8 != "off":  # the linears in float8, and those left in train.dtype
        from raytrain_hybrid.distributed.fp8 import describe_fp8

        print(describe_fp8(cfg))
    print("\n".join(placement_lines(report, par.ep)))  # the rank table and the groups (summarized when huge)
    print(redact("\n".join([*said, *plan.lines(), f"lease: {plan.lease}"])))  # as the driver says them
    print(redact("\n".join(plan.detail_lines())))  # the rest of the plan train runs
    if args.hardware:
        from raytrain_hybrid.planner.hardware import load_hardware
        from raytrain_hybrid.planner.search import describe

        hw = load_hardware(args.hardware)
        if cfg.cluster.gpus_per_node:
            hw = dataclasses.replace(hw, gpus_per_node=cfg.cluster.gpus_per_node)
        # The model's sizes are the checkpoint's: without them, those the config file gives (which the
        # checkpoint's config.json must agree with), else no prediction rather than one that misleads.
        unread = any(n.startswith("model.pretrained=") for n in unverified or ())
        given = any(getattr(cfg.model, k) != getattr(type(cfg.model)(), k) for k in ("num_layers", "hidden_size"))
        if unread and not given:
            print("planner: not run: it needs the model sizes in the checkpoint's config.json, unread here")
        else:
            print(f"planner: {describe(cfg, hw)}" + (" (the model sizes the config file gives)" if unread else ""))
    return 0


def _train(cfg, resume: str | None = None, verbose: bool = False, allow_change: list[str] | None = None, source=None):
    from raytrain_hybrid.launch.runtime.quiet_run import train_command  # under torchrun: without Ray

    return train_command(cfg, resume, verbose, allow_change, source)


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
            "cp",  # context parallelism (added after the keys plan --json has always printed)
            "ep",  # expert parallelism (mixtures of experts)
        )
        print(json.dumps([{k: r[k] for k in keep} for r in shown], indent=1))
        return 0
    from raytrain_hybrid.planner.search import format_table

    print(f"{len(rows)} layouts of {args.world_size} ranks on {hw.name}, best first:")
    print(format_table(shown))
    return 0


def _sweep(args, cfg) -> int:
    from raytrain_hybrid.launch.plan.address import ray_address
    from raytrain_hybrid.planner.calibrate import default_profile
    from raytrain_hybrid.planner.hardware import load_hardware
    from raytrain_hybrid.planner.search import plan
    from raytrain_hybrid.storage import open_store
    from raytrain_hybrid.tools.sweep import OUT_KEY, set_line, sweep

    ray_address(cfg)  # an address that cannot be joined is refused before anything is written
    profile = default_profile()
    hw = load_hardware(args.hardware or (str(profile) if profile.exists() else "h100"))
    if not any(r["feasible"] for r in plan(cfg, args.world_size, hw)):
        raise ConfigError(
            "--world-size", args.world_size, f"no layout of that many ranks fits {hw.name}: see `raytrain-hybrid plan`"
        )
    out = open_store(args.out, OUT_KEY)
    rows = sweep(cfg, args.world_size, hw, top=args.top, steps=args.steps, out_dir=out)
    for r in rows:
        measured = f"{r['measured_tokens_per_s']:,.0f}" if not r["failed"] else f"failed: {redact(r['reason'])[:80]}"
        print(f"{r['name']:>40}  predicted {r['predicted_tokens_per_s']:>12,.0f}  measured {measured}")
    ok = [r for r in rows if not r["failed"]]
    if not ok:
        print("error: every trial failed", file=sys.stderr)
        return 1
    best = max(ok, key=lambda r: r["measured_tokens_per_s"])
    print(f"best: {best['name']}  ({best['measured_tokens_per_s']:,.0f} tokens/s); results in {out.uri}")
    print(set_line(best))
    return 0


def _calibrate(args) -> int:
    import os
    from pathlib import Path

    from raytrain_hybrid.planner.calibrate import calibrate, default_profile

    path = Path(args.out) if args.out else default_profile()
    try:  # refused before the minute of measuring, not after
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--out", str(path), f"its directory cannot be made: {exc.strerror}") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise ConfigError("--out", str(path), "must be a file in a directory you can write to")
    profile = calibrate(path, threads=args.threads)
    print(
        f"wrote {path}: {profile['peak_tflops'] * 1e3:.1f} GFLOP/s matmul, "
        f"{profile['intra_node_gbps']:.2f} GB/s gloo all-reduce, {profile['latency_s'] * 1e6:.0f} us latency"
    )
    return 0


def _command_run(args) -> int:
    if args.command == "prepare-data":
        return _prepare(args)
    if args.command == "export":
        from raytrain_hybrid.checkpoint.export import export_hf
        from raytrain_hybrid.storage import as_store

        out = export_hf(args.checkpoint, args.out_dir, merge=args.merge)
        adapter = as_store(out).child("adapter_config.json").exists()
        print(f"wrote {out} ({'adapter_config.json, adapter_model' if adapter else 'config.json, model'}.safetensors)")
        return 0
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "lighthouse":
        from raytrain_hybrid.launch.runtime.lighthouse import serve

        return serve(args.port, args.min_replicas, args.join_timeout_s, args.heartbeat_timeout_s)
    overrides = args.overrides
    if getattr(args, "address", ""):  # --address: cluster.address, over a --set of it
        overrides = [*overrides, f"cluster.address={args.address}"]
    # check validates what it can and says what it could not read; the other commands need it all.
    unverified: list[str] | None = [] if args.command == "check" else None
    cfg = load_config(args.config, overrides, unverified=unverified)
    if args.command == "check":
        return _check(args, cfg, unverified)
    if args.command == "plan":
        return _plan(args, cfg)
    if args.command == "sweep":
        return _sweep(args, cfg)
    from raytrain_hybrid.launch.runtime.ft_groups import Source  # a fault-tolerant run's groups are launched from it

    return _train(cfg, args.resume, args.verbose, args.allow_change, Source(args.config, tuple(overrides)))


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 success; 1 the run failed; 2 bad input (argparse's own errors are 2 too);
    130 Ctrl-C; 143 SIGTERM during `train`."""
    args = _parser().parse_args(argv)
    try:
        return _command_run(args)
    except (ConfigError, LayoutError) as exc:
        print(redact(f"error: {exc}"), file=sys.stderr)  # every message the CLI prints is redacted
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run (a check, a prepare-data, Ray's start): one line
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
