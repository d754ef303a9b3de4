"""parallelism.compile_cache: a rank's inductor cache archived into the run directory once, after
the first step that compiled, and extracted by a restart (its own archive, or rank 0's); an
archive that would write outside its directory is not used. The warm start itself (a restart's
first-step compile time against the cold one's) is measured by benchmarks/bench_compile_cache.py."""

from __future__ import annotations

import io
import tarfile

import pytest

from raytrain_hybrid.config import load_config
from raytrain_hybrid.engine.compile_cache import CompileCache
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import open_store


def test_archived_once_and_extracted_on_restart(tmp_path):
    store = open_store(str(tmp_path / "run")).child("compile_cache")
    first = tmp_path / "a"
    (first / "fxgraph" / "ab").mkdir(parents=True)
    (first / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    cache = CompileCache(store, 1, str(first))
    cache.after_step({"compiles": 0})  # nothing compiled yet: nothing written
    assert not (tmp_path / "run" / "compile_cache").exists()
    cache.after_step({"compiles": 2, "compile_s": 9.0})
    (first / "fxgraph" / "ab" / "later").write_bytes(b"x")
    cache.after_step({"compiles": 1})  # once a process
    assert sorted(p.name for p in (tmp_path / "run" / "compile_cache").iterdir()) == ["rank1.tar"]

    again = tmp_path / "b"
    again.mkdir()
    assert CompileCache(store, 1, str(again)).load() == 1
    assert (again / "fxgraph" / "ab" / "entry").read_bytes() == b"graph"
    assert CompileCache(store, 2, str(tmp_path / "c")).load() == 0  # no archive of its own, none of rank 0's
    CompileCache(store, 0, str(first)).after_step({"compiles": 1})
    assert CompileCache(store, 2, str(tmp_path / "d")).load() == 2  # rank 0's


def test_an_archive_reaching_outside_is_not_used(tmp_path):
    run = tmp_path / "run" / "compile_cache"
    run.mkdir(parents=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../../planted.py")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"boom"))
    (run / "rank0.tar").write_bytes(buffer.getvalue())
    local = tmp_path / "local"
    local.mkdir()
    assert CompileCache(open_store(str(tmp_path / "run")).child("compile_cache"), 0, str(local)).load() == 0
    assert not list(tmp_path.rglob("planted.py"))


def test_refused_without_compile():
    with pytest.raises(ConfigError, match="parallelism.compile_cache"):
        load_config(None, ["parallelism.compile=false", "parallelism.compile_cache=true"])
