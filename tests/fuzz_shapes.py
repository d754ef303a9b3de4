"""Fuzzing targets for input shaped to be slow or deep rather than wrong: long values built from
the characters URIs and secret parameters are made of (the credential patterns run on every
config value and every message), timed one by one against a bound.

A runner returns "accepted" or "refused" like the others (tests/fuzz_targets.py) and raises
Crash for anything else, a case slower than ``BOUND_S`` included.
"""

from __future__ import annotations

import time
from pathlib import Path

from fuzz_targets import KEYS, Crash, _text
from hypothesis import strategies as st

from raytrain_hybrid.errors import ConfigError

BOUND_S = 1.0  # CPU seconds of one case (the machine's other load left out); quadratic patterns took 11-100 s
# What URIs, user-info and secret parameters are made of; repeated, a shape a pattern may scan
# from each of its positions.
FRAGMENTS = ["a", "1", "://", ":", "@", "/", "?", "&", "#", ";", "=", "token", "key", "s3", "x.", "-", " ", "'"]
LONG_VALUES = st.tuples(
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), _text(3)), min_size=1, max_size=5),
    st.integers(1, 200_000),
    st.sampled_from(KEYS),
)


def run_long_values(case, workdir: Path) -> str:
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.errors import has_credentials, redact

    parts, repeat, key = case
    text = ("".join(parts) * repeat)[:1_000_000]

    def load() -> str:
        try:
            load_config(None, [f"{key}={text}"])
            return "accepted"
        except ConfigError:
            return "refused"

    load()  # untimed: the first value of a key may import what checks it (torch: 1-2 s of CPU)
    start = time.process_time()
    has_credentials(text)
    redact(text)
    outcome = load()
    if (took := time.process_time() - start) > BOUND_S:
        raise Crash(f"{took:.2f} s for {len(text):,} characters of {''.join(parts)!r} in {key}")
    return outcome


# --- config files and manifests nested deep, or holding values JSON allows and no run writes ----

DEEP_SHAPES = ["toml arrays", "toml tables", "manifest arrays", "manifest objects", "manifest value"]
MANIFEST_VALUES = ["Infinity", "-Infinity", "NaN", "1e400", '"2"', "-3", "2.5", "true", "null", "[]", "{}"]
DEEP_FILES = st.tuples(
    st.sampled_from(DEEP_SHAPES),
    st.one_of(st.integers(1, 64), st.sampled_from([1_000, 50_000, 100_000, 200_000])),
    st.sampled_from(["step", "world_size", "files", "config", "format", "data_origin", "size"]),
    st.sampled_from(MANIFEST_VALUES),
)


def run_deep_files(case, workdir: Path) -> str:
    import json

    from fuzz_files import _checkpoint, run_config_file, run_manifest

    shape, depth, key, value = case
    manifest = _checkpoint()[1]  # (made once per process, before the clock starts)
    start = time.process_time()
    if shape == "toml arrays":
        outcome = run_config_file(f"[run]\noutput_dir = {'[' * depth}{']' * depth}\n", workdir)
    elif shape == "toml tables":
        outcome = run_config_file(f"[run]\noutput_dir = {'{a = ' * depth}1{'}' * depth}\n", workdir)
    else:
        text = json.dumps(manifest)
        if shape == "manifest value" and key == "size":
            text = text.replace('"size": ', f'"size": {value}, "was": ', 1)
        elif shape == "manifest value":
            text = text.replace(f'"{key}": ', f'"{key}": {value}, "was": ', 1)
        else:
            opening, closing = ("[", "]") if shape == "manifest arrays" else ('{"a": ', "}")
            text = text[:-1] + f', "extra": {opening * depth}0{closing * depth}}}'
        outcome = run_manifest(("bytes", text.encode()), workdir)
    if (took := time.process_time() - start) > 2 * BOUND_S:  # (a whole export or check, not one value)
        raise Crash(f"{took:.2f} s for {shape} {depth} deep")
    return outcome
