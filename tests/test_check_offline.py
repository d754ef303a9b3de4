"""`check` of a job whose model sits in a bucket out of reach here (no network, no credentials):
the model is said as not verified and the rest is checked (exit 0), where `train` would stop; the
planner predicts on the sizes the job file gives."""

from __future__ import annotations

from pathlib import Path

from raytrain_hybrid import cli

JOB = Path(__file__).resolve().parents[1] / "jobs" / "finetune_llama3_8b_chat.toml"


def test_check_says_an_unreachable_pretrained_model_as_not_verified(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    sets = ["model.pretrained=s3://my-bucket/models/M", "data.path=s3://my-bucket/chat/", f"run.output_dir={tmp_path}"]
    argv = ["check", str(JOB), "--hardware", "h100"]
    code = cli.main([*argv, *(a for s in sets for a in ("--set", s))])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "not verified: model.pretrained='s3://my-bucket/models/M' could not be read here" in out.out
    assert "layout ok: dp=8" in out.out
    # The job file gives Meta-Llama-3-8B's sizes: the planner predicts offline on them, and says so.
    planner = out.out.splitlines()[-1]
    assert planner.startswith("planner: H100-80GB SXM, 8 ranks: 20.4 GiB/rank") and "57,645 tokens/s" in planner
    assert planner.endswith("(the model sizes the config file gives)"), planner


def test_without_the_sizes_the_planner_is_not_run_offline(capsys, monkeypatch, tmp_path):
    """A config file that gives no sizes: no prediction rather than one on the default tiny model."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    sets = ["model.pretrained=s3://my-bucket/models/M", f"run.output_dir={tmp_path}", "data.path=memory"]
    code = cli.main(["check", "--hardware", "h100", *(a for s in sets for a in ("--set", s))])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert out.out.splitlines()[-1] == (
        "planner: not run: it needs the model sizes in the checkpoint's config.json, unread here"
    )
