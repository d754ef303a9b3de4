"""What a user copies: the example configs, the job files and their submit lines, the cluster
configs' placeholders and node types, the dataset snippet, the saved notebooks. Cheap: no Ray,
one CLI run."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import load_job
from job_files import filled, placeholder_keys, submit_argv, submit_overrides, submit_sets

import raytrain_hybrid as rh
from raytrain_hybrid.config import load_config

ROOT = Path(__file__).resolve().parent.parent
JOBS = sorted((ROOT / "jobs").glob("*.toml"))
CLUSTER = ROOT / "cluster_configs"
STAND_IN_MODEL = ROOT / "tests" / "assets" / "Meta-Llama-3-8B-Instruct"  # its published config.json
CHAT = ROOT / "examples" / "finetune_chat" / "chat.parquet"


def _keys(sets: list[str]) -> set[str]:
    return {kv.split("=", 1)[0] for kv in sets}


# Placeholders: refused with the key and what to put there.


def test_a_placeholder_is_refused_with_its_key_and_what_to_fill_in():
    with pytest.raises(rh.ConfigError) as err:
        load_config(None, ["run.output_dir=s3://<your-bucket>/runs/8b"])
    assert err.value.key == "run.output_dir"
    assert str(err.value).startswith(
        "run.output_dir='s3://<your-bucket>/runs/8b': replace <your-bucket> with your bucket"
    )
    # Before the checkpoint is read: a placeholder is not a path that "does not exist".
    with pytest.raises(rh.ConfigError, match=r"^model.pretrained='<path-to-model-dir>': replace <path-to-model-dir> "):
        load_config(None, ["model.pretrained=<path-to-model-dir>"])
    with pytest.raises(rh.ConfigError, match=r"replace <GCP_PROJECT> with gcp project"):
        load_config(None, ["run.output_dir=gs://<GCP_PROJECT>-runs/x"])
    # A URI with angle brackets that are no placeholder name passes.
    assert load_config(None, ["run.output_dir=runs/a<1>"]).run.output_dir == "runs/a<1>"


def test_check_refuses_the_8gpu_example_until_its_placeholders_are_filled():
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_hybrid.cli", "check", "examples/finetune_8gpu.toml"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: model.pretrained='<path-to-model-dir>': replace <path-to-model-dir> with a Hugging Face model" in (
        done.stderr
    )


# jobs/: each header's submit line sets what the file leaves to fill in, and then it validates.


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_a_job_headers_submit_line_sets_its_placeholders_and_validates(job):
    argv = submit_argv(job)
    assert argv[:3] == ["ray", "job", "submit"]
    env = argv[argv.index("--runtime-env") + 1]
    assert (ROOT / env).is_file() and ".venv" in yaml.safe_load((ROOT / env).read_text())["excludes"]
    entry = argv[argv.index("--") + 1 :]
    assert entry[:5] == ["python", "-m", "raytrain_hybrid.cli", "train", f"jobs/{job.name}"]
    sets = submit_sets(job)
    # What the file leaves to fill in is what the line overrides, and the line overrides nothing else.
    assert placeholder_keys(job) == {kv.split("=", 1)[0] for kv in sets if "<" in kv} == _keys(sets)
    if sets:  # as the file stands, the first placeholder is refused
        with pytest.raises(rh.ConfigError) as err:
            load_config(job)
        assert err.value.key in placeholder_keys(job) and "replace <your-bucket> with your bucket" in str(err.value)
    cfg = load_job(job)  # the line's --set, filled in (conftest: a stand-in for an unreachable checkpoint)
    for kv in submit_overrides(job):
        key, value = kv.split("=", 1)
        if key != "model.pretrained":
            section, name = key.split(".")
            assert getattr(getattr(cfg, section), name) == value


def test_the_jobs_readme_submits_what_the_headers_do():
    text = (ROOT / "jobs" / "README.md").read_text()
    commands = re.findall(r"^ray job submit .*?(?<!\\)$", text.replace("\\\n", "\\ "), re.M | re.S)
    seen = set()
    for command in commands:
        argv = shlex.split(command.replace("\\ ", " "))
        config = argv[argv.index("train") + 1]
        sets = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        assert placeholder_keys(ROOT / config) <= _keys(sets), f"jobs/README.md leaves a placeholder of {config}"
        seen.add(config)
    assert {"jobs/local_3d.toml", "jobs/llama3_8b_1node_h100.toml", "jobs/finetune_llama3_8b_chat.toml"} <= seen


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml", "kuberay-raycluster.yaml"])
def test_a_cluster_configs_submit_line_overrides_what_its_job_header_does(name):
    argv = submit_argv(CLUSTER / name)
    job = ROOT / argv[argv.index("train") + 1]
    sets = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    assert _keys(sets) == _keys(submit_sets(job))
    scheme = "gs://" if name.startswith("gcp") else "s3://"
    assert all(kv.split("=", 1)[1].startswith(scheme) for kv in sets), sets
    load_job(job, [filled(kv) for kv in sets])


def test_no_look_real_names_or_development_history_in_what_users_copy():
    look_real = re.compile(
        r"my-bucket|my-gcp-project|\bami-[0-9a-f]{8,}|\bsubnet-[0-9a-f]{8,}|\bsg-[0-9a-f]{8,}|\b\d{12}\b"
        r"|\bissue \d+|\bissues? #\d+|design document"
    )
    files = [p for d in ("jobs", "cluster_configs", "examples", "notebooks") for p in (ROOT / d).rglob("*")]
    files = [p for p in files if p.is_file() and p.suffix != ".parquet" and "__pycache__" not in p.parts]
    assert len(files) > 20
    for path in files:
        text = path.read_text()
        if path.suffix == ".ipynb":  # the notebook's text, not its pictures
            nb = json.loads(text)
            text = "".join("".join(c["source"]) for c in nb["cells"])
        found = look_real.findall(text)
        assert not found, f"{path.relative_to(ROOT)}: {found}"


# cluster_configs/: a CPU type for what needs CPUs only; the image; the RayJob's code.


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_cpu_only_work_starts_a_cpu_node_and_training_a_gpu_node(name):
    """Ray's own scheduler picks the node types to launch: Ray Data's CPU tasks (prepare-data as a
    job; the head offers no CPU) get the CPU type, a training worker an 8-GPU type."""
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for
    from test_autoscaling_sim import aws_worker_types, gcp_worker_types

    raw = yaml.safe_load((CLUSTER / name).read_text())
    resources = aws_worker_types() if name.startswith("aws") else gcp_worker_types()
    types = {t: {"resources": resources[t], "max_workers": n["max_workers"]}
             for t, n in raw["available_node_types"].items() if t != raw["head_node_type"]}  # fmt: skip
    (cpu,) = [t for t, r in resources.items() if not r.get("GPU")]

    # What the autoscaler's scheduler passes: no launch failures seen.
    scorer = functools.partial(_default_utilization_scorer, node_availability_summary=NodeAvailabilitySummary({}))

    def launched(demand):
        added, left = get_nodes_for(types, {}, raw["head_node_type"], 10, demand, scorer)
        assert not left
        return set(added)

    assert launched([{"CPU": 1}] * 40) == {cpu}
    assert launched([{"CPU": 8, "GPU": 1, "accelerator_type:H100": 0.001}] * 8) == {"gpu_h100_8x"}


def test_the_rayjob_code_zip_holds_the_entrypoint_whatever_the_checkout_is_called(tmp_path):
    """The manifest header's `git archive` line, run in the repository, packs a zip that Ray's
    own unpacking (a remote working_dir) turns into a directory with the job's config and package."""
    from ray._private.runtime_env.packaging import unzip_package

    header = [ln.removeprefix("#").strip() for ln in (CLUSTER / "kuberay-rayjob.yaml").read_text().splitlines()]
    argv = shlex.split(next(ln for ln in header if ln.startswith("git archive ")).split("#")[0])
    zip_name = argv[argv.index("-o") + 1]
    argv[argv.index("-o") + 1] = str(tmp_path / zip_name)
    subprocess.run(argv, cwd=ROOT, check=True, timeout=60)
    doc = yaml.safe_load((CLUSTER / "kuberay-rayjob.yaml").read_text())["spec"]
    working_dir = yaml.safe_load(doc["runtimeEnvYAML"])["working_dir"]
    assert working_dir.endswith(f"/{zip_name}")
    assert not [ln for ln in header if ln.startswith(("git ", "aws ", "zip ", "cd ")) and ".." in ln], (
        "no parent folder"
    )
    assert any(ln.startswith("aws s3 cp ") and ln.split()[3:5] == [zip_name, working_dir] for ln in header)
    unzip_package(str(tmp_path / zip_name), str(tmp_path / "wd"), remove_top_level_directory=True, unlink_zip=False)
    entry = doc["entrypoint"].split()
    assert (tmp_path / "wd" / entry[entry.index("train") + 1]).is_file()
    assert (tmp_path / "wd" / "raytrain_hybrid" / "cli.py").is_file()


def test_the_gpu_runtime_env_names_the_projects_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((ROOT / "jobs" / "runtime_env_gpu.yaml").read_text())["pip"]["packages"]
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", (CLUSTER / "Dockerfile").read_text(), re.M).group(1)
    assert sorted(env) == sorted([f"torch=={torch}", *(d for d in project if not d.startswith(("torch", "ray")))])


# examples/: one quick start, the 8-GPU fine-tune, the dataset snippet.


def test_one_quick_start_and_its_job_file_differ_only_where_the_header_says():
    assert not (ROOT / "examples" / "llama_3d.toml").exists()
    default, job = load_config(None), load_config(ROOT / "jobs" / "local_3d.toml")
    differ = {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(default)
        for f in dataclasses.fields(getattr(default, s.name))
        if getattr(getattr(default, s.name), f.name) != getattr(getattr(job, s.name), f.name)
    }
    assert differ == {"model.num_kv_heads", "train.steps", "run.output_dir"}
    header = (ROOT / "jobs" / "local_3d.toml").read_text()
    assert "2 key/value heads" in header and "10 steps" in header and "`raytrain-hybrid train` with no config" in header


def test_the_8gpu_finetune_example_checks_once_its_paths_are_filled_in():
    path = ROOT / "examples" / "finetune_8gpu.toml"
    assert placeholder_keys(path) == {"model.pretrained", "data.path"}
    cfg = load_config(path, [f"model.pretrained={STAND_IN_MODEL}", f"data.path={CHAT}"])
    assert cfg.parallelism.layout == "auto" and cfg.train.dtype == "bfloat16" and cfg.data.format == "chat"
    assert cfg.cluster.use_gpu is True and cfg.cluster.gpus_per_node == 8 and cfg.parallelism.world_size == 8
    assert "://" not in cfg.run.output_dir and cfg.model.arch == "llama" and cfg.model.num_layers == 32
    # The planner prices it from the checkpoint's config.json; rh.check, which also makes the run's
    # plan, refuses the stand-in as train would: it is that config.json without the weights.
    from raytrain_hybrid.planner.hardware import load_hardware
    from raytrain_hybrid.planner.search import describe

    planner = describe(cfg, load_hardware("h100"))
    assert "8 ranks" in planner and "(fits)" in planner, planner
    with pytest.raises(rh.ConfigError, match=r"has no \*\.safetensors weights next to config\.json"):
        rh.check(cfg, topology=[8], hardware="h100")
    header = path.read_text()
    for key in ("model.pretrained", "data.path"):
        assert f"--set {key}=" in header  # the header's commands fill both


def _snippet():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_dataset_to_chat", ROOT / "examples" / "hf_dataset_to_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5"},  # Alpaca
    {"instruction": "Translate.", "input": "bonjour", "output": "hello"},
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello."},
        ]
    },  # ShareGPT  # fmt: skip
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"question": "Capital of France?", "answer": "Paris"},
]


def test_the_dataset_snippet_writes_chat_rows_the_trainer_reads(tmp_path):
    from raytrain_hybrid.data.chat import _checked_messages

    snippet = _snippet()
    table = snippet.to_table(ROWS)
    assert table.schema.field("messages").type == snippet.MESSAGES
    rows = table.column("messages").to_pylist()
    for row in rows:
        _checked_messages(row, "data.messages_column")  # the trainer's own row check
    assert rows[1][0] == {"role": "user", "content": "Translate.\n\nbonjour"}
    assert [m["role"] for m in rows[2]] == ["system", "user", "assistant"]
    with pytest.raises(ValueError, match="no messages, conversations"):
        snippet.to_table([{"text": "a document"}])
    # As a user runs it on a local file (no `datasets`, no network).
    source = tmp_path / "alpaca.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    out = tmp_path / "chat.parquet"
    done = subprocess.run([sys.executable, "examples/hf_dataset_to_chat.py", str(source), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "(2 conversations)" in done.stdout, done.stderr
    assert pq.read_table(out).column("messages").to_pylist() == rows[:2]
    cfg = load_config(None, [f"model.pretrained={STAND_IN_MODEL}", f"data.path={out}", "data.format=chat"])
    assert cfg.data.messages_column in pq.read_schema(out).names


# notebooks/: the public API, saved with what a reader sees.


@pytest.mark.parametrize("name", ["quick_start.ipynb", "layout_explorer.ipynb", "sweep_analysis.ipynb"])
def test_a_notebook_is_saved_with_its_outputs(name):
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    outputs = [o for c in code for o in c["outputs"]]
    assert all(c["execution_count"] for c in code), "every cell ran"
    assert any("image/png" in o.get("data", {}) for o in outputs), "a plot a reader sees without running it"
    assert not [o for o in outputs if o["output_type"] == "error" or o.get("name") == "stderr"]
    assert (ROOT / "notebooks" / name).stat().st_size < 300_000
    source = "".join("".join(c["source"]) for c in code)
    assert "from raytrain_hybrid.config" not in source and "from raytrain_hybrid.launch" not in source
    if name != "sweep_analysis.ipynb":  # (that one reads a sweep.json only)
        assert "import raytrain_hybrid as rh" in source
