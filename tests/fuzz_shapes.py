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
    start = time.process_time()
    has_credentials(text)
    redact(text)
    try:
        load_config(None, [f"{key}={text}"])
        outcome = "accepted"
    except ConfigError:
        outcome = "refused"
    if (took := time.process_time() - start) > BOUND_S:
        raise Crash(f"{took:.2f} s for {len(text):,} characters of {''.join(parts)!r} in {key}")
    return outcome
