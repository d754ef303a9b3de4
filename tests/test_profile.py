"""run.profile_steps: every rank writes a torch.profiler trace of the chosen steps into the run
directory (gloo processes, no Ray), a Chrome/Perfetto JSON file that holds those steps' ops."""

from __future__ import annotations

import json

from gloo_harness import run_gloo

STEPS = (
    "train.steps=3",
    "model.num_layers=2",
    "train.global_batch_size=4",
    "model.seq_len=32",
    "parallelism.dp=1",
    "parallelism.tp=1",
    "parallelism.pp=2",
    "parallelism.microbatches=2",
)


def _spans(events: list[dict], prefix: str) -> dict[str, dict]:
    return {e["name"]: e for e in events if e.get("ph") == "X" and e["name"].startswith(prefix)}


def test_each_rank_traces_the_chosen_steps_into_the_run_directory(tmp_path):
    """Steps 2 and 3 of 3 (step 1 the warm-up, left out): one trace per rank under profile/,
    each a "step <N>" span a step with the rank's matmuls (its stage's forward and backward) and
    its pipeline sends inside; no memory snapshot on CPU."""
    out = tmp_path / "run"
    result = run_gloo([*STEPS, "run.profile_steps=[2, 3]", f"run.output_dir={out}"])
    assert [h["step"] for h in result["history"]] == [0, 1, 2]
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["trace_rank0.json", "trace_rank1.json"]
    for rank in (0, 1):
        events = json.loads((out / "profile" / f"trace_rank{rank}.json").read_text())["traceEvents"]
        steps = _spans(events, "step ")
        assert sorted(steps) == ["step 2", "step 3"], sorted(steps)
        for span in steps.values():
            inside = [e for e in events if span["ts"] <= e.get("ts", -1) <= span["ts"] + span["dur"]]
            names = {e["name"] for e in inside}
            assert names & {"aten::mm", "aten::addmm"}, sorted(names)[:40]
            assert "autograd::engine::evaluate_function: MmBackward0" in names or "aten::mm" in names
            assert any("send" in n or "recv" in n for n in names), sorted(names)[:40]
