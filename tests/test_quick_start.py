"""The README's quick start, run as a reader pastes it: ``.venv/bin/raytrain-hybrid train`` in a
scratch copy of the checkout, no cluster named (its own local Ray, 8 Ray Train workers at 2x2x2),
no network. It exits 0 and prints every line the README shows after it (the start line with the
copy's directory for ``<checkout>``, each shown step's loss and gradient norm to the digits shown,
the last line; the throughputs are examples), and ``runs/latest`` holds what the README says it
holds. docs/index.md shows the same command; tests/test_docs.py holds that every other documented
command that runs on a CPU is run by .ci/docs.

The run (about 130 s of CPU, two minutes on 2 cores) is a background job (tests/background.py),
after the submitted jobs' head, so that it fills the cores the last single-process modules leave.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from background import result as background_result
from doc_commands import DOCS, ROOT, commands, missing_claims

COMMAND = ("train",)


def _quick_start():
    (shown,) = [c for c in commands(DOCS[0]) if c.args == COMMAND]  # README.md
    return shown


def _scratch(into: Path) -> None:
    """The checkout's files (tracked, and new ones git does not ignore) and a link to .venv, as
    scripts/run_doc_commands.py makes a page's copy: runs/ of the checkout untouched."""
    import shutil

    ls = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    for name in subprocess.run(ls, cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    (into / ".venv").symlink_to(ROOT / ".venv")


def background(workdir: Path, env: dict, cases: set[str] | None = None) -> dict:
    """The quick start's command in a copy of the checkout under ``workdir``, with the walk's
    environment: no RAY_ADDRESS, the Hub offline, no bucket reachable."""
    checkout = workdir / "checkout"
    checkout.mkdir()
    _scratch(checkout)
    # What the session's own ray.init put in this process's environment is not a reader's shell.
    env = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_CLIENT_MODE")}
    env.update(HF_HUB_OFFLINE="1", AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL="http://127.0.0.1:9")
    argv = [".venv/bin/raytrain-hybrid", *COMMAND]
    for _ in range(2):  # Ray's own start gave up on a loaded machine (its fixed wait), before the run began
        proc = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
        if "timed out during startup" not in proc.stdout + proc.stderr:
            break
    latest = checkout / "runs" / "latest"
    files = sorted(str(p.relative_to(latest)) for p in latest.rglob("*")) if latest.is_dir() else []
    return {"checkout": str(checkout), "code": proc.returncode, "out": proc.stdout, "err": proc.stderr, "files": files}


@pytest.fixture(scope="module")
def ran() -> dict:
    return background_result("test_quick_start", background)


def test_the_readme_quick_start_runs_as_shown(ran):
    shown = _quick_start()
    assert len(shown.output) >= 5 and shown.output[0].startswith("start: dp=2 tp=2 pp=2, 8 workers")
    printed = ran["out"] + ran["err"]
    assert ran["code"] == 0, printed[-3000:]
    missing = missing_claims(shown, printed, checkout=ran["checkout"], measured=True)
    assert not missing, f"the README shows it print {missing}, but it printed:\n{printed[-3000:]}"
    # "runs/latest/ then holds metrics.jsonl, summary.json, config.json, TensorBoard files and Ray's
    # own output (driver.log)"
    for name in ("metrics.jsonl", "summary.json", "config.json", "driver.log"):
        assert name in ran["files"], ran["files"]
    assert any(f.startswith("tensorboard/") or "tfevents" in f for f in ran["files"]), ran["files"]


def test_the_check_bites_on_a_wrong_loss(ran):
    """The same printed lines with one shown loss changed in its last digit fail the comparison."""
    shown = _quick_start()
    printed = (ran["out"] + ran["err"]).replace("loss 8.3363", "loss 8.3364")
    assert missing_claims(shown, printed, checkout=ran["checkout"], measured=True)


def test_docs_index_shows_the_same_command():
    index = [c for c in commands(ROOT / "docs" / "index.md") if c.args == COMMAND]
    assert index and all(c.text == _quick_start().text for c in index)
