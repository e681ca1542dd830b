"""The JIT's disk cache: the size cap evicts least recently used entries, `ranvier cache`
reports and clears it, and entries vanishing under a reader cost only a recompile."""

from __future__ import annotations

import os

import pytest

from ranvier.backends.cpu import jit
from ranvier.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RANVIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(jit, "_MEMORY_CACHE", {})
    return tmp_path / "cache"


def _store(key: str, size: int) -> bytes:
    code, origin = jit.cached_object(key, lambda: bytes(size))
    assert origin == "compiled"
    return code


def _age(cache, key: str, seconds_ago: float) -> None:
    when = os.stat(cache / f"{key}.o").st_mtime - seconds_ago
    os.utime(cache / f"{key}.o", (when, when))


def test_cap_evicts_least_recently_used(cache, monkeypatch):
    monkeypatch.setenv("RANVIER_CACHE_MAX_MB", str(2.5 * 1024 / 2**20))  # room for two 1,000-byte entries
    _store("a", 1000)
    _store("b", 1000)
    _age(cache, "a", 30)
    _age(cache, "b", 20)
    jit._MEMORY_CACHE.clear()
    assert jit.cached_object("a", lambda: pytest.fail("a is on disk"))[1] == "disk"  # a read makes "a" recent
    _store("c", 1000)
    assert sorted(path.stem for path in cache.glob("*.o")) == ["a", "c"]


def test_cache_info_and_clear(cache, capsys):
    _store("a", 1000)
    _store("b", 3000)
    (cache / ".x.o.123.tmp").write_bytes(b"another process is writing")
    assert main(["cache", "info"]) == 0
    info = capsys.readouterr().out
    assert f"cache: {cache}" in info and "entries: 2," in info and "of 512 MB" in info and "most recently used" in info
    assert main(["cache", "clear"]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out
    assert [path.name for path in cache.iterdir()] == [".x.o.123.tmp"]  # a writer's temporary file is left alone
    assert main(["cache", "info"]) == 0
    assert "entries: 0," in capsys.readouterr().out


def test_entry_evicted_while_reading_is_recompiled(cache, monkeypatch):
    _store("a", 1000)
    jit._MEMORY_CACHE.clear()
    read = jit._read_entry

    def evicted_first(path):  # another process deletes the entry between the check and the read
        path.unlink()
        return read(path)

    monkeypatch.setattr(jit, "_read_entry", evicted_first)
    code, origin = jit.cached_object("a", lambda: b"fresh")
    assert (code, origin) == (b"fresh", "compiled")
