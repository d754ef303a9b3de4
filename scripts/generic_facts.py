"""Record what transformers says of each causal-LM family with a tensor-parallel plan (its plans,
module names, attention and config attribute names) in raytrain_hybrid/assets/generic_facts.json,
which models.generic_facts reads instead of importing the family's modeling code. Run after
changing the transformers version pinned in pyproject.toml; tests/test_generic_facts.py holds the
file equal to what the installed transformers says.

    .venv/bin/python scripts/generic_facts.py                       # every family, ~10 min
    .venv/bin/python scripts/generic_facts.py --only llama4_text    # these again, the rest kept
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from fractions import Fraction

from raytrain_hybrid.models import generic_counts, generic_facts

# The monomials a count polynomial may have (generic_counts.variables): every product of up to three
# of the model's widths, plus the layer count and the position table's length alone or times one
# width (a count per layer or per position outside the blocks).
WIDTHS = "VHFNKD"
MONOMIALS = sorted(
    {"".join(c) for n in range(4) for c in itertools.combinations_with_replacement(WIDTHS, n)}
    | {"L", "P", "LL", "LV", "LH", "PH", "PV"},
    key=lambda mono: (len(mono), mono),
)
FIT_PROBES, CHECK_PROBES = 150, 30


def probe(rng: random.Random, layers: int | None = None) -> dict:
    """model.* sizes a family's class builds (heads divide the width, kv heads the heads, a rotary
    quarter of an even width), drawn apart from each other so that no monomial moves with others."""
    heads = rng.randrange(1, 13)
    return {
        "vocab_size": rng.randrange(40, 400),
        "hidden_size": heads * 2 * rng.randrange(1, 13),
        "ffn_hidden_size": 2 * rng.randrange(4, 120),
        "num_heads": heads,
        "num_kv_heads": rng.choice([k for k in range(1, heads + 1) if heads % k == 0]),
        "head_dim": 8 * rng.randrange(1, 6),
        "num_layers": layers or rng.randrange(1, 7),
        "seq_len": rng.choice((32, 100, 200, 300)),
        "pretrained": "",
        "pretrained_revision": "",
    }


# Widths as released models have them, far above probe's (built on the meta device, 2 blocks: the
# counts are per block): a family that rounds a width to a multiple (LFM2's FFN, to 256) looks like a
# polynomial at probe's small sizes only, and is held to these too.
REALISTIC = (
    {"vocab_size": 32000, "hidden_size": 4096, "ffn_hidden_size": 11008, "num_heads": 32, "num_kv_heads": 8,
     "head_dim": 128, "num_layers": 2, "seq_len": 4096, "pretrained": "", "pretrained_revision": ""},
    {"vocab_size": 151936, "hidden_size": 2048, "ffn_hidden_size": 6144, "num_heads": 16, "num_kv_heads": 8,
     "head_dim": 128, "num_layers": 2, "seq_len": 2048, "pretrained": "", "pretrained_revision": ""},
)  # fmt: skip


def fit_counts(model_type: str, seed: int = 0) -> dict | str:
    """The family's parameter counts from model.* sizes as polynomials (what the planner reads
    instead of building the model): fitted on built models at random sizes, then held to more built
    at other sizes (some with many layers) exactly; a string says why there is none."""
    import numpy as np

    rng = random.Random(f"{model_type}:{seed}")
    rows, tied = [], set()
    for index in range(FIT_PROBES + CHECK_PROBES):
        m = probe(rng, layers=(24, 61)[index % 2] if index >= FIT_PROBES + CHECK_PROBES - 4 else None)
        try:
            blocks, embed, rest, head, tie = generic_counts.built_parts(model_type, m)
        except Exception as exc:  # noqa: BLE001 - sizes the class refuses
            if index == 0:
                return f"builds no model from model.* sizes ({type(exc).__name__})"
            continue
        if len(set(blocks)) != 1:
            return "its blocks differ from each other"
        x = generic_counts.variables(m)
        rows.append((x, [blocks[0], embed, rest, head]))
        tied.add(tie)
    if len(tied) != 1:
        return "tied embeddings depend on the sizes"
    fit_rows = rows[: len(rows) - CHECK_PROBES]
    if len(fit_rows) < len(MONOMIALS) + 10:
        return "too few sizes build"
    a = np.array([[math.prod(x[v] for v in mono) for mono in MONOMIALS] for x, _ in fit_rows], dtype=np.float64)
    scale = np.abs(a).max(axis=0)
    if np.linalg.matrix_rank(a / scale) < len(MONOMIALS):
        return "the sizes its class builds do not tell its monomials apart"
    out: dict = {"tied": tied.pop()}
    for col, part in enumerate(("block", "embed", "rest", "head")):
        b = np.array([y[col] for _, y in fit_rows], dtype=np.float64)
        coef, *_ = np.linalg.lstsq(a / scale, b, rcond=None)
        terms = []
        for mono, c in zip(MONOMIALS, coef / scale, strict=True):
            q = Fraction(float(c)).limit_denominator(64)
            if q:
                terms.append([q.numerator if q.denominator == 1 else str(q), mono])
        if any(generic_counts.evaluate(terms, x) != y[col] for x, y in rows):
            return f"its {part} count is no polynomial of the sizes"
        out[part] = terms
    for m in REALISTIC:
        try:
            blocks, embed, rest, head, _ = generic_counts.built_parts(model_type, m)
        except Exception:  # noqa: BLE001 - sizes the class refuses: the polynomials are not read there either
            continue
        x = generic_counts.variables(m)
        got = [generic_counts.evaluate(out[part], x) for part in ("block", "embed", "rest", "head")]
        if got != [blocks[0], embed, rest, head]:
            return f"its counts at a released model's widths ({m['hidden_size']} wide) are no polynomial of probe's"
    return out


def families() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(
        mt
        for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if mt in CONFIG_MAPPING and getattr(CONFIG_MAPPING[mt], "base_model_tp_plan", None)
    )


def main() -> None:
    import argparse

    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model_types: record these again, keep the rest")
    args = ap.parse_args()
    record: dict = {"transformers": transformers.__version__, "command": "scripts/generic_facts.py", "families": {}}
    only = [mt for mt in args.only.split(",") if mt]
    if only:  # (the other families' facts as recorded, for this same transformers)
        kept = json.loads(generic_facts.FACTS.read_text())
        if kept["transformers"] != transformers.__version__:
            sys.exit(f"--only: the file is for transformers {kept['transformers']}; record every family")
        record["families"] = {mt: f for mt, f in kept["families"].items() if mt not in only}
    failed = []
    for mt in only or families():
        try:
            record["families"][mt] = generic_facts.derive(mt)
        except Exception as exc:  # noqa: BLE001 - read from its classes at run time, as before
            print(f"{mt}: not recorded ({type(exc).__name__}: {exc})", file=sys.stderr)
            if only:  # asked by name: what was recorded stays, and the script fails
                if mt in kept["families"]:
                    record["families"][mt] = kept["families"][mt]
                failed.append(mt)
            continue
        try:
            counts = fit_counts(mt)
        except Exception as exc:  # noqa: BLE001 - read from its classes at run time, as before
            counts = f"fitting failed ({type(exc).__name__})"
        if isinstance(counts, str):  # (its model is built on the meta device to count it)
            print(f"{mt}: no count polynomials: {counts}", file=sys.stderr)
        else:
            record["families"][mt]["counts"] = counts
    generic_facts.FACTS.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"{len(record['families'])} families -> {generic_facts.FACTS}")
    if failed:
        sys.exit(f"--only: {', '.join(failed)} could not be derived; what was recorded of them was kept")


if __name__ == "__main__":
    main()
