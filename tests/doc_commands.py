"""The ``raytrain-hybrid`` commands README.md and docs/**/*.md show, as a reader pastes them.

Shared by tests/test_docs.py (each command parses; check and plan run; the others' configs load)
and scripts/run_doc_commands.py (the walk that runs every command that runs on a CPU, page by
page, in a scratch copy of the repository, and records what each did).

Collected: every line of a bash/sh block, the ``$ `` lines of other blocks; ``.venv/bin/raytrain-hybrid``,
``raytrain-hybrid`` and ``python -m raytrain_hybrid.cli``, also after ``ray job submit ... --``.
Placeholders such as ``<your-bucket>`` are filled in with a sample value, as a reader would.
What a command is shown to print: the lines after it in a console block (up to the next ``$ ``),
or, for the last command of a shell block, a ``text`` block that follows it directly (the README's
quick start); ``missing_claims`` says which of those lines a run did not print.

``walk(page)`` says, for each command of a page in order, whether it runs on a CPU here, and if
not why: a cluster's job server, a bucket, GPUs, a tracking server or account, or a file the
reader brings (a model, a dataset), or the output of such a command. It reads the commands and
the config files they name only (no Ray, no model), so the suite can ask it cheaply.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELLS = {"bash", "sh", "shell", "zsh"}
PLACEHOLDER = re.compile(r"<([A-Za-z][\w .-]*)>")
_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_REDIRECT = re.compile(r"^\d?>>?(&\d)?$|^&>$")
_ENV = re.compile(r"^[A-Za-z_]\w*=")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# --set keys whose value is a file or directory a command reads.
INPUT_KEYS = ("model.pretrained", "data.path", "data.val_path", "data.tokenizer")


@dataclass(frozen=True)
class Shown:
    where: str  # file:line
    args: tuple[str, ...]  # what follows `raytrain-hybrid`
    output: tuple[str, ...] = ()  # the lines shown after it (a console block), up to the next `$ `
    env: tuple[str, ...] = ()  # the VAR=value words before it
    remote: bool = False  # after `ray job submit ... --`: it runs on a cluster's job server

    @property
    def fails(self) -> bool:
        """The block shows it refused: its first output line starts with "error:"."""
        return bool(self.output) and self.output[0].startswith("error:")

    @property
    def text(self) -> str:
        """The command as the walk records it (placeholders filled)."""
        return shlex.join(["raytrain-hybrid", *self.args])

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Setup:
    """A repository script a shell block runs (``.venv/bin/python examples/x.py ARGS``), such as
    the one that makes the model a later command fine-tunes."""

    where: str
    argv: tuple[str, ...]

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


def fill(text: str) -> str:
    """Placeholders filled in as a reader does: <your-bucket> -> your-bucket."""
    return PLACEHOLDER.sub(lambda m: re.sub(r"\W+", "-", m.group(1)).lower(), text)


def blocks(text: str):
    """(language, [(line number, line)]) for each fenced code block."""
    block, fence, lang = None, "", ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if block is None and m:
            block, fence, lang = [], m.group(1), m.group(2).lower()
        elif block is not None and line.strip().startswith(fence[:3]) and line.strip().strip(fence[0]) == "":
            yield lang, block
            block = None
        elif block is not None:
            block.append((number, line))


def _invocation(tokens: list[str]) -> tuple[list[str], list[str], bool] | None:
    """(VAR=value words, the arguments after raytrain-hybrid or python -m raytrain_hybrid.cli, after
    `ray job submit --`) in one simple command, or None when it does not run the CLI."""
    for i, tok in enumerate(tokens):
        env = [t for t in tokens[:i] if _ENV.match(t)]
        submitted = i > 0 and tokens[i - 1] == "--"
        lead = all(_ENV.match(t) or t in ("time", "exec") for t in tokens[:i]) or submitted
        if Path(tok).name == "raytrain-hybrid" and lead:
            return env, tokens[i + 1 :], submitted
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] == "raytrain_hybrid.cli":
            return env, tokens[i + 2 :], False
    return None


def _segments(path: Path):
    """(where, language, one simple command's words, the lines a console block shows after it)."""
    for lang, lines in blocks(path.read_text()):
        logical: list[tuple[int, str]] = []  # continuation lines joined
        for number, line in lines:
            if logical and logical[-1][1].endswith("\\"):
                logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + line.strip())
            else:
                logical.append((number, line.rstrip()))
        for i, (number, line) in enumerate(logical):
            text = line.strip()
            if text.startswith("$ "):
                text = text[2:]
            elif lang not in SHELLS:
                continue  # output, not a command
            try:
                tokens = shlex.split(text, comments=True)
            except ValueError:
                continue  # not shell (a snippet of another language in the block)
            segments, current = [], []
            for tok in tokens:  # `a && b`, `a | b`, `a; b`: each its own command
                if tok in ("&&", "||", "|", ";"):
                    segments.append(current)
                    current = []
                else:
                    current.append(tok)
            segments.append(current)
            output = []  # what a console block shows the command print
            for _, after in logical[i + 1 :] if lang not in SHELLS else ():
                if after.strip().startswith("$ "):
                    break
                output.append(after.strip())
            for segment in segments:
                cut = next((j for j, t in enumerate(segment) if _REDIRECT.match(t)), len(segment))
                yield f"{path.relative_to(ROOT)}:{number}", lang, segment[:cut], tuple(output)


def _printed_after_shell_blocks(text: str) -> dict[int, tuple[str, ...]]:
    """{line number of a shell block's last line: the lines of a ``text`` block right after it}
    (only blank lines between, and no ``$ `` line in it): what the block's last command prints."""
    found: dict[int, tuple[str, ...]] = {}
    lines = text.splitlines()
    last_shell, gap_ok = 0, False
    block, lang = None, ""
    for number, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        if block is None and m:
            block, lang = [], m.group(2).lower()
            if lang == "text" and last_shell and gap_ok:
                block_of = last_shell
            else:
                block_of = 0
        elif block is not None and line.strip().startswith("```") and line.strip().strip("`") == "":
            if lang in SHELLS:
                last_shell, gap_ok = max((n for n, t in block if t.strip()), default=0), True
            else:
                if block_of and not any(t.strip().startswith("$ ") for _, t in block):
                    found[block_of] = tuple(t.strip() for _, t in block)
                last_shell, gap_ok = 0, False
            block = None
        elif block is not None:
            block.append((number, line))
        elif line.strip():
            gap_ok = False  # prose between: the text block is not the shell block's output
    return found


def commands(path: Path) -> list[Shown]:
    shown = []
    for where, _, words, output in _segments(path):
        found = _invocation(words)
        if found is not None:
            env, args, remote = found
            shown.append(Shown(where, tuple(fill(a) for a in args), output, tuple(fill(e) for e in env), remote))
    printed = _printed_after_shell_blocks(path.read_text())
    for i, cmd in enumerate(shown):  # the last command on a shell block's last line
        number = int(cmd.where.rsplit(":", 1)[1])
        last = i + 1 == len(shown) or shown[i + 1].where != cmd.where
        if number in printed and last and not cmd.output:
            shown[i] = Shown(cmd.where, cmd.args, printed[number], cmd.env, cmd.remote)
    return shown


# A figure a run measures (its throughput) differs run to run: "592 tok/s" is shown as an example.
_MEASURED = re.compile(r"[\d,]+(?:\.\d+)? (tok/s|tokens/s)")


def missing_claims(shown: Shown, printed: str, checkout: str = "", measured: bool = False) -> list[str]:
    """The lines ``shown`` is shown to print that ``printed`` lacks. "..." elides lines; a line ending
    in "..." shows the start of one; ``<checkout>`` is the directory it ran in (``checkout``); with
    ``measured``, throughputs (N tok/s, N tokens/s) are examples and any value matches."""

    def norm(line: str) -> str:
        line = line.strip()
        if checkout:
            line = line.replace("<checkout>", checkout.rstrip("/"))
        return _MEASURED.sub(r"N \1", line) if measured else line

    lines = [norm(line) for line in printed.splitlines()]
    missing = []
    for raw in shown.output:
        want = norm(raw)
        if want in ("", "...", "…") or want in lines:
            continue
        head = want.rstrip(".…").rstrip()
        if (want.endswith("...") or want.endswith("…")) and any(line.startswith(head) for line in lines):
            continue
        missing.append(raw)
    return missing


def steps(path: Path) -> list[Shown | Setup]:
    """The page's commands and the repository scripts its shell blocks run, in order."""
    out: list[Shown | Setup] = []
    shown = iter(commands(path))
    for where, lang, words, _ in _segments(path):
        if _invocation(words) is not None:
            out.append(next(shown))
        elif lang in SHELLS and len(words) > 1 and Path(words[0]).name == "python" and words[1].endswith(".py"):
            if (ROOT / words[1]).is_file():
                out.append(Setup(where, tuple(fill(w) for w in words)))
    return out


# ---- which commands run on a CPU here ----


@dataclass
class Step:
    step: Shown | Setup
    skip: str = ""  # why it does not run here ("" : it runs)
    makes: tuple[str, ...] = ()  # the paths it writes (relative to the repository root)
    chained: bool = False  # it reads what an earlier step of its page makes

    @property
    def expected_exit(self) -> int:
        return 2 if isinstance(self.step, Shown) and self.step.fails else 0


def _config(args) -> dict:
    """The TOML config file a command names, as a dict (filled in), or {}."""
    name = getattr(args, "config", None)
    if not name or not (ROOT / name).is_file():
        return {}
    return tomllib.loads(fill((ROOT / name).read_text()))


def _key(args, config: dict, key: str, default=None):
    """A config key's value: its last --set, else the config file's, else ``default``."""
    for override in reversed(getattr(args, "overrides", None) or []):
        name, _, value = override.partition("=")
        if name == key:
            return value
    section, _, field = key.partition(".")
    return config.get(section, {}).get(field, default)


def _inputs(args, config: dict) -> list[tuple[str, str]]:
    """(what, path) for each file or directory the command reads."""
    found = []
    if getattr(args, "config", None):
        found.append(("config file", args.config))
    for name in ("resume", "checkpoint", "source", "tokenizer"):
        if getattr(args, name, None):
            found.append((f"--{name}" if name in ("resume", "tokenizer") else name.upper(), getattr(args, name)))
    if getattr(args, "command", "") in ("train", "sweep", "check", "plan"):
        for key in INPUT_KEYS:
            value = _key(args, config, key)
            if isinstance(value, str) and value not in ("", "builtin", "memory"):
                found.append((key, value))
    return found


def _under(path: str, made: dict[str, str]) -> str | None:
    """Which of ``made`` holds ``path`` (the same path or a directory above it)."""
    clean = path.rstrip("/")
    return next((m for m in made if clean == m or clean.startswith(m + "/")), None)


def walk(path: Path) -> list[Step]:
    """Each step of a page with why it does not run here, if it does not. A page is a chain:
    a command that reads what an earlier one makes runs when that one runs."""
    from raytrain_hybrid import cli  # the CLI's own parser: no Ray, no model

    made: dict[str, str] = {}  # path -> where the step that makes it is
    skipped: dict[str, str] = {}  # path -> where the skipped step that would make it is
    setups: dict[str, Step] = {}  # path -> the repository script that makes it
    out: list[Step] = []
    for step in steps(path):
        if isinstance(step, Setup):
            # Runs when a later command needs what it makes (its path arguments).
            item = Step(step, skip="nothing run on this page needs what it makes")
            item.makes = tuple(w for w in step.argv[2:] if not w.startswith("-"))
            setups.update({m.rstrip("/"): item for m in item.makes})
            out.append(item)
            continue
        args = _parsed(cli._parser(), step.args)
        item = Step(step)
        item.skip = _why_not(step, args, made, skipped, setups)
        if args is not None:
            config = _config(args)
            item.makes = tuple(_outputs(args, config))
            item.chained = any(_under(v, made) or _under(v, setups) for _, v in _inputs(args, config))
        for m in item.makes:
            (skipped if item.skip or step.fails else made)[m.rstrip("/")] = step.where
        out.append(item)
    return out


def _parsed(parser, args: tuple[str, ...]):
    """The parsed arguments, or None where the parser prints and exits (--help, --version, a bad flag)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args(args)
    except SystemExit:
        return None


def _outputs(args, config: dict) -> list[str]:
    if args.command == "train":
        return [_key(args, config, "run.output_dir", "runs/latest")]
    if args.command in ("export", "prepare-data"):
        return [args.out_dir]
    return []


def _why_not(step: Shown, args, made: dict, skipped: dict, setups: dict) -> str:
    if step.remote or getattr(args, "address", ""):
        return "submitted to a Ray cluster's job server (ray job submit / --address)"
    for word in step.env:
        if "://" in word:
            return f"logs to a server ({word})"
        if word.startswith("WANDB_API_KEY="):
            return "logs to Weights & Biases (an account, WANDB_API_KEY)"
    if args is not None and args.command == "lighthouse":
        return "a server that runs until it is stopped (tests/test_replicas.py starts one as shown)"
    if args is None or args.command in ("check", "plan") or step.fails:
        runs_anyway = True  # offline: check and plan read no bucket, start nothing
    else:
        runs_anyway = False
    config = _config(args) if args is not None else {}
    if not runs_anyway:
        uris = [a for a in step.args if "://" in a]
        if uris:
            return f"reads or writes object storage ({uris[0].split('=', 1)[-1]}): a bucket and its credentials"
        ft = str(_key(args, config, "fault_tolerance.enabled", "")).lower() == "true"
        if ft and str(_key(args, config, "fault_tolerance.replica_group", "-1")) != "-1":
            return "one replica group of several launches meeting at a Lighthouse (tests/test_replicas.py runs them)"
        if str(_key(args, config, "cluster.use_gpu", "")).lower() == "true":
            return f"needs GPUs (cluster.use_gpu = true in {getattr(args, 'config', '') or '--set'})"
    for what, value in _inputs(args, config) if args is not None else ():
        if (
            "://" in value
            or (ROOT / value).exists()
            or _under(value, made)
            or ("*" in value and list(ROOT.glob(value)))
        ):
            continue
        if (found := _under(value, setups)) is not None:
            setups[found].skip = ""  # the script runs, before this command
            continue
        if (found := _under(value, skipped)) is not None:
            return f"reads {value}, which the command at {skipped[found]} (not run here) makes"
        if what == "model.pretrained" and _HUB_ID.match(value) and not value.startswith(("runs/", "data/")):
            return f"downloads {value} from the Hugging Face Hub (no network here)"
        if not step.fails:
            return f"reads {value} ({what}), the reader's own, not in the repository"
    return ""
