"""The model matrix's feature passes (scripts/model_matrix.py --tp, --ep, --cp, --sp, --packing, --lora): over the
families the matrix recorded as passing, each feature held to a one-process reference that shares no
code with the engine, its verdict (or the reason it cannot run) added to the family's row in
raytrain_hybrid/assets/generic_families.json, which models.generic_check reads to refuse it.

- tp: the matrix's dp=2 x tp=2 x pp=2 again, for a family held at tp=1 before its plan was translated;
- ep: a mixture of experts at dp=2 x ep=2 (x tp=2) x pp=2, its experts sharded over the dp ranks;
- cp: cp=2 x pp=2 (x tp=2 where the family takes tp) against tests/reference.py's loop;
- sp: dp=1 x tp=2 x pp=2 with sequence parallelism against the same loop (families that take tp);
- packing: data.packing=true on the corpus's documents, dp=1 x pp=2 (x tp=2 with sequence parallelism
  where the family takes tp), against tests/reference_packing.py (every example alone through
  transformers' model);
- lora: rank 4 on every linear "all-linear" adapts (the TP plan's), named to peft alike, dp=1 x pp=2
  (x tp=2), against peft's adapters on transformers' model (tests/reference_lora.py);
- planner: the planner's parameter count of the checkpoint (off its files' headers) over transformers'
  count of its model (the matrix records it with the family's row; this pass redoes it alone);
- export: trained in one process at a vanishing learning rate, exported (rh.export) and loaded by
  transformers: the source's safetensors key names, its config.json, the same class, its logits (1e-5);
- aux: a mixture of experts' router auxiliary loss (models.generic_router) at weight AUX, at the
  family's ep layout where the ep pass held one (else dp x tp x pp), against the same loop with the
  family's own load_balancing_loss_func on its router logits, per sequence and layer.
"""

from __future__ import annotations

import datetime
import json
import shutil
import tempfile
import time
from pathlib import Path

# The family's pipeline stages: 2, or 1 for a family without a pipeline plan, whose layouts then
# take dp=2 instead (the same ranks). Set by run_pass per family.
_STAGED = {"pp": 2}


def _stages(*middle: str) -> tuple[str, ...]:
    pp = _STAGED["pp"]
    return (f"parallelism.dp={3 - pp}", *middle, f"parallelism.pp={pp}", "parallelism.microbatches=2")


LORA = ("lora.rank=4", "lora.alpha=8", "train.lr=1e-2")
# The row keys each pass writes: the verdict, its layout, its reason.
KEYS = {
    name: (name, f"{name}_layout", f"{name}_reason", f"{name}_tp_reason")
    for name in ("cp", "sp", "packing", "lora", "ep", "export")
} | {
    "tp": ("tp", "layout", "tp_reason", "tp_tp_reason"),  # (the matrix's own layout: model_matrix.parallel_layout)
    "aux": ("aux", "aux_layout", "aux_reason", "aux_tp_reason", "aux_router"),  # (and where the router is)
    "planner": ("planner_params_ratio", "planner_layout", "planner_reason"),  # (a ratio, no layout)
}


def _tp(row: dict) -> int:
    return 2 if row.get("tp") else 1


def _tp_keys(row: dict) -> tuple[str, ...]:
    """tp=2 where the family takes it, with sequence parallelism where the sp pass held it."""
    sp = "true" if row.get("sp") else "false"
    return (f"parallelism.tp={_tp(row)}", f"parallelism.sequence_parallel={sp}")


def _layout_name(tp: int, cp: int = 1) -> str:
    pp = _STAGED["pp"]
    return f"dp{3 - pp}-{f'cp{cp}-' if cp > 1 else ''}tp{tp}-pp{pp}"


def _config(path: Path, *extra: str):
    from test_models import COMMON

    from raytrain_hybrid.config import load_config

    pp = f"parallelism.pp={_STAGED['pp']}"  # (the default layout's pp=2 is refused without a pipeline plan)
    return load_config(None, [f"model.pretrained={path}", *COMMON, pp, *extra])


def _start(path: Path) -> tuple[dict, set[str]]:
    """transformers' own load of the checkpoint: the references' initial state, and which of its
    entries are buffers (router biases, activation constants), which the oracle does not compare."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return {n: v.detach().clone() for n, v in hf.state_dict().items()}, {n for n, _ in hf.named_buffers()}


def context_parallel(row: dict, path: Path, model_type: str) -> None:
    from model_matrix import oracle

    from raytrain_hybrid.models import generic, generic_cp

    why = generic_cp.cp_refusal(model_type, generic.hf_config(model_type, _config(path, "parallelism.tp=1")))
    if why:
        row.update(cp=False, cp_reason=why)
        return
    tp = _tp(row)
    oracle(path, (*_stages("parallelism.cp=2"), *_tp_keys(row)), 4 * tp)
    row.update(cp=True, cp_layout=_layout_name(tp, 2))


def sequence_parallel(row: dict, path: Path, model_type: str) -> None:
    from model_matrix import oracle

    if not row.get("tp"):
        row.update(sp=False, sp_reason="runs at tp=1 only, where sequence parallelism has nothing to split")
        return
    oracle(path, (*_stages(), "parallelism.tp=2", "parallelism.sequence_parallel=true"), 4)
    row.update(sp=True, sp_layout=_layout_name(2))


def packing(row: dict, path: Path, model_type: str) -> None:
    from gloo_harness import run_gloo_jobs
    from model_matrix import rank_env
    from reference import _buffer_shuffle, corpus_tokens
    from reference_packing import packed_reference_run, packed_steps, text_examples
    from test_models import SINGLE, _assert_oracle
    from tokenizers import Tokenizer

    from raytrain_hybrid.data.tokenizer import DEFAULT_TOKENIZER, EOT
    from raytrain_hybrid.models import generic, generic_check

    why = generic_check.packing_refusal(generic.hf_config(model_type, _config(path, "parallelism.tp=1")))
    if why:
        row.update(packing=False, packing_reason=why)
        return
    # The corpus's documents in order (the reference's shuffle buffer is the engine's for chat rows).
    packed = ("data.packing=true", "data.shuffle_buffer=0")
    cfg = _config(path, *SINGLE, *packed)
    eot = Tokenizer.from_file(str(DEFAULT_TOKENIZER)).token_to_id(EOT)
    steps = packed_steps(cfg, text_examples(corpus_tokens(), eot, cfg.model.seq_len + 1), _buffer_shuffle)
    start, buffers = _start(path)
    reference = packed_reference_run(cfg, steps, start)
    reference[0]["initial"] = {n: v for n, v in reference[0]["initial"].items() if n not in buffers}

    def attempt(tp: int, keys: tuple[str, ...]) -> None:
        overrides = [f"model.pretrained={path}", *_common(), *_stages(), *keys, *packed]
        _assert_oracle(run_gloo_jobs(2 * tp, {"run": overrides}, env=rank_env())["run"], reference)

    _held(row, "packing", attempt)


def _held(row: dict, name: str, attempt) -> None:
    """``attempt(tp, keys)`` at tp=2 where the family takes it, else (or where tp=2 misses the
    reference) at tp=1: then held at tp=1 only, tp=2's difference recorded (check refuses it there)."""
    tp = _tp(row)
    try:
        attempt(tp, _tp_keys(row))
        row.update({name: True, f"{name}_layout": _layout_name(tp)})
        return
    except AssertionError as exc:
        if tp == 1:
            raise
        why = f"differs from the reference at tp=2: {_short(exc)}"
    attempt(1, ("parallelism.tp=1", "parallelism.sequence_parallel=false"))
    row.update({name: True, f"{name}_layout": _layout_name(1), f"{name}_tp_reason": why})


def _common() -> tuple[str, ...]:
    from test_models import COMMON

    return COMMON


def lora(row: dict, path: Path, model_type: str) -> None:
    import numpy as np
    from gloo_harness import run_gloo_jobs
    from model_matrix import rank_env
    from reference_lora import lora_reference_run
    from test_lora import lora_mismatches
    from test_models import SINGLE

    from raytrain_hybrid.models import generic, generic_check
    from raytrain_hybrid.models.lora import target_names

    why = generic_check.lora_refusal(generic.hf_config(model_type, _config(path, "parallelism.tp=1")))
    if why:
        row.update(lora=False, lora_reason=why)
        return
    # The linears "all-linear" adapts (those of the family's TP plan), named to peft too: its own
    # "all-linear" takes every nn.Linear (routers, latent projections outside the plan).
    names = target_names(generic.spec(model_type))
    if not names:
        row.update(lora=False, lora_reason="has no linear in its tensor-parallel plan that its checkpoint holds whole")
        return
    lora = (*LORA, f"lora.targets={json.dumps(list(names))}")
    cfg = _config(path, *SINGLE, *lora)

    def attempt(tp: int, keys: tuple[str, ...]) -> None:
        overrides = [f"model.pretrained={path}", *_common(), *_stages(), *keys, *lora]
        run = run_gloo_jobs(2 * tp, {"run": overrides}, env=rank_env())["run"]
        probe = run["probe"]
        head = f"{generic.head_name(model_type)}.weight"
        embed = f"{generic._prefix(model_type)}.{generic.pp_names(model_type)[0]}.weight"
        if head in probe["initial"] and json.loads((path / "config.json").read_text()).get("tie_word_embeddings"):
            # A tied model's head is its embedding (peft names it once): the engine's copy stays frozen and equal.
            for state in (probe["initial"], probe["final"]):
                assert np.array_equal(state.pop(head), state[embed]), "the tied head left the embedding"
            for norms in probe["grad_norms"]:
                assert norms.pop(head, 0.0) == 0.0, "the tied head has a gradient"
        bad = lora_mismatches(run, lora_reference_run(cfg, str(path), probe["initial"]))
        assert not bad, f"{len(bad)} mismatches: " + "; ".join(bad[:5])

    _held(row, "lora", attempt)


def tensor_parallel(row: dict, path: Path, model_type: str) -> None:
    """The matrix's dp=2 x tp=2 x pp=2 again (model_matrix.parallel_layout), for families recorded at
    tp=1 whose plan the engine now translates (a mixture of experts kept whole on each tp rank,
    models.generic_split.moe_children): where tp=2 misses the reference, dp=2 x tp=1 x pp=2 again."""
    from model_matrix import parallel_layout

    from raytrain_hybrid.models import generic

    row["tp"] = generic.refusal(model_type, tp=2, recorded=False) is None
    parallel_layout(row, path, row["tp"], model_type)
    if row.get("status") != "passed":  # (parallel_layout's verdict: no layout held at all)
        raise AssertionError(row["reason"])  # (the row keeps it: run_pass merges the refusal)


def _experts_refusal(path: Path, model_type: str) -> str | None:
    """Why the tiny checkpoint's experts cannot be split over ep=2 (None: they can): the dispatch's
    own rule (distributed.expert_parallel.refusal) on the model built on the meta device, or an
    expert count ep=2 does not divide (then not checked)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from raytrain_hybrid.distributed import expert_parallel
    from raytrain_hybrid.models import generic_split

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    found = [m for name, m in model.named_modules() if name.endswith("." + generic_split.expert_module(model_type))]
    if not found:
        return "was not checked with ep: the model matrix's tiny model of it has no experts (its config's default)"
    why = next((w for m in found if (w := expert_parallel.refusal(m))), None)
    if why is None and found[0].num_experts % 2:
        count = found[0].num_experts
        why = f"was not checked with ep: the model matrix's tiny model of it has {count} experts, which ep=2"
        why += " does not divide"
    return why


def expert_parallel(row: dict, path: Path, model_type: str) -> None:
    """dp=2 x ep=2 (x tp=2 with sequence parallelism where the family takes them) x pp=2 against the
    same loop: the experts module sharded over the two dp ranks, tokens sent to their experts by
    all-to-all (distributed.expert_parallel). A dense family is left without a verdict."""
    from model_matrix import oracle

    from raytrain_hybrid.models import generic_split

    if not generic_split.moe_children(model_type):
        return
    if generic_split.expert_module(model_type) is None:
        row.update(
            ep=False, ep_reason="has more than one experts module in a block, which expert parallelism does not shard"
        )
        return
    why = _experts_refusal(path, model_type)
    if why:
        row.update(ep=False, ep_reason=why)
        return
    pp = _STAGED["pp"]

    def attempt(tp: int, keys: tuple[str, ...]) -> None:
        oracle(
            path,
            ("parallelism.dp=2", "parallelism.ep=2", *keys, f"parallelism.pp={pp}", "parallelism.microbatches=2"),
            2 * tp * pp,
        )

    _held(row, "ep", attempt)
    row["ep_layout"] = row["ep_layout"].replace(f"dp{3 - pp}-", "dp2-ep2-")


# The router loss's weight in the aux pass: 100 times transformers' usual 0.001, so that a run without it
# misses the reference (tests/test_models.py shows one does).
AUX = 0.1


def router_aux(row: dict, path: Path, model_type: str) -> None:
    """The router auxiliary loss where transformers' model of the family adds one (models.generic_router
    .find, recorded in the row as ``aux_router``); a dense family is left without a verdict."""
    from model_matrix import oracle

    from raytrain_hybrid.models import generic, generic_check, generic_router, generic_split

    # A mixture of experts: its TP plan's experts, or an expert count in its config (gpt-oss's plan
    # names no experts, and its causal LM adds the loss).
    counted = any(getattr(generic.classes(model_type)[0](), k, None) for k in generic_check.EXPERT_KEYS)
    if not generic_split.moe_children(model_type) and not counted:
        return
    found, why = generic_router.search(model_type)
    if found is None:
        row.update(aux=False, aux_reason=why)
        return
    row["aux_router"] = found
    pp, ep = _STAGED["pp"], bool(row.get("ep"))

    def attempt(tp: int, keys: tuple[str, ...]) -> None:
        layout = ("parallelism.dp=2", "parallelism.ep=2") if ep else (f"parallelism.dp={3 - pp}",)
        dp = 2 if ep else 3 - pp
        oracle(path, (*layout, *keys, f"parallelism.pp={pp}", "parallelism.microbatches=2"), dp * tp * pp, aux=AUX)

    _held(row, "aux", attempt)
    if ep:
        row["aux_layout"] = row["aux_layout"].replace(f"dp{3 - pp}-", "dp2-ep2-")


def export(row: dict, path: Path, model_type: str) -> None:
    """The checkpoint trained 3 steps at lr 1e-12 in one process, exported to transformers' format,
    held to the source as tests/test_models.py's export test holds its families."""
    import torch
    from gloo_harness import run_gloo_jobs
    from test_models import SEQ, SINGLE, VOCAB, _overrides, _safetensors_keys
    from transformers import AutoModelForCausalLM

    import raytrain_hybrid as rh

    scratch = Path(tempfile.mkdtemp(prefix=f"export-{model_type}-"))
    try:
        overrides = [o for o in _overrides(path, SINGLE) if not o.startswith("train.lr=")]
        run = [*overrides, "train.lr=1e-12", "checkpoint.interval=3", f"run.output_dir={scratch / 'run'}"]
        run_gloo_jobs(1, {model_type: run})
        rh.export(str(scratch / "run"), scratch / "hf")
        want = json.loads((path / "config.json").read_text())
        got = json.loads((scratch / "hf" / "config.json").read_text())
        changed = sorted(k for k in {*want, *got} if want.get(k) != got.get(k))
        assert not changed, f"the exported config.json differs from the source's in {changed}"
        keys, source = _safetensors_keys(scratch / "hf"), _safetensors_keys(path)
        assert keys == source, f"the exported files name {sorted(keys ^ source)[:4]} otherwise than the source's"
        a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        b = AutoModelForCausalLM.from_pretrained(scratch / "hf", dtype=torch.float32, local_files_only=True).eval()
        assert type(a) is type(b), f"transformers loads the export as {type(b).__name__}, not {type(a).__name__}"
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            la, lb = a(input_ids=ids).logits, b(input_ids=ids).logits
        gap = ((la - lb).norm() / la.norm()).item()
        assert gap <= 1e-5, f"the exported model's logits differ from the source's by {gap:.1e}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    row.update(export=True, export_layout="dp1-tp1-pp1")


def planner_ratio(path: Path) -> float:
    """The planner's parameter count of a checkpoint (off its config.json and safetensors headers) over
    transformers' count of its model."""
    from test_models import SINGLE
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.models.params import param_count

    cfg = load_config(None, [f"model.pretrained={path}", "data.path=memory", "model.seq_len=32", *SINGLE])
    want = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).num_parameters()
    return round(param_count(cfg.model) / want, 4)


def planner_count(row: dict, path: Path, model_type: str) -> None:
    row["planner_params_ratio"] = planner_ratio(path)


PASSES = {
    "tp": tensor_parallel,
    "ep": expert_parallel,
    "cp": context_parallel,
    "sp": sequence_parallel,
    "packing": packing,
    "lora": lora,
    "aux": router_aux,
    "planner": planner_count,
    "export": export,
}


def _short(exc: BaseException) -> str:
    """The error in words (matrix_words.describe): what a reader of the refusal needs."""
    from matrix_words import describe

    return describe(f"{type(exc).__name__}: {exc}")


def run_pass(name: str, only: list[str], out: Path) -> dict:
    """One feature over the recorded passing families (``only``: some of them), written to ``out``
    after each family (an interrupted pass keeps what it did); returns the record."""
    import os

    os.environ["RAYTRAIN_MODEL_MATRIX"] = "1"  # the recorded verdicts are what is being redone
    from test_models import make_checkpoint

    from raytrain_hybrid.models import GENERIC_PATH_ENV, generic

    record = json.loads(out.read_text())
    tmp = Path(tempfile.mkdtemp(prefix=f"matrix-{name}-"))
    # Each pass in order (a pass --only some families redoes their rows alone).
    command = f"scripts/model_matrix.py --{name}" + (f" --only {','.join(only)}" if only else "")
    passes = record.get(f"{name}_passes", []) if only else []
    record[f"{name}_passes"] = [*passes, {"command": command, "date": datetime.date.today().isoformat()}]
    for mt, row in record["families"].items():
        if row["status"] != "passed" or (only and mt not in only):
            continue
        verdict, layout, reason = KEYS[name][:3]
        for key in KEYS[name]:
            row.pop(key, None)
        t0 = time.perf_counter()
        if row.get("attention") == "eager":  # the family runs eager (model_matrix.single_oracle)
            os.environ["RH_EAGER"] = "1"
        _STAGED["pp"] = 2 if generic.has_pp_plan(mt) else 1
        if row.get("spec"):  # a hand-written family, held on the generic path (model_matrix.main)
            os.environ[GENERIC_PATH_ENV] = row["spec"]  # (the spec's name: qwen3-moe for qwen3_moe)
        try:
            PASSES[name](row, make_checkpoint(tmp, mt), mt)
        except Exception as exc:  # noqa: BLE001 - recorded per family
            row.update({verdict: False, reason: f"differs from the reference with {name}: {_short(exc)}"})
        os.environ.pop("RH_EAGER", None)
        os.environ.pop(GENERIC_PATH_ENV, None)
        shutil.rmtree(tmp / mt, ignore_errors=True)
        print(
            f"{mt:24s} {name}={row.get(verdict)} {row.get(reason, row.get(layout, ''))[:100]} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        _merge(out, record, name, mt)
    return _merge(out, record, name, None)


def _merge(out: Path, record: dict, name: str, mt: str | None) -> dict:
    """This pass's keys of ``mt``'s row (and its passes list) into the file as it is now: passes of
    other features may run beside it."""
    now = json.loads(out.read_text())
    now[f"{name}_passes"] = record[f"{name}_passes"]
    if mt is not None:
        row = now["families"][mt]
        for key in KEYS[name]:
            row.pop(key, None)
        row.update({k: v for k, v in record["families"][mt].items() if k in KEYS[name]})
        if record["families"][mt]["status"] != "passed":  # (a pass that refuses the family: the tp pass's tp=1)
            row.update(status=record["families"][mt]["status"], reason=record["families"][mt].get("reason"))
    out.write_text(json.dumps(now, indent=1) + "\n")
    return now
