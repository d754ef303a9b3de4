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

import numpy as np
import pytest
import torch

pytest.importorskip("torchft")

from ft_trial import Group, reached, wait_until  # noqa: E402
from gloo_harness import context  # noqa: E402
from reference import memory_windows, reference_run  # noqa: E402
from test_oracle import MEMORY, SHORT, assert_oracle, layout  # noqa: E402

from raytrain_hybrid.config import load_config  # noqa: E402
from raytrain_hybrid.errors import ConfigError  # noqa: E402

STEPS = 8
DIE_AT = 3  # group 1's first attempt dies in this step
WAIT_FROM = 5  # group 0 waits here until group 1 is back (the test's clock, not the trainer's)
# At the default learning rate, AdamW turns the fp32 rounding of any two summation orders into
# differences above 1e-4 after about six steps (a plain dp=2 tp=2 run too); at 3e-5 they stay
# below it for ten, while other rows than the record's would still change every loss and gradient.
FT = (
    *SHORT,
    *MEMORY,
    f"train.steps={STEPS}",
    "train.lr=3e-5",
    *layout(2, 2, 1, "1F1B", 2),
    "fault_tolerance.enabled=true",
)


def test_a_group_dies_and_rejoins_and_the_survivor_matches_the_replayed_reference(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    marker = str(tmp_path / "rejoined")
    common = (*FT, f"fault_tolerance.lighthouse={lighthouse.address()}", "fault_tolerance.step_timeout_s=20")
    cfgs = [load_config(None, [*common, f"fault_tolerance.replica_group={g}"]) for g in (0, 1)]
    ctx = context()
    # Buckets of 64 KiB: the groups' gradients go in several all-reduces, as a real model's do.
    small = {"bucket_bytes": 64 * 1024}
    survivor = Group(ctx, cfgs[0], marker, "survivor", {"waits_at": WAIT_FROM, **small})
    doomed = Group(ctx, cfgs[1], marker, "doomed", {"dies_at": DIE_AT, **small})
    assert wait_until(doomed.died), "group 1 did not die at its step"
    doomed.kill()
    # Group 1 comes back once group 0 has trained on alone (committed the step group 1 died in).
    assert wait_until(lambda: reached(marker, "survivor", DIE_AT + 1))
    rejoined = Group(ctx, cfgs[1], marker, "rejoined", {"rejoins": True, **small})
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
    with pytest.raises(ConfigError, match="fault_tolerance.min_replicas.*only with fault_tolerance.enabled=true"):
        load_config(None, [*SHORT, *MEMORY, "fault_tolerance.min_replicas=2"])
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
        trained = wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, every=0.2)
        assert trained, "group 1 never trained"
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
    summary = json.loads((run / "replica_0" / "summary.json").read_text())
    assert summary["ended"] == "completed" and summary["fault_tolerance"] == {
        "replica_group": 0,
        "replica_groups": 2,
        "steps_trained_here": steps,
        "steps_without": {},
    }
    healed = [json.loads(line) for line in (run / "replica_1_restart1" / "metrics.jsonl").read_text().splitlines()]
    healed_steps = [r["step"] for r in healed if "loss" in r]
    assert healed_steps and healed_steps[0] >= 2 and healed_steps[-1] == steps - 1, healed_steps
    reference = reference_history(common, "memory")
    for got, want in zip(steps_of, reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=RTOL), (key, got["step"])
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9)


def test_a_launch_of_every_group_or_of_one_is_checked_before_ray_starts(tmp_path, capsys):
    """On Ray, `train` without fault_tolerance.replica_group starts every group and their
    Lighthouse (tests/test_replicas_ray.py runs it): `check` says so. A launch of one group needs
    a Lighthouse named; a resume of every group needs their replica_<g> records; the Python API,
    which launches one group, needs its number. Each is refused before Ray starts, saying what
    to set, and leaves nothing behind."""
    import raytrain_hybrid as rh
    from raytrain_hybrid import cli

    sets = [
        *SHORT,
        *MEMORY,
        *layout(2, 2, 1, "1F1B", 2),
        "fault_tolerance.enabled=true",
        f"run.output_dir={tmp_path}/r",
    ]
    env = os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    try:
        assert cli.main(["check", *[a for o in sets for a in ("--set", o)]]) == 0
        out = capsys.readouterr().out
        assert "fault tolerance: 2 replica groups of 2 workers, each a Ray Train run restarted alone" in out, out
        assert "a Lighthouse started as a Ray actor on this driver's node" in out, out
        (tmp_path / "old").mkdir()
        args = ["train", *[a for o in sets for a in ("--set", o)], "--resume", str(tmp_path / "old")]
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert "--resume" in err and "has no replica_0/" in err, err
        assert cli.main(["check", *args[1:]]) == 2  # check: the same words
        assert capsys.readouterr().err == err
        more = [*sets, "fault_tolerance.replica_group=1"]
        assert cli.main(["train", *[a for o in more for a in ("--set", o)]]) == 2
        err = capsys.readouterr().err
        assert "fault_tolerance.lighthouse" in err and "TORCHFT_LIGHTHOUSE is not set" in err, err
        with pytest.raises(ConfigError, match="replica_group.*without it starts every group"):
            rh.train(load_config(None, sets))
    finally:
        if env is not None:
            os.environ["TORCHFT_LIGHTHOUSE"] = env
    assert not (tmp_path / "r").exists()


def test_when_the_lighthouse_goes_the_groups_stop_saying_why(tmp_path):
    """Nothing decides who is in a step without the Lighthouse: when its process is killed (its
    node lost), each group stops once fault_tolerance.quorum_timeout_s has passed, naming the
    Lighthouse and what to do."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    cmd = [str(Path(sys.executable).parent / "raytrain-hybrid"), "lighthouse", "--port", "0"]
    lighthouse = subprocess.Popen(
        [*cmd, "--join-timeout-s", "1", "--heartbeat-timeout-s", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    marker = str(tmp_path / "mark")
    try:
        address = lighthouse.stdout.readline().split()[1]
        common = (
            *SHORT,
            *MEMORY,
            "train.steps=400",
            *layout(2, 1, 1, "1F1B", 2),
            "fault_tolerance.enabled=true",
            f"fault_tolerance.lighthouse={address}",
            "fault_tolerance.quorum_timeout_s=4",
            "fault_tolerance.step_timeout_s=4",
        )
        ctx = context()
        cfgs = [load_config(None, [*common, f"fault_tolerance.replica_group={g}"]) for g in (0, 1)]
        groups = [Group(ctx, cfgs[g], marker, f"g{g}") for g in (0, 1)]
        assert wait_until(lambda: reached(marker, "g0", 2) and reached(marker, "g1", 2))
    finally:
        lighthouse.send_signal(signal.SIGKILL)
        lighthouse.wait(30)
    for group in groups:
        status, message = group.outcome(limit=120)
        assert status == "error", "trained on without a Lighthouse"
        assert "no quorum from the Lighthouse" in message and "fault_tolerance.quorum_timeout_s" in message, message


def test_ray_init_leaves_the_clis_sigterm_handler_in_place():
    """ray.init sets a SIGTERM handler of its own (exit at once, killing the local Ray): joining
    Ray puts back the one the CLI had set, so that SIGTERM still ends a run, or a launch of every
    replica group, with its records written and each group told (exit 143)."""
    import signal

    from raytrain_hybrid.launch.runtime.driver import Terminated, sigterm_ends_the_run
    from raytrain_hybrid.launch.runtime.session import _sigterm_kept

    with sigterm_ends_the_run():
        ours = signal.getsignal(signal.SIGTERM)
        with _sigterm_kept():
            signal.signal(signal.SIGTERM, lambda signum, frame: None)  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is ours
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line
