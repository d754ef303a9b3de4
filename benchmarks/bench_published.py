"""The planner on published training runs. Writes benchmarks/results/published.json.

    .venv/bin/python benchmarks/bench_published.py

For each run in raytrain_hybrid/planner/published.py (sources cited there): the planner's best row at
the published layout (dp, tp, pp and what the source fixes; micro-batches, ZeRO stage,
recomputation and SP searched), whether it fits, and predicted against published MFU and
tokens/s per GPU. Pure arithmetic: no GPU, seconds to run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from raytrain_hybrid.planner.published import RUNS, assess

OUT = Path(__file__).resolve().parent / "results" / "published.json"


def main() -> None:
    rows = [assess(run) for run in RUNS]
    OUT.write_text(
        json.dumps(
            {"command": "cd <repo> && .venv/bin/python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
             "runs": rows},
            indent=2,
        )
        + "\n"
    )  # fmt: skip
    for r in rows:
        mfu = r.get("published_mfu")
        published = f"{mfu[0]:.0%}" + (f"-{mfu[1]:.0%}" if mfu and mfu[1] != mfu[0] else "") if mfu else "n/a"
        b = r["best"]
        print(
            f"{r['name']:<42} fits={r['feasible']!s:<5} {b['gib_per_rank']:5.1f} GiB  "
            f"m={b['microbatches']:<3} zero={b['zero']} ac={b['activation_checkpointing']!s:<5} "
            f"MFU pred {r['predicted_mfu']:.1%} / pub {published}  "
            f"tok/s/GPU pred {r['predicted_tokens_per_s_per_gpu']:,.0f} / pub {r['published_tokens_per_s_per_gpu']}"
        )


if __name__ == "__main__":
    main()
