"""The CLI's `train` and `prepare-data` as a user sees them: Ray's own output kept off the
terminal (in driver.log, or a log file for prepare-data) unless ``--verbose``; one line for a
refusal, a failure or Ctrl-C; exit codes 0 done, 1 failed, 2 refused, 130 Ctrl-C, 143 SIGTERM.
Under torchrun, `train` runs without Ray (launch.runtime.torchrun).
"""

from __future__ import annotations

import time

from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError, LayoutError, redact


def train_command(
    cfg: Config,
    resume: str | None = None,
    verbose: bool = False,
    allow_change: list[str] | None = None,
    source=None,
) -> int:
    """``source`` (launch.runtime.ft_groups.Source): the config file and overrides given, from which a
    fault-tolerant run on Ray without fault_tolerance.replica_group launches every group."""
    from raytrain_hybrid.launch.plan.address import ray_address
    from raytrain_hybrid.launch.runtime.driver import sigterm_ends_the_run
    from raytrain_hybrid.launch.runtime.torchrun import torchrun_train

    if (code := torchrun_train(cfg, resume, allow_change)) is not None:  # started by torchrun: no Ray
        return code
    if cfg.fault_tolerance.enabled:  # this launch is one replica group (launch.runtime.lighthouse), or all
        from raytrain_hybrid.launch.runtime.lighthouse import group_launch

        if source is not None and cfg.fault_tolerance.replica_group < 0:
            from raytrain_hybrid.launch.runtime.ft_groups import train_groups

            group_launch(cfg, None, "", every=True)  # group 0's checks stand for each group's
            ray_address(cfg)
            return train_groups(cfg, source, resume, verbose, allow_change)
        cfg = group_launch(cfg, None, "")
    ray_address(cfg)  # an address that cannot be joined is refused before the run directory is made
    with sigterm_ends_the_run():
        return _train_in(cfg, resume, verbose, allow_change)


def _train_in(cfg, resume, verbose: bool, allow_change) -> int:
    import ray

    from raytrain_hybrid.launch.records.lease import LeaseLost
    from raytrain_hybrid.launch.records.progress import quiet_driver
    from raytrain_hybrid.launch.records.rundir import RunDir, mirror_dir
    from raytrain_hybrid.launch.records.summary import done_line
    from raytrain_hybrid.launch.runtime.driver import Terminated, run

    connected_before = ray.is_initialized()  # e.g. a notebook's or a test's own session
    log = mirror_dir(cfg.run.output_dir) / "driver.log"  # the run dir itself, unless it is a URI
    summary, started = None, [True]  # [] once it is known that this launch did not run there
    try:
        with quiet_driver(log, quiet=not verbose, keep=lambda: bool(started)) as (out, err, live_log):
            try:
                summary = run(cfg, resume=resume, stream=out, driver_log=live_log, allow_change=allow_change)
                if "completed_from" in summary:  # nothing left to train: said in one line; the
                    started.clear()  # driver.log there stays the last run's (a killed driver's)
                    return 0
            except (ConfigError, LayoutError) as exc:
                started.clear()  # its log is not this directory's (it may be another run's)
                # Said now, before Ray is torn down: whatever happens in that teardown (a driver
                # killed on its way out, a shutdown that hangs), the refusal has reached the user.
                print(redact(f"error: {exc}"), file=err, flush=True)
                return 2
            except LeaseLost as exc:  # another run took run.output_dir over: nothing more is written there
                started.clear()  # (its driver.log is the other run's now)
                print(redact(f"error: {exc}"), file=err, flush=True)
                return 1
            except Exception as exc:  # a worker failed: Ray's error carries its traceback
                print(redact(f"error: training failed: {exc}"), file=err)  # (Ray's error quotes values)
                if not verbose:
                    print(f"Ray's output of this run: {log}", file=err)
                return 1
            except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (launch.runtime.driver.sigterm_ends_the_run)
                how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"
                if not getattr(exc, "records_written", False):  # stopped in its checks, before the start
                    print(f"{how} before the run started: nothing was written", file=err, flush=True)
                else:
                    print(f"{how}: the run stopped; what it wrote is in {cfg.run.output_dir}", file=err, flush=True)
                return 143 if isinstance(exc, Terminated) else 130
            finally:
                if ray.is_initialized() and not connected_before:
                    ray.shutdown()  # inside: Ray's listener threads print until they stop
    finally:
        if log.exists() and started:  # the run started: its driver.log goes where its other files went
            RunDir.open(cfg.run.output_dir).sync()
    print(done_line(summary, cfg.run.output_dir) + ("" if verbose else f" (Ray's output: {log.name})"))
    return 0


def prepare_command(
    source: str, out_dir: str, *, text_column: str, tokenizer: str, address: str, verbose: bool = False
) -> int:
    """`prepare-data`: Ray's start-up notices and Ray Data's progress go to a log file of this
    user's (its path said at the end) unless ``verbose``."""
    import ray

    from raytrain_hybrid.data.prepare import prepare_data
    from raytrain_hybrid.launch.plan.address import join_address
    from raytrain_hybrid.launch.records.progress import quiet_driver
    from raytrain_hybrid.launch.runtime.session import join_ray
    from raytrain_hybrid.storage import private_dir

    connected_before = ray.is_initialized()
    log = private_dir("logs") / f"prepare-data-{time.strftime('%Y%m%d-%H%M%S')}-{id(source):x}.log"
    with quiet_driver(log, quiet=not verbose) as (_, err, _log):
        try:
            join_ray(join_address(address))
            stats = prepare_data(source, out_dir, text_column=text_column, tokenizer=tokenizer)
        except (FileNotFoundError, ConfigError) as exc:
            print(redact(f"error: {exc}"), file=err, flush=True)
            return 2
        except KeyboardInterrupt:
            print("interrupted (Ctrl-C)", file=err, flush=True)
            return 130
        except Exception as exc:  # Ray's start, a read task: said in one line, the log has the rest
            print(redact(f"error: prepare-data failed: {exc}"), file=err, flush=True)
            if not verbose:
                print(f"Ray's output: {log}", file=err)
            return 1
        finally:
            if ray.is_initialized() and not connected_before:
                ray.shutdown()
    seen = "" if verbose else f" (Ray's output: {log})"
    print(f"wrote {stats['tokens']:,} tokens to {stats['out_dir']}{seen}")
    return 0
