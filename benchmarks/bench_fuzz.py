"""Fuzzing benchmark: many more cases of the fuzzing targets (tests/fuzz_targets.py, fuzz_files.py)
than the suite runs.

    .venv/bin/python benchmarks/bench_fuzz.py [--examples 400] [--seed 0] [--target NAME ...]

Each target (``--set`` values, config files, chat / prompt-completion Parquet rows, JSONL given
as data, checkpoint manifests read by ``export``, a pretrained directory's config.json read by
``check``) draws ``--examples`` cases from its hypothesis strategy, seeded, and runs each the
way a user does (tests/fuzz_files.py's ``run_case``). A case ends accepted, refused clearly (exit
2 or a ConfigError naming a key or the file, the user's files unchanged), or it crashed
(anything else: a traceback, an unclear message, a changed file, more than ``--timeout`` s).
Writes benchmarks/results/fuzz.json (with ``--target``, into it: the other targets' rows stay, and
the redone ones carry their own command and date): per target the cases tried, accepted, refused clearly and
crashed (goal 0), with the first crashes' input and error, the slowest case and its time (wall
clock, and this process's CPU time, which a shared machine's load does not inflate), the mean and
99th percentile of the time per case and the cases over 1 s, the command, date and machine.

The bound: no input may take over ``--bound`` CPU seconds (1 s). A case over it is run a second
time, and the second run is what the input costs (the first may have paid a one-time cost on its
path, such as an import); ``slowest_input_cpu_s`` is the largest such cost, ``inputs_over_bound``
those still over it. The script exits 1 when a case crashed or an input is over the bound.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing reaches the network
os.environ.pop("RAY_ADDRESS", None)


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("case ran past the limit")


WARM_UP = 40  # cases of a target run untimed and uncounted first


def warm_up(target: str) -> None:
    """WARM_UP cases of ``target`` run untimed and uncounted first (drawn apart from the seeded
    ones), so that the target's one-time costs (its imports, those of an accepted case's path such
    as an export's, the checkpoint the manifest cases copy) are not any input's."""
    import warnings

    from fuzz_files import TARGETS, run_case

    for _ in range(WARM_UP):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case = TARGETS[target][0].example()
        with contextlib.suppress(Exception):
            run_case(target, case)


def fuzz(target: str, examples: int, seed: int, timeout: float, bound: float = 1.0) -> dict:
    from fuzz_files import TARGETS, known_crash, run_case
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    counts = collections.Counter()
    slowest = [0.0, ""]  # seconds of the slowest case, and the case
    walls: list[float] = []  # each case's wall-clock seconds
    cpus: list[float] = []  # and this process's CPU seconds in it (the machine may be shared)
    crashes: list[dict] = []
    again: list[dict] = []  # cases over the bound, run a second time (the first 20 recorded)
    own: list[float] = []  # each input's own CPU seconds: the second run's for those over the bound
    signatures: set[str] = set()

    @hseed(seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(TARGETS[target][0])
    def one(case):
        counts["tried"] += 1
        signal.setitimer(signal.ITIMER_REAL, timeout)
        started, cpu = time.perf_counter(), time.process_time()
        try:
            counts[run_case(target, case)] += 1
        except (Exception, BaseException) as exc:  # noqa: BLE001 - every failure is a crash (DCP's are BaseException)
            if isinstance(exc, KeyboardInterrupt):
                raise
            counts["crashed"] += 1
            known = known_crash(target, case)
            counts["crashed_known"] += known is not None
            error = f"{type(exc).__name__}: {exc}"[:400]
            signature = known or f"{type(exc).__name__}:{str(exc)[:60]}"
            if signature not in signatures and len(crashes) < 12:
                signatures.add(signature)
                crashes.append({"case": repr(case)[:300], "error": error, "class": known or "new"})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.perf_counter() - started
            walls.append(took)
            cpus.append(time.process_time() - cpu)
            if took > slowest[0]:
                slowest[:] = [took, repr(case)[:200]]
            own.append(cpus[-1])
            if cpus[-1] > bound:  # a first-time cost, or the input's own? run it once more: that one counts
                wall, cpu = time.perf_counter(), time.process_time()
                with contextlib.suppress(Exception):
                    run_case(target, case)
                own[-1] = time.process_time() - cpu
                if len(again) < 20:
                    again.append({"case": repr(case)[:200], "cpu_s": round(cpus[-1], 3),
                                  "again_cpu_s": round(own[-1], 3),
                                  "again_s": round(time.perf_counter() - wall, 3)})  # fmt: skip

    t0 = time.perf_counter()
    warm_up(target)
    one()
    return {
        "tried": counts["tried"],
        "accepted": counts["accepted"],
        "refused_clearly": counts["refused"],
        "crashed": counts["crashed"],
        # of them, in a class already found (tests/fuzz_files.py's known_crash, outside the fuzzed change)
        "crashed_in_known_classes": counts["crashed_known"],
        "seconds": round(time.perf_counter() - t0, 1),
        "slowest_case_s": round(slowest[0], 3),
        "slowest_case": slowest[1],
        "slowest_case_cpu_s": round(max(cpus, default=0.0), 3),
        "mean_case_s": round(sum(walls) / max(len(walls), 1), 4),
        "p99_case_s": round(sorted(walls)[int(0.99 * (len(walls) - 1))], 3) if walls else 0.0,
        "cases_over_1s": sum(t > 1.0 for t in walls),
        "cases_over_1s_cpu": sum(t > 1.0 for t in cpus),
        "cases_over_1s_cpu_run_again": again,
        # what the bound holds: each input's CPU seconds, a case over the bound counted by its second run
        "slowest_input_cpu_s": round(max(own, default=0.0), 3),
        "inputs_over_bound": sum(t > bound for t in own),
        "crashes": crashes,
    }


def main() -> None:
    from fuzz_files import TARGETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400, help="cases per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    parser.add_argument("--bound", type=float, default=1.0, help="CPU seconds an input may take")
    parser.add_argument("--target", action="append", choices=list(TARGETS), help="default: all")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz.json"))
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    targets = {}
    for name in args.target or list(TARGETS):
        targets[name] = fuzz(name, args.examples, args.seed, args.timeout, args.bound)
        row = targets[name]
        print(
            f"{name:>12}: {row['tried']} tried, {row['accepted']} accepted, {row['refused_clearly']} refused "
            f"clearly, {row['crashed']} crashed ({row['seconds']} s, slowest case {row['slowest_case_s']} s)",
            flush=True,
        )
    command = "cd <repo> && .venv/bin/python benchmarks/bench_fuzz.py " + " ".join(sys.argv[1:])
    earlier = json.loads(Path(args.out).read_text()) if args.target and Path(args.out).is_file() else {}
    if earlier:  # the targets this run did not redo stay, and those it did say how they were made
        for name in targets:
            targets[name] |= {"command": command.strip(), "date": datetime.date.today().isoformat()}
        targets = {**{k: v for k, v in earlier["targets"].items() if k not in targets}, **targets}
    totals = {k: sum(t[k] for t in targets.values()) for k in ("tried", "accepted", "refused_clearly", "crashed")}
    totals["slowest_case_s"] = max(t["slowest_case_s"] for t in targets.values())
    totals["slowest_case_cpu_s"] = max(t["slowest_case_cpu_s"] for t in targets.values())
    totals["cases_over_1s"] = sum(t["cases_over_1s"] for t in targets.values())
    totals["bound_cpu_s"] = args.bound
    totals["slowest_input_cpu_s"] = max(t["slowest_input_cpu_s"] for t in targets.values())
    totals["inputs_over_bound"] = sum(t["inputs_over_bound"] for t in targets.values())
    result = {
        "command": earlier.get("command") or command.strip(),
        "date": earlier.get("date") or datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}",
        "seed": args.seed,
        "examples_per_target": args.examples,
        "totals": totals,
        "targets": targets,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"total: {totals}; wrote {args.out}")
    if totals["crashed"] or totals["inputs_over_bound"]:
        sys.exit(f"failed: {totals['crashed']} crashed, {totals['inputs_over_bound']} inputs over {args.bound} CPU s")


if __name__ == "__main__":
    main()
