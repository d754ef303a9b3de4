"""Shell commands in README.md, docs/ and jobs/README* work as pasted: no ``<...>`` placeholder in
them (bash reads ``s3://<your-bucket>/x`` as an input redirection), variables such as ``$BUCKET``
instead, each set on its page before it is used."""

from __future__ import annotations

import re

from doc_commands import PLACEHOLDER, ROOT, SHELLS, blocks

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("jobs/README*"))]
_USED = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)")
_SET = re.compile(r"^(?:export\s+)?([A-Z][A-Z0-9_]*)=")
# Set by the environment a command runs in, not by the page (Slurm, a shell, a cloud login).
_GIVEN = {"HOME", "PATH", "USER", "PWD", "SLURM_SUBMIT_DIR", "RAY_ADDRESS", "AWS_PROFILE"}


def shell_lines(page):
    for lang, lines in blocks(page.read_text()):
        for number, line in lines:
            if lang in SHELLS or line.strip().startswith("$ "):
                yield number, line.strip().removeprefix("$ ")


def test_shell_commands_hold_no_angle_bracket_placeholders():
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line[:100]}"
        for page in PAGES
        for n, line in shell_lines(page)
        if PLACEHOLDER.search(line.split(" #")[0])
    ]
    assert not found, "a placeholder bash would read as a redirection:\n" + "\n".join(found)


def test_every_variable_a_command_uses_is_set_on_its_page_first():
    unset = []
    for page in PAGES:
        known = set(_GIVEN)
        for n, line in shell_lines(page):
            for word in line.split():
                if m := _SET.match(word):
                    known.add(m.group(1))
            code = line.split(" #")[0]
            unset += [f"{page.relative_to(ROOT)}:{n}: ${v}" for v in _USED.findall(code) if v not in known]
    assert not unset, unset
