"""The JIT's disk cache: the size cap evicts least recently used entries, `ranvier cache`
reports and clears it, entries vanishing under a reader cost only a recompile, a damaged
entry fails its checksum and is compiled again, and processes compiling the same model at
once all succeed and leave one intact entry. A generated GEMM's entry is keyed by every
source its code is made of."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from ranvier.backends import compile_cache
from ranvier.backends.cpu import amx, bf16gemv, jit, parallel, q8gemm, sgemm
from ranvier.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RANVIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_cache, "_MEMORY_CACHE", OrderedDict())
    return tmp_path / "cache"


def _store(key: str, size: int) -> bytes:
    code, origin = compile_cache.cached_object(key, lambda: bytes(size))
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
    compile_cache._MEMORY_CACHE.clear()
    assert compile_cache.cached_object("a", lambda: pytest.fail("a is on disk"))[1] == "disk"  # a read makes "a" recent
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


def test_cache_info_names_the_machine_measurements_that_clearing_keeps(cache, capsys):
    _store("a", 1000)
    (cache / "gemm-0123.json").write_text('{"NN 8x8x8": true}')
    assert main(["cache", "clear"]) == 0
    capsys.readouterr()
    assert main(["cache", "info"]) == 0
    assert "this machine's measurements (split thresholds, GEMM choices): gemm-0123.json" in capsys.readouterr().out


def test_measurements_that_do_not_read_are_measured_again_and_cleared(cache, capsys, monkeypatch):
    """A split-*.json of strings (hand-edited, or written by something else) is measured
    anew, not a traceback at the first compile, and `cache clear` removes one."""
    monkeypatch.delenv("RANVIER_SPLIT_BYTES", raising=False)
    parallel.split_thresholds.cache_clear()
    monkeypatch.setattr(parallel, "_measure", lambda cores: parallel.SplitThresholds(1 << 20, 1 << 17, 1e-5, 1e-7, 1e10, 1e11))
    try:
        kept = parallel.split_thresholds()
        (path,) = cache.glob("split-*.json")
        for corrupt in ({**json.loads(path.read_text()), "flops": "many"}, {"flops": 1}, ["x"], {"nbytes": 0}):
            path.write_text(json.dumps(corrupt))
            parallel.split_thresholds.cache_clear()
            assert parallel.split_thresholds() == kept
            assert json.loads(path.read_text()) == dataclasses.asdict(kept)  # the file is whole again
    finally:
        parallel.split_thresholds.cache_clear()
    (cache / "split-0123.json").write_text('{"flops": "many"}')
    (cache / "split-4567.json").write_bytes(b"\xff")
    assert main(["cache", "clear"]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out
    assert [p.name for p in cache.glob("*.json")] == [path.name]  # the measurements that read are kept


def test_entry_evicted_while_reading_is_recompiled(cache, monkeypatch):
    _store("a", 1000)
    compile_cache._MEMORY_CACHE.clear()
    read = compile_cache._read_entry

    def evicted_first(path):  # another process deletes the entry between the check and the read
        path.unlink()
        return read(path)

    monkeypatch.setattr(compile_cache, "_read_entry", evicted_first)
    code, origin = compile_cache.cached_object("a", lambda: b"fresh")
    assert (code, origin) == (b"fresh", "compiled")


def test_every_damaged_byte_fails_the_checksum(cache):
    code = _store("a", 1000)
    entry = cache / "a.o"
    intact = entry.read_bytes()
    rng = random.Random(0)
    for position in [0, len(intact) // 2, len(intact) - 1, *rng.sample(range(len(intact)), 40)]:
        damaged = bytearray(intact)
        damaged[position] ^= 1 << rng.randrange(8)
        entry.write_bytes(bytes(damaged))
        assert compile_cache._read_entry(entry) is None, f"a flipped bit at byte {position} went unnoticed"
    entry.write_bytes(intact)
    assert compile_cache._read_entry(entry) == code


_COMPILE_SCRIPT = """
import sys
import numpy as np
import ranvier as rv
flow = rv.Flow()
f = rv.Builder(flow, "f")
x = f.var("x", "float32", [37, 13])
y = f.tanh(x * 2.0) + f.sigmoid(x) * x
y.var.out = True
cell = rv.Compiler("cpu").compile(flow).cell("f")
instance = cell.instance()
a = np.linspace(-3, 3, 37 * 13, dtype=np.float32).reshape(37, 13)
instance[x] = a
instance.compute()
assert np.allclose(instance[y], np.tanh(2 * a) + a / (1 + np.exp(-a)), rtol=1e-5, atol=1e-6)
print(cell.native.origin)
"""


@pytest.mark.slow
def test_processes_compiling_the_same_model_at_once(tmp_path):
    cache = tmp_path / "cache"
    root = Path(__file__).parents[1]
    env = dict(os.environ, RANVIER_CACHE=str(cache), PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for round_ in range(3):  # an empty cache, then one a previous round filled
        writers = [subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for _ in range(4)]
        origins = []
        for writer in writers:
            out, err = writer.communicate(timeout=300)
            assert writer.returncode == 0, f"round {round_}: a writer failed: {err[-2000:]}"
            origins.append(out.split()[-1])
        assert set(origins) <= {"compiled", "disk"} and (round_ == 0 or origins == ["disk"] * 4), origins
        entries = [e for e in cache.iterdir() if not e.name.startswith("split-")]  # this machine's split thresholds
        assert len(entries) == 1 and entries[0].suffix == ".o", f"left in the cache: {[e.name for e in entries]}"
        assert compile_cache._read_entry(entries[0]) is not None


def test_the_folder_is_listed_at_the_first_write_then_after_each_sixteenth_of_the_cap(cache, monkeypatch):
    """Enforcing the cap lists every entry: a cache of 50,000 small entries made each
    compile pay for that listing before writes were counted."""
    monkeypatch.setattr(compile_cache, "_PRUNING", compile_cache._PruneSchedule())
    monkeypatch.setenv("RANVIER_CACHE_MAX_MB", str(16_000 / 2**20))  # a sixteenth: about 1,000 bytes
    listings = []
    monkeypatch.setattr(compile_cache, "prune_cache", listings.append)
    for number, size in enumerate([10, 400, 400, 300, 10]):
        _store(f"k{number}", size)
        assert len(listings) == [1, 1, 1, 2, 2][number], f"after write {number}"


def test_a_generated_functions_key_covers_the_sources_its_code_comes_from():
    """The GEMM generators' cached code is keyed by their own source and every backend module
    they import, through one another: the Values and pointers they are written over (once
    left out: an edit of values.py kept the old machine code), and for bf16gemv.py the
    panels and instruction it takes from sgemm.py."""
    backends = Path(sgemm.__file__).resolve().parent.parent
    for generator in (sgemm, amx, q8gemm, bf16gemv):
        sources = {str(path.relative_to(backends)) for path in jit.generator_sources(Path(generator.__file__))}
        assert {"llvm/irutil.py", "llvm/convert.py", "llvm/values.py", "llvm/pointers.py"} <= sources, generator
        assert f"cpu/{Path(generator.__file__).name}" in sources
    assert "cpu/sgemm.py" in {str(p.relative_to(backends)) for p in jit.generator_sources(Path(bf16gemv.__file__))}
