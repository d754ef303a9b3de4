"""Record what transformers says of each causal-LM family with a tensor-parallel plan (its plans,
module names, attention and config attribute names) in raytrain_hybrid/assets/generic_facts.json,
which models.generic_facts reads instead of importing the family's modeling code. Run after
changing the transformers version pinned in pyproject.toml; tests/test_generic_facts.py holds the
file equal to what the installed transformers says.

    .venv/bin/python scripts/generic_facts.py
"""

from __future__ import annotations

import json
import sys

from raytrain_hybrid.models import generic_facts


def families() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(
        mt
        for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if mt in CONFIG_MAPPING and getattr(CONFIG_MAPPING[mt], "base_model_tp_plan", None)
    )


def main() -> None:
    import transformers

    record: dict = {"transformers": transformers.__version__, "command": "scripts/generic_facts.py", "families": {}}
    for mt in families():
        try:
            record["families"][mt] = generic_facts.derive(mt)
        except Exception as exc:  # noqa: BLE001 - read from its classes at run time, as before
            print(f"{mt}: not recorded ({type(exc).__name__}: {exc})", file=sys.stderr)
    generic_facts.FACTS.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"{len(record['families'])} families -> {generic_facts.FACTS}")


if __name__ == "__main__":
    main()
