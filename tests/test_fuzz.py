"""Property-based fuzzing (hypothesis) of what users hand the trainer: ``--set`` values, config
files, chat / prompt-completion Parquet rows, JSONL given as data, checkpoint manifests and a
pretrained directory's config.json (the targets: tests/fuzz_targets.py, tests/fuzz_files.py).
Every case must end accepted, or refused clearly: exit 2 (or a ConfigError) naming a key or the
file, never a traceback, and the user's files unchanged.

The suite runs a few seeded examples of each target (derandomized, the file in seconds);
benchmarks/bench_fuzz.py runs many more of the same targets.
"""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from fuzz_files import TARGETS, known_crash, run_case  # noqa: E402
from fuzz_targets import Crash, _named  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _offline():
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "RAY_ADDRESS")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.pop("RAY_ADDRESS", None)
    yield
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


# Seeded and small: the suite's share of the fuzzing (the benchmark runs thousands).
EXAMPLES = {
    "set_values": 30,
    "config_file": 30,
    "chat_rows": 15,
    "jsonl_rows": 5,
    "manifest": 15,
    "hf_config": 30,
    "long_values": 10,
    "deep_files": 10,
    "resume_files": 15,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzzed_input_is_accepted_or_refused_clearly(target):
    strategy, _ = TARGETS[target]

    @settings(
        max_examples=EXAMPLES[target],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def check(case):
        hypothesis.assume(known_crash(target, case) is None)
        assert run_case(target, case) in ("accepted", "refused")

    check()


def test_a_refusal_that_names_nothing_counts_as_a_crash():
    """The runner's own judgement: an error line that names no key or file is not a clear refusal."""
    with pytest.raises(Crash):
        _named("error: something went wrong\n", {"train.lr"})
    with pytest.raises(Crash):
        _named("Traceback (most recent call last):\n", {"train.lr"})
    _named("error: train.lr='x': must be a number\n", {"train.lr"})


# One input of each class of crash the fuzzing found and that was then fixed: each is refused
# clearly now, naming the key or the file.
FIXED_CRASHES = {
    "config file not UTF-8": ("config_file", b"\x82\xebM"),
    "pretrained unknown scheme": ("set_values", ["model.pretrained=nosuchscheme://x/y"]),
    "config.json empty": ("hf_config", ("bytes", b"")),
    "config.json a list": ("hf_config", ("whole", [])),
    "config.json without hidden_size": ("hf_config", ("edits", [(["hidden_size"], "del", None)])),
    "config.json hidden_size a string": ("hf_config", ("edits", [(["hidden_size"], "set", "wide")])),
    "cluster.address none": ("set_values", ["cluster.address=none"]),
    "config file arrays 100,000 deep": ("deep_files", ("toml arrays", 100_000, "step", "1")),
    "config file tables 50,000 deep": ("deep_files", ("toml tables", 50_000, "step", "1")),
    "manifest 200,000 deep": ("deep_files", ("manifest arrays", 200_000, "step", "1")),
    "manifest step Infinity": ("deep_files", ("manifest value", 1, "step", "Infinity")),
    "manifest size 1e400": ("deep_files", ("manifest value", 1, "size", "1e400")),
    'manifest step "2"': ("deep_files", ("manifest value", 1, "step", '"2"')),
    "manifest step 2.5": ("deep_files", ("manifest value", 1, "step", "2.5")),
    "manifest without config": ("deep_files", ("manifest value", 1, "config", "null")),
}


@pytest.mark.parametrize("name", list(FIXED_CRASHES))
def test_a_crash_fuzzing_found_is_refused_clearly(name):
    target, case = FIXED_CRASHES[name]
    assert run_case(target, case) == "refused"


def test_the_fuzzing_benchmark_fails_past_its_time_bound(tmp_path):
    """benchmarks/bench_fuzz.py times every input in CPU seconds and exits 1 when one is over its
    bound (run again first, so that a first-time cost such as an import is not the input's): with
    a bound of 0 every input is over it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "fuzz.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fuzz.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--examples", "3", "--target", "set_values", "--bound", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "0 crashed, 3 inputs over 0.0 CPU s" in done.stderr, done.stderr[-2000:]
    totals = json.loads(out.read_text())["totals"]
    assert totals["tried"] == 3 and totals["inputs_over_bound"] == 3 and totals["slowest_input_cpu_s"] > 0
