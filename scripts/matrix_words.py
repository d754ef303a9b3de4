"""The matrix's verdicts in words: what a reader of docs/models.md or of `check`'s refusal needs,
not the harness's assertion text.

The oracle (tests/test_oracle.py's ``oracle_mismatches``) reports lines such as
``final value of model.layers.2.mlp.down_proj.lora_A.default.weight: differs by 1.44e-04 of its norm``
or ``gradient norm of model.layers.0.self_attn.q_norm.weight at step 1: 0.0274..., want 0.0274...``;
``describe`` turns the first of them, and their count, into a sentence. The full assertion text
stays in the run's own output, not in the recorded reason.
"""

from __future__ import annotations

import re

RTOL = 1e-4  # tests/test_oracle.py's bound, relative


def _what(line: str) -> str | None:
    """One mismatch line as a phrase, or None for a line that is not an oracle mismatch."""
    m = re.match(r"final value of (\S+): differs by ([0-9.e+-]+) of its norm", line)
    if m:
        return f"the final value of {m[1]} differs by {float(m[2]):.1e} of its norm"
    m = re.match(r"final value of (\S+): moved more than", line)
    if m:
        return f"{m[1]} moved although its gradient is zero but for rounding"
    m = re.match(r"gradient norm of (\S+) at step (\d+): ([0-9.e+-]+), want ([0-9.e+-]+)", line)
    if m:
        off = abs(float(m[3]) - float(m[4])) / max(abs(float(m[4])), 1e-30)
        return f"the gradient norm of {m[1]} differs by {off:.1e} at step {m[2]}"
    m = re.match(r"(loss|grad_norm) at step (\d+): ([0-9.e+-]+), want ([0-9.e+-]+)", line)
    if m:
        off = abs(float(m[3]) - float(m[4])) / max(abs(float(m[4])), 1e-30)
        name = "the loss" if m[1] == "loss" else "the global gradient norm"
        return f"{name} differs by {off:.1e} at step {m[2]}"
    m = re.match(r"initial value of (\S+)", line)
    if m:
        return f"the initial value of {m[1]} differs"
    return None


def describe(text: str) -> str:
    """``text`` (``"AssertionError: 3 mismatches: ..."``, or any ``"Type: message"``) as a sentence
    without the harness's words. Applying it to its own output changes nothing."""
    text = " ".join(text.split())
    m = re.match(r"AssertionError: (\d+) mismatches: (.*)", text)
    if m:
        count, first = int(m[1]), _what(m[2])
        if first is not None:
            others = f" (and {count - 1} other value{'s' * (count > 2)} past the bound)" if count > 1 else ""
            return f"{first}, past the {RTOL:.0e} bound{others}"
    m = re.search(r"a rank exited with -(\d+) before reporting", text)
    if m:
        killed = " (most likely for memory)" if m[1] == "9" else ""
        return f"a training rank was killed by signal {m[1]}{killed}"
    m = re.match(r"(?:AssertionError: |it raised AssertionError \()rank (\d+): (\w+)\((['\"])(.*?)\3\)", text)
    if m:  # (the harness's report of a rank's error, with its traceback)
        message = m[4] if len(m[4]) <= 160 else m[4][:157] + "..."
        return f"rank {m[1]} raised {m[2]} ({message})"
    m = re.match(r"(\w+(?:Error|Exception)): (.*)", text)
    if m:
        message = m[2] if len(m[2]) <= 160 else m[2][:157] + "..."
        return f"it raised {m[1]} ({message})"
    return text


def reworded(reason: str) -> str:
    """A recorded reason (``"<verdict>: <text>"``) with its text described, its verdict kept."""
    for head in (
        "differs from the reference with SDPA attention: ",
        "differs from the reference at tp=2: ",
        "differs from the reference at a parallel layout: ",
        "could not be built or trained here: ",
    ):
        if reason.startswith(head):
            return head + describe(reason[len(head) :])
    m = re.match(r"(differs from the reference with \w+: )(.*)", reason)
    if m:
        return m[1] + describe(m[2])
    return reason
