"""Fuzzing benchmark: many more cases of the fuzzing targets (tests/fuzz_targets.py, fuzz_files.py)
than the suite runs.

    .venv/bin/python benchmarks/bench_fuzz.py [--examples 400] [--seed 0] [--target NAME ...]

Each target (``--set`` values, config files, chat / prompt-completion Parquet rows, JSONL given
as data, checkpoint manifests read by ``export``, a pretrained directory's config.json read by
``check``) draws ``--examples`` cases from its hypothesis strategy, seeded, and runs each the
way a user does (tests/fuzz_files.py's ``run_case``). A case ends accepted, refused clearly (exit
2 or a ConfigError naming a key or the file, the user's files unchanged), or it crashed
(anything else: a traceback, an unclear message, a changed file, more than ``--timeout`` s).
Writes benchmarks/results/fuzz.json: per target the cases tried, accepted, refused clearly and
crashed (goal 0), with the first crashes' input and error, the slowest case and its time, the
command, date and machine.
"""

from __future__ import annotations

import argparse
import collections
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


def fuzz(target: str, examples: int, seed: int, timeout: float) -> dict:
    from fuzz_files import TARGETS, known_crash, run_case
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    counts = collections.Counter()
    slowest = [0.0, ""]  # seconds of the slowest case, and the case
    crashes: list[dict] = []
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
        started = time.perf_counter()
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
            if (took := time.perf_counter() - started) > slowest[0]:
                slowest[:] = [took, repr(case)[:200]]

    t0 = time.perf_counter()
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
        "crashes": crashes,
    }


def main() -> None:
    from fuzz_files import TARGETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400, help="cases per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    parser.add_argument("--target", action="append", choices=list(TARGETS), help="default: all")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz.json"))
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    targets = {}
    for name in args.target or list(TARGETS):
        targets[name] = fuzz(name, args.examples, args.seed, args.timeout)
        row = targets[name]
        print(
            f"{name:>12}: {row['tried']} tried, {row['accepted']} accepted, {row['refused_clearly']} refused "
            f"clearly, {row['crashed']} crashed ({row['seconds']} s, slowest case {row['slowest_case_s']} s)",
            flush=True,
        )
    totals = {k: sum(t[k] for t in targets.values()) for k in ("tried", "accepted", "refused_clearly", "crashed")}
    command = "cd <repo> && .venv/bin/python benchmarks/bench_fuzz.py " + " ".join(sys.argv[1:])
    result = {
        "command": command.strip(),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}",
        "seed": args.seed,
        "examples_per_target": args.examples,
        "totals": totals,
        "targets": targets,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"total: {totals}; wrote {args.out}")


if __name__ == "__main__":
    main()
