"""The driver's terminal during a run: Ray's output diverted to the run's log, ours kept."""

from __future__ import annotations

import logging
import os

import pytest

from raytrain_hybrid.launch.records.progress import quiet_driver


def test_quiet_driver_sends_ray_output_to_the_log_and_keeps_the_terminal(tmp_path, capfd):
    log = tmp_path / "driver.log"
    # Ray's loggers hold the process's stderr (file descriptor 2), bound before the run.
    stderr_fd = open(2, "w", closefd=False)  # noqa: SIM115
    handler = logging.StreamHandler(stderr_fd)
    logger = logging.getLogger("fake_ray")
    logger.addHandler(handler)
    try:
        with quiet_driver(log) as (out, err, _):
            print("(raylet) WARNING: 8 PYTHON worker processes have been started")  # Ray: sys.stdout
            logger.warning("Started a local Ray instance.")  # Ray's loggers: the stderr they hold
            os.write(2, b"[C++ core] fd 2\n")  # Ray's core: the file descriptor
            print("step 1/3  loss 8.3", file=out)
            print("error: something the user must see", file=err)
    finally:
        logger.removeHandler(handler)
        stderr_fd.close()
    print("after")
    seen = capfd.readouterr()
    assert seen.out == "step 1/3  loss 8.3\nafter\n"
    assert seen.err == "error: something the user must see\n"
    text = log.read_text()
    for line in ("(raylet) WARNING", "Started a local Ray instance.", "[C++ core] fd 2"):
        assert line in text


def test_a_run_refused_before_its_directory_exists_creates_nothing(tmp_path):
    with quiet_driver(tmp_path / "run" / "driver.log"):
        print("Ray said something")
    assert not (tmp_path / "run").exists()


def test_verbose_keeps_everything_on_the_terminal(tmp_path, capfd):
    with quiet_driver(tmp_path / "driver.log", quiet=False) as (out, err, live):
        print("(raylet) WARNING")
        print("step 1/3", file=out)
    assert live is None
    assert capfd.readouterr().out == "(raylet) WARNING\nstep 1/3\n"
    assert not (tmp_path / "driver.log").exists()


def test_every_worker_group_start_after_the_first_is_a_restart(tmp_path):
    """Rank 0 of each worker group says where it starts: a restart is counted also when it
    resumes past the last step the driver heard of (the checkpoint after step 4 was complete,
    step 5 was never reported), and the steps and checkpoints it redoes are dropped."""
    import json

    from raytrain_hybrid.launch.records.events import CheckpointEvent, StartEvent, StepEvent
    from raytrain_hybrid.launch.records.progress import RunLog

    log = RunLog(tmp_path, steps=6, progress=False, tensorboard=False)
    log.handle(StartEvent(0))
    for step in range(4):
        log.handle(StepEvent({"step": step, "loss": 1.0}))
        if step in (1, 3):
            log.handle(CheckpointEvent(step + 1, f"step_{step + 1}", write_s=0.1, save_s=0.1, blocked_s=0.0))
    log.handle(StartEvent(4))
    log.handle(StartEvent(2))
    for step in range(2, 6):
        log.handle(StepEvent({"step": step, "loss": 2.0}))
    log.close()
    assert log.restarts == 2 and log.restarted_from == [4, 2]
    assert [c["step"] for c in log.checkpoints] == [2]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(6)) and [m["loss"] for m in lines] == [1.0] * 2 + [2.0] * 4


def test_a_preemption_notice_its_save_and_the_restart_are_recorded_as_summary_json_keeps_them(tmp_path):
    """Rank 0's typed events of a preemption (heard at step 2 with Ray Train's nodes, ranks and
    deadline; its save complete; the group restarted from it) become the record summary.json
    keeps: the notice's fields, the save's, the step the group restarted from, and the
    checkpoint marked as the preemption's."""
    from raytrain_hybrid.launch.records.events import CheckpointEvent, PreemptionEvent, StartEvent, StepEvent
    from raytrain_hybrid.launch.records.progress import RunLog

    log = RunLog(tmp_path, steps=4, progress=False, tensorboard=False)
    log.handle(StartEvent(0, dp=2, tp=1, pp=1, microbatches=1))
    for step in range(2):
        log.handle(StepEvent({"step": step, "loss": 1.0}))
    heard = PreemptionEvent(2, noticed_at=100.0, nodes=["abcdef123"], ranks=[1], deadline_ms=160_000)
    log.handle(heard)
    log.handle(CheckpointEvent(2, "step_2", write_s=0.1, save_s=0.2, blocked_s=0.2))
    log.handle(PreemptionEvent(2, saved=True, saved_at=103.5))
    log.handle(StartEvent(2, dp=1, tp=1, pp=1, microbatches=2))
    log.close()
    assert log.preemptions == [
        {"step": 2, "saved": True, "noticed_at": 100.0, "nodes": ["abcdef123"], "ranks": [1],
         "deadline_ms": 160_000, "saved_at": 103.5, "restarted_from": 2}
    ]  # fmt: skip
    assert log.checkpoints == [
        {"step": 2, "path": "step_2", "write_s": 0.1, "save_s": 0.2, "blocked_s": 0.2, "reason": "preemption"}
    ]
    assert log.dp_starts == [
        {"step": 0, "dp": 2, "tp": 1, "pp": 1, "microbatches": 1},
        {"step": 2, "dp": 1, "tp": 1, "pp": 1, "microbatches": 2},
    ]
    assert log.restarts == 1 and log.restarted_from == [2]
    with pytest.raises(TypeError, match="not an event of a run"):
        log.handle(("step", {"step": 3}))


def test_a_group_restarted_from_step_0_that_receives_a_live_groups_state_keeps_the_steps_it_trained(tmp_path):
    """Fault tolerance: a replica group restarted without a checkpoint (step 0) is given the
    live group's state at step 2 and redoes nothing; its records keep steps 0 and 1."""
    import json

    from raytrain_hybrid.launch.records.events import StartEvent, StepEvent
    from raytrain_hybrid.launch.records.progress import RunLog

    log = RunLog(tmp_path, steps=4, progress=False, tensorboard=False)
    log.handle(StartEvent(0))
    for step in range(2):
        log.handle(StepEvent({"step": step, "loss": 1.0}))
    log.handle(StartEvent(0))
    for step in range(2, 4):
        log.handle(StepEvent({"step": step, "loss": 2.0}))
    log.close()
    assert log.restarts == 1 and log.restarted_from == [0]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and [m["loss"] for m in lines] == [1.0, 1.0, 2.0, 2.0]
