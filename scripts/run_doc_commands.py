"""Run every ``raytrain-hybrid`` command README.md and docs/ show that runs on a CPU, as pasted.

    .venv/bin/python scripts/run_doc_commands.py                      # every page (an hour or more on 2 CPUs)
    .venv/bin/python scripts/run_doc_commands.py docs/checkpoints.md  # one page again; the others' records kept
    .venv/bin/python scripts/run_doc_commands.py --check              # CI (.ci/docs): no record; exit 1 on a miss

Each page runs in a fresh scratch copy of the checkout (the files git tracks or does not ignore,
and a link to .venv),
its commands in the page's order, so a page that chains (train, then resume, then export of
runs/a) runs as a reader runs it, and the runs/ directories the docs name are made there, not in
the checkout. Placeholders are filled in as tests/doc_commands.py fills them. A command that
cannot run here (a cluster's job server, a bucket, GPUs, a tracking server, a model or data the
reader brings) is recorded as skipped with the reason (tests/test_docs.py ``check``s those and
loads their configs). A repository script a block runs first (``.venv/bin/python
examples/.../make_checkpoint.py ...``) runs when a later command needs what it makes.

A command does as its page says when it exits with the code the page shows (2 where it shows the
refusal, else 0) and prints every line the page shows it print (tests/doc_commands.missing_claims;
a throughput of a run is an example). Each command is recorded in
benchmarks/results/doc_commands.json (page, line, the command, its digest, exit code and the one
the docs expect, seconds, its last output line, the shown lines it did not print): a log of the
walk's timings, which no test reads. ``--check`` writes no record and exits 1 when a command did
not do as its page says: CI runs it on a clean checkout (.ci/docs), so that every documented
command that runs on a CPU is run, as pasted, whenever the code or a page changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from doc_commands import DOCS, Setup, missing_claims, walk  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "doc_commands.json"
RETRIES = 2  # a run whose Ray cluster did not come up (the message below) runs again, at most this often
RAY_START_OVERLOADED = "timed out during startup"
TIMEOUT_S = 1800  # one command; the slowest (a sweep of 4 trials) takes a few minutes on 2 CPUs


def _scratch(into: Path) -> None:
    """A copy of the checkout's files (tracked and new ones git does not ignore, as they are in the
    working tree: the Ray workers import the package from it, the driver from the checkout) and a
    link to .venv."""
    ls = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(ls, cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    (into / ".venv").symlink_to(ROOT / ".venv")


def _env(step) -> dict[str, str]:
    """A shell with no cluster named and no network, as on a laptop without credentials."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HF_HUB_OFFLINE="1", AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL="http://127.0.0.1:9")
    for word in getattr(step, "env", ()):
        name, _, value = word.partition("=")
        env[name] = value
    return env


def _run_once(argv: list[str], step, cwd: Path) -> tuple[int | None, list[str], list[str]]:
    try:
        proc = subprocess.run(
            argv, cwd=cwd, env=_env(step), capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL
        )
        out, err = proc.stdout, proc.stderr
        code = proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = "", f"{exc.stderr or ''}\ntimed out after {TIMEOUT_S} s", None
    lines = [[line.rstrip() for line in text.splitlines() if line.strip()] for text in (out, err)]
    return code, lines[0], lines[1]


def _run(step, cwd: Path) -> dict:
    argv = list(step.argv) if isinstance(step, Setup) else [".venv/bin/raytrain-hybrid", *step.args]
    start = time.monotonic()
    retried = []
    for attempt in range(1 + RETRIES):
        code, out, err = _run_once(argv, step, cwd)
        if attempt == RETRIES or not any(RAY_START_OVERLOADED in line for line in out + err):
            break
        # Ray's own start-up gave up (a loaded machine) before the run wrote anything.
        retried.append(next(line for line in out + err if RAY_START_OVERLOADED in line).strip())
        time.sleep(30)
    record = {"exit_code": code, "seconds": round(time.monotonic() - start, 1)}
    # What the command printed last: its own last line (stdout), else the last of stderr.
    record["last_line"] = (out or err or [""])[-1].strip()
    if retried:
        record["retried_after"] = retried
    if not isinstance(step, Setup):
        training = step.args[:1] in (("train",), ("sweep",))  # their throughputs are examples
        missing = missing_claims(step, "\n".join(out + err), checkout=str(cwd), measured=training)
        if missing:
            record["claims_missing"] = missing
    if code != (2 if getattr(step, "fails", False) else 0) or record.get("claims_missing"):
        record["output_tail"] = (out + err)[-25:]
    return record


def _as_shown(record: dict) -> bool:
    return record["exit_code"] == record["expected_exit"] and not record.get("claims_missing")


def run_page(page: Path, log, earlier: list[dict] | None = None) -> tuple[list[dict], float]:
    """The page's records. ``earlier``: its records from before, whose commands that did as the
    page says are kept instead of run again (``--failed-only``)."""
    records = []
    start = time.monotonic()
    steps = walk(page)
    done = {r["command"]: r for r in earlier or [] if r["status"] == "ran" and _as_shown(r)}
    if any(s.chained and s.step.text not in done for s in steps if not s.skip):
        done = {}  # a command to run again reads what an earlier one makes: the whole page runs again
    cwd = Path(tempfile.mkdtemp(prefix="docswalk-"))
    _scratch(cwd)
    # The scratch copy is removed when every command did as the page says, else kept to look at.
    for item in steps:
        step = item.step
        if not item.skip and step.text in done:
            records.append({**done[step.text], "line": int(step.where.split(":")[1])})
            log(f"{step.where}: kept its earlier record: {step.text}")
            continue
        rel, line = step.where.split(":")
        record = {
            "page": rel,
            "line": int(line),
            "kind": "setup" if isinstance(step, Setup) else "command",
            "command": step.text,
        }
        if not isinstance(step, Setup):
            record["digest"] = step.digest
        if item.skip:
            record.update(status="skipped", reason=item.skip)
            log(f"{step.where}: skipped ({item.skip}): {step.text}")
        else:
            log(f"{step.where}: {step.text}")
            record.update(status="ran", expected_exit=item.expected_exit, **_run(step, cwd))
            record["date"] = datetime.date.today().isoformat()
            ok = "ok" if _as_shown(record) else "FAILED"
            log(f"  -> {ok}: exit {record['exit_code']} in {record['seconds']} s: {record['last_line']}")
            for line in record.get("claims_missing", []):
                log(f"     the page shows it print: {line}")
            for line in record.get("output_tail", []) if ok != "ok" else []:
                log(f"     | {line}")
        records.append(record)
    if any(r["status"] == "ran" and not _as_shown(r) for r in records):
        log(f"kept the scratch copy of {page.relative_to(ROOT)}: {cwd}")
    else:
        shutil.rmtree(cwd, ignore_errors=True)
    return records, round(time.monotonic() - start, 1)


def _write(result: dict, records: list[dict], out: Path) -> None:
    order = {str(p.relative_to(ROOT)): i for i, p in enumerate(DOCS)}
    records.sort(key=lambda r: (order.get(r["page"], len(order)), r["line"]))
    pages = sorted(result["pages"], key=lambda k: order.get(k, len(order)))
    result.update(records=records, pages={k: result["pages"][k] for k in pages})
    out.write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="pages to run (default: README.md and every page of docs/)")
    parser.add_argument(
        "--failed-only",
        action="store_true",
        help="run again only the commands of these pages whose record is not what the page says (a page "
        "whose such command reads what an earlier one makes runs whole)",
    )
    parser.add_argument("--out", default=str(RESULT), help="the result file (default: %(default)s)")
    parser.add_argument(
        "--check", action="store_true", help="write no record: exit 1 when a command did not do as its page says (CI)"
    )
    opts = parser.parse_args(argv)
    if opts.check and opts.failed_only:
        parser.error("--check runs every command of the pages; --failed-only reads earlier records")
    out = Path(opts.out)
    pages = [(ROOT / p).resolve() for p in opts.pages] or DOCS
    # One page again: the other pages' records are kept. Every page: a new file.
    keep = opts.pages and out.exists() and not opts.check
    result = json.loads(out.read_text()) if keep else {"pages": {}, "records": []}
    command = shlex.join(
        [".venv/bin/python", "scripts/run_doc_commands.py", *(argv if argv is not None else sys.argv[1:])]
    )
    today = datetime.date.today().isoformat()
    machine = f"{os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), no GPU used"
    result.update(command=f"cd <repo> && {command}", date=today, machine=machine)
    records = list(result["records"])
    for page in pages:  # written after each page: a walk cut short keeps the pages it finished
        name = str(page.relative_to(ROOT))
        load = os.getloadavg()[0]
        earlier = [r for r in records if r["page"] == name] if opts.failed_only else None
        page_records, seconds = run_page(page, lambda text: print(text, flush=True), earlier)
        records = [r for r in records if r["page"] != name] + page_records
        if opts.check:
            continue
        # The machine's load average while it ran: other work on it slows the runs' seconds.
        result["pages"][name] = {"date": today, "command": command, "seconds": seconds}
        result["pages"][name]["load_average"] = [round(load, 1), round(os.getloadavg()[0], 1)]
        _write(result, records, out)
    ran = [r for r in records if r["status"] == "ran"]
    failed = [r for r in ran if not _as_shown(r)]
    wrote = "" if opts.check else f"; wrote {out}"
    print(f"{len(ran)} ran, {len(records) - len(ran)} skipped, {len(failed)} not as the docs say{wrote}")
    for r in failed:
        print(f"  {r['page']}:{r['line']}: {r['command']} -> exit {r['exit_code']}: {r['last_line']}")
        for line in r.get("claims_missing", []):
            print(f"    does not print: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
