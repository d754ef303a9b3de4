"""The command line as a user types it: --version, --help (every command and flag described, the
exit codes documented), exit code 2 on bad input, and a RAY_ADDRESS that names the dashboard's
job server (http://host:8265, what `ray job submit` takes) refused before Ray starts, with what
to set instead. No Ray cluster: every case here ends before ray.init."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.launch.plan.address import join_address

BIN = Path(sys.executable).parent / "raytrain-hybrid"
DASHBOARD = "http://10.0.0.1:8265"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *argv], capture_output=True, text=True, timeout=60)


def test_version_prints_the_installed_version():
    done = _run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"raytrain-hybrid {importlib.metadata.version('raytrain-hybrid')}"


def test_help_describes_the_tool_its_commands_and_exit_codes():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "Thin:" not in text and "DP x TP x PP" in text
    commands = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in commands.choices:
        assert f"\n    {name}" in text, name  # listed with its line
    assert "examples:\n  raytrain-hybrid train" in text
    codes = text.split("exit codes:\n", 1)[1]
    for code, meaning in (("0", "success"), ("1", "the run failed"), ("2", "bad input")):
        assert f"  {code}  {meaning}" in codes, codes


def _walk(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # the lines of the command list
                yield f"{path} {choice.dest}", choice
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        else:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action


def test_every_command_and_flag_has_a_help_line():
    seen = dict(_walk(cli._parser(), "raytrain-hybrid"))
    missing = [name for name, action in seen.items() if not action.help or action.help == argparse.SUPPRESS]
    assert not missing, f"no help line: {missing}"
    # The walk reaches the flags the usage issue named (so it walks the whole tree).
    for name in ("plan --world-size", "plan --gpus-per-node", "plan --top", "sweep --steps", "check --json"):
        assert f"raytrain-hybrid {name}" in seen, name
    for command in ("train", "check", "sweep", "prepare-data"):
        assert f"raytrain-hybrid {command} --address" in seen, command


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """cli.main in this process, as the console script calls it: (exit code, stderr, stdout)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    said = capsys.readouterr()
    return code, said.err, said.out


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--set", "train.steps=1"],
        ["check"],
        ["sweep", "--world-size", "2"],
        ["prepare-data", "README.md", "tokens"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_dashboard_ray_address_is_refused_before_ray_starts_with_what_to_set(argv, capsys, monkeypatch, tmp_path):
    import ray

    inits = []  # as in a shell without Ray, though the suite's Ray may be running in this process
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append((a, k)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", DASHBOARD)
    out = ["--set", f"run.output_dir={tmp_path / 'run'}"] if argv[0] == "train" else []
    out += ["--out", str(tmp_path / "sweep")] if argv[0] == "sweep" else []
    if argv[0] == "prepare-data":
        argv = ["prepare-data", str(Path(__file__).parents[1] / "README.md"), str(tmp_path / "tokens")]
    code, err, _ = _main(capsys, *argv, *out)
    assert code == 2, err
    assert f"RAY_ADDRESS='{DASHBOARD}'" in err and "--address auto" in err and "ray job submit --address" in err
    assert inits == []
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, sweep or shards begun


def test_address_flag_wins_over_a_dashboard_ray_address_and_refuses_one_itself(capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", DASHBOARD)
    code, err, _ = _main(capsys, "check", "--address", "https://head:8265")
    assert code == 2 and "--address (cluster.address)='https://head:8265'" in err, err
    code, err, out = _main(capsys, "check", "--address", "local")  # a private local Ray: one node holding all
    assert code == 0 and "layout ok: dp=2 tp=2 pp=2 on 1 node(s) [8]" in out, err
    # `--address auto` on a cluster's node: Ray's own "auto" would read the dashboard RAY_ADDRESS and fail,
    # so the explicit choice drops it from this process's environment (not joined here: no cluster).
    monkeypatch.setenv("RAY_ADDRESS", DASHBOARD)
    assert join_address("auto") == "auto"
    assert "RAY_ADDRESS" not in os.environ


@pytest.mark.parametrize(
    "argv, says",
    [
        (["check", "--set", "parallelism.tp=x"], "parallelism.tp='x'"),
        (["check", "--set", "parallelism.bogus=1"], "is not a known key"),
        (["train", "--set", "nokey"], "a --set needs the form key=value"),
        (["check", "no_such.toml"], "does not exist"),
        (["check", "--topology", "4,x"], "argument --topology"),
        (["check", "--topology", "4,3"], "places 7 workers; the layout needs 8"),
        (["plan", "--world-size", "8", "--gpus-per-node", "8", "--top", "-1"], "argument --top"),
        (["plan", "--world-size", "0", "--gpus-per-node", "8"], "argument --world-size"),
        (["sweep", "--world-size", "1000"], "no layout of that many ranks"),
        (["calibrate", "--threads", "0"], "argument --threads"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_bad_input_exits_2_with_what_is_wrong(argv, says, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, err, _ = _main(capsys, *argv)
    assert code == 2, err
    assert says in err, err


def test_calibrate_refuses_an_unwritable_out_before_measuring(capsys, tmp_path):
    (tmp_path / "a_file").write_text("")
    for out in (tmp_path / "a_file" / "profile.json", tmp_path):
        code, err, _ = _main(capsys, "calibrate", "--out", str(out))
        assert code == 2 and "--out=" in err, err
