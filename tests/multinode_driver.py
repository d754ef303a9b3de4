"""Run layouts on a simulated multi-node Ray cluster; print one JSON line of results.

Used by test_topology_ray.py in a subprocess: a process joins one Ray cluster, and the
rest of the test session shares a single-node one. Virtual nodes of
ray.cluster_utils.Cluster share one IP, so ranks are grouped by node id.

    python tests/multinode_driver.py '{"nodes": [4, 4], "tmp_root": DIR, "cases": {"name": CASE}}'

A CASE is a list of "key=value" overrides, or {"overrides": [...], "lose_node_after": "checkpoints/step_2"}:
then a spare node joins first, and once that checkpoint of run.output_dir is complete (its
manifest is there) one node holding training workers is removed, and its disk with it. A CASE
with "add_gpus" is an elastic run through the CLI on nodes of its own (run_elastic), where a
node with workers is drained for preemption instead ("drain_after", "deadline_s"). With
"tmp_root", every worker node gets its own TMPDIR under it (its "local disk"), and the result
lists what each one holds after the cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from raytrain_hybrid.checkpoint.manifest import read_manifest, step_dirs
from raytrain_hybrid.config import load_config
from raytrain_hybrid.launch.runtime.driver import run
from raytrain_hybrid.storage import open_store


class Nodes:
    """The cluster's worker nodes, named node0, node1, ... in the order they joined."""

    def __init__(self, cluster: Cluster, tmp_root: str | None) -> None:
        self.cluster, self.tmp_root = cluster, Path(tmp_root) if tmp_root else None
        self.names: dict[str, str] = {}  # node id -> name
        self.alive: dict[str, object] = {}  # name -> ray's Node
        self.gpus: dict[str, int] = {}

    def add(self, gpus: int, wait: bool = True):
        name = f"node{len(self.names)}"
        extra = {}
        if self.tmp_root is not None:  # what a worker there writes to "local disk" lands in its own folder
            (self.tmp_root / name).mkdir(parents=True)
            extra["env_vars"] = {"TMPDIR": str(self.tmp_root / name)}
        node = self.cluster.add_node(wait=wait, num_cpus=gpus, num_gpus=gpus, **extra)
        self.names[node.node_id], self.alive[name], self.gpus[name] = name, node, gpus
        return node

    def busy(self) -> list[str]:
        """Nodes whose GPUs training workers hold (never the driver's head)."""
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
        return [n for n, node in self.alive.items() if free.get(node.node_id, {}).get("GPU", 0) < self.gpus[n]]

    def remove_one_with_workers(self) -> dict:
        """Remove a node whose GPUs training workers hold, and its disk."""
        busy = self.busy()
        if not busy:
            return {"removed": None, "busy_before": busy}
        name = busy[-1]
        self.remove(name)
        return {"removed": name, "busy_before": busy, "removed_at": time.time()}

    def drain_one_with_workers(self, seconds: float) -> dict:
        """What a cloud's spot reclaim does in Ray (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
        --deadline-remaining-seconds N`, the same GCS call): a node with workers is drained for
        preemption, to be taken away ``seconds`` from now."""
        busy = self.busy()
        if not busy:
            return {"drained": None, "busy_before": busy}
        name = busy[-1]
        return {"drained": name, "busy_before": busy, "drained_at": time.time(), "deadline": self.drain(name, seconds)}

    def drain(self, name: str, seconds: float) -> float:
        """Drain node ``name`` for preemption ``seconds`` from now (again: the new deadline holds)."""
        from ray.core.generated import autoscaler_pb2

        deadline = time.time() + seconds
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        gcs = ray._raylet.GcsClient(address=self.cluster.address)
        accepted, why = gcs.drain_node(self.alive[name].node_id, reason, "spot reclaim (test)", int(deadline * 1000))
        assert accepted, why
        return deadline

    def watcher_alive(self) -> bool:
        """Whether Ray Train's preemption watcher (an actor per worker group) is alive."""
        return any(
            a.get("ActorClassName", "").endswith("PreemptionWatcher") and a.get("State") in ("ALIVE", 2)
            for a in ray._private.state.actors().values()
        )

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.alive.pop(name))
        if self.tmp_root is not None:
            shutil.rmtree(self.tmp_root / name)

    def disks(self) -> dict[str, list[str]]:
        """Per live node, the files under its TMPDIR (relative paths)."""
        if self.tmp_root is None:
            return {}
        return {
            n: sorted(str(p.relative_to(self.tmp_root / n)) for p in (self.tmp_root / n).rglob("*")) for n in self.alive
        }


def lose_node_when_complete(nodes: Nodes, manifest, done: threading.Event, report: dict) -> None:
    """Wait for ``manifest`` (a checkpoint complete on storage), then remove a node with workers."""
    while not done.is_set():
        if manifest.exists():
            report.update(nodes.remove_one_with_workers())
            return
        time.sleep(0.1)


def run_case(nodes: Nodes, spec: dict, name: str, case, tmp: str) -> dict:
    case = case if isinstance(case, dict) else {"overrides": case}
    cfg = load_config(
        None,
        [
            "cluster.use_gpu=true",
            "cluster.backend=gloo",  # fake GPUs: CUDA is absent, workers fall back to the CPU
            f"run.output_dir={Path(tmp) / name}",
            "run.shared_fs=true",  # the simulated nodes share this machine's disk
            "run.progress=false",
            *case["overrides"],  # last: a case may override the keys above
        ],
    )
    out = open_store(cfg.run.output_dir)
    loss: dict = {}
    done = threading.Event()
    if "lose_node_after" in case:
        nodes.add(spec["nodes"][0])  # the spare the restarted worker group will need
        marker = out.child(*case["lose_node_after"].split("/"), "manifest.json")
        watcher = threading.Thread(target=lose_node_when_complete, args=(nodes, marker, done, loss), daemon=True)
        watcher.start()
    try:
        summary = run(cfg)
    except Exception as exc:  # reported to the test, which decides
        return {"error": str(exc), **loss}
    finally:
        done.set()
    history = [json.loads(line) for line in out.child("metrics.jsonl").read_text().splitlines()]
    per_rank = [{**r, "node": nodes.names.get(r["node"], r["node"])} for r in summary["per_rank"]]
    result = {"history": history, "per_rank": per_rank, **loss}
    if "lose_node_after" in case:
        result["summary"] = json.loads(out.child("summary.json").read_text())
        result["summary_returned"] = json.loads(json.dumps({k: v for k, v in summary.items() if k != "per_rank"}))
        result["checkpoints"] = out.child("checkpoints").listdir()
    return result


def replace_nodes(nodes: Nodes, sizes: list[int]) -> None:
    """The nodes there are removed, then nodes of ``sizes`` GPUs each join (side by side)."""
    for old in list(nodes.alive):
        nodes.remove(old)
    for gpus in sizes:
        nodes.add(gpus, wait=False)
    nodes.cluster.wait_for_nodes()


def run_elastic(nodes: Nodes, name: str, case: dict, tmp: str) -> dict:
    """As a user: the CLI joins this cluster through RAY_ADDRESS, on fresh nodes of
    case["nodes"] GPUs each (the earlier cases' nodes removed, so the run's workers land only
    there). Once case["drain_after"] is complete in
    run.output_dir (and Ray Train's preemption watcher is up) a node with workers is drained for
    preemption, case["deadline_s"] ahead, and once the notice's checkpoint is saved drained again,
    case["sooner_s"] ahead; it is
    removed once that deadline passed and the group restarted without it. Once a checkpoint of
    the smaller group is complete, a node of case["add_gpus"] joins. Then, on fresh nodes of
    case["auto_nodes"] GPUs each (when given; else the nodes there are), `check` with
    case["check"] and a run of case["auto"]'s overrides (parallelism.layout=auto)."""
    replace_nodes(nodes, case["nodes"])
    sets = ["cluster.use_gpu=true", "cluster.backend=gloo", "run.progress=true", *case["overrides"]]
    out = open_store(next(s.split("=", 1)[1] for s in sets if s.startswith("run.output_dir=")))
    env = {**os.environ, "RAY_ADDRESS": nodes.cluster.address, **case.get("env", {})}
    cli = str(Path(sys.executable).parent / "raytrain-hybrid")
    argv = [cli, "train", *[a for s in sets for a in ("--set", s)]]
    err = Path(tmp) / f"{name}.stderr"  # a file: a pipe nobody reads could fill and stall the CLI
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, env=env, cwd=tmp)
    events: dict = {}

    def smaller_group_saved() -> str | None:
        """A complete checkpoint of a group below max_dp (older ones are pruned as we look)."""
        for path in step_dirs(out.child("checkpoints")):
            with contextlib.suppress(OSError, ValueError, KeyError):
                if read_manifest(path)["layout"]["dp"] < case["max_dp"]:
                    return path.name
        return None

    lines: list = []  # (seconds since the start, line) of what the CLI prints

    def read_stdout() -> None:
        for line in proc.stdout:
            lines.append((round(time.time() - started, 1), line.rstrip("\n")))

    started = time.time()
    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    due = out.child(*case["drain_after"].split("/"), "manifest.json")
    try:  # here, not in a thread: Cluster.add_node installs a signal handler (main thread only)
        while proc.poll() is None and time.time() - started < 900:
            # Drained once the group has its preemption watcher (an actor Ray Train starts beside
            # the workers; on a loaded machine it came up after step_2 once, and heard nothing).
            if "drained" not in events and due.exists() and nodes.watcher_alive():
                events.update(nodes.drain_one_with_workers(case["deadline_s"]))
            elif events.get("drained") and "sooner" not in events and any(x.startswith("  saved") for _, x in lines):
                # The notice's checkpoint is saved: the reclaim comes sooner than first said (a
                # second drain, as a cloud may send), so the test does not wait out a deadline
                # generous enough for a save on a loaded machine.
                events.update(sooner=time.time(), first_deadline=events["deadline"])
                events["deadline"] = nodes.drain(events["drained"], case["sooner_s"])
            elif events.get("drained") and "removed" not in events and time.time() > events["deadline"]:
                # The cloud takes the node once the group has restarted without it (Ray Train waits
                # out the deadline); taken earlier, its workers' deaths would be worker failures.
                if any(line.startswith("restart 1") for _, line in lines):
                    nodes.remove(events["drained"])
                    events.update(removed=events["drained"], removed_at=time.time())
            elif "removed" in events and "added" not in events and (saved := smaller_group_saved()):
                nodes.add(case["add_gpus"])
                events.update(added=list(nodes.alive)[-1], added_at=time.time(), added_after=saved)
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    reader.join(timeout=60)
    stdout = "\n".join(line for _, line in lines)
    result = {"returncode": proc.returncode, "stdout": stdout, "lines": lines, "stderr": err.read_text()[-4000:]}
    result.update(events, started=started)
    if proc.returncode == 0:
        result["history"] = [json.loads(line) for line in out.child("metrics.jsonl").read_text().splitlines()]
        result["summary"] = json.loads(out.child("summary.json").read_text())
    if "auto_nodes" in case:
        replace_nodes(nodes, case["auto_nodes"])
    if "check" in case:  # what parallelism.layout=auto would pick on this cluster
        sets_check = ["cluster.use_gpu=true", "cluster.backend=gloo", *case["check"]]
        done = subprocess.run([cli, "check", *[a for s in sets_check for a in ("--set", s)]], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        result["check"] = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-3000:]}
    if "auto" in case:
        auto = case["auto"]
        result["auto"] = run_cli(
            cli, auto["overrides"], Path(tmp) / f"{name}-auto", nodes, tmp, auto.get("lose_node_after")
        )
    return result


def run_cli(
    cli: str, overrides: list[str], out: Path, nodes: Nodes, cwd: str, lose_node_after: str | None = None
) -> dict:
    """`raytrain-hybrid train` on this cluster through RAY_ADDRESS, output in ``out`` (the
    simulated nodes share this machine's disk): what it printed, its metrics and summary. With
    ``lose_node_after`` (a checkpoint), a node with workers is removed once that is complete."""
    sets = ["cluster.use_gpu=true", "cluster.backend=gloo", "run.shared_fs=true", f"run.output_dir={out}", *overrides]
    env = {**os.environ, "RAY_ADDRESS": nodes.cluster.address}
    proc = subprocess.Popen([cli, "train", *[a for s in sets for a in ("--set", s)]], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    loss: dict = {}
    done = threading.Event()
    if lose_node_after:
        marker = out.joinpath(*lose_node_after.split("/"), "manifest.json")
        threading.Thread(target=lose_node_when_complete, args=(nodes, marker, done, loss), daemon=True).start()
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        done.set()
        proc.kill()
    result = {"returncode": proc.returncode, "stdout": stdout, "stderr": stderr[-3000:], **loss}
    if proc.returncode == 0:
        result["history"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        result["summary"] = json.loads((out / "summary.json").read_text())
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    # The head holds no worker slots (Ray Train's controller needs no CPU), nor a dashboard
    # (nothing here reads it); each virtual node has fake GPUs, so placement follows GPU
    # slots as on a real cluster.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    nodes = Nodes(cluster, spec.get("tmp_root"))
    for gpus in spec["nodes"]:  # the nodes start side by side, then one wait for them all
        nodes.add(gpus, wait=False)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in spec["cases"].items():
            t0 = time.time()
            if "add_gpus" in case:  # it replaces the nodes: what the earlier cases left on their disks first
                results.setdefault("disks", nodes.disks())
            outcome = (
                run_elastic(nodes, name, case, tmp) if "add_gpus" in case else run_case(nodes, spec, name, case, tmp)
            )
            results[name] = {**outcome, "seconds": round(time.time() - t0, 1)}
    results.setdefault("disks", nodes.disks())
    results["cwd"] = sorted(os.listdir("."))
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
