"""`check` of a job whose model sits in a bucket out of reach here (no network, no credentials):
the model is said as not verified and the rest is checked (exit 0), where `train` would stop; the
planner predicts on the sizes the job file gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raytrain_hybrid import cli

JOBS = Path(__file__).resolve().parents[1] / "jobs"
# The shipped jobs whose model is a checkpoint in the user's bucket.
IN_A_BUCKET = sorted(p for p in JOBS.glob("*.toml") if 'pretrained = "s3://' in p.read_text())


def _offline(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.mark.parametrize("job", IN_A_BUCKET, ids=lambda p: p.name)
def test_the_documented_check_of_a_job_predicts_offline(job, capsys, monkeypatch, tmp_path):
    """The check its header documents, with its submit line's --set filled in as a user fills them:
    the model is said as not verified, the rest is checked (exit 0), and the planner predicts on
    the sizes the job file gives, the prediction its header quotes."""
    from job_files import submit_overrides

    _offline(monkeypatch)
    header = re.search(r"^# planner \(`raytrain-hybrid (check \S+ --hardware \S+)`.*\n#   (.+)$", job.read_text(), re.M)
    assert len(IN_A_BUCKET) >= 3 and header, job
    argv = [*header.group(1).split(), *(a for s in submit_overrides(job) for a in ("--set", s))]
    code = cli.main([*argv, "--set", f"run.output_dir={tmp_path}"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "not verified: model.pretrained='s3://example-bucket/models/" in out.out
    assert out.out.splitlines()[-1] == f"planner: {header.group(2)} (the model sizes the config file gives)"


def test_without_the_sizes_the_planner_is_not_run_offline(capsys, monkeypatch, tmp_path):
    """A config file that gives no sizes: no prediction rather than one on the default tiny model."""
    _offline(monkeypatch)
    sets = ["model.pretrained=s3://my-bucket/models/M", f"run.output_dir={tmp_path}", "data.path=memory"]
    code = cli.main(["check", "--hardware", "h100", *(a for s in sets for a in ("--set", s))])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert out.out.splitlines()[-1] == (
        "planner: not run: it needs the model sizes in the checkpoint's config.json, unread here"
    )
