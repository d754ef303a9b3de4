"""Every transformers causal-LM family with tensor and pipeline plans, held to the oracle.

For each model_type of the pinned transformers whose config class ships both
``base_model_tp_plan`` and ``base_model_pp_plan``:

1. refused up front where models.generic says why (not a decoder, a style it cannot honour);
2. a tiny checkpoint written by transformers (tests/test_models.make_checkpoint), and the engine's
   stage forward against transformers' own forward (eager attention, fp32, 1e-4 of the logits' norm);
3. (1,1,1) for 3 steps against tests/reference.py's plain loop over transformers' model: losses,
   global and per-parameter gradient norms, final weights (tests/test_models._assert_oracle);
4. with --layout: dp=2 x tp=2 x pp=2 (tp=1 where the family's TP styles are not all translated)
   against the same reference.

Writes raytrain_hybrid/assets/generic_families.json (read by models.generic: a family that failed
is refused with its reason) and docs/models.md, and prints a line per family.

    .venv/bin/python scripts/model_matrix.py [--layout] [--only qwen3,gemma2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from matrix_passes import PASSES, planner_ratio, run_pass

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "raytrain_hybrid" / "assets" / "generic_families.json"
DOC = ROOT / "docs" / "models.md"


# Why a refused family fails, where the error alone does not say it (read in transformers' modeling
# code); the error itself stays in the row as "error".
KNOWN = {
    "cohere_compass_text": "transformers' own default config of this family has no rotary parameters for "
    "its layer types, so not even transformers builds a model of it to compare with",
    "lara_mini": "a hybrid with linear-attention layers whose global layers drop positional encoding in "
    "the base model's code rather than in its config",
    "phi4_multimodal": "its tiny model still carries full-size vision and audio towers (a 3.3 GB "
    "checkpoint, 7 GB to build and compare): the training run's rank was killed (signal 9, most likely "
    "for memory) on the machine that checks the families; its forward matched transformers'",
}

# Families whose tiny model is not tiny (a full-size tower the config's defaults keep): building one
# took the matrix process past this machine's 24 GB and the kernel killed it. Recorded unbuilt.
UNBUILT = {
    "llama4": "its tiny model keeps a full-size vision tower: building it took the checking process past "
    "24 GB of memory (killed by the kernel), so it was not compared; train `llama4_text` for its decoder",
    # (Read in modeling_gemma3n: Gemma3nTextModel.forward's altup_projections and altup_unembed_projections.)
    "gemma3n_text": "its base model's own forward turns the embedding into four AltUp streams before its "
    "layers and back into one after them: code outside the layers, which the pipeline's stages do not run",
    # The matrix's run of it missed the bound from the first loss: the routing is drawn, not computed.
    "phimoe": "its router samples the experts at random while training (transformers' sparsemixer draws "
    "from torch.rand), so no run can be held to a reference's draws",
}


def families() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            c = CONFIG_MAPPING[mt]
        except KeyError:
            continue
        if getattr(c, "base_model_tp_plan", None):  # (without a pipeline plan: tried at pp=1)
            out.append(mt)
    return out


def _short(exc: BaseException) -> str:
    """The error in words (matrix_words.describe): what a reader of the refusal needs."""
    from matrix_words import describe

    return describe(f"{type(exc).__name__}: {exc}")


def forward_gap(path: Path, model_type: str) -> float:
    """Relative logit difference of the engine's stage (one stage, all blocks) vs transformers'."""
    import torch
    from test_models import _stage_of

    stage, ref = _stage_of(path)
    stage.eval()
    ref.eval()
    vocab = ref.config.vocab_size
    ids = torch.randint(3, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, exp = stage(ids), ref(input_ids=ids).logits
    return float((got - exp).norm() / exp.norm())


def oracle(path: Path, layout: tuple[str, ...], world: int, aux: float = 0.0) -> None:
    """``layout`` in ``world`` gloo ranks against tests/reference.py's loop (``aux``: with a mixture
    of experts' router auxiliary loss of that weight, in both)."""
    import torch
    from gloo_harness import run_gloo_jobs
    from reference import reference_run
    from test_models import COMMON, _assert_oracle
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.config import load_config

    overrides = [f"model.pretrained={path}", *COMMON, *layout, *([f"model.router_aux_loss_coef={aux}"] if aux else [])]
    result = run_gloo_jobs(world, {"run": overrides}, env=rank_env())["run"]
    from test_models import SINGLE

    cfg = load_config(None, [*(o for o in overrides if not o.startswith("parallelism.")), *SINGLE])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    start = {n: v.detach().clone() for n, v in hf.state_dict().items()}
    _assert_oracle(result, reference_run(cfg, initial=start, aux=aux))


def rank_env() -> dict | None:
    """What the ranks must see of this process's environment (they are forked from a server started
    before a family set RH_EAGER)."""
    import os

    from raytrain_hybrid.models import GENERIC_PATH_ENV

    env = {k: os.environ[k] for k in ("RH_EAGER", GENERIC_PATH_ENV) if os.environ.get(k)}
    return env or None


def single_oracle(row: dict, path: Path, model_type: str) -> None:
    """(1,1,1) against the reference; where SDPA misses it and transformers' eager attention (the
    reference's) holds, the family is recorded to run eager (models.generic reads it), and the rest
    of its checks run so (RH_EAGER, which the ranks inherit)."""
    import os

    from test_models import SINGLE

    from raytrain_hybrid.models import generic

    try:
        oracle(path, SINGLE, 1)
        return
    except AssertionError as exc:
        if generic.attention_implementation(model_type) == "eager":
            raise
        why = f"differs from the reference with SDPA attention: {_short(exc)}"
    os.environ["RH_EAGER"] = "1"
    oracle(path, SINGLE, 1)
    row.update(attention="eager", attention_reason=why)


def parallel_layout(row: dict, path: Path, tp_ok: bool, model_type: str) -> None:
    """dp=2 x tp=2 x pp=2 against the reference; where tp=2 differs, dp=2 x pp=2 alone: a family
    that passes it is recorded with tp=1 only (models.generic refuses tp > 1 with the reason). A
    family without a pipeline plan: the same at pp=1 (two micro-batches a replica)."""
    from test_models import THREE_D

    from raytrain_hybrid.models import generic

    pp = 2 if generic.has_pp_plan(model_type) else 1
    layout = tuple(o.replace("pp=2", f"pp={pp}") for o in THREE_D)
    tp1 = tuple(o.replace("tp=2", "tp=1") for o in layout)
    if tp_ok:
        # tp=2 with sequence parallelism (the default), else without it (a family whose layers take
        # the TP plan and not SP's split of the sequence: the --sp pass then records why, and check
        # runs it without SP)
        why = None
        for keys in ((), ("parallelism.sequence_parallel=false",)):
            try:
                oracle(path, (*layout, *keys), 4 * pp)
                row["layout"] = f"dp2-tp2-pp{pp}"
                return
            except BaseException as exc:  # noqa: BLE001 - recorded
                why = why or f"differs from the reference at tp=2: {_short(exc)}"  # (with SP: the default's)
        row.update(tp=False, tp_reason=why)
    try:
        oracle(path, tp1, 2 * pp)
        row["layout"] = f"dp2-tp1-pp{pp}"
    except BaseException as exc:  # noqa: BLE001 - recorded
        row.update(status="refused", reason=f"differs from the reference at a parallel layout: {_short(exc)}")


def main() -> None:
    import os

    os.environ["RAYTRAIN_MODEL_MATRIX"] = "1"  # the recorded verdicts are what is being redone
    import transformers
    from test_models import make_checkpoint

    from raytrain_hybrid.models import generic

    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", action="store_true", help="also run dp=2 x tp=2 x pp=2 against the reference")
    ap.add_argument("--only", default="", help="comma-separated model_types")
    for name in PASSES:  # matrix_passes: one feature over the recorded families, held to its reference
        ap.add_argument(f"--{name}", action="store_true", help=f"only add the recorded families' {name} verdicts")
    ap.add_argument("--doc", action="store_true", help="only write docs/models.md from the JSON")
    args = ap.parse_args()
    if args.doc:
        return write_doc(json.loads(OUT.read_text()))
    for name in PASSES:
        if getattr(args, name):
            return write_doc(run_pass(name, [n for n in args.only.split(",") if n], OUT))
    names = [n for n in args.only.split(",") if n] or families()
    previous = json.loads(OUT.read_text())["families"] if OUT.exists() and args.only else {}
    generic.verified.cache_clear()
    rows = dict(previous)
    tmp = Path(tempfile.mkdtemp(prefix="matrix-"))
    # Model types a hand-written spec trains (sequence parallelism, ep, ...): held by their own
    # oracle tests (tests/test_oracle.py, test_pretrained.py, test_moe.py), and by this matrix on the
    # generic path where RAYTRAIN_GENERIC_PATH names them (their rows keep the spec's name).
    from raytrain_hybrid.models import ARCH_NAMES, GENERIC_PATH_ENV, HAND_MODEL_TYPES

    forced = {n for n in os.environ.get(GENERIC_PATH_ENV, "").split(",") if n in ARCH_NAMES}
    hand = {mt: name for mt, name in HAND_MODEL_TYPES.items() if name not in forced}
    for mt in names:
        t0 = time.perf_counter()
        row: dict = {"status": "refused"}
        if mt in hand:
            rows[mt] = {"status": "hand-written", "spec": hand[mt]}
            print(f"{mt:24s} hand-written spec {hand[mt]}", flush=True)
            continue
        try:
            # The recorded verdict is what is being redone: the static reasons only.
            why = UNBUILT.get(mt) or generic.refusal(mt, tp=1, recorded=False)
            if why:
                row["reason"] = why
            else:
                path = make_checkpoint(tmp, mt)
                gap = forward_gap(path, mt)
                if gap > 1e-4 and generic.attention_implementation(mt) != "eager":
                    # transformers' eager attention (the reference's), where SDPA's differs: a family
                    # whose attention reads its mask as data (Doge's dynamic mask) needs the mask tensor
                    # SDPA's causal path goes without; the family then runs eager (single_oracle's rule)
                    os.environ["RH_EAGER"] = "1"
                    sdpa, gap = gap, forward_gap(path, mt)
                    if gap <= 1e-4:
                        why = f"its layers' forward differs from transformers' with SDPA attention ({sdpa:.1e})"
                        row.update(attention="eager", attention_reason=why)
                    else:
                        os.environ.pop("RH_EAGER")
                row["forward_gap"] = gap
                if gap > 1e-4:
                    row["reason"] = f"its layers' forward differs from transformers' ({gap:.1e} of the logits)"
                else:
                    row["planner_params_ratio"] = planner_ratio(path)
                    single_oracle(row, path, mt)
                    row.update(status="passed", single=True)
                    tp_ok = generic.refusal(mt, tp=2, recorded=False) is None
                    row["tp"] = tp_ok
                    if args.layout:
                        parallel_layout(row, path, tp_ok, mt)
        except BaseException as exc:  # noqa: BLE001 - recorded per family
            if isinstance(exc, KeyboardInterrupt):
                raise
            # An oracle's mismatch (the single-process run, SDPA and eager alike) or another failure.
            mismatch = isinstance(exc, AssertionError)
            head = "differs from the reference" if mismatch else "could not be built or trained here"
            row["reason"] = f"{head}: {_short(exc)}"
            row["trace"] = traceback.format_exc(limit=3)[-600:]
        if HAND_MODEL_TYPES.get(mt) in forced:  # trained by its spec unless RAYTRAIN_GENERIC_PATH names it
            row["spec"] = HAND_MODEL_TYPES[mt]  # (the spec's name: qwen3-moe for qwen3_moe)
        os.environ.pop("RH_EAGER", None)  # (single_oracle's, for this family's checks alone)
        shutil.rmtree(tmp / mt, ignore_errors=True)  # some families' default sizes make GB-sized checkpoints
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows[mt] = row
        print(f"{mt:24s} {row['status']:8s} {row.get('reason', '')[:110]}", flush=True)
    for mt, row in rows.items():
        if row["status"] == "refused" and mt in KNOWN and row.get("reason") != KNOWN[mt]:
            row.update(error=row.get("reason"), reason=KNOWN[mt])
    record = {
        "command": "scripts/model_matrix.py" + (" --layout" if args.layout else ""),
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "families": dict(sorted(rows.items())),
    }
    if args.only and OUT.exists():  # some rows redone: the file keeps the other rows' run and passes
        before = json.loads(OUT.read_text())
        record |= {f"{n}_passes": before.get(f"{n}_passes", []) for n in PASSES}
        record["only_runs"] = before.get("only_runs", before.get("generic_path_runs", []))
        env = f"{GENERIC_PATH_ENV}={','.join(sorted(forced))} " if forced else ""
        command = f"{env}{record['command']} --only {args.only}"
        record["only_runs"].append({"command": command, "date": record["date"]})
        record |= {"command": before["command"], "date": before["date"]}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    write_doc(record)
    passed = sum(r["status"] == "passed" for r in rows.values())
    print(f"{passed} of {len(rows)} families passed the generic path's oracle")


def _cell(row: dict, name: str) -> str:
    """A feature's column: the layout it was held to its reference at, or why not (the error itself
    stays in the JSON), or that it was not checked."""
    if row.get(name):
        return row[f"{name}_layout"] + (" (tp=1 only: differs at tp=2)" if row.get(f"{name}_tp_reason") else "")
    if name == "sp" and not row.get("tp"):
        return "- (tp=1 only)"
    if name in ("ep", "aux") and name not in row:
        return "-"  # (a dense family; a mixture of experts the pass has not run gets "not checked")
    why = row.get(f"{name}_reason")
    if why is None:
        return "not checked"
    if why.startswith("differs from the reference"):
        why = why.split(":")[0]
    return "no: " + why.replace("|", "/")


def write_doc(record: dict) -> None:
    DOC.write_text(render_doc(record))


def render_doc(record: dict) -> str:
    """docs/models.md from the matrix's record."""
    from test_models import FAMILIES as SUITE_3D  # held at dp=2 x tp=2 x pp=2 by the test suite

    from raytrain_hybrid.models import ARCH_NAMES, get_arch

    rows = record["families"]
    passed = {k: v for k, v in rows.items() if v["status"] in ("passed", "hand-written")}
    lines = [
        "# Models",
        "",
        "<!-- Generated by scripts/model_matrix.py from raytrain_hybrid/assets/generic_families.json. -->",
        "",
        "`model.pretrained` names a Hugging Face checkpoint (a directory, a storage URI or a Hub id); its",
        "`config.json`'s `model_type` picks the architecture. Two kinds of families train here:",
        "",
        f"- **Hand-written specs**: {', '.join(f'`{n}`' for n in ARCH_NAMES)}. Sequence parallelism,",
        "  context parallelism, packing, LoRA (not on the mixtures of experts), and for the mixtures of",
        "  experts expert parallelism and the router's auxiliary loss.",
        "- **Any other transformers decoder** with a tensor-parallel plan: transformers' own class and",
        "  plans, no code of ours per family; dp, tp, pp (pp=1 only for a family transformers gives no",
        "  pipeline plan: its *3D checked* column says pp1) and the ZeRO stages, and, where the",
        "  columns below say so, sequence parallelism (on by default with tp > 1), context parallelism,",
        "  packing (`data.packing`), LoRA and, for a mixture of experts, expert parallelism",
        "  (`parallelism.ep`). A mixture of experts (router, experts, shared experts) is kept whole on",
        "  every tp rank while attention is split, as the hand-written specs keep theirs (and the MLP of",
        "  a dense layer under the same module name; the planner counts them so). The router's auxiliary",
        "  loss where the *router loss* column says so, as transformers adds it: on when the checkpoint's",
        "  config sets `output_router_logits`, weighed by its `router_aux_loss_coef` (`model.router_aux_loss_coef`",
        "  set to another value than its default, 0.001, sets the weight; `0` trains without it). A",
        "  checkpoint that asks for the loss for a family this table does not list is refused rather than",
        "  trained without it. `check` refuses `model.num_experts` and `model.experts_per_token`: the",
        "  experts are the checkpoint's.",
        "",
        f"Checked with transformers {record['transformers']} ({record['date']}): each family below was built",
        "tiny (4 layers, grouped-query attention, 8 experts and narrow latent attention where it has them,",
        "its own tying of embeddings and sliding windows), its forward compared with transformers' own, and 3",
        "training steps at one process compared with a plain loop over transformers' model (losses, every",
        "parameter's gradient norm, final weights; fp32, 1e-4).",
        "The column *3D* says where dp=2 x tp=2 x pp=2 (pp=1 without a pipeline plan) was also held to that",
        "loop. The columns *sp*, *cp*,",
        "*packing*, *LoRA*, *ep* and *router loss* give the layout each feature was held to its own one-process",
        "reference at, or",
        "why the family cannot take it:",
        "",
        "- *sp*: dp=1 x tp=2 x pp=2 with sequence parallelism, against the same loop (the norms and the",
        "  residual stream split along the sequence over tp; a family that takes tp=1 only has none);",
        "- *cp*: cp=2 x pp=2 (with tp=2 where the family takes it), against the same loop;",
        "- *packing*: several of the corpus's documents a row, dp=1 x pp=2 (x tp=2 with sequence",
        "  parallelism where the family takes it), against every document run alone through transformers'",
        "  model;",
        "- *LoRA*: rank 4 on every linear, at the same layout, against peft's adapters on transformers' model;",
        "- *ep*: a mixture of experts at dp=2 x ep=2 (x tp=2 with sequence parallelism where the family takes",
        "  them) x pp=2 (pp=1 without a pipeline plan), its experts split over the two dp ranks, against the",
        "  same loop (`-`: no experts);",
        "- *router loss*: `model.router_aux_loss_coef=0.1` at the *ep* layout (dp x tp x pp where the family",
        "  has none), against the same loop plus the family's own `load_balancing_loss_func` on transformers'",
        "  router logits, taken per sequence and MoE layer;",
        "- *export*: the round trip: 3 steps at one process and a vanishing learning rate, exported as",
        "  `raytrain-hybrid export` does, and transformers' `from_pretrained` of the result: the source's",
        "  safetensors names, its `config.json`, the same class, and the source's logits (1e-5). That an",
        "  export holds the trained weights, not the source's, the suite holds for Qwen2 and Qwen2-MoE.",
        "",
        "A family without a pipeline plan takes dp=2 where these say dp=1 x pp=2 (the same ranks).",
        "",
        "`check` refuses `parallelism.cp`, `data.packing`, `lora.rank` and `parallelism.ep` for a family",
        "with a reason in its column (and at tp > 1 where the column says *tp=1 only*), before any worker",
        "starts, and says whether",
        "sequence parallelism applies to a run at tp > 1. A LoRA run adapts the linears of the family's",
        "tensor-parallel plan that it names (`lora.targets`; the column was checked with `all-linear`),",
        "not a mixture of experts' experts. The default targets, `q_proj` and `v_proj`, are refused where",
        "they are not such linears (as in OLMo 2, whose plan gathers their outputs): name others or `all-linear`.",
        "*not checked*: no verdict was recorded for that feature and family (`check` does not refuse it).",
        "*eager attention*: with SDPA the family's gradients missed the 1e-4 bound by rounding where",
        "transformers' eager attention held it, so it runs eager (and so without context parallelism).",
        "*hand-written spec; this row: the generic path*: the family trains with its hand-written spec, and",
        "the row holds the generic path to the same reference (the matrix trains it so); the spec stays",
        "while the suite's layouts and the GPU benchmarks are measured with it.",
        "",
        f"## Supported ({len(passed)} families)",
        "",
        "| model_type | tensor parallel | 3D checked | sp | cp | packing | LoRA | ep | router loss | export | "
        "planner's parameter count / transformers' |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mt, row in passed.items():
        if row["status"] == "hand-written":
            spec = get_arch(row["spec"])
            cells = [spec.sequence_parallel, spec.attention, True, spec.moe is None]
            cells = " | ".join(["yes" if c else "no" for c in cells] + ["yes" if spec.moe else "-"] * 2)
            cells += " | its own tests"
            lines.append(f"| `{mt}` | yes (hand-written spec `{row['spec']}`) | its own oracle tests | {cells} | - |")
            continue
        layout = row.get("layout") or ("dp2-tp2-pp2" if mt in SUITE_3D else "-")
        ratio = row.get("planner_params_ratio")
        ratio = f"{ratio:.3f}" if ratio else "-"
        cells = " | ".join(_cell(row, name) for name in ("sp", "cp", "packing", "lora", "ep", "aux"))
        cells += " | " + ("yes" if row.get("export") else _cell(row, "export"))
        name = f"`{mt}`" + (" (eager attention)" if row.get("attention") == "eager" else "")
        name += " (hand-written spec; this row: the generic path)" if row.get("spec") else ""
        lines.append(f"| {name} | {'yes' if row.get('tp') else 'tp=1 only'} | {layout} | {cells} | {ratio} |")
    lines += ["", f"## Refused ({len(rows) - len(passed)} families)", "", "| model_type | why |", "| --- | --- |"]
    for mt, row in rows.items():
        if row["status"] == "refused":
            lines.append(f"| `{mt}` | {row['reason'].replace('|', '/')} |")
    lines += [
        "",
        "`check` refuses a refused family before any worker starts, with the reason above. A family",
        "transformers adds later and this table does not list is tried by the generic path as it is.",
        "",
        "## Your own model",
        "",
        "A model that is not on the Hub trains the same way when it is written as transformers writes its",
        "decoders: a `PretrainedConfig` with a `model_type`, a `base_model_tp_plan` (the styles above:",
        "`colwise`, `rowwise`, `colwise_gather_output`, `rowwise_split_input`, `replicated_with_grad_allreduce`,",
        "`embedding_rowwise`) and a `base_model_pp_plan` (the embedding, the block list, the final norm), and a",
        "`PreTrainedModel` causal LM. Register it before loading the config; Ray's workers register it again",
        "by the classes' import paths, so define them at the top level of a module they can import:",
        "",
        "```python",
        "import raytrain_hybrid as rh",
        "from my_models import TinyDecoderConfig, TinyDecoderForCausalLM",
        "",
        "rh.register_model(TinyDecoderConfig, TinyDecoderForCausalLM)  # returns its model_type",
        'rh.train(rh.load_config(None, ["model.pretrained=/models/tiny-decoder"]))',
        "```",
        "",
        "`model.pretrained` names a directory its `save_pretrained` wrote; without one, `model.arch` is the",
        "model_type and `model.*` sets its sizes.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
