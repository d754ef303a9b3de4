"""The house rules, checked like any other behaviour: the layer order of the package
(import-linter's layers contract in pyproject.toml, lazy imports included), ruff's lint and
format, and small modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MAX_LINES = 400


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_layers_contract_is_kept():
    done = _run(str(BIN / "lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_layers_contract_bites(tmp_path):
    """A lower layer importing a higher one (config -> launch, inside a function) breaks it."""
    probe = ROOT / "raytrain_hybrid" / "config" / "_layer_probe.py"
    probe.write_text("def f():\n    from raytrain_hybrid.launch import driver  # noqa: F401\n")
    try:
        done = _run(str(BIN / "lint-imports"), "--no-cache")
    finally:
        probe.unlink()
    assert done.returncode != 0
    assert "raytrain_hybrid.config._layer_probe -> raytrain_hybrid.launch.driver" in done.stdout


def test_ruff_lint_and_format_are_clean():
    lint = _run(str(BIN / "ruff"), "check", ".")
    assert lint.returncode == 0, lint.stdout[-4000:]
    fmt = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout[-4000:]


def test_no_module_over_the_size_limit():
    big = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "raytrain_hybrid").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines: {big}"
