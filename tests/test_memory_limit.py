"""The memory limit (`ranvier.limits`): sizes a file or a config gives are refused before
anything that size is allocated, with an error naming where the size came from: a cell's
instance and a global variable at compile time, a model's parameters and rotary tables from
its config. (ONNX values folded at load: test_onnx_import.py; a run's config.json through
the command line: test_cli_errors.py.)"""

from __future__ import annotations

import tracemalloc

import pytest

import ranvier as rv
from ranvier.errors import CompileError, RanvierError
from ranvier.flow.flags import VarFlags
from ranvier.limits import ENVIRONMENT, byte_size, memory_limit, physical_memory
from ranvier.models import MLP
from ranvier.models.llama import Llama, LlamaConfig, rope_tables
from ranvier.models.moe import MoE, MoEConfig

HUGE = 10**12


@pytest.fixture
def limit_1mb(monkeypatch):
    monkeypatch.setenv(ENVIRONMENT, "1")


def test_the_default_is_half_the_machines_memory_and_the_setting_is_checked(monkeypatch):
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    assert memory_limit() == physical_memory() // 2 > 0
    monkeypatch.setenv(ENVIRONMENT, "1.5")
    assert memory_limit() == 3 << 19
    for bad in ("0", "-1", "lots", "inf", "nan", ""):
        monkeypatch.setenv(ENVIRONMENT, bad)
        with pytest.raises(RanvierError, match=rf"{ENVIRONMENT}='{bad}' is not a positive number of megabytes"):
            memory_limit()


@pytest.mark.parametrize("nbytes, text", [(0, "0 bytes"), (1023, "1023 bytes"), (1536, "1.5 KiB"), (3 << 30, "3 GiB"),
                                          (4 * 10**12, "3.64 TiB"), (1000 << 20, "1000 MiB"), (2**70, "1048576 PiB")])
def test_sizes_read_as_people_write_them(nbytes, text):
    assert byte_size(nbytes) == text


def relu_flow(shape, learnable: bool = False) -> rv.Flow:
    flow = rv.Flow()
    b = rv.Builder(flow, "f")
    x = b.var("x", rv.DT_FLOAT, shape)
    if learnable:
        x.var.flags |= VarFlags.LEARNABLE
    b.relu(x, name="y")
    return flow


def test_an_instance_past_the_limit_is_refused_at_compile_time():
    with pytest.raises(CompileError, match=r"an instance of cell f \(its largest variable f/(x|y): float32\[100000x100000x100\], "
                                           r"3.64 TiB\): 7.28 TiB, past ranvier's memory limit"):
        rv.Compiler().compile(relu_flow([100_000, 100_000, 100]))


def test_a_global_without_data_past_the_limit_is_refused(limit_1mb):
    with pytest.raises(RanvierError, match=r"global variable f/x: float32\[1024x512\]: 2 MiB, past ranvier's memory limit "
                                           r"of 1 MiB \(RANVIER_MAX_MEMORY_MB sets it\)"):
        rv.Compiler().compile(relu_flow([1024, 512], learnable=True))


def test_what_fits_compiles_and_runs(limit_1mb):
    data = rv.Compiler().compile(relu_flow([64, 64])).cell("f").instance()
    data["f/x"] = -1.0
    data.compute()
    assert (data["f/y"] == 0).all()


@pytest.mark.parametrize("build, words", [
    (lambda: MLP([784, HUGE, 10]), r"mlp's 795,000,000,000,010 parameters \(layer sizes \[784, 1000000000000, 10\]\): 2.82 PiB"),
    (lambda: Llama(LlamaConfig(dim=64, n_layers=2**31 - 1, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172)),
     r"llama's [\d,]+ parameters \(dim 64, n_layers 2147483647, hidden_dim 172, vocab_size 512\)"),
    (lambda: MoE(MoEConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=1, vocab_size=512, hidden_dim=96, n_experts=10**7,
                           top_k=2)), r"moe's [\d,]+ parameters \(.*n_experts 10000000\)"),
    (lambda: rope_tables(64, HUGE, 1e4), r"rotary tables for 1,000,000,000,000 positions of head size 64: 232.83 TiB"),
], ids=["mlp-hidden", "llama-n_layers", "moe-n_experts", "rope-seq"])
def test_model_sizes_from_a_config_are_refused_before_drawing_any(build, words, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    tracemalloc.start()
    try:
        with pytest.raises(RanvierError, match=rf"{words}.*past ranvier's memory limit"):
            build()
        assert tracemalloc.get_traced_memory()[1] < 1 << 20  # refused before allocating
    finally:
        tracemalloc.stop()


def test_a_model_that_fits_is_drawn(limit_1mb):
    assert MLP([16, 32, 4]).parameter_count() == 16 * 32 + 32 + 32 * 4 + 4
