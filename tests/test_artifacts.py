"""Artifacts users run as they are: cluster launcher YAMLs (Ray's own schema), KubeRay
manifests (structure, and the layout their job needs), jobs/ configs and their planner lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import load_job
from job_files import filled, submit_sets

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
            # Ray creates a security group with SSH open to 0.0.0.0/0 for types without one. With
            # EFA interfaces, subnet and groups are the interfaces' (Ray copies them up).
            from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces

            if "NetworkInterfaces" in cfg:
                cfg = _configure_subnets_and_groups_from_network_interfaces(cfg)
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
    sets = [entry[i + 1] for i, arg in enumerate(entry) if arg == "--set"]
    assert sets == submit_sets(config), "the RayJob overrides what the job's own submit line does"
    cfg = load_job(config, [filled(kv) for kv in sets])
    (group,) = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus_per_pod = int(pod["nvidia.com/gpu"])
    par = cfg.parallelism
    assert group["replicas"] * gpus_per_pod == par.world_size  # exactly the job's 64 GPUs
    assert gpus_per_pod % par.tp == 0 and cfg.cluster.gpus_per_node == gpus_per_pod  # TP inside a pod
    assert cfg.cluster.cpus_per_worker * gpus_per_pod < int(pod["cpu"])  # room left for Ray Data reads


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_job_config_loads_and_its_planner_line_is_current(path):
    cfg = load_job(path)  # validation: layout against model, batch against micro-batches
    text = path.read_text()
    match = re.search(
        r"^# planner \(`raytrain-hybrid check (\S+) --hardware (\S+)`(?: with the --set below)?\):\n#   (.+)$",
        text,
        re.M,
    )
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
    lines = re.findall(r"--runtime-env (\S+) -- \\\n\s+python -m raytrain_hybrid.cli train (\S+)", text)
    assert len(lines) >= 3
    for env, config in lines:
        env_doc = yaml.safe_load((ROOT / env).read_text())
        assert ".venv" in env_doc["excludes"], "the working directory upload must leave out the venv"
        load_job(ROOT / config)


# Point 4 of issue 18: the configs provide what the jobs ask for, and give the nodes what a run
# on them needs (credentials, the fast network, the image, token authentication).

CLUSTER = ROOT / "cluster_configs"
IMAGE = "raytrain-hybrid:0.1.0"  # cluster_configs/Dockerfile, pushed to the user's registry
GPU_JOBS = [p for p in JOB_CONFIGS if load_job(p).cluster.use_gpu is True]


def _yaml(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def _worker_types():
    from test_autoscaling_sim import aws_worker_types, gcp_worker_types, kuberay_worker_types

    return {
        "aws-gpu.yaml": aws_worker_types(),
        "gcp-gpu.yaml": gcp_worker_types(),
        "kuberay-raycluster.yaml": kuberay_worker_types(),
    }


@pytest.mark.parametrize("job", GPU_JOBS, ids=lambda p: p.name)
def test_every_gpu_job_fits_a_node_type_of_every_config(job):
    """A node full of the job's workers (gpus_per_node of them, each asking GPU 1, its CPUs and
    its accelerator type) fits a node type of each config, with a CPU left for Ray Data's reads
    (the heads have none). tests/test_autoscaling_sim.py runs one job per config for real."""
    from test_autoscaling_sim import worker_demand

    cluster = load_job(job).cluster
    per_node = {k: v * cluster.gpus_per_node for k, v in worker_demand(f"jobs/{job.name}").items()}
    for config, types in _worker_types().items():
        fits = [
            name
            for name, res in types.items()
            if all(res.get(k, 0) >= v for k, v in per_node.items()) and res["CPU"] - per_node["CPU"] >= 1
        ]
        assert fits, f"{config}: no node type holds {cluster.gpus_per_node} workers of {job.name} ({per_node})"


def test_the_rayjob_workers_are_the_rayclusters_h100_type():
    """The RayJob's fixed group is the RayCluster's H100 group, which the simulation proves."""
    from test_autoscaling_sim import kuberay_worker_types

    assert (
        kuberay_worker_types("kuberay-rayjob.yaml")["gpu-h100-8x"]
        == _worker_types()["kuberay-raycluster.yaml"]["gpu-h100-8x"]
    )


def test_kuberay_resources_param_reaches_ray_start_as_json():
    """The operator puts rayStartParams on `ray start` as --resources=<value>; the shell must
    hand Ray the JSON the autoscaler reads."""
    import json
    import shlex

    from test_autoscaling_sim import kuberay_worker_types

    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        types = kuberay_worker_types(name)
        for group in _cluster_spec(_yaml(name))["workerGroupSpecs"]:
            (arg,) = shlex.split(f"--resources={group['rayStartParams']['resources']}")
            declared = json.loads(arg.removeprefix("--resources="))
            assert declared.items() <= types[group["groupName"]].items(), (name, declared)
            assert any(k.startswith("accelerator_type:") for k in declared)


def test_aws_workers_have_credentials_and_efa():
    raw = _yaml("aws-gpu.yaml")
    efa_cards = {"p5.48xlarge": 32, "p4de.24xlarge": 4}
    for name, node in raw["available_node_types"].items():
        cfg = node["node_config"]
        # Instance profile: S3 for the workers, EC2 and S3 for the head (Ray gives workers none).
        assert cfg["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::"), name
        if not node["resources"].get("GPU"):  # the head, the CPU workers: no NCCL traffic
            continue
        nics = cfg["NetworkInterfaces"]
        assert [n["NetworkCardIndex"] for n in nics] == list(range(efa_cards[cfg["InstanceType"]])), name
        assert all(n["InterfaceType"] == "efa" and n["SubnetId"] and n["Groups"] for n in nics), name
        assert [n["DeviceIndex"] for n in nics] == [0] + [1] * (len(nics) - 1), name
        assert cfg["Placement"]["GroupName"], f"{name}: EFA wants a cluster placement group"
        opts = node["docker"]["worker_run_options"]
        assert "--device=/dev/infiniband" in opts and "--ulimit memlock=-1:-1" in opts, name
    start = " ".join(raw["worker_start_ray_commands"])
    assert "NCCL_NET_PLUGIN=ofi" in start and "/opt/amazon/ofi-nccl/lib" in start
    assert start.index("NCCL_NET_PLUGIN=ofi") < start.index("ray start")  # the raylet passes it on
    assert "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so" in (CLUSTER / "Dockerfile").read_text()


def test_gcp_nodes_have_credentials_tcpx_and_wait_for_the_driver():
    raw = _yaml("gcp-gpu.yaml")
    for name, node in raw["available_node_types"].items():
        cfg = node["node_config"]
        (account,) = cfg["serviceAccounts"]
        assert account["email"].endswith(".iam.gserviceaccount.com"), name
        assert "https://www.googleapis.com/auth/cloud-platform" in account["scopes"], name
        if not node["resources"].get("GPU"):  # the head, the CPU workers: no driver to wait for
            assert "nvidia-smi" not in yaml.safe_dump(node), name
            continue
        # The host has the driver before Docker starts Ray's container with the GPUs, and the
        # container sees every GPU before `ray start` (setup commands run before the start commands).
        assert "nvidia-smi" in node["initialization_commands"][0], name
        assert any('grep -q "GPU 7"' in c for c in node["worker_setup_commands"]), name
        if not cfg["machineType"].startswith("a3-"):
            continue
        # GPUDirect-TCPX: 4 GPU NICs besides the host's, the plugin and RxDM on the host, NCCL
        # pointed at them inside the container.
        nics = cfg["networkInterfaces"]
        assert len(nics) == 5 and all(n["nicType"] == "GVNIC" for n in nics), name
        assert len({n["subnetwork"] for n in nics}) == 5, f"{name}: one VPC per GPU NIC"
        init = " ".join(node["initialization_commands"])
        assert "nccl-plugin-gpudirecttcpx" in init and "tcpgpudmarxd" in init, name
        env = dict(o.removeprefix("--env ").strip("'").split("=", 1) for o in node["docker"]["worker_run_options"]
                   if o.startswith("--env "))  # fmt: skip
        assert len(env["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"].split(",")) == 4
        assert env["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"] == "/run/tcpx"
        assert env["LD_LIBRARY_PATH"].startswith("/usr/local/tcpx/lib64")
        assert "-v /run/tcpx:/run/tcpx" in node["docker"]["worker_run_options"]
    # Start commands are every type's, the CPU one's too: no GPU wait there.
    assert not any("nvidia-smi" in c for c in raw["worker_start_ray_commands"])


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_launcher_nodes_run_the_project_image_with_token_auth(path):
    raw = yaml.safe_load(path.read_text())
    assert raw["docker"]["image"].endswith(f"/{IMAGE}")
    assert not any("pip install" in c for c in raw["setup_commands"]), "deps are in the image"
    (token,) = [remote for remote, local in raw["file_mounts"].items() if local == "~/.ray/auth_token"]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in raw[key] if "ray start" in c]
        assert "RAY_AUTH_MODE=token" in start, key
        assert f"RAY_AUTH_TOKEN_PATH=$HOME/{token.removeprefix('~/')}" in start, key


def test_kuberay_pods_have_credentials_efa_image_and_token_auth():
    for name, doc in _manifests().items():
        spec = _cluster_spec(doc)
        assert spec["authOptions"]["mode"] == "token", name
        head = spec["headGroupSpec"]["template"]["spec"]
        groups = spec["workerGroupSpecs"]
        for pod in [head, *(g["template"]["spec"] for g in groups)]:
            assert pod["serviceAccountName"] == "raytrain-hybrid", f"{name}: IRSA / Workload Identity"
            (container,) = pod["containers"]
            assert container["image"].endswith(f"/{IMAGE}"), name
        for group in groups:
            (container,) = group["template"]["spec"]["containers"]
            res = container["resources"]
            assert int(res["limits"]["vpc.amazonaws.com/efa"]) >= 4, f"{name}/{group['groupName']}"
            assert res["requests"]["vpc.amazonaws.com/efa"] == res["limits"]["vpc.amazonaws.com/efa"]
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env["NCCL_NET_PLUGIN"] == "ofi" and "/opt/amazon/ofi-nccl/lib" in env["LD_LIBRARY_PATH"]
            assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]


def test_kuberay_rayjob_keeps_its_outputs_and_ships_its_code_on_storage():
    doc = _manifests()["kuberay-rayjob.yaml"]["spec"]
    assert doc["ttlSecondsAfterFinished"] > 0  # the pods, and any file on them, go away
    assert re.search(r"--set run\.output_dir=s3://\S+", doc["entrypoint"])
    env = yaml.safe_load(doc["runtimeEnvYAML"])
    assert env["working_dir"].startswith("s3://") and env["working_dir"].endswith(".zip")
    assert "pip" not in env, "the image has the dependencies"
    gpu_env = yaml.safe_load((ROOT / "jobs" / "runtime_env_gpu.yaml").read_text())["env_vars"]
    assert env["env_vars"] == gpu_env  # the NCCL and libfabric settings of every GPU job


def test_image_and_gpu_runtime_env_pin_one_torch_inside_the_projects_range():
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    deps = {Requirement(d).name: Requirement(d) for d in project}
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert re.search(r"^FROM rayproject/ray:2\.60\.0-py311-gpu$", dockerfile, re.M)
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1)
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu12\d$", dockerfile, re.M)
    assert deps["torch"].specifier.contains(torch)
    # The project itself, which brings pyproject's dependencies, with every extra but dev's.
    extras = sorted(
        set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"dev"}
    )
    assert re.search(rf'^RUN pip install --no-cache-dir "/tmp/raytrain-hybrid\[{",".join(extras)}\]"', dockerfile, re.M)
    assert re.search(r"^COPY \S+ pyproject.toml README.md /tmp/raytrain-hybrid/$", dockerfile, re.M)
    assert re.search(r"^COPY \S+ raytrain_hybrid /tmp/raytrain-hybrid/raytrain_hybrid$", dockerfile, re.M)
    env = yaml.safe_load((ROOT / "jobs" / "runtime_env_gpu.yaml").read_text())
    assert f"torch=={torch}" in env["pip"]["packages"]
    nccl = env["env_vars"]
    assert nccl["FI_PROVIDER"] == "efa" and nccl["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert nccl["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_cluster_readme_says_how_a_client_gets_the_token():
    text = (CLUSTER / "README.md").read_text()
    assert "ray get-auth-token --generate" in text
    assert "kubectl get secret raytrain-hybrid -o jsonpath='{.data.auth_token}'" in text
    assert "RAY_AUTH_MODE=token" in text


@pytest.mark.parametrize("job", GPU_JOBS, ids=lambda p: p.name)
def test_every_gpu_job_checkpoints_to_object_storage_and_survives_failures(job):
    """On a cluster a run keeps its files only on storage every node reaches: the GPU jobs save
    checkpoints, keep a few, allow worker-group restarts, and write to an object-store URI."""
    cfg = load_job(job)
    assert cfg.run.output_dir.startswith(("s3://", "gs://")), cfg.run.output_dir
    assert cfg.checkpoint.interval > 0 and 0 < cfg.checkpoint.keep <= 5
    assert cfg.checkpoint.interval <= cfg.train.steps
    assert cfg.run.max_failures > 0
