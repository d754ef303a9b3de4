"""Per-step fault tolerance ([fault_tolerance], torchft): two replica groups (each dp=1 x tp=2,
a process group of its own, as two torchrun launches would be) meet at a real torchft
Lighthouse. Group 1 dies in the middle of step 3 (after its backward, before the groups'
gradient average); group 0 gives that step up, retries it alone and goes on; group 1,
started again (as torchrun's --max-restarts does), receives the weights, optimizer state and
step from group 0 and trains with it again.

The oracle: a plain single-process transformers loop that replays the participation record
(each step, the rows of the groups in ``replicas_in_step``) trains exactly what group 0 trained:
losses, every parameter's gradient norm, final weights (fp32, 1e-4). The rejoined group ends with
group 0's weights.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

pytest.importorskip("torchft")

from gloo_harness import _first_report, _rank, _run_job, context, rendezvous  # noqa: E402
from reference import memory_windows, reference_run  # noqa: E402
from test_oracle import MEMORY, SHORT, assert_oracle, layout  # noqa: E402

from raytrain_hybrid.config import load_config  # noqa: E402
from raytrain_hybrid.errors import ConfigError  # noqa: E402

STEPS = 8
DIE_AT = 3  # group 1's first attempt dies in this step
WAIT_FROM = 5  # group 0 waits here until group 1 is back (the test's clock, not the trainer's)
FT = (*SHORT, *MEMORY, f"train.steps={STEPS}", *layout(2, 2, 1, "1F1B", 2), "fault_tolerance.enabled=true")


def _group_job(rank: int, world: int, job: dict, marker: str, role: str) -> dict:
    """One rank of one replica group: the engine's worker, with the test's fault and clock."""
    from raytrain_hybrid.engine import replicas

    if role == "dies":  # rank 0 of group 1's first attempt, mid-step, before the gradient average
        combine = replicas.ReplicaSync.combine

        def dying(self, loss, tokens):
            if rank == 0 and self.manager.current_step() == DIE_AT:
                os._exit(1)
            return combine(self, loss, tokens)

        replicas.ReplicaSync.combine = dying
    if role == "rejoins":  # heartbeating: group 0 may go on
        init = replicas.ReplicaSync.__init__

        def joined(self, *args, **kwargs):
            init(self, *args, **kwargs)
            open(marker, "a").close()

        replicas.ReplicaSync.__init__ = joined
    if role == "survives":
        begin = replicas.ReplicaSync.begin

        def waiting(self):
            open(f"{marker}.survivor_at_{self.manager.current_step()}", "a").close()
            if self.manager.current_step() == WAIT_FROM:
                deadline = time.monotonic() + 120
                while not os.path.exists(marker) and time.monotonic() < deadline:
                    time.sleep(0.2)
            return begin(self)

        replicas.ReplicaSync.begin = waiting
    return _run_job(rank, world, job)


class _Group:
    """A replica group's ranks, forked, with a store of its own (as a torchrun launch has)."""

    def __init__(self, ctx, cfg, marker: str, role: str) -> None:
        self.store = rendezvous()
        self.queue = ctx.Queue()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port)}
        job = {"cfg": cfg}
        world = cfg.parallelism.tp
        self.procs = [
            ctx.Process(
                target=_rank, args=(r, world, self.store.port, _group_job, (job, marker, role), env, self.queue)
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def died(self) -> bool:
        return any(p.exitcode not in (None, 0) for p in self.procs)

    def kill(self) -> None:  # what torchrun's agent does to the rest of a group when one worker fails
        for p in self.procs:
            p.kill()
            p.join(30)

    def result(self):
        status, payload = _first_report(self.queue, self.procs, limit=300)
        if status != "ok":
            self.kill()
        assert status == "ok", payload
        for p in self.procs:
            p.join(60)
        return payload


def test_a_group_dies_and_rejoins_and_the_survivor_matches_the_replayed_reference(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    marker = str(tmp_path / "rejoined")
    common = (*FT, f"fault_tolerance.lighthouse={lighthouse.address()}", "fault_tolerance.step_timeout_s=20")
    cfgs = [load_config(None, [*common, f"fault_tolerance.replica_group={g}"]) for g in (0, 1)]
    ctx = context()
    survivor = _Group(ctx, cfgs[0], marker, "survives")
    doomed = _Group(ctx, cfgs[1], marker, "dies")
    deadline = time.monotonic() + 240
    while not doomed.died() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert doomed.died(), "group 1 did not die at its step"
    doomed.kill()
    # Group 1 comes back once group 0 has trained on alone (committed the step group 1 died in).
    while not os.path.exists(f"{marker}.survivor_at_{DIE_AT + 1}") and time.monotonic() < deadline:
        time.sleep(0.2)
    rejoined = _Group(ctx, cfgs[1], marker, "rejoins")
    try:
        first, second = survivor.result(), rejoined.result()
    finally:
        lighthouse.shutdown()

    history = first["history"]
    record = {h["step"]: h["replicas_in_step"] for h in history}
    assert sorted(record) == list(range(STEPS))
    assert record[DIE_AT] == [0], record  # the step group 1 died in: given up, then committed alone
    assert any(groups == [0, 1] for s, groups in record.items() if s > DIE_AT), record  # back in
    # The rejoined group trained from the step it was given, with both groups.
    healed = [h["step"] for h in second["history"]]
    assert healed and healed[0] > DIE_AT and healed[-1] == STEPS - 1, healed
    assert all(h["replicas_in_step"] == [0, 1] for h in second["history"])

    # The reference: one process, transformers' own model, the steps' rows as the record says.
    full = cfgs[0]
    batches = memory_windows(full, STEPS)
    share = full.train.global_batch_size // 2
    replay = [torch.cat([batches[s][g * share : (g + 1) * share] for g in record[s]]) for s in range(STEPS)]
    reference = reference_run(full, windows=replay, initial=first["probe"]["initial"])
    assert_oracle(first, reference)
    for name, value in first["probe"]["final"].items():
        np.testing.assert_allclose(second["probe"]["final"][name], value, rtol=0, atol=1e-6, err_msg=name)


def test_refusals_name_the_key_and_what_works():
    def refused(*overrides):
        with pytest.raises(ConfigError) as err:
            load_config(None, [*SHORT, *MEMORY, "fault_tolerance.enabled=true", *overrides])
        return str(err.value)

    assert "at least two replica groups" in refused(*layout(1, 2, 1, "1F1B", 2))
    assert "zero=1" in refused(*layout(2, 1, 1, "1F1B", 2, 1))
    msg = refused(*layout(2, 1, 1, "1F1B", 2), "fault_tolerance.min_replicas=3")
    assert "fault_tolerance.min_replicas" in msg and "2 replica groups" in msg
    assert "fault_tolerance.replica_group" in refused(*layout(2, 1, 1, "1F1B", 2), "fault_tolerance.replica_group=2")
    # zero=2/3: the groups are parallelism.replicate's
    cfg = load_config(
        None,
        [*SHORT, *MEMORY, "fault_tolerance.enabled=true", *layout(4, 1, 1, "1F1B", 2, 3), "parallelism.replicate=2"],
    )
    from raytrain_hybrid.engine.replicas import group_config

    group = group_config(cfg)
    assert (group.parallelism.dp, group.parallelism.replicate, group.train.global_batch_size) == (2, 1, 8)


def test_torchrun_groups_a_killed_worker_and_the_run_equals_an_uninterrupted_one(tmp_path):
    """From the user's side: `raytrain-hybrid lighthouse`, then one torchrun launch per replica
    group (--max-restarts). A worker of group 1 is killed (SIGKILL) during the run; torchrun
    restarts that group alone, which receives the state from group 0, and the run's losses,
    gradient norms and learning rates are those of an uninterrupted single-process run."""
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil
    from conftest import reference_history
    from test_oracle import RTOL

    bin_dir = Path(sys.executable).parent
    steps = 6
    common = (*SHORT, *MEMORY, f"train.steps={steps}", *layout(2, 1, 1, "1F1B", 2))
    lighthouse = subprocess.Popen(
        [str(bin_dir / "raytrain-hybrid"), "lighthouse", "--port", "0", "--min-replicas", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        address = lighthouse.stdout.readline().split()[1]
        run = tmp_path / "run"
        sets = [
            *common,
            "fault_tolerance.enabled=true",
            "fault_tolerance.min_replicas=2",  # group 0 waits for group 1 at each step: it cannot finish first
            "fault_tolerance.step_timeout_s=20",
            f"run.output_dir={run}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": address}

        def launch(group: int) -> subprocess.Popen:
            args = [a for o in (*sets, f"fault_tolerance.replica_group={group}") for a in ("--set", o)]
            cmd = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1"]
            return subprocess.Popen(
                [*cmd, "-m", "raytrain_hybrid.cli", "train", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )

        groups = [launch(0), launch(1)]
        metrics = run / "replica_1" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        assert metrics.exists(), "group 1 never trained"
        workers = psutil.Process(groups[1].pid).children(recursive=True)
        assert workers, "no worker process under group 1's torchrun"
        os.kill(workers[-1].pid, signal.SIGKILL)  # one worker: torchrun restarts its group
        outs = [g.communicate(timeout=300)[0] for g in groups]
        assert [g.returncode for g in groups] == [0, 0], outs
    finally:
        lighthouse.send_signal(signal.SIGINT)
        lighthouse.wait(30)

    assert "fault tolerance: replica group 0 of 2" in outs[0], outs[0]
    rows = [json.loads(line) for line in (run / "replica_0" / "metrics.jsonl").read_text().splitlines()]
    steps_of = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps_of] == list(range(steps))
    assert all(r["replicas_in_step"] == [0, 1] for r in steps_of), [r["replicas_in_step"] for r in steps_of]
    healed = [json.loads(line) for line in (run / "replica_1_restart1" / "metrics.jsonl").read_text().splitlines()]
    healed_steps = [r["step"] for r in healed if "loss" in r]
    assert healed_steps and healed_steps[0] >= 2 and healed_steps[-1] == steps - 1, healed_steps
    reference = reference_history(common, "memory")
    for got, want in zip(steps_of, reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=RTOL), (key, got["step"])
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9)


def test_train_on_ray_refuses_fault_tolerance_and_says_how_to_launch_it(tmp_path, capsys):
    from raytrain_hybrid import cli

    sets = [
        *SHORT,
        *MEMORY,
        *layout(2, 2, 1, "1F1B", 2),
        "fault_tolerance.enabled=true",
        f"run.output_dir={tmp_path}/r",
    ]
    assert cli.main(["train", *[a for o in sets for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err
    assert "fault_tolerance.enabled" in err and "torchrun --standalone --nproc-per-node 2" in err, err
    assert "raytrain-hybrid lighthouse" in err and not (tmp_path / "r").exists()
