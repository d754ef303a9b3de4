"""The documentation tells the truth, and keeps telling it as the code changes.

- The site (mkdocs.yml, docs/) builds with ``mkdocs build --strict``: a broken link or anchor,
  or a page left out of the navigation, fails.
- docs/reference/config.md and docs/reference/cli.md are what scripts/gen_reference.py writes
  from the schema and the CLI today, and every config key has a comment to document it.
- Every ``raytrain-hybrid`` command in README.md and docs/**/*.md (fenced code blocks: every line
  of a bash/sh block, the ``$ `` lines of other blocks; ``.venv/bin/raytrain-hybrid``,
  ``raytrain-hybrid`` and ``python -m raytrain_hybrid.cli``, also after ``ray job submit ... --``)
  parses with the CLI's own argparse parser. ``--version``, ``--help``, ``check`` and ``plan``
  run for real through ``cli.main`` in this process, from the repository root, and must exit 0;
  a command whose next line in the block starts with ``error:`` (``train`` too) runs for real and
  must be refused with exit 2 instead. The lines a console block shows after a command are lines
  it prints ("..." elides). ``train`` and ``sweep`` commands' config file and ``--set`` overrides
  load and validate as ``check`` loads them, without a cluster (what cannot be read offline, a Hub
  model or a bucket, is left unverified as ``check`` leaves it). Placeholders such as
  ``<your-bucket>`` are filled in with a sample value first, as a reader would. A local path the
  reader supplies or an earlier command creates (``model.pretrained``, ``data.path``, ...) that
  does not exist here is the one refusal accepted. (The collector is tests/doc_commands.py.)
- The commands that train on a CPU run for real, as pasted, in scratch copies of the repository:
  the README's quick start (``raytrain-hybrid train``, also docs/index.md's) in the suite
  (tests/test_quick_start.py, its printed lines checked); every other one (train, resume, export,
  prepare-data, sweep: minutes each) in CI on a clean checkout, ``.ci/docs``
  (scripts/run_doc_commands.py --check: exit codes and printed lines). The test below holds that
  split: each command the walk (tests/doc_commands.walk) says runs on a CPU is run by one of them.
  No committed record stands in for a run.
- docs/performance.md quotes each figure's date and command as its benchmarks/results/*.json
  records them, and quotes every result file.
- README.md stays short, keeps the two setup-contract commands (.ci/run runs the second exactly),
  and its status box says a GPU result exists exactly when one is committed; README.md,
  CONTRIBUTING.md and CHANGELOG.md link only to files that exist; user text names no issue or
  commit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from doc_commands import DOCS, PLACEHOLDER, ROOT, SHELLS, Shown, blocks, commands, fill, missing_claims, walk

from raytrain_hybrid import cli
from raytrain_hybrid.config import Config, load_config
from raytrain_hybrid.errors import ConfigError, LayoutError

RUN = {"check", "plan"}  # commands cheap enough to run for real (no Ray, no model)
LOADS = {"train", "sweep", "check", "plan"}  # commands that take a config and --set overrides
# Keys whose value is a file or directory the reader brings (or an earlier command makes).
READER_PATHS = {"model.pretrained", "data.path", "data.val_path", "data.tokenizer", "config file"}
SETUP_TRAIN = "bash scripts/setup.sh && .venv/bin/raytrain-hybrid train"
SETUP_TEST = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    for page in DOCS[1:]:  # every page of docs/ became a page of the site
        html = site / page.relative_to(ROOT / "docs").with_suffix("") / "index.html"
        assert html.exists() or page.name == "index.md", f"{page.relative_to(ROOT)} is not in the site"


def test_the_reference_pages_are_generated_from_todays_code():
    gen = _generator()
    for path, text in gen.pages().items():
        name = path.relative_to(ROOT)
        fix = "run `.venv/bin/python scripts/gen_reference.py` and commit the result"
        assert path.exists(), f"{name} is missing: {fix}"
        assert path.read_text() == text, f"{name} differs from the code (schema or CLI changed): {fix}"


def test_every_config_key_is_documented_by_its_comment():
    gen = _generator()
    page = gen.config_page()
    for section in fields(Config):
        docs = gen._field_docs(section.default_factory)
        for f in fields(section.default_factory):
            assert docs[f.name][1], f"{section.name}.{f.name} has no comment above it in config/schema.py"
            assert f"### {section.name}.{f.name}\n" in page


# ---- the commands shown in README.md and docs/ ----


SHOWN = [cmd for path in DOCS for cmd in commands(path)]


def test_the_commands_are_collected():
    """The collector finds what the README shows (so the test below cannot pass on nothing)."""
    readme = {c.args for c in SHOWN if c.where.startswith("README.md")}
    assert ("train",) in readme
    assert ("train", "--set", "parallelism.tp=3") in readme
    assert [c.fails for c in SHOWN if c.args == ("train", "--set", "parallelism.tp=3")][0]


def _reader_path(exc: ConfigError) -> bool:
    """The refusal names a local file or directory the reader is to bring, absent here."""
    value = str(getattr(exc, "value", ""))
    return getattr(exc, "key", "") in READER_PATHS and "://" not in value and not (ROOT / value).exists()


@pytest.fixture
def as_a_reader(monkeypatch):
    """A shell in the repository root, no cluster named, no network: Hub ids resolve offline and
    no bucket answers (refused at once), as on a laptop without credentials."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants  # it reads HF_HUB_OFFLINE once, at its import (maybe a test's before)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing listens


def _filled_config(args: list[str], config: str | None, tmp: Path) -> list[str]:
    """The arguments with a config file whose text holds placeholders replaced by a filled copy
    (the docs tell the reader to fill them in; refusing them as they are is check's job)."""
    if not config or not (ROOT / config).is_file() or not PLACEHOLDER.search((ROOT / config).read_text()):
        return args
    copy = tmp / Path(config).name
    copy.write_text(fill((ROOT / config).read_text()))
    return [str(copy) if a == config else a for a in args]


@pytest.mark.parametrize("shown", SHOWN, ids=[c.where for c in SHOWN])
def test_a_documented_command_works_as_pasted(shown, as_a_reader, capsys, tmp_path):
    args = list(shown.args)
    try:
        parsed = cli._parser().parse_args(args)
    except SystemExit as exc:  # --help, --version: they print and exit; a bad flag exits 2
        out = capsys.readouterr()
        assert exc.code == (2 if shown.fails else 0), f"{shown.where}: {args} -> {out}"
        _shows_what_it_prints(shown, out.out + out.err)
        return
    command = parsed.command
    args = _filled_config(args, getattr(parsed, "config", None), tmp_path)
    parsed = cli._parser().parse_args(args)
    if command in LOADS:
        try:
            load_config(getattr(parsed, "config", None), parsed.overrides, unverified=[])
        except (ConfigError, LayoutError) as exc:
            if shown.fails:  # refused before anything starts: the command itself runs, cheaply
                code = cli.main(args)
                out = capsys.readouterr()
                assert code == 2, f"{shown.where}: {' '.join(args)} -> {code}\n{out.out}\n{out.err}"
                _shows_what_it_prints(shown, out.out + out.err)
                return
            if isinstance(exc, ConfigError) and _reader_path(exc):
                return
            pytest.fail(f"{shown.where}: {' '.join(args)}\n  the config does not load: {exc}")
    if command in RUN:
        if getattr(parsed, "address", None):  # checked on one node here, as without a cluster
            i = args.index("--address")
            del args[i : i + 2]
        code = cli.main(args)
        out = capsys.readouterr()
        assert code == (2 if shown.fails else 0), f"{shown.where}: {' '.join(args)} -> {code}\n{out.out}\n{out.err}"
        _shows_what_it_prints(shown, out.out + out.err)
    else:
        assert not shown.fails, f"{shown.where}: {' '.join(args)} is shown failing but loads and validates"


def _shows_what_it_prints(shown: Shown, printed: str) -> None:
    """Each output line the block shows is a line the command printed ("..." elides lines; a
    line ending in "..." shows the start of one)."""
    missing = missing_claims(shown, printed)
    if missing:
        pytest.fail(f"{shown.where}: {' '.join(shown.args)} does not print\n  {missing[0]}\nbut\n{printed}")


QUICK_START = "raytrain-hybrid train"  # run as pasted by tests/test_quick_start.py
CI_DOCS = ROOT / ".ci" / "docs"


def where_it_runs(step) -> str:
    """Who runs a documented command that runs on a CPU: "here" (this module: --help, --version,
    check, plan, and every command shown refused), "quick start" (tests/test_quick_start.py), or
    "ci" (.ci/docs, the walk on a clean checkout)."""
    if isinstance(step.step, Shown):
        args = step.step.args
        if step.step.fails or not args or args[0] in RUN | {"--version", "-h"} or "--help" in args:
            return "here"
        if step.step.text == QUICK_START:
            return "quick start"
    return "ci"


def test_the_walk_knows_what_runs_on_a_cpu():
    """The walk's split (tests/doc_commands.walk) runs the checkpoints page's chain and the quick
    start, and skips the 8-GPU fine-tune, the bucket and the export of a run it did not make."""
    steps = {(s.step.where.split(":")[0], s.step.text): s for path in DOCS for s in walk(path)}
    chain = [s for (page, _), s in steps.items() if page == "docs/checkpoints.md"]
    assert len(chain) == 4 and not any(s.skip for s in chain)
    assert not steps["README.md", "raytrain-hybrid train"].skip
    readme = [s for (page, _), s in steps.items() if page == "README.md" and "finetune_8gpu" in s.step.text]
    assert "GPUs" in readme[0].skip and "not run here" in readme[1].skip
    assert any("object storage" in s.skip for (page, _), s in steps.items() if page == "README.md")


def test_every_command_that_runs_on_a_cpu_is_run_by_the_suite_or_ci():
    """Each documented command that runs on a CPU here is run by this module, by the quick start's
    test, or by .ci/docs: the walk over every page in --check mode on a clean checkout, which fails
    on an exit code or a printed line the page does not show. Nothing is taken from a record."""
    ci = CI_DOCS.read_text().strip().splitlines()
    assert ci[-1] == "bash scripts/setup.sh && .venv/bin/python scripts/run_doc_commands.py --check", ci[-1]
    runs: dict[str, list[str]] = {}
    for path in DOCS:
        for step in walk(path):
            if not step.skip:
                runs.setdefault(where_it_runs(step), []).append(f"{step.step.where}: {step.step.text}")
    quick = runs.get("quick start", [])
    assert sorted(w.split(":")[0] for w in quick) == ["README.md", "docs/index.md"], quick
    assert len(runs.get("ci", [])) >= 15 and len(runs.get("here", [])) >= 20, {k: len(v) for k, v in runs.items()}


# ---- performance figures and the README ----

_MEASURED = re.compile(
    r"Measured on (\d{4}-\d{2}-\d{2}) with `([^`]+)` \(`benchmarks/results/([\w.]+\.json)`(?:, `(\w+)`)?\)"
)


def test_performance_figures_quote_their_results():
    text = (ROOT / "docs" / "performance.md").read_text()
    quoted = _MEASURED.findall(text)
    assert quoted, "docs/performance.md quotes no result"
    for date, command, name, key in quoted:
        result = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        record = result[key] if key else result
        assert (record["date"], record["command"]) == (date, command), f"{name} {key}: the page and the file disagree"
    results = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    # Not speed or memory figures: the suite's timings (CONTRIBUTING.md), a calibrated planner profile,
    # the fuzzing of user input (docs/security.md), the fault-injection campaign across checkpoint saves.
    # The walk of the documented commands (tests/test_docs.py reads it).
    results -= {"suite_time.json", "local_profile.json", "fuzz.json", "faults.json", "faults_ray.json"}
    results -= {"doc_commands.json"}
    assert results <= {name for _, _, name, _ in quoted}, "a result in benchmarks/results/ is not on the page"


def test_the_readme_is_short_and_keeps_the_setup_contract():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    shell_lines = {line.strip() for lang, block in blocks(readme) if lang in SHELLS for _, line in block}
    assert {SETUP_TRAIN, SETUP_TEST} <= shell_lines
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == SETUP_TEST


def test_the_readme_names_the_schedules_there_are():
    """The README's features say how many pipeline schedules there are and name each as
    parallelism.schedule takes it."""
    from raytrain_hybrid.config.parallelism import SCHEDULES

    line = " ".join(re.search(r"\w+ pipeline schedules \(([^)]*)\)", (ROOT / "README.md").read_text()).group(0).split())
    count = "two three four five six seven eight nine ten".split().index(line.split()[0]) + 2
    named = re.search(r"\(([^)]*)\)", line).group(1).split(", ")
    assert (count, sorted(named)) == (len(SCHEDULES), sorted(SCHEDULES)), line


def test_the_readme_installs_the_cpu_torch_first_in_an_own_environment():
    """Into an environment of one's own, the README installs the CPU build of a torch that
    pyproject.toml accepts before the package, so that the resolver keeps it (and does not pull
    the CUDA wheels onto a machine without a GPU)."""
    import tomllib

    from packaging.requirements import Requirement

    readme = (ROOT / "README.md").read_text()
    own = readme[readme.index("environment of your own") :]
    torch_first = re.search(r"pip install torch==([\w.]+) --index-url https://download\.pytorch\.org/whl/cpu", own)
    assert torch_first and torch_first.start() < own.index("pip install -e"), own[:400]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert torch.specifier.contains(torch_first.group(1)), (torch_first.group(1), str(torch.specifier))


def test_the_status_box_says_what_ran_on_a_gpu():
    """The README says no GPU result is committed exactly while benchmarks/results/ holds none."""
    status = "\n".join(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(">"))
    assert "Not yet run" in status and "NCCL" in status
    gpu = [p for p in (ROOT / "benchmarks" / "results").glob("*.json") if re.search(r"gpu|h100", p.name, re.I)]
    says_none = "no GPU measurement is committed yet" in status
    assert says_none == (not gpu), f"the README's status box is out of date with {[p.name for p in gpu]}"


def test_user_text_has_no_issue_numbers_or_commit_hashes():
    """History belongs in CHANGELOG.md: no "issue 19", no commit of this repository named (a
    hexadecimal word is a commit when git knows it: node ids and digests are not)."""
    git = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True)
    commits = git.stdout.split() if git.returncode == 0 else []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            assert not re.search(r"\bissues? #?\d+", line, re.I), (
                f"{where}: an issue number; history belongs in CHANGELOG.md"
            )
            for word in re.findall(r"\b[0-9a-f]{7,40}\b", line):
                assert not any(c.startswith(word) for c in commits), (
                    f"{where}: commit {word}; history belongs in CHANGELOG.md"
                )


def test_the_top_level_pages_link_to_files_that_exist():
    """README.md, CONTRIBUTING.md and CHANGELOG.md are read on the forge, outside the site's
    strict build: each relative link of theirs must name a file of the repository."""
    for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md"):
        text = (ROOT / name).read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target or target.startswith("#"):
                continue
            assert (ROOT / target.split("#")[0]).exists(), f"{name} links to {target}, which does not exist"
