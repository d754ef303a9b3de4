"""The notebooks run top to bottom as a user opens them (a fresh kernel, the notebook's folder
as working directory) and produce their pictures."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def outputs(nb, kind: str) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == kind]


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)


def text(nb) -> str:
    return "".join(o.get("text", "") for o in outputs(nb, "stream"))


def test_layout_explorer():
    nb = execute("layout_explorer.ipynb")
    out = text(nb)
    assert "fit in 74.5 GiB per device" in out
    assert "dp  tp  pp" in out
    assert "GPipe: bubble 27.3%" in out and "1F1B: bubble 27.3%" in out  # (p-1)/(m+p-1) at p=4, m=8
    assert "Interleaved1F1B: bubble 15.8%" in out
    assert images(nb) == 2  # memory breakdown, schedule timelines


def test_sweep_analysis():
    nb = execute("sweep_analysis.ipynb")
    out = text(nb)
    assert "Spearman rank correlation, predicted vs measured tokens/s: 0.905" in out  # the committed benchmark
    assert images(nb) == 1


@pytest.mark.slow
def test_quick_start_trains_on_local_ray(ray_local, monkeypatch):
    # The kernel joins the session's cluster through RAY_ADDRESS, as the notebook says a user
    # with a running cluster does (without it, the notebook starts its own: a minute more here).
    monkeypatch.setenv("RAY_ADDRESS", ray_local.get_runtime_context().gcs_address)
    nb = execute("quick_start.ipynb")
    out = text(nb)
    assert "6 steps, final loss" in out
    assert out.count("rank ") >= 8
    assert images(nb) == 1
