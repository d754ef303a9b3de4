"""The notebooks run top to bottom as a user opens them (a fresh kernel, the notebook's folder
as working directory) and produce their pictures; what each cell shows in the committed notebook
is what it shows when run now (text to the character, except measured speeds; pictures by their
kind and size, not by pixel). With RT_WRITE_NOTEBOOKS=1 the tests write the executed notebooks
back instead (CONTRIBUTING.md: The notebooks)."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str, env: dict[str, str]):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        record_timing=False,  # (no timestamps in the cells' metadata: a re-saved notebook differs by its outputs only)
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute(env=env)
    return nb


# What a cell prints that is measured, not computed: masked before the saved and the new outputs are compared.
MEASURED = {"quick_start.ipynb": [re.compile(r"[\d,.]+ tokens/s")]}


def shown(nb, name: str) -> list[list]:
    """Per code cell, what it shows: what it prints (each stream's chunks joined, measured
    numbers masked), and of a picture its kinds of data and its text form ("<Figure size 500x300
    with 1 Axes>"). Not the PNG's bytes, which move with matplotlib's and freetype's versions,
    nor stderr: the libraries' log lines (Ray's, tqdm's), with their times and process ids."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        out: list = []
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == "stderr":
                continue
            if o.output_type == "stream":
                text = o.text.replace(str(ROOT), "<checkout>")  # (saved so, see assert_saved_outputs_current)
                for pattern in MEASURED.get(name, []):
                    text = pattern.sub("<measured>", text)
                if out and out[-1][0] == o.name:
                    out[-1] = (o.name, out[-1][1] + text)
                else:
                    out.append((o.name, text))
            else:
                data = o.get("data", {})
                out.append((o.output_type, sorted(data), data.get("text/plain", o.get("ename", ""))))
        cells.append(out)
    return cells


def assert_saved_outputs_current(nb, name: str) -> None:
    """The committed notebook shows what it shows when run now (or, with RT_WRITE_NOTEBOOKS=1,
    is rewritten with the new outputs)."""
    import nbformat

    path = NOTEBOOKS / name
    if os.environ.get("RT_WRITE_NOTEBOOKS") == "1":  # saved without the log lines (not compared: see shown)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs = [o for o in cell.outputs if o.get("name") != "stderr"]
                for o in cell.outputs:  # this checkout's path as the README writes it
                    if o.output_type == "stream":
                        o.text = o.text.replace(str(ROOT), "<checkout>")
        nbformat.write(nb, path)
        return
    saved, now = shown(nbformat.read(path, as_version=4), name), shown(nb, name)
    assert len(saved) == len(now), f"notebooks/{name}: {len(saved)} code cells saved, {len(now)} now"
    for i, (was, got) in enumerate(zip(saved, now, strict=True), 1):
        assert was == got, (
            f"notebooks/{name}, code cell {i}: the saved output is not what the cell shows now; re-save the "
            f"notebook with RT_WRITE_NOTEBOOKS=1 (CONTRIBUTING.md)\nsaved: {was}\nnow:   {got}"
        )


NOTEBOOK_OF = {
    "test_layout_explorer": "layout_explorer.ipynb",
    "test_sweep_analysis": "sweep_analysis.ipynb",
    "test_quick_start_trains_on_local_ray": "quick_start.ipynb",
}


@pytest.fixture(scope="module")
def executed(request):
    """The notebooks of this file's selected tests, executed side by side, a kernel each (their
    start-up and imports, and the quick start's waits on Ray, overlap); a future per notebook."""
    names = {NOTEBOOK_OF[item.originalname] for item in request.session.items if item.module is request.module}
    env = {}
    if "quick_start.ipynb" in names:
        # The kernel joins the session's cluster through RAY_ADDRESS, as the notebook says a user
        # with a running cluster does (without it, the notebook starts its own: a minute more here).
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_local").get_runtime_context().gcs_address
    env = {**os.environ, **env}  # after Ray's start, which sets the cluster's token variables here
    with ThreadPoolExecutor(len(names)) as pool:
        yield {name: pool.submit(execute, name, env) for name in names}


def outputs(nb, kind: str) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == kind]


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)


def text(nb) -> str:
    return "".join(o.get("text", "") for o in outputs(nb, "stream"))


def test_layout_explorer(executed):
    nb = executed["layout_explorer.ipynb"].result()
    out = text(nb)
    assert "layouts of 32 ranks" in out and "of 74.5 (fits)" in out  # rh.plan, then rh.check's planner line
    assert "dp  cp  tp  pp" in out
    assert "GPipe: bubble 27.3%" in out and "1F1B: bubble 27.3%" in out  # (p-1)/(m+p-1) at p=4, m=8
    assert "Interleaved1F1B: bubble 15.8%" in out
    assert images(nb) == 2  # memory breakdown, schedule timelines
    assert_saved_outputs_current(nb, "layout_explorer.ipynb")


def test_sweep_analysis(executed):
    nb = executed["sweep_analysis.ipynb"].result()
    out = text(nb)
    assert "Spearman rank correlation, predicted vs measured tokens/s: 0.905" in out  # the committed benchmark
    assert images(nb) == 1
    assert_saved_outputs_current(nb, "sweep_analysis.ipynb")


def quick_start_reference() -> list[dict]:
    """The single-process reference of the quick start's run (its job file and overrides)."""
    from reference import reference_run

    from raytrain_hybrid.config import load_config

    return reference_run(load_config(ROOT / "jobs" / "local_3d.toml", ["train.steps=6", "data.path=memory"]))


@pytest.mark.slow
def test_quick_start_trains_on_local_ray(executed):
    """The README's main layout, 2x2x2 on 8 Ray Train workers: every step's loss and gradient
    norm are the single-process run's (computed here while the notebook runs)."""
    reference = quick_start_reference()
    nb = executed["quick_start.ipynb"].result()
    out = text(nb)
    assert "6 steps, final loss" in out
    assert out.count("rank ") >= 8
    assert images(nb) == 1
    history = [json.loads(x) for x in (ROOT / "runs" / "quick_start" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == len(reference) == 6
    for got, want in zip(history, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), f"loss at step {want['step']}"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), f"grad_norm at step {want['step']}"
    assert_saved_outputs_current(nb, "quick_start.ipynb")
