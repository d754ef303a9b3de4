"""parallelism.layout = "auto" without Ray: `check` asks the planner for the best layout of the
nodes given by --topology (workers each node holds) and prints it with the runner-up and why;
refused input names the key and a fix. On a live cluster: tests/test_storage_ray.py (a resume on
the session's one CPU node) and tests/test_topology_ray.py (`check` on three one-GPU nodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.plan.autolayout import node_slots

# A Llama-7B-sized model on 80 GB H100s (the planner prices it; nothing is built).
BIG = ["model.num_layers=32", "model.hidden_size=4096", "model.num_heads=32", "model.seq_len=4096",
       "model.vocab_size=32000", "train.global_batch_size=64", "data.path=memory",
       "parallelism.layout=auto", "parallelism.dp=8"]  # fmt: skip


def _check(capsys, overrides, *args):
    code = cli.main(["check", *[a for o in overrides for a in ("--set", o)], *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _picked(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("layout auto: dp="))


def test_two_clusters_get_two_layouts_each_printed_with_the_runner_up(capsys):
    """Four nodes of one GPU: a 7B model fits one GPU a replica only with its states sharded over
    dp (ZeRO); one node of eight: eight replicas. Each pick names the runner-up and what it loses on."""
    code, four, _ = _check(capsys, BIG, "--topology", "1,1,1,1")
    assert code == 0, four
    code, eight, _ = _check(capsys, BIG, "--topology", "8")
    assert code == 0, eight
    assert _picked(four) != _picked(eight)
    assert "dp=4 tp=1 pp=1" in _picked(four) and "on nodes holding [1, 1, 1, 1] workers" in four, four
    assert "dp=8 tp=1 pp=1" in _picked(eight) and "H100-80GB SXM" in eight, eight
    for out in (four, eight):
        assert "layout auto: runner-up dp=" in out and "slower (most of it" in out, out
        assert "layout ok: dp=" in out  # then the usual check of the pick, placement included
    assert "layout ok: dp=4 tp=1 pp=1 on 4 node(s) [1, 1, 1, 1]" in four, four


def test_a_pick_keeps_dp_within_parallelism_dp_and_leaves_a_cpu_for_ray_data():
    cfg = load_config(None, [*BIG[:-1], "parallelism.dp=2", "data.path=builtin", "cluster.use_gpu=true"])
    # GPUs with a CPU each and no other CPU: a worker gives up its node's CPU to Ray Data's reads.
    assert node_slots(cfg, [{"CPU": 4, "GPU": 4}], True) == [3]
    assert node_slots(cfg, [{"CPU": 5, "GPU": 4}, {"CPU": 1, "GPU": 1}], True) == [4, 1]
    from raytrain_hybrid.launch.plan.autolayout import choose_layout
    from raytrain_hybrid.launch.plan.reach import Reach

    picked = choose_layout(cfg, lambda line: None, Reach([{"CPU": 9, "GPU": 8}]), True)[0].parallelism
    assert picked.dp <= 2 and picked.layout == "auto"


BAD = {
    "no cluster": ([], (), "RAY_ADDRESS"),
    "nothing fits": (
        ["model.hidden_size=65536", "model.num_heads=64"],
        ("--topology", "1"),
        "no layout of at most dp=8",
    ),
    # Elastic (min_dp): Ray is asked for whole replicas of the configured tp*pp=4; one GPU holds none.
    "elastic, too few": (
        ["parallelism.min_dp=1"],
        ("--topology", "1"),
        "hold none of the worker counts [4, 8, 16, 32]",
    ),
    "unknown": (["parallelism.layout=best"], ("--topology", "1"), "must be one of {auto, fixed}"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_layout_auto_is_refused_naming_key_and_fix(capsys, monkeypatch, name):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if name == "no cluster":  # as in a shell with no cluster, though the suite's Ray runs in this process
        import ray

        monkeypatch.setattr(ray, "is_initialized", lambda: False)
    extra, args, fix = BAD[name]
    code, _, err = _check(capsys, [*BIG, *extra], *args)
    assert code == 2 and "parallelism.layout=" in err and fix in err, err
    if name == "unknown":
        with pytest.raises(ConfigError) as exc:
            load_config(None, ["parallelism.layout=best"])
        assert exc.value.key == "parallelism.layout"


def test_check_json_of_the_pick(capsys):
    code, out, err = _check(capsys, BIG, "--topology", "8", "--json")
    assert code == 0 and "layout auto: dp=8" in err  # the pick's lines on stderr: stdout is the JSON
    got = json.loads(out)
    assert len(got["ranks"]) == 8 and got["dp_values"] == [8]


def test_check_of_an_elastic_auto_run_shows_the_first_starts_pick_and_its_dp_values(capsys):
    """With min_dp, layout=auto picks at every start for the workers Ray started (whole replicas of
    the configured tp*pp=4): `check` shows the first start's pick for the nodes given, checks it,
    and lists the counts a start may have. Two clusters, two picks."""
    elastic = [*BIG, "parallelism.min_dp=1"]
    code, two, _ = _check(capsys, elastic, "--topology", "8,8")
    assert code == 0, two
    code, small, _ = _check(capsys, elastic, "--topology", "2,2,2")
    assert code == 0, small
    assert "the first, as Ray will likely place 16:" in two and "the first, as Ray will likely place 4:" in small
    assert "for the 16 workers started on nodes holding [8, 8] (H100-80GB SXM)" in _picked(two), two
    assert "for the 4 workers started on nodes holding [2, 2] (H100-80GB SXM)" in _picked(small), small
    assert _picked(two).split(" for ")[0] != _picked(small).split(" for ")[0]
    for out in (two, small):
        assert "layout auto: runner-up dp=" in out, out
        assert "elastic: dp in {1, 2, 4, 8} (4 workers a replica): dp=1: 4 workers, dp=2: 8 workers" in out, out
    picked = _picked(small).split()[2:5]  # ['dp=4', 'tp=1', 'pp=1']
    assert f"layout ok: {' '.join(picked)} on 2 node(s) [2, 2]" in small, small


# A `ray up` head's view: the shipped GCP config as the autoscaler reads it (its node types declare
# their resources; `ray up` fills in those an AWS type leaves to the instance type), the head up.
HEAD = {"CPU": 0.0, "node:__internal_head__": 1.0}
H100_NODE = {"CPU": 208.0, "GPU": 8.0, "accelerator_type:H100": 1.0}


ROOT = Path(__file__).resolve().parent.parent
# A GPU profile on which a tiny model's compute dominates its step (H100's is all latency), so that
# more GPUs win: priced on it, a fixed layout=auto run picks the most its cluster may reach.
SLOW_GPU = ROOT / "tests" / "assets" / "slow-gpu.json"
TINY_AUTO = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
             "model.ffn_hidden_size=128", "model.vocab_size=4096", "model.seq_len=32", "train.dtype=float32",
             "data.path=memory", "parallelism.layout=auto"]  # fmt: skip


def _gcp() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "cluster_configs" / "gcp-gpu.yaml").read_text())


def test_the_autoscaler_may_add_each_type_up_to_its_max_and_the_cluster_up_to_its_own():
    from raytrain_hybrid.launch.plan.reach import may_add

    config = _gcp()
    assert config["max_workers"] == 16 and config["available_node_types"]["gpu_h100_8x"]["max_workers"] == 8
    added = may_add(config, [HEAD])
    assert {name: n for name, (n, _) in added.items()} == {"gpu_h100_8x": 8, "gpu_a100_8x": 8}
    assert added["gpu_h100_8x"][1] == H100_NODE
    # A live H100 node counts against its type and the cluster; cluster.accelerator_type keeps its type only.
    assert {name: n for name, (n, _) in may_add(config, [HEAD, {**H100_NODE, "memory": 1e12}], "H100").items()} == {
        "gpu_h100_8x": 7
    }
    # The cluster's max_workers binds first: the types with the most GPUs, then CPUs, get the room.
    config["max_workers"] = 3
    assert {name: n for name, (n, _) in may_add(config, [HEAD, H100_NODE]).items()} == {"gpu_h100_8x": 2}
    assert may_add(config, [HEAD], "B200") == {}


def test_a_fixed_auto_pick_is_for_the_most_the_autoscaler_may_reach(monkeypatch):
    """A cluster whose live nodes hold no worker (an autoscaler's CPU-only head) and whose autoscaler
    may add two nodes of two GPUs: the pick uses both (on a profile where compute dominates, more GPUs
    win), says the nodes it waits for and what the live nodes alone would take; with nothing to add
    the same cluster is refused, naming the fix."""
    from raytrain_hybrid.launch.plan.autolayout import choose_layout
    from raytrain_hybrid.launch.plan.reach import Reach

    monkeypatch.setenv("RAYTRAIN_HYBRID_HARDWARE", str(SLOW_GPU))
    cfg = load_config(None, [*TINY_AUTO, "parallelism.dp=2"])
    said: list[str] = []
    two = {"gpu_2x": (2, {"CPU": 2.0, "GPU": 2.0})}
    picked, hw = choose_layout(cfg, said.append, Reach([HEAD], two, "~/ray_bootstrap_config.yaml"), True)
    par = picked.parallelism
    assert (par.dp, par.tp, par.pp) == (2, 2, 1) and hw.name == "slow GPU", said
    assert said[0] == (
        "layout auto: the autoscaler may add 2 x gpu_2x {'CPU': 2.0, 'GPU': 2.0} (max_workers in "
        "~/ray_bootstrap_config.yaml): picking for the most the cluster may reach"
    )
    assert (
        said[1].startswith("layout auto: dp=2 tp=2 pp=1 ") and "on nodes holding [2, 2] workers (slow GPU)" in said[1]
    )
    assert said[-1] == "layout auto: the live nodes alone hold no layout yet (workers a node: [])"
    # One node of the two up: alone it would take two replicas of one GPU.
    said.clear()
    one_up = Reach([HEAD, {"CPU": 2.0, "GPU": 2.0}], {"gpu_2x": (1, {"CPU": 2.0, "GPU": 2.0})}, "f")
    assert choose_layout(cfg, said.append, one_up, True)[0].parallelism.tp == 2
    assert said[-1].startswith("layout auto: the live nodes alone would take dp=2 tp=1 pp=1 "), said
    with pytest.raises(ConfigError, match="no layout of at most dp=2 fits nodes holding"):
        choose_layout(cfg, said.append, Reach([HEAD]), True)


def test_check_of_a_fixed_layout_places_it_on_the_nodes_the_autoscaler_may_add(capsys, monkeypatch):
    """`check` through RAY_ADDRESS on a head whose autoscaler may add two nodes of two GPUs (its reach
    stubbed: tests/test_autoscaling_sim.py reads a real one): a layout of four workers is placed on
    the nodes to come, as `train` would ask for them; one of eight is refused, saying so."""
    import ray

    from raytrain_hybrid.launch.plan import reach

    two = {"gpu_2x": (2, {"CPU": 2.0, "GPU": 2.0})}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    monkeypatch.setattr(reach, "cluster_reach", lambda *a: reach.Reach([HEAD], two, "~/ray_bootstrap_config.yaml"))
    fits = ["data.path=memory", "parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=1"]
    code, out, err = _check(capsys, fits)
    assert code == 0, err
    assert "placement: the autoscaler may add 2 x gpu_2x {'CPU': 2.0, 'GPU': 2.0} (max_workers in " in out, out
    assert "layout ok: dp=2 tp=2 pp=1 on 2 node(s) [2, 2]" in out, out
    code, out, err = _check(capsys, [*fits[:-1], "parallelism.pp=2"])
    # Fewer GPUs than workers: with cluster.use_gpu unset they would be CPU workers, which no node holds either.
    assert code == 2 and "cannot hold 8 workers of {'CPU': 1.0} with the nodes its autoscaler may add" in err, err


def test_the_autoscaler_config_is_read_on_the_head_of_a_joined_cluster_only(monkeypatch, tmp_path):
    """Where `ray up` puts it (JSON in ~/ray_bootstrap_config.yaml); not for a private local Ray or
    a driver off the head (another cluster's file, if any); a file not in Ray's format is said, and
    the pick is for the live nodes."""
    from raytrain_hybrid.launch.plan import placement, reach

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(placement, "live_node_totals", lambda: [HEAD])
    on_head = [True]
    monkeypatch.setattr(reach, "_on_head", lambda: on_head[0])
    config = {"max_workers": 2, "head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 0}, "max_workers": 0},
        "gpu_2x": {"resources": {"CPU": 2, "GPU": 2}, "min_workers": 0, "max_workers": 4}}}  # fmt: skip
    assert reach.cluster_reach(True) == reach.Reach([HEAD])  # no file
    (tmp_path / "ray_bootstrap_config.yaml").write_text(json.dumps(config))
    got = reach.cluster_reach(True)
    assert got.added == {"gpu_2x": (2, {"CPU": 2.0, "GPU": 2.0})} and got.source == "~/ray_bootstrap_config.yaml"
    assert len(got.nodes) == 3
    assert reach.cluster_reach(False).added == {}  # a private local Ray
    on_head[0] = False
    assert reach.cluster_reach(True).added == {}
    on_head[0] = True
    (tmp_path / "ray_bootstrap_config.yaml").write_text("available_node_types: [not, a, mapping]\n")
    broken = reach.cluster_reach(True)
    assert broken.added == {} and broken.said() == [
        "~/ray_bootstrap_config.yaml unreadable (AttributeError: 'list' object has no attribute 'items'); "
        "picking for the live nodes"
    ]


def test_a_raycluster_without_its_autoscaler_adds_nothing_and_one_out_of_reach_is_said(monkeypatch):
    """On a KubeRay head (its pod's variables): in-tree autoscaling off, the live nodes are all there
    is; a RayCluster the API refuses (403: the head's account may not read it) is said, and the pick
    is for the live nodes. The RayCluster read as the API returns it: tests/test_reach_kuberay.py."""
    import requests
    import yaml
    from ray.autoscaler._private.kuberay.node_provider import KubernetesHttpApiClient

    from raytrain_hybrid.launch.plan import placement, reach

    manifest = yaml.safe_load(
        (Path(__file__).parent.parent / "cluster_configs" / "kuberay-raycluster.yaml").read_text()
    )
    manifest["metadata"]["namespace"] = "team-a"
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/ray_bootstrap_config.yaml
    monkeypatch.setenv("RAY_CLUSTER_NAME", "raytrain-hybrid")
    monkeypatch.setenv("RAY_CLUSTER_NAMESPACE", "team-a")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setattr(placement, "live_node_totals", lambda: [HEAD])
    monkeypatch.setattr(reach, "_on_head", lambda: True)
    asked = []

    def get(client, path):
        asked.append((client._namespace, path))
        if answer := answers.pop(0):
            return answer
        response = requests.Response()
        response.status_code, response.url, response.reason = 403, "https://10.0.0.1/" + path, "Forbidden"
        response.raise_for_status()

    monkeypatch.setattr(KubernetesHttpApiClient, "get", get)
    answers = [manifest, {**manifest, "spec": {**manifest["spec"], "enableInTreeAutoscaling": False}}, None]
    got = reach.cluster_reach(True, "H100")
    assert {name: n for name, (n, _) in got.added.items()} == {"gpu-h100-8x": 8}, got
    assert got.said()[0].endswith("(maxReplicas in RayCluster team-a/raytrain-hybrid)"), got.said()
    assert reach.cluster_reach(True, "H100") == reach.Reach([HEAD])  # autoscaling off: nothing said
    refused = reach.cluster_reach(True, "H100")
    assert refused.added == {} and refused.said() == [
        "RayCluster team-a/raytrain-hybrid unreadable (HTTPError: 403 Client Error: Forbidden for url: "
        "https://10.0.0.1/rayclusters/raytrain-hybrid); picking for the live nodes"
    ], refused.said()
    assert asked == [("team-a", "rayclusters/raytrain-hybrid")] * 3
