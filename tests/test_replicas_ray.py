"""Per-step fault tolerance on a simulated Ray cluster, from the user's side: one
`raytrain-hybrid train --address ...` with fault_tolerance.enabled starts two replica groups
(dp=2 x tp=2: two workers each, one group on each node) and their Lighthouse (a Ray actor on the
head). Then, in turn (tests/ft_cluster_driver.py):

1. the node holding group 1 is removed (a fresh node joins): Ray Train restarts group 1 alone,
   which receives the state from group 0; group 0's workers go on (no restart);
2. the Lighthouse's process is killed: Ray starts it again at the same address and the groups'
   next quorum finds it there (no restart);
3. the head node is lost (the driver, the Lighthouse and Ray's head with it): the cluster is
   gone; on a new one, the same `train` with `--resume` of its output continues each group from
   its newest checkpoint.

The run's records and checkpoints are on S3 (the local server), which the restarted groups read.

fault_tolerance.min_replicas=2 keeps the groups in step, so every committed step has both
groups' rows: the run must train what one uninterrupted process trains (losses, gradient norms,
learning rates, fp32, 1e-4), each step once in the records.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from background import on_stop  # noqa: E402
from background import result as background_result  # noqa: E402
from conftest import reference_history  # noqa: E402
from s3_server import fresh_buckets  # noqa: E402
from test_oracle import MEMORY, RTOL, SHORT, layout  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS = 12
# AdamW turns the fp32 rounding of two summation orders into differences above 1e-4 after about
# six steps at the default learning rate; at 1e-5 they stay below it for these 12.
MODEL = (*SHORT, *MEMORY, f"train.steps={STEPS}", "train.lr=1e-5", *layout(2, 2, 1, "1F1B", 2))
FAULTS = {"node": 2, "lighthouse": 6, "head": 10}  # each once group 0 has trained that many steps
OUT = "s3://ftruns/run"


def background(workdir: Path, env: dict, wanted: set[str] | None = None) -> dict:
    sets = [
        *MODEL,
        "fault_tolerance.enabled=true",
        "fault_tolerance.min_replicas=2",
        "fault_tolerance.step_timeout_s=10",
        "fault_tolerance.quorum_timeout_s=120",
        "checkpoint.interval=2",
        "run.max_failures=3",
        f"run.output_dir={OUT}",  # each group's records and checkpoints, read back from there
    ]
    spec = {"out": OUT, "sets": sets, "faults": FAULTS}
    argv = [sys.executable, str(HERE / "ft_cluster_driver.py"), json.dumps(spec)]
    env = {**env, **fresh_buckets("ftruns")}  # the S3 endpoint and keys reach every node by the environment
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    on_stop(proc.kill)
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    finally:
        proc.kill()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def faults():
    reference_history(MODEL)  # cached, while the cluster runs
    return background_result("test_replicas_ray", background)


def test_each_fault_fired_and_the_launch_ended_well(faults):
    out, first = faults["stdout"], faults["earlier"]
    assert faults["returncode"] == 0, out[-3000:]
    assert [f["fault"] for f in faults["faults"]] == ["node", "lighthouse", "head"], faults["faults"]
    node, lighthouse, head = faults["faults"]
    assert node["removed"] == 1 and lighthouse["killed"], faults["faults"]
    assert head["returncode"] == -9, head
    assert "fault tolerance: 2 replica groups of 2 workers" in first and "lighthouse: http://" in first, first[:2000]
    assert "done: replica group(s) 0, 1 trained every step" in out, out[-2000:]
    assert faults["summary"]["ended"] == "completed"
    assert [r["exit_code"] for r in faults["summary"]["replica_groups"]] == [0, 0]


def test_only_the_failed_group_restarted_and_the_lighthouse_cost_no_restart(faults):
    """Before the head's loss: group 1 restarted once (its node, in 1), group 0 never; the
    Lighthouse's death (2) restarted neither."""
    first = faults["earlier"]
    restarts = [[line for line in first.splitlines() if line.startswith(f"[group {g}] restart ")] for g in (0, 1)]
    assert [len(r) for r in restarts] == [0, 1], restarts
    # From its newest checkpoint, none (step 0) or step 2 (checkpoint.interval=2) if its save of
    # step 2 completed before the node went: the groups step together, so which is timing.
    said = "[group 1] restart 1: the worker group continues from step "
    assert restarts[1][0].startswith(said), restarts
    assert int(restarts[1][0][len(said) :]) in range(0, faults["faults"][0]["group0_steps"] + 1, 2), restarts


def test_the_resume_after_the_heads_loss_continued_each_group_from_its_checkpoint(faults):
    head_at = faults["faults"][2]["group0_steps"]
    for g in (0, 1):
        start = next(line for line in faults["stdout"].splitlines() if line.startswith(f"[group {g}] start:"))
        assert f"resumed from {OUT}/replica_{g}/checkpoints/step_" in start, start
        resumed = int(start.rsplit(" at step ", 1)[1].split()[0].rstrip(";"))
        assert 0 < resumed <= head_at and resumed % 2 == 0, start  # checkpoint.interval=2


def test_every_step_once_with_both_groups_and_the_losses_of_an_uninterrupted_process(faults):
    """Each group's records have each step at most once, every one with both groups and the
    reference's numbers; together they have every step. (A group resumed from an older checkpoint
    than the other's receives the other's state: the steps between are in the other's records,
    its own driver having died before it recorded them on storage.)"""
    reference = reference_history(MODEL)
    seen = set()
    for g in (0, 1):
        steps = [r for r in faults[f"metrics_{g}"] if "loss" in r]
        numbers = [r["step"] for r in steps]
        assert numbers == sorted(set(numbers)), (g, numbers)
        assert numbers[0] == 0 and numbers[-1] == STEPS - 1, (g, numbers)
        assert all(r["replicas_in_step"] == [0, 1] and r["committed"] for r in steps), g
        for got in steps:
            want = reference[got["step"]]
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=RTOL), (g, key, got["step"])
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-9)
        seen |= set(numbers)
    assert seen == set(range(STEPS)), (sorted(seen), faults["faults"][-1])
