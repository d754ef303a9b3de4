"""Artifacts users run as they are: cluster launcher YAMLs (Ray's own schema), KubeRay
manifests (structure, and the layout their job needs), jobs/ configs and their planner lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from raytrain_hybrid.config import load_config
from raytrain_hybrid.planner.hardware import load_hardware
from raytrain_hybrid.planner.search import describe

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER_YAMLS = sorted((ROOT / "cluster_configs").glob("*-gpu.yaml"))
JOB_CONFIGS = sorted((ROOT / "jobs").glob("*.toml"))


def test_artifacts_exist():
    assert {p.name for p in LAUNCHER_YAMLS} == {"aws-gpu.yaml", "gcp-gpu.yaml"}
    assert len(JOB_CONFIGS) >= 5


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_launcher_yaml_passes_rays_schema(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(path.read_text())
    validate_config(prepare_config(raw))  # raises jsonschema.ValidationError on a bad file


def test_schema_check_catches_a_broken_launcher_yaml():
    """The check above can fail: a float resource (Ray wants integers) is refused."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(LAUNCHER_YAMLS[0].read_text())
    raw["available_node_types"]["gpu_h100_8x"]["resources"]["GPU"] = 8.5
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate_config(prepare_config(raw))


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_launcher_yaml_gpu_nodes_autoscale_and_nothing_is_public(path):
    raw = yaml.safe_load(path.read_text())
    provider = raw["provider"]
    assert provider["use_internal_ips"] is True
    head_cmds = " ".join(raw["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds, "the dashboard must bind to localhost on the head"
    gpu_types = {k: v for k, v in raw["available_node_types"].items() if v.get("resources", {}).get("GPU")}
    assert len(gpu_types) >= 2  # an H100 and an A100 type
    for name, node in gpu_types.items():
        assert node["resources"]["GPU"] == 8, name
        assert node["min_workers"] == 0 < node["max_workers"], name
    for name, node in raw["available_node_types"].items():
        cfg = node["node_config"]
        if provider["type"] == "aws":
            # Ray creates a security group with SSH open to 0.0.0.0/0 for types without one.
            assert cfg.get("SecurityGroupIds"), f"{name}: give your own security group"
            assert cfg.get("SubnetIds"), f"{name}: place nodes in a (private) subnet"
        else:
            nics = cfg.get("networkInterfaces")
            assert nics and all(not nic.get("accessConfigs") for nic in nics), f"{name}: no external IP"
    assert "0.0.0.0/0" not in yaml.safe_dump(raw)  # no rule open to the internet


def _manifests():
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "cluster_configs").glob("kuberay-*.yaml"))}


def _cluster_spec(doc):
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def test_kuberay_manifests_structure():
    docs = _manifests()
    assert {d["kind"] for d in docs.values()} == {"RayCluster", "RayJob"}
    for name, doc in docs.items():
        assert doc["apiVersion"] == "ray.io/v1", name
        spec = _cluster_spec(doc)
        head = spec["headGroupSpec"]
        assert head.get("serviceType", "ClusterIP") == "ClusterIP", f"{name}: the head must not be exposed"
        assert head["rayStartParams"]["num-cpus"] == "0"
        for group in spec["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            (container,) = pod["containers"]
            limits = container["resources"]["limits"]
            gpus = int(limits["nvidia.com/gpu"])
            assert gpus == 8 and int(group["rayStartParams"]["num-gpus"]) == gpus, f"{name}/{group['groupName']}"
            assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), "GPU nodes are tainted"
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert _cluster_spec(docs["kuberay-raycluster.yaml"])["enableInTreeAutoscaling"] is True


def test_kuberay_rayjob_has_the_workers_its_layout_needs():
    doc = _manifests()["kuberay-rayjob.yaml"]
    entry = doc["spec"]["entrypoint"].split()
    config = ROOT / entry[entry.index("train") + 1]
    cfg = load_config(config, [a for a in entry if a.startswith("data.")])
    (group,) = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus_per_pod = int(pod["nvidia.com/gpu"])
    par = cfg.parallelism
    assert group["replicas"] * gpus_per_pod == par.world_size  # exactly the job's 64 GPUs
    assert gpus_per_pod % par.tp == 0 and cfg.cluster.gpus_per_node == gpus_per_pod  # TP inside a pod
    assert cfg.cluster.cpus_per_worker * gpus_per_pod < int(pod["cpu"])  # room left for Ray Data reads


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_job_config_loads_and_its_planner_line_is_current(path):
    cfg = load_config(path)  # validation: layout against model, batch against micro-batches
    text = path.read_text()
    match = re.search(r"^# planner \(`raytrain-hybrid check (\S+) --hardware (\S+)`\):\n#   (.+)$", text, re.M)
    if cfg.cluster.use_gpu is not True:
        assert match is None  # local jobs quote no GPU prediction
        return
    assert match, f"{path.name}: a GPU job states the planner's prediction in its header"
    assert match.group(1) == f"jobs/{path.name}"
    hw = load_hardware(match.group(2))
    assert cfg.cluster.gpus_per_node == hw.gpus_per_node
    assert match.group(3) == describe(cfg, hw)
    assert "(fits)" in match.group(3)


def test_job_readme_submit_lines_name_real_files():
    text = (ROOT / "jobs" / "README.md").read_text()
    lines = re.findall(r"--runtime-env (\S+) \\\n\s+-- python -m raytrain_hybrid.cli train (\S+)", text)
    assert len(lines) >= 3
    for env, config in lines:
        env_doc = yaml.safe_load((ROOT / env).read_text())
        assert ".venv" in env_doc["excludes"], "the working directory upload must leave out the venv"
        load_config(ROOT / config)
