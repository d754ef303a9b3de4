"""Faults injected into checkpoint saves: kill -9 at chosen points, and an S3 endpoint that dies.

A run here is what ``train`` does, without Ray: a driver process takes the start the CLI's
driver takes (the run directory's checks and, with a resume, resolve() of the newest intact
checkpoint and the trajectory check; then the run's lease), and gloo ranks run
``engine.worker.run_worker`` from that point. All of them are forked from one forkserver that
has imported torch and the engine once (a run of a tiny model takes a few seconds).

A fault is a dict, handed to the ranks (``install``), nothing in the package is changed:
``point`` where it fires, on rank ``rank``, in the save of checkpoint ``step`` (the ``nth``
time that point is reached there; for the timed ones ``delay`` seconds after the point, or
``share`` times the length of the rank's previous save when there was one),
``target`` what is killed with SIGKILL: ``worker`` (that rank), ``driver`` (the driver and every
rank at once: a dead driver's job goes with it) or ``s3`` (the S3 endpoint, which the caller
restarts). Points: ``random`` (a timer from the start of the save's background part), ``dcp_write``
(DCP writing the nth tensor into a shard), ``dcp_metadata`` (rank 0 before DCP writes .metadata),
``hash`` (before the nth file's SHA-256), ``upload`` (a timer from the start of the rank's upload),
``fsync_dir`` (the nth directory fsync of rank 0: manifest written, not yet renamed; then after the
rename), ``rename`` / ``after_rename`` (local), ``manifest`` / ``after_manifest`` (object storage).

Each rank logs to ``<trial>/events.jsonl``: a checkpoint complete (rank 0, right after the rename
or the manifest's upload) and the fault as it fires, with the phase the rank was in.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

_PRELOAD = ["torch", "torch.distributed.tensor", "transformers.models.llama.modeling_llama",
            "raytrain_hybrid.engine.worker", "raytrain_hybrid.launch.runtime.start"]  # fmt: skip
_STATE = {"phase": "training", "step": 0}


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _log(trial: str, **event) -> None:
    with open(os.path.join(trial, "events.jsonl"), "a") as f:
        f.write(json.dumps({**event, "t": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _die(fault: dict, trial: str, rank: int) -> None:
    _log(trial, event="fault", rank=rank, phase=_STATE["phase"], at_step=_STATE["step"], fault=fault)
    if fault["target"] == "s3":  # the endpoint dies; the caller restarts it; this rank goes on
        pid = json.loads(Path(trial, "pids.json").read_text())["proxy"]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return
    if fault["target"] == "driver":
        pids = json.loads(Path(trial, "pids.json").read_text())
        for pid in [pids["driver"], *pids["ranks"]]:
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def install(fault: dict | None, trial: str, rank: int) -> None:
    """In a forked rank: wrap the save path's steps to log completions and to fire ``fault``."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from raytrain_hybrid.checkpoint import save
    from raytrain_hybrid.storage import Store

    fault = fault or {}
    counts: dict[str, int] = {}
    mine = fault.get("rank", 0) == rank and fault.get("point")

    def at(point: str) -> None:
        _STATE["phase"] = point
        if not mine or fault["point"] != point or fault["step"] != _STATE["step"]:
            return
        counts[point] = counts.get(point, 0) + 1
        if counts[point] == fault.get("nth", 1):
            _die(fault, trial, rank)

    def timer(point: str) -> None:
        _STATE["phase"] = point
        if mine and fault["point"] == point and fault["step"] == _STATE["step"] and point not in counts:
            counts[point] = 1
            # A share of this rank's previous save (its length follows the machine's load), else seconds.
            delay = fault["share"] * _STATE["last_save_s"] if "share" in fault and "last_save_s" in _STATE else None
            threading.Timer(fault["delay"] if delay is None else delay, _die, (fault, trial, rank)).start()

    finish_call = save._Finish.__call__

    def finish(self, state):
        _STATE["step"] = int(self.final.name.split("_")[1])
        timer("random")
        _STATE["phase"], t0 = "dcp_write", time.monotonic()
        out = finish_call(self, state)
        _STATE["phase"], _STATE["last_save_s"] = "training", time.monotonic() - t0
        return out

    write_item = dcp_fs._write_item

    def writing(*args, **kwargs):
        at("dcp_write")
        return write_item(*args, **kwargs)

    finish_plan = dcp_fs.FileSystemWriter.finish

    def metadata(self, *args, **kwargs):
        at("dcp_metadata")
        return finish_plan(self, *args, **kwargs)

    digest = save.file_digest

    def hashing(path):
        at("hash")
        return digest(path)

    upload = Store.upload

    def uploading(self, local_dir):
        timer("upload")
        out = upload(self, local_dir)
        _STATE["phase"] = "gather"
        return out

    write_text = Store.write_text

    def writing_text(self, text):
        manifest = not self.local and self.path.endswith("/manifest.json") and "/checkpoints/step_" in self.path
        if manifest:
            at("manifest")
        write_text(self, text)
        if manifest:
            _log(trial, event="complete", step=_STATE["step"], rank=rank)
            at("after_manifest")

    fsync_dir = save._fsync_dir

    def syncing(path):
        at("fsync_dir")
        return fsync_dir(path)

    rename = os.rename

    def renaming(src, dst, *args, **kwargs):
        staging = str(src).endswith(f"step_{_STATE['step']}.partial")
        if staging:
            at("rename")
        rename(src, dst, *args, **kwargs)
        if staging:
            _log(trial, event="complete", step=_STATE["step"], rank=rank)
            at("after_rename")

    save._Finish.__call__ = finish
    dcp_fs._write_item = writing
    dcp_fs.FileSystemWriter.finish = metadata
    save.file_digest = hashing
    Store.upload = uploading
    Store.write_text = writing_text
    save._fsync_dir = syncing
    os.rename = renaming


# ------------------------------------------------------------------ the processes of one run


def restart_point(overrides: list[str], resume: str | None) -> dict:
    """What the CLI's driver does before any worker starts: the run directory's checks and,
    with ``resume``, the newest intact checkpoint and the trajectory check (a ConfigError
    refuses the start); returns the resume point as the workers get it."""
    import dataclasses

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.runtime.start import prepare_run_dir

    _, point = prepare_run_dir(load_config(None, overrides), resume, None, lambda line: None)
    return dataclasses.asdict(point)


def _driver(overrides: list[str], resume: str | None, env: dict, queue, release) -> None:
    os.environ.update(env)
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.errors import ConfigError
    from raytrain_hybrid.launch.records.lease import acquire

    try:  # the lease first, as the driver takes it: then the checkpoint the resume picks
        lease = acquire(load_config(None, overrides).run.output_dir)
        point = restart_point(overrides, resume)
        if point["finished"]:  # nothing left to train: the CLI completes the run's records, exits 0
            lease.release()
            del lease
            queue.put(("nothing_left", -1, point))
        else:
            lease.start_renewing()
            queue.put(("start", -1, point))
    except ConfigError as exc:
        if "lease" in locals():
            lease.release()
            del lease
        queue.put(("refused", -1, str(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        queue.put(("error", -1, repr(exc)))
    queue.close()
    queue.join_thread()  # what it said is sent before it goes on (or exits)
    if "lease" in locals():
        with contextlib.suppress(EOFError):
            release.recv()  # the caller says the run ended (or went away)
        lease.release()
    os._exit(0)


def _rank(rank: int, world: int, port: int, job: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(job["env"])
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        install(job.get("fault"), job["trial"], rank)
        from raytrain_hybrid.config import load_config
        from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
        from raytrain_hybrid.engine.worker import run_worker

        saves: list[dict] = []

        def saved(step: int, path, metrics: dict) -> None:
            saves.append({"step": step, **{k: metrics[k] for k in ("write_s", "save_s", "blocked_s")}})

        point = job["point"]
        plan = WorkerPlan(load_config(None, job["overrides"]), resume=point["path"], launch_id=job["launch_id"],
                          data_origin=point["data_origin"], trajectory=point["trajectory"])  # fmt: skip
        result = run_worker(plan, "node0", WorkerIO(on_checkpoint=saved))
        status = ("ok", rank, {"history": [[h["step"], h["loss"]] for h in result["history"]], "saves": saves})
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        import traceback

        status = ("error", rank, f"{exc!r}\n{traceback.format_exc()[-3000:]}")
    queue.put(status)
    queue.close()
    queue.join_thread()
    os._exit(0 if status[0] == "ok" else 1)


def run(ctx, overrides: list[str], world: int, trial: str, *, resume: str | None = None, fault: dict | None = None,
        env: dict | None = None, proxy=None, limit: float = 300.0) -> dict:  # fmt: skip
    """One start of a run (a driver and ``world`` ranks) until it ends or a fault kills it.

    ``status``: ``ok``, ``nothing_left`` (a resume of a run that has done all its steps),
    ``refused`` (the driver's checks said no: ``error`` says why), ``killed`` (a process died of
    SIGKILL; the survivors are killed as a worker group is torn down), ``failed`` (a rank raised:
    ``error``) or ``hung``."""
    import uuid

    import torch.distributed as dist

    env = dict(env or {})
    # A pipe, not an Event, tells the driver the run ended: an Event's set() waits for every
    # process that waited on it to wake up, and a driver killed while waiting never does.
    queue, (release, ended) = ctx.Queue(), ctx.Pipe(duplex=False)
    driver = ctx.Process(target=_driver, args=(overrides, resume, env, queue, release))
    driver.start()
    release.close()
    kind, point = "error", f"the driver exited with {driver.exitcode} before starting the run"
    started = _drain_one(queue, driver, limit)
    if started is not None:
        kind, _, point = started
    if kind == "nothing_left":
        driver.join(30)
        return {"status": "nothing_left", "resumed_from": point["path"]}
    if kind != "start":
        driver.join(30)
        return {"status": "refused" if kind == "refused" else "failed", "error": point}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = {"overrides": overrides, "point": point, "launch_id": uuid.uuid4().hex, "trial": trial, "env": env,
           "fault": fault}  # fmt: skip
    ranks = [ctx.Process(target=_rank, args=(r, world, store.port, job, queue)) for r in range(world)]
    for p in ranks:
        p.start()
    _write_pids(trial, driver.pid, [p.pid for p in ranks], proxy)
    out: dict = {"status": "hung", "resumed_from": point["path"], "launch_id": job["launch_id"]}
    deadline, errors, oks, first_error = time.monotonic() + limit, [], {}, None
    while time.monotonic() < deadline:
        if proxy is not None:
            proxy.keep_up()
        codes = [p.exitcode for p in [driver, *ranks]]
        _drain(queue, oks, errors, 0.2 if None in codes[1:] else 1.0)
        first_error = first_error or (time.monotonic() if errors else None)
        if -signal.SIGKILL in codes:
            out["status"] = "killed"
            break
        if None not in codes[1:]:  # every rank has ended
            out.update(status="ok", **oks[0]) if len(oks) == world else out.update(status="failed")
            break
        if first_error and time.monotonic() - first_error > 10:  # the others did not end on their own
            out["status"] = "failed"
            break
    for p in ranks:
        if p.exitcode is None:
            p.kill()
        p.join(30)
    out["exitcodes"] = [p.exitcode for p in ranks]
    out["driver_killed"] = driver.exitcode == -signal.SIGKILL
    with contextlib.suppress(OSError):  # a driver still alive sees the run end (its lease released)
        ended.send(True)
    ended.close()
    driver.join(30)
    if driver.exitcode is None:
        driver.kill()
        driver.join(10)
    if errors:
        out["error"] = errors[0]
    del store
    return out


def _drain_one(queue, process, limit: float):
    """The first message on ``queue``; None if ``process`` ended (or ``limit`` passed) without one."""
    import queue as queues

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except queues.Empty:
            if process.exitcode is not None:
                try:
                    return queue.get(timeout=1.0)
                except queues.Empty:
                    return None
    return None


def _drain(queue, oks: dict, errors: list, wait: float) -> None:
    import queue as queues

    try:
        while True:
            kind, rank, payload = queue.get(timeout=wait)
            (oks.__setitem__(rank, payload) if kind == "ok" else errors.append(f"rank {rank}: {payload}"))
            wait = 0.01
    except queues.Empty:
        pass


def _write_pids(trial: str, driver: int, ranks: list[int], proxy) -> None:
    pids = {"driver": driver, "ranks": ranks, "proxy": proxy.pid if proxy is not None else None}
    tmp = Path(trial, "pids.json.tmp")
    tmp.write_text(json.dumps(pids))
    tmp.replace(Path(trial, "pids.json"))


def events(trial: str) -> list[dict]:
    path = Path(trial, "events.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
