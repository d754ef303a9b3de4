"""Bad input, entered as a user does (the CLI, real files): non-finite numbers, credentials in a
URI, export and prepare-data outputs that are files, object storage or not empty, and the private
cache directory. Each is refused with exit 2 naming the key or file, and changes nothing."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
import typing
from pathlib import Path

import pytest
from s3_server import s3_server

from raytrain_hybrid import cli
from raytrain_hybrid.config import Config, load_config
from raytrain_hybrid.errors import ConfigError

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLEKEY"  # raw, with the "/" and "+" real keys hold
CRED_URI = f"s3://AKIAEXAMPLEKEYID:{SECRET}@bucket/x"
TINY = [
    "parallelism.dp=1",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "parallelism.microbatches=1",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.seq_len=16",
    "train.global_batch_size=2",
    "train.steps=2",
    "data.path=memory",
    "checkpoint.interval=2",
    "checkpoint.async_save=false",
]


def _float_keys() -> list[str]:
    """Every key of the schema that takes a float (or a list of them)."""
    out = []
    for section, cls in typing.get_type_hints(Config).items():
        for name, hint in typing.get_type_hints(cls).items():
            if hint is float or hint == list[float]:
                out.append(f"{section}.{name}")
    return out


# --- 1. non-finite numbers ---------------------------------------------------------------------


def test_every_float_key_refuses_nan_and_inf_naming_the_key():
    keys = _float_keys()
    assert {"train.grad_clip", "train.lr", "model.class_weights", "run.startup_timeout_s"} <= set(keys)
    for key in keys:
        for text in ("nan", "inf", "-inf", "1e999"):
            with pytest.raises(ConfigError, match=rf"^{key}=.*finite") as err:
                load_config(None, [f"{key}={text}"])
            assert err.value.key == key


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf", "+nan"])
def test_toml_nan_and_inf_literals_are_refused_by_the_cli(tmp_path, capsys, literal):
    path = tmp_path / "run.toml"
    path.write_text(f"[train]\ngrad_clip = {literal}\n")
    before = path.read_bytes()
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.grad_clip=" in err and "finite" in err, err
    assert path.read_bytes() == before


def test_set_grad_clip_nan_is_refused_before_training(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--set", "train.grad_clip=nan", "--set", f"run.output_dir={out}"]) == 2
    assert "train.grad_clip='nan': must be a finite number" in capsys.readouterr().err
    assert not out.exists()


# --- 2. credentials in a URI -------------------------------------------------------------------


@pytest.mark.parametrize("key", ["run.output_dir", "data.path", "data.val_path", "model.pretrained", "data.tokenizer"])
def test_a_uri_with_credentials_is_refused_at_load_without_echoing_them(tmp_path, capsys, key):
    assert cli.main(["check", "--set", f"{key}={CRED_URI}"]) == 2
    err = capsys.readouterr().err
    assert f"{key}='s3://***@bucket/x': holds credentials" in err, err
    assert SECRET not in err and "AKIAEXAMPLEKEYID" not in err and SECRET.split("/")[0] not in err
    # The same from a config file, and in a key that is not one (the misspelt key is named, not shown).
    path = tmp_path / "run.toml"
    section, name = key.split(".")
    path.write_text(f'[{section}]\n{name} = "{CRED_URI}"\nbogus = "{CRED_URI}?token=abc"\n')
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "***" in err and SECRET not in err and "abc" not in err.split("***")[-1], err


def test_secret_query_parameters_are_refused_and_redacted(capsys):
    uri = "https://host/data.parquet?X-Amz-Credential=AKIDX&X-Amz-Signature=deadbeefcafe"
    assert cli.main(["check", "--set", f"data.path={uri}"]) == 2
    err = capsys.readouterr().err
    assert "X-Amz-Signature=***" in err and "deadbeefcafe" not in err and "AKIDX" not in err, err


def test_cli_locations_outside_the_config_are_refused_without_echoing_them(tmp_path, capsys, monkeypatch):
    import ray

    started: list = []  # nothing may start or join Ray for a refused location
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    monkeypatch.chdir(tmp_path)
    commands = {
        "--resume": ["train", "--resume", CRED_URI, "--set", f"run.output_dir={tmp_path / 'run'}"],
        "CHECKPOINT": ["export", CRED_URI, str(tmp_path / "out")],
        "OUT_DIR": ["export", str(tmp_path), CRED_URI],
        "prepare-data OUT_DIR": ["prepare-data", str(tmp_path), CRED_URI],
        "sweep --out": ["sweep", "--world-size", "8", "--out", CRED_URI],
    }
    for key, argv in commands.items():
        if argv[0] == "prepare-data":
            monkeypatch.setattr("raytrain_hybrid.launch.runtime.session.join_ray", lambda *a, **k: None)
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{key}='s3://***@bucket/x': holds credentials" in err, err
        assert SECRET not in err and "AKIAEXAMPLEKEYID" not in err
    assert started == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused command left files behind"


# Shapes that made the credential patterns quadratic (40,000 letters took 1.2 s here and 11.6 s on
# the reporter's machine; 200,000 take 25 times that): runs of scheme characters, a "?" before a
# long name, "://" over and over, many parameters.
SLOW_SHAPES = {
    "letters": "a" * 200_000,
    "query name": "?" + "x" * 200_000,
    "schemes": "a://" * 50_000,
    "schemes with colons": "a://a:" * 35_000,
    "user-info without @": "s3://" + "a:" * 100_000,
    "parameters": "&x=" * 70_000,
    "secret parameters": "?token=a;" * 25_000,
    "megabyte": "s3://b/" + "a/?k" * 250_000,
}


@pytest.mark.parametrize("shape", list(SLOW_SHAPES))
def test_credential_matching_takes_time_linear_in_the_length(shape):
    """A value or message of any shape is looked at in well under a second of CPU (counted for this
    process alone, so that a busy machine does not fail it; quadratic matching took 30 s on these)."""
    import time

    from raytrain_hybrid.errors import has_credentials, redact

    text = SLOW_SHAPES[shape]
    start = time.process_time()
    has_credentials(text)
    redact(text)
    ConfigError("run.output_dir", text, "refused")
    assert time.process_time() - start < 1.0, shape


def test_a_value_longer_than_any_the_trainer_takes_is_refused_by_its_length(tmp_path, capsys):
    import time

    path = tmp_path / "run.toml"
    path.write_text('[data]\npath = "s3://b/x?token=hunter2x&' + "a" * 200_000 + '"\n')
    start = time.process_time()
    assert cli.main(["check", str(path)]) == 2
    assert time.process_time() - start < 5.0
    err = capsys.readouterr().err
    assert "data.path='<200,024 characters>': is longer than any value" in err and len(err) < 400, err


def test_check_with_a_60000_character_output_dir_is_quick(tmp_path, capsys):
    import time

    start = time.process_time()
    assert cli.main(["check", "--set", f"run.output_dir={tmp_path}/" + "a" * 60_000]) in (0, 2)
    assert time.process_time() - start < 5.0  # was 100 s
    capsys.readouterr()


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket/data?api_key=hunter2x",
        "https://host/x?apikey=hunter2x",
        "https://host/x?auth=hunter2x",
        "https://host/x?private_key=hunter2x",
        "https://host/x?pwd=hunter2x",
        "https://host/x?Authorization=hunter2x",
        "https://host/x#token=hunter2x",
        "https://host/x;token=hunter2x",
        "https://host/x#access_token=hunter2x&state=1",
        "https://ghp_hunter2xhunter2xhunter2x1234@github.com/org/repo",
    ],
)
def test_more_secret_parameters_are_refused_without_echoing_them(capsys, uri):
    assert cli.main(["check", "--set", f"data.path={uri}"]) == 2
    err = capsys.readouterr().err
    assert "data.path=" in err and "holds credentials" in err and "***" in err, err
    assert "hunter2x" not in err, err


def test_errors_the_cli_prints_are_redacted(tmp_path, capsys, monkeypatch):
    """A refusal that is not a ConfigError, and a failed run whose error (Ray's, pyarrow's)
    quotes a URI, are printed without its credentials."""
    from raytrain_hybrid.errors import LayoutError

    leaky = "s3://bucket/data?api_key=hunter2x failed: Authorization: Bearer hunter2x"

    def refuse(*args, **kwargs):
        raise LayoutError(leaky)

    monkeypatch.setattr(cli, "_check", refuse)
    assert cli.main(["check"]) == 2
    err = capsys.readouterr().err
    assert "hunter2x" not in err and "api_key=***" in err, err

    def fail(*args, **kwargs):
        raise RuntimeError(leaky)

    monkeypatch.setattr("raytrain_hybrid.launch.runtime.driver.run", fail)
    assert cli.main(["train", "--verbose", "--set", f"run.output_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err
    assert "training failed" in err and "hunter2x" not in err, err


def test_lines_the_driver_prints_during_a_run_are_redacted(tmp_path):
    import io

    from raytrain_hybrid.launch.records.progress import RunLog

    stream = io.StringIO()
    log = RunLog(tmp_path, steps=2, progress=True, tensorboard=False, stream=stream)
    log._say("restart 1: worker died reading s3://AKIAX:hunter2x@bucket/data?token=hunter2x")
    log.file.close()
    assert "hunter2x" not in stream.getvalue() and "s3://***@bucket" in stream.getvalue()


def test_an_authorization_header_in_a_message_is_redacted():
    from raytrain_hybrid.errors import redact

    assert redact("GET s3://b/x failed: Authorization: Bearer SECRET (403)") == (
        "GET s3://b/x failed: Authorization: *** (403)"
    )


@pytest.mark.parametrize(
    "uri", ["hdfs://user@namenode:8020/data", "ssh://git@github.com/org/repo", "s3://b/x?author=me"]
)
def test_a_user_without_a_secret_is_not_refused(uri):
    from raytrain_hybrid.errors import has_credentials, redact

    assert not has_credentials(uri) and redact(uri) == uri


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    """A short run that saves a checkpoint (the engine's workers as gloo processes, no Ray), with
    every secret a cloud run has in its environment; and a run tracked in MLflow from that env."""
    from gloo_harness import run_gloo

    secrets = {
        "AWS_SECRET_ACCESS_KEY": "aws-secret-never-written-1",
        "HF_TOKEN": "hf_tokenneverwritten2",
        "WANDB_API_KEY": "wandb-key-never-written-3",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-password-never-written-4",
    }
    root = tmp_path_factory.mktemp("secret_run")
    run_gloo([*TINY, f"run.output_dir={root / 'run'}"], env=secrets)
    return root, secrets


def test_secrets_in_the_environment_never_land_in_what_a_run_writes(secret_run, monkeypatch):
    from raytrain_hybrid.launch.records.rundir import RunDir
    from raytrain_hybrid.launch.records.tracking import TrackedRun

    root, secrets = secret_run
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (root / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = load_config(None, [*TINY, f"run.output_dir={root / 'run'}", "run.tracking=mlflow"])
    # The driver's files: config.json (the config as the driver writes it) and the tracker's params.
    run_dir = RunDir.open(cfg.run.output_dir)
    (run_dir.local / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    tracked = TrackedRun()
    tracked.open(cfg)
    tracked.finish({"steps": 2, "final_loss": 1.0})
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in files) and any(p.parent.name == "params" for p in files)
    for path in files:
        data = path.read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in data, f"{name} found in {path}"


# --- 3. export ---------------------------------------------------------------------------------


def test_export_to_object_storage_uploads_the_same_files_as_a_local_export(secret_run, tmp_path, capsys, monkeypatch):
    root, _ = secret_run
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "local"
    assert cli.main(["export", str(root / "run"), str(local)]) == 0
    with s3_server() as env:
        import pyarrow.fs as pafs

        assert cli.main(["export", str(root / "run"), "s3://bucket/exported/model"]) == 0
        assert "wrote s3://bucket/exported/model" in capsys.readouterr().out
        fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"])
        infos = fs.get_file_info(pafs.FileSelector("bucket/exported/model"))
        uploaded = {}
        for info in infos:
            with fs.open_input_stream(info.path) as f:
                uploaded[info.base_name] = f.read()
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(uploaded)
        assert uploaded == {p.name: p.read_bytes() for p in local.iterdir()}
        # A second export there is refused: the directory is not empty.
        assert cli.main(["export", str(root / "run"), "s3://bucket/exported/model"]) == 2
        assert "OUT_DIR='s3://bucket/exported/model': exists and is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"], "no local folder named s3: or a stage"


def test_export_onto_a_file_is_refused_naming_it(secret_run, tmp_path, capsys):
    root, _ = secret_run
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"the user's own file")
    assert cli.main(["export", str(root / "run"), str(target)]) == 2
    assert f"OUT_DIR='{target}': is a file" in capsys.readouterr().err
    assert cli.main(["export", str(root / "run"), str(target / "sub")]) == 2
    assert f"cannot be made: {target} is a file" in capsys.readouterr().err
    assert target.read_bytes() == b"the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


# --- 4. prepare-data ---------------------------------------------------------------------------


def _prepare(capsys, source: Path, out: str) -> tuple[int, str]:
    code = cli.main(["prepare-data", str(source), out])
    return code, capsys.readouterr().err


def test_prepare_data_writes_its_marker_last_and_refuses_a_non_empty_output(ray_local, tmp_path, capsys, monkeypatch):
    import pyarrow.dataset as pads
    import ray.data

    source = tmp_path / "docs.txt"
    source.write_text("\n\n".join(f"document number {i} with a few words" for i in range(40)))
    out = tmp_path / "tokens"
    code, err = _prepare(capsys, source, str(out))
    assert code == 0, err
    marker = json.loads((out / "_SUCCESS").read_text())
    parquet = sorted(p for p in out.iterdir() if p.suffix == ".parquet")
    table = pads.dataset(str(out), format="parquet").to_table()  # readers skip the marker
    assert marker == {
        "rows": 40,
        "tokens": sum(table.column("num_tokens").to_pylist()),
        "files": [p.name for p in parquet],
    }
    assert table.num_rows == 40
    assert all((out / "_SUCCESS").stat().st_mtime_ns >= p.stat().st_mtime_ns for p in parquet)
    listing = sorted(p.name for p in out.iterdir())

    code, err = _prepare(capsys, source, str(out))  # a re-run: refused, nothing added
    assert code == 2 and f"prepare-data OUT_DIR='{out}': holds a finished prepare-data output" in err, err
    assert sorted(p.name for p in out.iterdir()) == listing

    # A run that dies after writing some shards leaves no marker; the directory is reported incomplete.
    crashed = tmp_path / "crashed"
    write = ray.data.Dataset.write_parquet

    def dies_after_writing(self, *args, **kwargs):
        write(self, *args, **kwargs)
        raise KeyboardInterrupt  # the process killed after the shards, before the marker

    monkeypatch.setattr(ray.data.Dataset, "write_parquet", dies_after_writing)
    assert cli.main(["prepare-data", str(source), str(crashed)]) == 130  # Ctrl-C: one line, exit 130
    assert capsys.readouterr().err.strip().endswith("interrupted (Ctrl-C)")
    monkeypatch.setattr(ray.data.Dataset, "write_parquet", write)
    assert not (crashed / "_SUCCESS").exists() and any(crashed.iterdir())
    code, err = _prepare(capsys, source, str(crashed))
    assert code == 2 and "holds an incomplete prepare-data output (no _SUCCESS" in err, err
    # A run on it is warned before any worker starts; a run on the finished output is not.
    from raytrain_hybrid.data.checks import schema_check

    for path, warned in ((crashed, True), (out, False)):
        notes: list[str] = []
        assert schema_check(load_config(None, [f"data.path={path}"]), say=notes.append) == 40
        assert (
            notes
            == [
                f"warning: data.path={path} holds prepare-data's columns but no _SUCCESS: the "
                "prepare-data that wrote it may have stopped part-way (rows missing); prepare it "
                "again into a new directory"
            ]
        ) == warned, notes

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    code, err = _prepare(capsys, source, str(tmp_path / "other"))
    assert code == 2 and f"prepare-data OUT_DIR='{tmp_path / 'other'}': is not empty" in err, err
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]
    code, err = _prepare(capsys, source, str(source))
    assert code == 2 and f"prepare-data OUT_DIR='{source}': is a file" in err, err

    with s3_server():  # on object storage too
        from raytrain_hybrid.storage import open_store

        open_store("s3://bucket/prep/old.parquet").write_bytes(b"an earlier output")
        code, err = _prepare(capsys, source, "s3://bucket/prep")
        assert code == 2 and "prepare-data OUT_DIR='s3://bucket/prep': holds an incomplete" in err, err
        assert open_store("s3://bucket/prep").listdir() == ["old.parquet"]


# --- 5. private cache directory ----------------------------------------------------------------


@pytest.fixture
def tmpdir_root(tmp_path, monkeypatch):
    """tempfile.gettempdir() pointed at a fresh directory (as TMPDIR would)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"raytrain-hybrid-{os.getuid()}"


def test_private_dir_is_made_0700_and_holds_the_caches(tmpdir_root, monkeypatch):
    from raytrain_hybrid.data import tokenizer
    from raytrain_hybrid.data.tokenizer import TokenizerFiles, load_hf_tokenizer
    from raytrain_hybrid.launch.records.rundir import mirror_dir
    from raytrain_hybrid.storage import private_dir

    where = private_dir("runs", "abc")
    assert where == tmpdir_root / "runs" / "abc" and where.is_dir()
    assert stat.S_IMODE(tmpdir_root.stat().st_mode) == 0o700
    with s3_server():
        assert mirror_dir("s3://bucket/run").parent == tmpdir_root / "runs"
    monkeypatch.setattr(tokenizer, "_HF_LOADED", {})  # as in a fresh worker
    bundle = TokenizerFiles.read("")  # the shipped BPE, rebuilt from its bytes
    load_hf_tokenizer(bundle)
    assert (tmpdir_root / "tokenizers" / bundle.digest / "tokenizer.json").is_file()


@pytest.mark.parametrize("plant", ["group-writable", "another user", "a link"])
def test_a_planted_cache_directory_is_refused_naming_it(tmpdir_root, tmp_path, capsys, plant):
    from raytrain_hybrid.storage import private_dir

    if plant == "a link":
        (tmp_path / "theirs").mkdir(mode=0o700)
        tmpdir_root.symlink_to(tmp_path / "theirs")
    else:
        tmpdir_root.mkdir(mode=0o700)
        if plant == "group-writable":
            os.chmod(tmpdir_root, 0o777)
        else:
            if os.getuid() != 0:
                pytest.skip("making a directory another user owns needs root")
            os.chown(tmpdir_root, 65534, 65534)
    with pytest.raises(ConfigError, match=rf"cache directory='{tmpdir_root}': "):
        private_dir("runs")
    # As a user meets it: a run writing to object storage mirrors its files there first.
    with s3_server():
        assert cli.main(["train", "--set", "run.output_dir=s3://bucket/run", "--set", "train.steps=1"]) == 2
    assert f"cache directory='{tmpdir_root}'" in capsys.readouterr().err
    assert not (tmpdir_root / "runs").exists() and not (tmp_path / "theirs" / "runs").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# --- 6. input nested deep, manifests that are not the trainer's, a cut-off metrics.jsonl -------------


@pytest.mark.parametrize(
    "body",
    [
        "x = " + "[" * 100_000 + "]" * 100_000,
        "x = " + "{a = " * 50_000 + "1" + "}" * 50_000,
        "x = " + "[" * 40 + "]" * 40,  # parses, but deeper than a config nests
    ],
    ids=["arrays 100,000 deep", "inline tables 50,000 deep", "arrays 40 deep"],
)
def test_a_config_nested_deep_is_refused_naming_the_file(tmp_path, capsys, body):
    path = tmp_path / "run.toml"
    path.write_text(f"[run]\n{body}\n")
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"config file='{path}'" in err and "nests arrays or tables deeper" in err and "Traceback" not in err


def test_a_set_key_nested_deep_is_refused(capsys):
    assert cli.main(["check", "--set", "a." * 100_000 + "b=1"]) == 2
    assert "is not a key: nests arrays or tables deeper" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint as a run writes it (tests/fuzz_files.py's: DCP shards and a manifest), no Ray."""
    from fuzz_files import make_checkpoint

    step = tmp_path_factory.mktemp("ckpt") / "run" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    return step, make_checkpoint(step)


FUZZ_TINY = [*TINY[:4], "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=4096"]
FUZZ_TINY += ["model.seq_len=16", "train.global_batch_size=1", "train.steps=4"]


def _planted(tiny_checkpoint, tmp_path, text: str) -> Path:
    import shutil

    source, _ = tiny_checkpoint
    step = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(source, step)
    (step / "manifest.json").write_text(text)
    return tmp_path / "run"


def _edited(manifest: dict, key: str, value) -> str:
    out = json.loads(json.dumps(manifest))
    if value is ...:
        del out[key]
    else:
        out[key] = value
    return json.dumps(out)


def _nested(manifest: dict, depth: int) -> str:
    """The manifest with a last key holding arrays nested ``depth`` deep (the text edited at its end:
    a config value may end in "0}" too)."""
    text = _edited(manifest, "extra", 0)
    assert text.endswith(', "extra": 0}'), text[-40:]
    return text[: -len("0}")] + "[" * depth + "]" * depth + "}"


MALFORMED = {
    "step Infinity": lambda m: _edited(m, "step", 0).replace('"step": 0', '"step": Infinity'),
    "size 1e400": lambda m: json.dumps(m).replace('"size": ', '"size": 1e400, "was": ', 1),
    'step "2"': lambda m: _edited(m, "step", "2"),
    "step -3": lambda m: _edited(m, "step", -3),
    "step 2.5": lambda m: _edited(m, "step", 2.5),
    "no config": lambda m: _edited(m, "config", ...),
    "nested 200,000 deep": lambda m: _nested(m, 200_000),
    "nested 40 deep": lambda m: _nested(m, 40),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_refused_by_export_and_resume_before_ray(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, case
):
    import ray

    started: list = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    run = _planted(tiny_checkpoint, tmp_path, MALFORMED[case](tiny_checkpoint[1]))
    manifest = run / "checkpoints" / "step_2" / "manifest.json"
    assert cli.main(["export", str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"CHECKPOINT='{run}': holds no intact checkpoint: step_2 has a manifest.json" in err, err
    assert "Traceback" not in err and not (tmp_path / "hf").exists()
    sets = [a for s in [*FUZZ_TINY, f"run.output_dir={tmp_path / 'out'}"] for a in ("--set", s)]
    assert cli.main(["train", "--resume", str(run), *sets]) == 2
    err = capsys.readouterr().err
    assert f"--resume='{run}': holds no intact checkpoint: step_2 has a manifest.json" in err, err
    assert "Traceback" not in err
    assert started == [] and manifest.exists()


def test_a_resume_says_which_later_checkpoint_it_passes_over(tiny_checkpoint, tmp_path, capsys):
    """A later checkpoint written whole (its manifest there) but damaged since is not chosen, and
    the resume says so rather than replacing it unsaid."""
    import shutil

    from fuzz_files import TINY

    run = _planted(tiny_checkpoint, tmp_path, json.dumps(tiny_checkpoint[1])).parent / "run"
    shutil.copytree(run / "checkpoints" / "step_2", run / "checkpoints" / "step_3")
    (run / "checkpoints" / "step_3" / "__0_0.distcp").write_bytes(b"x")
    sets = [a for s in [*TINY, f"run.output_dir={run}"] for a in ("--set", s)]
    assert cli.main(["check", "--resume", str(run), *sets]) == 0
    out = capsys.readouterr().out
    assert "resume: step_3 is later than step_2 but not intact; this run's save of its step replaces it" in out, out
    assert "resumed from " in out and out.count("checkpoints/step_2 at step 2") == 1


def test_a_cut_off_last_line_of_metrics_jsonl_is_left_out_on_resume(tmp_path):
    from raytrain_hybrid.launch.runtime.start import _metrics_lines
    from raytrain_hybrid.storage import as_store

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "loss": 9.1}\n{"step": 1, "loss": 8.7}\n{"step": 2, "lo\xc3')
    said: list[str] = []
    assert [h["step"] for h in _metrics_lines(as_store(path), said.append)] == [0, 1]
    assert len(said) == 1 and "cut off" in said[0]
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 2 is not a step's record"):
        _metrics_lines(as_store(path), said.append)


# --- 7. links planted in a run directory or a checkpoint --------------------------------------------


def test_files_a_run_writes_replace_a_planted_link_and_leave_its_target(tmp_path):
    """config.json, summary.json (written whole), metrics.jsonl (written as it goes), driver.log
    (copied in at each checkpoint and at the end) and files through the storage layer: a link
    planted at the name is replaced by the run's file, its target left as it was."""
    from raytrain_hybrid.launch.records.progress import RunLog, quiet_driver
    from raytrain_hybrid.launch.records.rundir import RunDir
    from raytrain_hybrid.launch.runtime.driver import write_config, write_results
    from raytrain_hybrid.storage import as_store

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "summary.json", "metrics.jsonl", "driver.log", "run.lease.json"):
        (run / name).symlink_to(victim)
    cfg = load_config(None, [f"run.output_dir={run}"])
    write_config(cfg, RunDir.open(str(run)))
    log = RunLog(run, steps=2, progress=False, tensorboard=False)
    driver_log = tmp_path / "live.log"
    driver_log.write_text("ray said\n")
    write_results(cfg, log, {}, RunDir.open(str(run)), driver_log, ended="failed")  # summary.json, driver.log
    log.file.close()
    as_store(run / "run.lease.json").write_text("{}")
    assert victim.read_text() == "precious\n"
    for name in ("config.json", "summary.json", "metrics.jsonl", "driver.log", "run.lease.json"):
        assert not (run / name).is_symlink() and (run / name).is_file(), name
    assert (run / "driver.log").read_text() == "ray said\n"
    # The CLI's driver.log, moved into the run at its end.
    (run / "driver.log").unlink()
    (run / "driver.log").symlink_to(victim)
    with quiet_driver(run / "driver.log") as (_, _, live):
        assert live is not None
    assert victim.read_text() == "precious\n" and not (run / "driver.log").is_symlink()


def test_a_shard_that_links_outside_the_checkpoint_is_refused(tiny_checkpoint, tmp_path, capsys):
    import shutil

    source, manifest = tiny_checkpoint
    step = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(source, step)
    shard = next(n for n in manifest["files"] if n.endswith(".distcp"))
    outside = tmp_path / "elsewhere.bin"
    (step / shard).rename(outside)  # the same bytes: sizes and digests match the manifest
    (step / shard).symlink_to(outside)
    assert cli.main(["export", str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"has {shard} as a link to {outside}, outside the checkpoint" in err, err
    assert not (tmp_path / "hf").exists()
    (step / shard).unlink()
    (step / shard).symlink_to(outside.rename(step / "beside.bin"))  # a link inside the checkpoint reads
    assert cli.main(["export", str(step), str(tmp_path / "hf")]) == 0, capsys.readouterr().err


def _rewritten(tiny_checkpoint, tmp_path, change) -> Path:
    """A copy of the tiny checkpoint changed by ``change(step)``, its manifest rewritten to match
    (as someone who can write the checkpoint can): only what the files say can refuse it."""
    import shutil

    from raytrain_hybrid.checkpoint.manifest import file_digest

    source, manifest = tiny_checkpoint
    step = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(source, step)
    change(step)
    manifest = {
        **manifest,
        "files": {p.name: file_digest(p) for p in sorted(step.iterdir()) if p.name != "manifest.json"},
    }
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


def _absurd_shape(step: Path) -> None:
    import pickle

    import torch

    from raytrain_hybrid.checkpoint.reader import parse_metadata

    md = parse_metadata((step / ".metadata").read_bytes())
    entry = next(iter(md.state_dict_metadata.values()))
    entry.size = torch.Size([1 << 40, 1 << 20])
    (step / ".metadata").write_bytes(pickle.dumps(md))


class _Payload:
    """What a planted pickle runs when unpickled without restriction."""

    def __init__(self, marker: Path, pad: int) -> None:
        self.marker, self.pad = marker, pad

    def __reduce__(self):  # (padded to the entry's length: as many bytes as the metadata's shape needs)
        return (os.system, (f"touch {self.marker} #{'x' * self.pad}",))


def _pickle_in_shard(step: Path) -> None:
    """A tensor entry of a shard replaced by a torch.save of an object whose unpickling runs a
    command (appended to the shard, the metadata pointed at it, as long as the entry was): only
    the shard's bytes say so."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from raytrain_hybrid.checkpoint.reader import parse_metadata

    md = parse_metadata((step / ".metadata").read_bytes())
    index, info = next((i, v) for i, v in md.storage_data.items() if v.relative_path == "__0_0.distcp")
    buf = io.BytesIO()
    torch.save(_Payload(step.parent.parent.parent / "marker", info.length), buf)
    shard = step / "__0_0.distcp"
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = _StorageInfo("__0_0.distcp", offset, len(buf.getvalue()))
    (step / ".metadata").write_bytes(pickle.dumps(md))


SHARD_MISFITS = {
    "a shard cut to nothing": (lambda step: (step / "__0_0.distcp").write_bytes(b""), "which holds 0"),
    "an absurd shape": (_absurd_shape, "more than its shards store"),
    "a pickle inside a shard": (_pickle_in_shard, "__0_0.distcp holds 'model."),
}


def test_a_manifest_that_describes_another_model_than_its_shards_is_refused_before_any_worker(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    """A manifest whose config was edited (model.hidden_size 32 -> 64) and a resume that asks for
    that model: the shards hold the 32-wide one, which `export`, `train --resume` and `check
    --resume` all say (exit 2) before Ray starts; a worker would fail loading it with a traceback."""
    import ray

    started: list = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))

    _, manifest = tiny_checkpoint
    wider = json.loads(json.dumps(manifest))
    wider["config"]["model"]["hidden_size"] = 64
    step = _planted(tiny_checkpoint, tmp_path, json.dumps(wider)) / "checkpoints" / "step_2"
    said = "its manifest.json describes model.embed_tokens.weight as [4096, 64], and the checkpoint holds [4096, 32]"
    assert cli.main(["export", str(step), str(tmp_path / "hf")]) == 2
    assert said in capsys.readouterr().err
    tiny = [s if s != "model.hidden_size=32" else "model.hidden_size=64" for s in FUZZ_TINY]
    tiny.append(f"model.ffn_hidden_size={manifest['config']['model']['ffn_hidden_size']}")  # (as the manifest)
    sets = [a for s in [*tiny, f"run.output_dir={tmp_path / 'out'}"] for a in ("--set", s)]
    for command in ("train", "check"):
        assert cli.main([command, "--resume", str(step), *sets]) == 2
        err = capsys.readouterr().err
        assert f"--resume='{step}': {said}" in err and "Traceback" not in err, err
    assert started == [] and not (tmp_path / "hf").exists()


def test_a_checkpoint_without_optimizer_state_is_refused_by_a_resume_and_exported(tmp_path, capsys, monkeypatch):
    """Shards of the model alone (no AdamW state): a resume, which loads that state, refuses it before
    Ray starts, naming what is missing and what works instead; `export` of it works."""
    import ray
    from fuzz_files import make_checkpoint

    started: list = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    step = tmp_path / "run" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    make_checkpoint(step, optimizer=False)
    sets = [a for s in [*FUZZ_TINY, f"run.output_dir={tmp_path / 'out'}"] for a in ("--set", s)]
    for command in ("train", "check"):
        assert cli.main([command, "--resume", str(step), *sets]) == 2
        err = capsys.readouterr().err
        assert "holds no optimizer state (step, exp_avg, exp_avg_sq) for model.embed_tokens.weight" in err, err
        assert "export its weights instead" in err
    assert started == []
    assert cli.main(["export", str(step), str(tmp_path / "hf")]) == 0


@pytest.mark.parametrize("case", list(SHARD_MISFITS))
def test_shards_that_cannot_hold_what_the_metadata_says_are_refused_before_any_worker(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, case
):
    import ray

    started: list = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    change, said = SHARD_MISFITS[case]
    step = _rewritten(tiny_checkpoint, tmp_path, change)
    assert cli.main(["export", str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"CHECKPOINT='{step}': is refused: " in err and said in err and "(nothing was loaded)" in err, err
    sets = [a for s in [*FUZZ_TINY, f"run.output_dir={tmp_path / 'out'}"] for a in ("--set", s)]
    assert cli.main(["train", "--resume", str(step), *sets]) == 2
    assert said in capsys.readouterr().err and started == []
    assert cli.main(["check", "--resume", str(step), *sets]) == 2
    assert said in capsys.readouterr().err and started == []
    assert not (tmp_path / "marker").exists() and not (tmp_path / "hf").exists()


# What pyarrow's Google Cloud Storage filesystem raised here for gs://your-bucket (no network, no
# credentials), word for word: `check` printed all of it, twice.
GCS_OFFLINE = (
    "google::cloud::Status(UNAVAILABLE: Retry policy exhausted, with a last message of Could not create a OAuth2 "
    "access token to authenticate the request. The request was not sent, as such an access token is required to "
    "complete the request successfully. Learn more about Google Cloud authentication at "
    "https://cloud.google.com/docs/authentication. The underlying error message was: PerformWork() - CURL error "
    "[6]=Could not resolve hostname error_info={reason=, domain=, metadata={gcloud-cpp.retry.on-entry=false, "
    "gcloud-cpp.retry.function=GetObjectMetadata, gcloud-cpp.retry.reason=retry-policy-exhausted}})"
)
S3_OFFLINE = (
    "When resolving region for bucket 'nobucket': AWS Error NETWORK_CONNECTION during HeadBucket operation: "
    "curlCode: 6, Could not resolve hostname; Details: Could not resolve host: nobucket.s3.us-east-1.amazonaws.com"
)


def test_an_object_stores_error_is_said_in_one_line():
    """`check`'s "not verified" notes and data.path's refusal quote an object store's error as a
    line a user reads: Google Cloud's status as its code, its first sentence and the underlying
    cause; the AWS SDK's without its details; never past 200 characters."""
    from raytrain_hybrid.errors import storage_reason

    assert storage_reason(OSError(GCS_OFFLINE)) == (
        "Google Cloud Storage: UNAVAILABLE: Could not create a OAuth2 access token to authenticate the request "
        "(Could not resolve hostname)"
    )
    assert storage_reason(OSError(S3_OFFLINE)) == (
        "When resolving region for bucket 'nobucket': AWS Error NETWORK_CONNECTION during HeadBucket operation: "
        "curlCode: 6, Could not resolve hostname"
    )
    assert storage_reason(OSError("google::cloud::Status(NOT_FOUND: bucket b does not exist)")) == (
        "Google Cloud Storage: NOT_FOUND: bucket b does not exist"
    )
    for long in (storage_reason(OSError("x " * 300)), storage_reason(OSError("x" * 300))):  # (a word too long)
        assert len(long) <= 200 and long.endswith(" ..."), len(long)
