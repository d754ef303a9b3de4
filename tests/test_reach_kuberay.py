"""`check --set parallelism.layout=auto` on a KubeRay head: the pick is for the nodes the RayCluster's
autoscaler may add, read as that autoscaler reads them, from the Kubernetes API (a stand-in server
on loopback, tests/k8s_server.py, serving the shipped cluster_configs/kuberay-raycluster.yaml as
the API returns it). The CLI joins the session's cluster through RAY_ADDRESS, as a `ray job submit`
driver runs on the head, with the variables a KubeRay pod has. A RayCluster without its autoscaler,
or one the API refuses: tests/test_autolayout.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from job_files import submit_overrides
from k8s_server import api_server

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "cluster_configs" / "kuberay-raycluster.yaml"
JOB = "jobs/llama3_8b_1node_h100.toml"  # the job the manifest's header submits
PATH = "/apis/ray.io/v1/namespaces/team-a/rayclusters/raytrain-hybrid"


def _raycluster(autoscaling: bool = True) -> dict:
    """The manifest as the API server returns the object (its namespace filled in)."""
    doc = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"] = {**doc["metadata"], "namespace": "team-a", "uid": "0c8e6b7a"}
    doc["spec"]["enableInTreeAutoscaling"] = autoscaling
    return doc


def _check(ray_local, env: dict, *sets: str) -> subprocess.CompletedProcess:
    # The job's submit line (its <your-bucket> filled in), the shipped corpus for its data.
    sets = (*submit_overrides(ROOT / JOB), "data.path=memory", *sets)
    argv = [sys.executable, "-m", "raytrain_hybrid.cli", "check", JOB, *(a for kv in sets for a in ("--set", kv))]
    env = {**os.environ, **env, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_layout_auto_on_a_kuberay_head_picks_for_the_worker_groups_it_may_scale(ray_local, tmp_path):
    with api_server({PATH: _raycluster()}, tmp_path) as (env, seen):
        pod = {**env, "RAY_CLUSTER_NAME": "raytrain-hybrid", "RAY_CLUSTER_NAMESPACE": "team-a"}
        done = _check(ray_local, pod, "parallelism.layout=auto")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert seen == [PATH], seen
    # The job asks for H100s (cluster.accelerator_type): the H100 group only, up to its maxReplicas.
    said = next(ln for ln in out.splitlines() if "the autoscaler may add" in ln)
    assert said.startswith("layout auto: the autoscaler may add 8 x gpu-h100-8x {") and "'GPU': 8.0" in said, out
    assert "A100" not in said and said.endswith(
        "(maxReplicas in RayCluster team-a/raytrain-hybrid): picking for the most the cluster may reach"
    ), said
    # Llama 3 8B at most 8 replicas on the 8 nodes to come (64 GPUs), none of which is up yet.
    picked = next(ln for ln in out.splitlines() if ln.startswith("layout auto: dp="))
    assert "on nodes holding [8, 8, 8, 8, 8, 8, 8, 8] workers (H100-80GB SXM)" in picked, out
    assert "layout auto: the live nodes alone hold no layout yet" in out, out
    assert "layout ok: dp=" in out and " on 8 node(s) [8, 8, 8, 8, 8, 8, 8, 8]" in out, out
