"""The oracle: every layout trains exactly the model a plain single-process loop trains.

Against tests/reference.py (unmodified transformers models, nothing computed by the
package), fp32, per step: the loss, the global gradient norm (1e-4 relative), the learning
rate, and every parameter's gradient norm gathered across TP/PP/FSDP/ZeRO shards (1e-4
relative); the run's initial state equal to the reference's; after the last step every
parameter (difference within 1e-4 of its norm; a parameter whose gradient is zero but for
rounding, like an attention key bias, only within AdamW's reach, as Adam turns noise into
full-size steps; so may an element whose gradient the reference saw tiny at a step,
_final_mismatch). A gradient scaled by 2 on one small tensor
fails it (test_the_oracle_notices_one_scaled_gradient), though the loss and the global norm
cannot see it.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import reference_history
from gloo_harness import run_gloo

STEPS = 5
COMMON = (f"train.steps={STEPS}", "model.num_layers=4", "train.global_batch_size=16")
# The gloo cases at seq_len 32 (divisible by tp=4, sequence parallelism): a quarter of the tokens.
SHORT = (*COMMON, "model.seq_len=32")
# Here the engine runs as plain gloo processes on the corpus in memory. Through Ray Train on
# Ray Data input the same losses hold in tests/test_cli_ray.py ((2,1,1) from the CLI, raw
# text), tests/test_storage_ray.py ((1,1,2) from S3), tests/test_jobs_ray.py ((1,2,2), a
# resubmitted job) and tests/test_recovery_ray.py ((2,1,1), losing a worker on the way).
MEMORY = ("data.path=memory",)
RTOL = 1e-4
# A gradient norm below this fraction of the global one is rounding noise (in fp32 the smallest
# real ones here are ~1e-6 of it, the noise of a mathematically zero gradient ~1e-11).
NOISE = 1e-8


def layout(dp, tp, pp, schedule="1F1B", microbatches=4, zero=0, *extra):
    return [
        f"parallelism.dp={dp}",
        f"parallelism.tp={tp}",
        f"parallelism.pp={pp}",
        f"parallelism.schedule={schedule}",
        f"parallelism.microbatches={microbatches}",
        f"parallelism.zero={zero}",
        *extra,
    ]


LLAMA_CASES = {
    "1x1x1": layout(1, 1, 1, microbatches=1),
    "1x1x1-accum-m4": layout(1, 1, 1, microbatches=4),  # gradient accumulation without a pipeline
    "2x1x1": layout(2, 1, 1, microbatches=2),
    "1x2x1": layout(1, 2, 1, microbatches=1),
    "1x1x2-gpipe": layout(1, 1, 2, "GPipe", 2),
    "1x1x2-1f1b": layout(1, 1, 2, "1F1B", 2),
    "2x2x1": layout(2, 2, 1, microbatches=2),
    "2x1x2": layout(2, 1, 2, microbatches=2),
    "1x2x2": layout(1, 2, 2, microbatches=2),
    # ZeRO-1 with TP and PP; 1F1B at m=2 runs two forwards before a backward on stage 0.
    "2x2x2-zero1-1f1b-m2": layout(2, 2, 2, "1F1B", 2, 1),
    "2x1x1-zero1": layout(2, 1, 1, microbatches=2, zero=1),
    "2x1x1-zero3": layout(2, 1, 1, microbatches=2, zero=3),
    # FSDP sharding under a pipeline, as the planner picks for published runs.
    "2x1x2-zero2-1f1b": layout(2, 1, 2, "1F1B", 2, 2),
    "2x2x2-zero3": layout(2, 2, 2, "1F1B", 2, 3),
    # Sequence parallelism is on by default at tp > 1 (every tp case above runs it); tp=4
    # with and without a pipeline, and tp=2 with it switched off.
    "1x4x1-sp": layout(1, 4, 1, microbatches=2),
    "1x4x2-sp": layout(1, 4, 2, "1F1B", 2),
    "1x2x2-nosp": layout(1, 2, 2, "1F1B", 2, 0, "parallelism.sequence_parallel=false"),
}
GPT2_CASES = {
    "2x2x2-1f1b-m4": layout(2, 2, 2, "1F1B", 4),
    "1x2x2": layout(1, 2, 2, "1F1B", 2),
    "2x1x2-interleaved": layout(2, 1, 2, "Interleaved1F1B", 2),
}


def _close(got: float, want: float, rtol: float) -> bool:
    return abs(got - want) <= rtol * abs(want) + 1e-12


def oracle_mismatches(result: dict, reference: list[dict], first: int = 0) -> list[str]:
    """Every way an engine run (gloo_harness.run_gloo's result) differs from the reference;
    ``first``: the run's first step (a resumed run)."""
    history, probe = result["history"], result["probe"]
    bad = []
    if [h["step"] for h in history] != list(range(first, len(reference))):
        bad.append(f"steps {[h['step'] for h in history]}, want {first}..{len(reference) - 1}")
    start = reference[0]["initial"]
    if sorted(probe["initial"]) != sorted(start):
        return [*bad, f"parameter names differ: {sorted(set(probe['initial']) ^ set(start))}"]
    bad += [f"initial value of {n}" for n, v in start.items() if not np.array_equal(probe["initial"][n], v.numpy())]
    for got, norms in zip(history, probe["grad_norms"], strict=True):
        want = reference[got["step"]]
        at = f"at step {want['step']}"
        for key, rtol in (("loss", RTOL), ("grad_norm", RTOL), ("lr", 1e-9)):
            if not _close(got[key], want[key], rtol):
                bad.append(f"{key} {at}: {got[key]!r}, want {want[key]!r}")
        floor = NOISE * math.sqrt(sum(w * w for w in want["grad_norms"].values()))
        for name, w in want["grad_norms"].items():
            if not (_close(norms[name], w, RTOL) or max(norms[name], w) < floor):
                bad.append(f"gradient norm of {name} {at}: {norms[name]!r}, want {w!r}")
    noise = _noise_only(reference)
    for name, w in reference[-1]["params"].items():
        w, g = w.numpy(), probe["final"][name]
        if name in noise:  # AdamW moves each element by about lr a step, whatever the noise's size
            bound = 3 * sum(r["lr"] for r in reference)
            if np.abs(g - probe["initial"][name]).max() > bound:
                bad.append(f"final value of {name}: moved more than {bound:.2e} on a zero gradient")
            continue
        quiet = [r["quiet"][name] for r in reference if name in r.get("quiet", {})]
        quiet = np.unique(np.concatenate(quiet)) if quiet else np.empty(0, dtype=np.int64)
        said = _final_mismatch(g - w, max(np.linalg.norm(w), 1e-12), 2 * sum(r["lr"] for r in reference), quiet)
        if said:
            bad.append(f"final value of {name}: {said}")
    return bad


def _final_mismatch(diff: np.ndarray, scale: float, flip: float, quiet: np.ndarray) -> str | None:
    """How a final tensor differs from the reference's, or None. AdamW moves an element by about
    lr a step whatever its gradient's size, so the step of an element whose gradient is tiny
    (rounding left in a sum that nearly cancels) turns with the summation order: another layout's,
    or the same kernel's on another CPU (one element of Qwen3-MoE's 8,192 in layer 0's q_proj, 3.3e-4
    off after two steps, on an AMD EPYC). ``quiet``: the flat indices of the elements whose gradient
    the reference found below reference.QUIET of the tensor's largest at some step; each may differ
    by up to ``flip`` (2 x the sum of the learning rates). Every other element is held as before:
    together within RTOL of the tensor's norm."""
    rel = np.linalg.norm(diff) / scale
    if rel <= RTOL:
        return None
    flat = diff.ravel().copy()
    held = flat[quiet]
    flat[quiet] = 0.0
    if quiet.size and np.linalg.norm(flat) / scale <= RTOL:
        if np.abs(held).max() <= flip:
            return None
        return f"an element whose gradient was tiny differs by {np.abs(held).max():.2e}, more than AdamW moves it"
    return f"differs by {rel:.2e} of its norm"


def _noise_only(reference: list[dict]) -> set[str]:
    """Parameters whose gradient is zero but for rounding (attention key biases: softmax
    ignores a constant added to every key), below NOISE of the global norm at some step."""
    out = set()
    for r in reference:
        floor = NOISE * math.sqrt(sum(w * w for w in r["grad_norms"].values()))
        out |= {n for n, w in r["grad_norms"].items() if w < floor}
    return out


def assert_oracle(result: dict, reference: list[dict], first: int = 0) -> None:
    bad = oracle_mismatches(result, reference, first)
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:20])


def assert_matches(history, reference):
    """Loss, global gradient norm and learning rate only (runs through Ray, seen from metrics.jsonl)."""
    assert len(history) == len(reference) == STEPS
    for got, want in zip(history, reference, strict=True):
        assert got["step"] == want["step"]
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), f"loss at step {want['step']}"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), f"grad_norm at step {want['step']}"
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9)


@pytest.mark.parametrize("name", sorted(LLAMA_CASES))
def test_llama_layout_matches_single_process(name):
    """The engine as plain gloo processes (the same run_worker Ray Train calls)."""
    result = run_gloo([*SHORT, *MEMORY, *LLAMA_CASES[name]])
    assert_oracle(result, reference_history(SHORT + MEMORY, "memory"))
    assert_replicas_share_rows(result["memory"], LLAMA_CASES[name])


def assert_replicas_share_rows(per_rank, overrides):
    """Every rank of a replica trained on the same rows; different replicas on different rows."""
    dp = int(next(o for o in overrides if o.startswith("parallelism.dp=")).split("=")[1])
    by_replica: dict[int, set] = {}
    for r in per_rank:
        by_replica.setdefault(r["dp"], set()).add(r["input_digest"])
        assert r["input_rows"] == STEPS * 16 // dp
    assert all(len(digests) == 1 for digests in by_replica.values()), by_replica
    assert len({d for ds in by_replica.values() for d in ds}) == len(by_replica)


@pytest.mark.parametrize("name", sorted(GPT2_CASES))
def test_gpt2_layout_matches_single_process(name):
    common = (*SHORT, *MEMORY, "model.arch=gpt2")
    result = run_gloo([*common, *GPT2_CASES[name]])
    assert_oracle(result, reference_history(common, "memory"))
    assert_replicas_share_rows(result["memory"], GPT2_CASES[name])


def test_the_final_weights_excuse_only_elements_whose_gradient_was_tiny_and_only_within_adamws_reach():
    """The rule of _final_mismatch on made-up tensors: a whole tensor off by 2e-4 of its norm fails;
    an element off by most of AdamW's reach passes only where the reference saw its gradient tiny
    (a skipped or doubled update of any other element fails), and not beyond that reach."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, size=(64, 128)).astype(np.float32)
    scale, flip = float(np.linalg.norm(w)), 2 * (1.5e-3 + 3e-3)
    quiet = np.array([3 * 128 + 7])  # element [3, 7]
    none = np.empty(0, dtype=np.int64)
    assert _final_mismatch(w * 1e-5, scale, flip, none) is None  # within RTOL everywhere
    assert _final_mismatch(w * 2e-4, scale, flip, quiet)  # every element a little off: a real difference
    one = np.zeros_like(w)
    one[3, 7] = 0.8 * flip  # 0.0072: 4e-3 of the norm alone
    assert _final_mismatch(one, scale, flip, quiet) is None
    assert _final_mismatch(one, scale, flip, none) == f"differs by {np.linalg.norm(one) / scale:.2e} of its norm"
    other = np.zeros_like(w)
    other[5, 9] = 1.5e-3  # one update skipped (or made twice) where the gradient was not tiny
    assert _final_mismatch(other, scale, flip, quiet)
    assert _final_mismatch(one + other, scale, flip, quiet)
    one[3, 7] = 1.5 * flip  # more than two AdamW steps can move it
    assert "more than AdamW moves it" in _final_mismatch(one, scale, flip, quiet)
    nan = np.zeros_like(w)
    nan[3, 7] = np.nan
    assert _final_mismatch(nan, scale, flip, quiet)


@pytest.mark.parametrize("case", ["1x2x2", "2x2x2-zero1"])
def test_the_oracle_notices_one_scaled_gradient(case):
    """One layer's q_proj gradient doubled before the optimizer step (a test-only hook in the
    gloo processes; under ZeRO-1 on the reduced slices): AdamW's update is blind to a constant
    factor, so every loss and the logged global norm still match; the per-parameter gradient
    norms do not."""
    name = "model.layers.1.self_attn.q_proj.weight"
    reference = reference_history(SHORT + MEMORY, "memory")
    where = layout(1, 2, 2, "1F1B", 2) if case == "1x2x2" else layout(2, 2, 2, "1F1B", 2, 1)
    result = run_gloo([*SHORT, *MEMORY, *where], scale=(name, 2.0))
    assert_matches(result["history"], reference)  # what the oracle compared before: all pass
    bad = oracle_mismatches(result, reference)
    scaled = [b for b in bad if b.startswith(f"gradient norm of {name} ")]
    assert len(scaled) == STEPS, bad
    assert all(name in b for b in bad), bad
    with pytest.raises(AssertionError, match=re.escape(name)):
        assert_oracle(result, reference)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "multimodal-bert"])
def test_initial_values_follow_the_init_rule(arch):
    """The engine's initial state (what the reference starts from) is the init rule's:
    N(0, init_std) drawn from (seed, name) for weights of linear layers and embeddings,
    zeros for biases, ones for norm scales; the rule itself is deterministic per (seed, name)."""
    from gloo_harness import initial_state

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.models.common import init_value

    tiny = ["model.pretrained=none", "model.hidden_size=32", "model.vocab_size=30522", "model.seq_len=16"]
    extra = tiny if arch == "multimodal-bert" else []
    cfg = load_config(None, [f"model.arch={arch}", "model.num_layers=2", "train.init_std=0.05", *extra])
    state = initial_state(cfg)
    kinds = {"normal": 0, "zeros": 0, "ones": 0}
    for name, value in state.items():
        if name.endswith("bias"):
            kind = "zeros"
        elif "norm" in name.lower() or re.search(r"\bln_", name):
            kind = "ones"
        else:
            kind = "normal"
        kinds[kind] += 1
        want = init_value(name, torch.Size(value.shape), kind, cfg.train.seed, cfg.train.init_std)
        assert np.array_equal(value, want.numpy()), name
    assert kinds["normal"] and kinds["ones"] and (kinds["zeros"] or arch == "llama"), kinds  # llama: no biases
    shape = torch.Size([256, 256])
    a = init_value("x.weight", shape, "normal", 0, 0.05)
    assert torch.equal(a, init_value("x.weight", shape, "normal", 0, 0.05))  # a function of (seed, name)
    assert not torch.equal(a, init_value("y.weight", shape, "normal", 0, 0.05))
    assert not torch.equal(a, init_value("x.weight", shape, "normal", 1, 0.05))
    assert a.std().item() == pytest.approx(0.05, rel=0.02) and abs(a.mean().item()) < 1e-3
    assert torch.equal(init_value("b", torch.Size([3]), "zeros", 0, 0.05), torch.zeros(3))
    assert torch.equal(init_value("g", torch.Size([3]), "ones", 0, 0.05), torch.ones(3))
