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
    assert "2 kept, 0 broken" in done.stdout


def test_layers_contract_bites(tmp_path):
    """A lower layer importing a higher one (config -> launch, inside a function) breaks the
    package's layers; inside launch/, the plan importing the runtime breaks its roles."""
    probes = {
        ROOT / "raytrain_hybrid" / "config" / "_layer_probe.py": "raytrain_hybrid.launch.runtime.driver",
        ROOT / "raytrain_hybrid" / "launch" / "plan" / "_role_probe.py": "raytrain_hybrid.launch.runtime.session",
    }
    for probe, imported in probes.items():
        module, name = imported.rsplit(".", 1)
        probe.write_text(f"def f():\n    from {module} import {name}  # noqa: F401\n")
    try:
        done = _run(str(BIN / "lint-imports"), "--no-cache")
    finally:
        for probe in probes:
            probe.unlink()
    said = " ".join(done.stdout.split())  # (lint-imports wraps its lines)
    assert done.returncode != 0
    assert "0 kept, 2 broken" in said, done.stdout[-3000:]
    assert "raytrain_hybrid.config._layer_probe -> raytrain_hybrid.launch.runtime.driver" in said
    assert "raytrain_hybrid.launch.plan._role_probe -> raytrain_hybrid.launch.runtime.session" in said


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


def test_config_check_and_plan_import_neither_torch_nor_transformers(tmp_path):
    """What a CLI command costs before it does anything: loading a config (every command, every
    driver), `plan` and `check --json` (no cluster: the layout and its groups) read the
    architectures' specs as data; importing torch and transformers' model code would add ~3 s of
    CPU to each (`check` took 5.4 s, now ~1 s). A spec module that imports them at its top, or a
    planner helper that pulls torch.distributed in, fails this."""
    code = """
import contextlib, io, sys
from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
for arch in ("llama", "mistral", "qwen2"):
    load_config(None, [f"model.arch={arch}", "parallelism.dp=2", "parallelism.pp=2"])
with contextlib.redirect_stdout(io.StringIO()) as out:
    assert cli.main(["plan", "--world-size", "8", "--gpus-per-node", "8", "--top", "2"]) == 0
    assert cli.main(["check", "--set", "parallelism.pp=2", "--set", "parallelism.tp=2", "--topology", "4,4"]) == 0
assert "layout" in out.getvalue(), out.getvalue()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout[-2000:]


def test_data_and_launch_have_no_import_circles():
    """Inside data/ and launch/ the modules import one another one way (lazy imports included):
    a circle (examples -> packing -> stream -> packing, elastic <-> elastic_ray, checks <->
    example_checks, all gone) means neither module can be read, changed or moved alone."""
    import grimp

    graph = grimp.build_graph("raytrain_hybrid", cache_dir=None)
    circles = set()
    for package in ("raytrain_hybrid.data", "raytrain_hybrid.launch"):
        inside = {m for m in graph.modules if m.startswith(package + ".")}
        for module in inside:
            for imported in graph.find_modules_directly_imported_by(module) & inside:
                if graph.chain_exists(importer=imported, imported=module):
                    circles.add(tuple(sorted((module, imported))))
    assert not circles, sorted(circles)
