"""The binary .flow format: golden bytes, round trips, old versions, and fuzzing.

Expected files are assembled here with struct.pack straight from Myelin's layout, never
with the writer under test, so a bug cannot cancel itself out between writer and reader.
"""

from __future__ import annotations

import os
import random
import struct
import time
import tracemalloc

import numpy as np
import pytest
from flowbytes import (
    MAGIC,
    blob_rec,
    flow_file,
    header,
    i32,
    list_rec,
    load_bytes,
    op_rec,
    s,
    u64,
    var_rec,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ranvier
from ranvier import dtypes
from ranvier.errors import FlowFileError
from ranvier.flow import Blob, Flow, FuncFlags, OpFlags, VarFlags

# ---- random data ------------------------------------------------------------------------------------


def random_array(rng: np.random.Generator, dtype: str, shape) -> np.ndarray:
    native = dtypes.to_numpy(dtype)
    if dtype == dtypes.DT_BOOL:
        return rng.random(shape) < 0.5
    if dtypes.is_float(dtype):
        return (rng.standard_normal(shape) * 10).astype(native)
    info = np.iinfo(native)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=native)


# ---- golden bytes -------------------------------------------------------------------------------------

W_VALUES = np.random.default_rng(1234).standard_normal((3, 2)).astype(np.float32)
BLOB_DATA = bytes(np.random.default_rng(99).integers(1, 256, size=17, dtype=np.uint8))


def golden_flow() -> Flow:
    flow = Flow()
    x = flow.add_var("f/x", dtypes.DT_FLOAT32, [-1, 3])
    x.flags = VarFlags.IN | VarFlags.REF
    flow.add_alias(x, "input")
    x.attrs["doc"] = "features"
    w = flow.add_var("f/W", dtypes.DT_FLOAT32, [3, 2])
    w.flags = VarFlags.LEARNABLE
    w.set_data(W_VALUES)
    y = flow.add_var("f/y:0", dtypes.DT_FLOAT32, [-1, 2])
    y.flags = VarFlags.OUT
    op = flow.add_op("f/y", "MatMul")
    op.add_input(x)
    op.add_input(w)
    op.add_output(y)
    op.attrs = {"transpose_a": "0", "note": "héllo"}
    op.nogradient = True
    func = flow.func("f")
    func.training = True
    func.add(op)
    cnx = flow.cnx("c")
    cnx.add(x)
    cnx.add(y)
    blob = flow.blob("vocab")
    blob.type = "dict"
    blob.set_attr("delimiter", "\n")
    blob.data = BLOB_DATA
    return flow


def golden_bytes(version: int) -> bytes:
    """golden_flow() as Myelin lays it out, field by field."""
    w_data = struct.pack("<6f", *W_VALUES.reshape(-1).tolist())
    ref_dtype = "&float32" if version < 5 else "float32"
    return flow_file(
        version,
        vars=[
            var_rec(version, "f/x", ref_dtype, [-1, 3], flags=1 | 4, aliases=["input"], var_attrs={"doc": "features"}),
            var_rec(version, "f/W", "float32", [3, 2], data=w_data, flags=8),
            var_rec(version, "f/y:0", "float32", [-1, 2], flags=2),
        ],
        ops=[op_rec(version, "f/y", "MatMul", ["f/x", "f/W"], ["f/y:0"], {"transpose_a": "0", "note": "héllo"}, 1)],
        funcs=[list_rec(version, "f", ["f/y"], flags=1)],
        cnxs=[list_rec(version, "c", ["f/x", "f/y:0"])],
        blobs=[blob_rec(version, "vocab", "dict", {"delimiter": "\n"}, BLOB_DATA)],
    )


@pytest.mark.parametrize("version", [4, 5, 6])
def test_golden_bytes(tmp_path, version):
    path = tmp_path / "golden.flow"
    golden_flow().save(path, version=version)
    assert path.read_bytes() == golden_bytes(version)


def test_golden_v6_layout_spot_checks():
    """A few fields at fixed offsets, in case the encoder above and the writer agree on a mistake."""
    data = golden_bytes(6)
    assert data[:4] == b"flow" and data[4:8] == b"\x06\0\0\0" and data[8:12] == bytes(4)
    assert struct.unpack_from("<ii", data, 12) == (3, 1 | 4)  # three vars; f/x is IN|REF
    assert data[20:27] == b"\x03\0\0\0f/x"


def test_golden_bytes_read_back():
    for version in (4, 5, 6):
        flow = load_bytes(golden_bytes(version))
        assert flow.vars["f/x"].ref
        np.testing.assert_array_equal(flow.vars["f/W"].data, W_VALUES)
        assert flow.ops["f/y"].attrs["note"] == "héllo"


# ---- round trips ----------------------------------------------------------------------------------------


def rich_flow(seed: int) -> Flow:
    rng = np.random.default_rng(seed)
    flow = Flow()
    for i, dtype in enumerate(dtypes.ALL_DTYPES):
        shape = [[2, 3], [4], [], [2, 1, 3]][i % 4]
        var = flow.add_var(f"c/{dtype}", dtype, shape)
        var.set_data(random_array(rng, dtype, shape))
        var.flags = VarFlags(int(rng.integers(0, 512)))
    x = flow.add_var("f/x", dtypes.DT_FLOAT32, [-1, 4])
    x.flags = VarFlags.IN | VarFlags.REF | VarFlags.ROW
    flow.add_alias(x, "f/input")
    flow.add_alias(x, "x")
    x.set_attr("sparse", True)
    x.set_attr("range", [0, 10])
    h = flow.add_var("f/h:0", dtypes.DT_FLOAT32, [-1, 3])
    h.flags = VarFlags.NOGRADIENT | VarFlags.DYNAMIC
    y = flow.add_var("f/y:0", dtypes.DT_FLOAT32, [-1, 3])
    y.flags = VarFlags.OUT
    w = flow.add_var("f/W", dtypes.DT_FLOAT32, [4, 3])
    w.flags = VarFlags.LEARNABLE | VarFlags.UNIQUE | VarFlags.COL
    w.set_data(random_array(rng, dtypes.DT_FLOAT32, [4, 3]))

    matmul = flow.add_op("f/MatMul", "MatMul")
    matmul.add_input(x)
    matmul.add_input(w)
    matmul.add_output(h)
    matmul.set_attr("transpose_b", False)
    matmul.nogradient = True
    relu = flow.add_op("f/y", "Relu")
    relu.add_input(h)
    relu.add_output(y)
    relu.attrs = {"alpha": f"{rng.random():.6f}", "ünïcode": "✓"}
    loose = flow.add_op("g/Identity", "Identity")
    loose.add_input(flow.vars["c/int64"])
    loose.add_output(flow.add_var("g/Identity:0", dtypes.DT_INT64, [4]))

    func = flow.func("f")
    func.add(relu)  # not dependency order: the file must keep the function's own order
    func.add(matmul)
    func.flags = FuncFlags.TRAINING | FuncFlags.BACKPROP
    flow.func("empty")

    cnx = flow.cnx("state")
    cnx.add(y)
    cnx.add(x)
    cnx.flags = int(rng.integers(1, 100))
    flow.cnx("unlinked")

    blob = flow.blob("lexicon")
    blob.type = "dict"
    blob.attrs = {"delimiter": "\n", "oov": "17"}
    blob.data = bytes(rng.integers(0, 256, size=300, dtype=np.uint8))
    blob.flags = int(rng.integers(1, 100))
    flow.blobs["empty"] = Blob("empty")
    return flow


def assert_same_flow(original: Flow, loaded: Flow, version: int) -> None:
    assert list(loaded.vars) == list(original.vars)
    for name, a in original.vars.items():
        b = loaded.vars[name]
        assert b.aliases == a.aliases
        assert b.dtype == a.dtype
        assert b.shape == a.shape
        assert b.flags == (a.flags if version >= 5 else a.flags & VarFlags.REF)
        assert b.attrs == (a.attrs if version >= 6 else {})
        if a.data is None:
            assert b.data is None
        else:
            assert b.data.dtype == a.data.dtype
            assert list(b.data.shape) == b.shape
            assert b.data.tobytes() == a.data.tobytes()
            assert isinstance(b.data, np.ndarray) and b.data.flags.writeable  # a copy, not a view of the file
        for alias in a.aliases:
            assert loaded.var(alias) is b

    assert list(loaded.ops) == list(original.ops)
    for name, a in original.ops.items():
        b = loaded.ops[name]
        assert b.type == a.type
        assert [v.name for v in b.inputs] == [v.name for v in a.inputs]
        assert [v.name for v in b.outputs] == [v.name for v in a.outputs]
        assert all(v is loaded.vars[v.name] for v in b.inputs + b.outputs)
        assert all(v.producer is b for v in b.outputs)
        assert all(b in v.consumers for v in b.inputs)
        assert b.attrs == a.attrs
        assert b.flags == (a.flags if version >= 5 else OpFlags.NONE)

    assert list(loaded.funcs) == list(original.funcs)
    for name, a in original.funcs.items():
        b = loaded.funcs[name]
        assert [op.name for op in b.ops] == [op.name for op in a.ops]
        assert all(op.func is b for op in b.ops)
        assert b.flags == (a.flags if version >= 5 else FuncFlags.NONE)

    assert list(loaded.cnxs) == list(original.cnxs)
    for name, a in original.cnxs.items():
        b = loaded.cnxs[name]
        assert [v.name for v in b.links] == [v.name for v in a.links]
        assert b.flags == (a.flags if version >= 5 else 0)

    assert list(loaded.blobs) == list(original.blobs)
    for name, a in original.blobs.items():
        b = loaded.blobs[name]
        assert (b.type, b.attrs, b.data) == (a.type, a.attrs, a.data)
        assert b.flags == (a.flags if version >= 5 else 0)


@pytest.mark.parametrize("version", [4, 5, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip(tmp_path, version, seed):
    original = rich_flow(seed)
    path = tmp_path / "model.flow"
    original.save(path, version=version)
    loaded = Flow().load(path)
    assert_same_flow(original, loaded, version)
    # Saving what was loaded gives the same bytes: nothing is lost on the second trip.
    again = tmp_path / "again.flow"
    loaded.save(again, version=version)
    assert again.read_bytes() == path.read_bytes()


def test_load_adds_to_a_flow_and_refuses_clashes(tmp_path):
    path = tmp_path / "model.flow"
    golden_flow().save(path)
    flow = Flow()
    other = flow.add_var("other", dtypes.DT_INT32, [2])
    flow.load(path)
    assert flow.vars["other"] is other and flow.var("input") is flow.vars["f/x"]
    before = (dict(flow.vars), dict(flow.ops))
    with pytest.raises(FlowFileError, match="already has"):
        flow.load(path)
    assert (flow.vars, flow.ops) == before


def test_write_rejects_bad_versions_and_inconsistent_flows(tmp_path):
    for version in (3, 7, 0):
        with pytest.raises(FlowFileError, match="version"):
            golden_flow().save(tmp_path / "x.flow", version=version)
    flow = golden_flow()
    flow.vars["f/W"].data = np.arange(5, dtype=np.float32) + 1
    with pytest.raises(FlowFileError, match="f/W"):
        flow.save(tmp_path / "x.flow")
    flow = golden_flow()
    flow.remove_var(flow.vars["f/y:0"])
    with pytest.raises(FlowFileError, match="not part of the flow"):
        flow.save(tmp_path / "x.flow")
    assert os.listdir(tmp_path) == []


# ---- older versions from hand-assembled bytes ------------------------------------------------------------


@pytest.mark.parametrize("version", [3, 4, 5])
def test_read_old_versions(version):
    rng = np.random.default_rng(version)
    table = rng.integers(-1000, 1000, size=(2, 2), dtype=np.int32)
    table[table == 0] = 7
    bias = rng.standard_normal(2).astype(np.float64)
    data = flow_file(
        version,
        vars=[
            var_rec(version, "f/x", "&int32", [2], flags=1, aliases=["x"]),
            var_rec(version, "f/table", "int32", [2, 2], data=struct.pack("<4i", *table.reshape(-1).tolist())),
            var_rec(version, "f/bias", "float64", [2], data=struct.pack("<2d", *bias.tolist())),
            var_rec(version, "f/y:0", "int32", [2]),
        ],
        ops=[op_rec(version, "f/y", "Gather", ["x", "f/table"], ["f/y:0"], {"axis": "0"}, flags=1)],
        funcs=[list_rec(version, "f", ["f/y"], flags=2)],
        cnxs=[list_rec(version, "pipe", ["f/y:0", "f/x"], flags=3)],
        blobs=[blob_rec(version, "meta", "json", {"k": "v"}, b'{"a": 1}', flags=4)] if version >= 4 else [],
    )
    flow = load_bytes(data)
    x = flow.vars["f/x"]
    assert x.ref and x.dtype == "int32" and x.aliases == ["x"]
    assert x.in_ == (version >= 5)
    np.testing.assert_array_equal(flow.vars["f/table"].data, table)
    np.testing.assert_array_equal(flow.vars["f/bias"].data, bias)
    op = flow.ops["f/y"]
    assert op.inputs == [x, flow.vars["f/table"]] and op.outputs == [flow.vars["f/y:0"]]
    assert op.attrs == {"axis": "0"} and op.nogradient == (version >= 5)
    assert flow.funcs["f"].ops == [op] and flow.funcs["f"].backprop == (version >= 5)
    assert flow.cnxs["pipe"].links == [flow.vars["f/y:0"], x]
    if version >= 4:
        blob = flow.blobs["meta"]
        assert (blob.type, blob.attrs, blob.data, blob.flags) == ("json", {"k": "v"}, b'{"a": 1}', 4 if version >= 5 else 0)
    else:
        assert flow.blobs == {}


def test_op_name_resolves_to_first_output():
    """Myelin lets a name stand for its op's first output: `f/y` names `f/y:0`. The consumer
    comes first in the file, so the reference is to an op not read yet."""
    version = 6
    data = flow_file(
        version,
        vars=[
            var_rec(version, "f/x", "float32", [2], flags=1),
            var_rec(version, "f/y:0", "float32", [2]),
            var_rec(version, "f/z:0", "float32", [2]),
        ],
        ops=[
            op_rec(version, "f/z", "Relu", ["f/y"], ["f/z:0"]),
            op_rec(version, "f/y", "Tanh", ["f/x"], ["f/y:0"]),
        ],
        funcs=[list_rec(version, "f", ["f/y", "f/z"])],
        cnxs=[list_rec(version, "c", ["f/z"])],
    )
    flow = load_bytes(data)
    assert flow.ops["f/z"].inputs == [flow.vars["f/y:0"]]
    assert flow.vars["f/y:0"].consumers == [flow.ops["f/z"]]
    assert flow.cnxs["c"].links == [flow.vars["f/z:0"]]


def test_unresolved_name_names_the_op():
    data = flow_file(
        6,
        vars=[var_rec(6, "f/x", "float32", [2])],
        ops=[op_rec(6, "f/a", "Relu", ["f/x"], ["f/a:0"])],
    )
    with pytest.raises(FlowFileError, match=r"op 0 \(f/a\).*'f/a:0'.*byte offset \d+"):
        load_bytes(data)


# ---- a compiled model survives the trip ------------------------------------------------------------------


def test_builder_model_round_trip_computes_the_same(tmp_path):
    rng = np.random.default_rng(7)
    flow = Flow()
    f = ranvier.Builder(flow, "f")
    W = f.array("W", rng.standard_normal((16, 8)).astype(np.float32))
    b = f.array("b", rng.standard_normal(8).astype(np.float32))
    x = f.var("x", ranvier.DT_FLOAT, [1, 16])
    y = f.softmax(f.relu(f.add(f.matmul(x, W), b)), name="y")
    path = tmp_path / "model.flow"
    flow.save(path)
    loaded = Flow().load(path)

    x_value = rng.standard_normal((1, 16)).astype(np.float32)
    results = []
    for model in (flow, loaded):
        data = ranvier.Compiler().compile(model).cell("f").instance()
        data["f/x"] = x_value
        data.compute()
        results.append(np.array(data["f/y"]))
    np.testing.assert_array_equal(results[0], results[1])
    assert results[0].shape == tuple(y.shape) and np.isclose(results[0].sum(), 1.0)


# ---- malformed files -----------------------------------------------------------------------------------------


def small_valid(version: int) -> bytes:
    """A file with a little of everything: every record kind, aliases, data, attrs."""
    return golden_bytes(version)


MALFORMED = [
    (b"", "magic"),
    (b"fl", "magic"),
    (b"\x89PNG\r\n\x1a\n" + bytes(24), "magic"),
    (b"\x7fELF\x02\x01\x01\0" + bytes(24), "magic"),
    (MAGIC + i32(7), r"header: unsupported flow file version 7"),
    (MAGIC + i32(2) + i32(0) * 4, "version 2"),
    (flow_file(6, vars=[var_rec(6, "a", "float32", [2])] * 2), r"variable 1 \(a\): duplicate variable name"),
    (
        flow_file(6, vars=[var_rec(6, "a", "float32", [2], aliases=["b"]), var_rec(6, "b", "int8", [])]),
        "'a' already has the alias 'b'",
    ),
    (
        flow_file(6, vars=[var_rec(6, "a", "float32", [2]), var_rec(6, "b", "int8", [], aliases=["a"])]),
        "alias 'a' already names variable 'a'",
    ),
    (
        flow_file(6, vars=[var_rec(6, "a", "int16", [2])], ops=[op_rec(6, "o", "Relu", [], ["a"])],
                  funcs=[list_rec(6, "f", ["o"]), list_rec(6, "g", ["o"])]),
        r"function 1 \(g\): op 'o' already belongs to function 'f'",
    ),
    (flow_file(6, vars=[var_rec(6, "a", "float8", [2])]), "unknown dtype 'float8'"),
    (flow_file(6, vars=[var_rec(6, "a", "Float32", [2])]), "unknown dtype 'Float32'"),
    (flow_file(6, vars=[var_rec(6, "a", "float32", [2, -2])]), r"variable 0 \(a\): dimension -2"),
    (flow_file(6, vars=[var_rec(6, "a", "int16", [3], data=bytes(5))]), r"5 bytes of constant data, but int16\[3\] takes 6"),
    (flow_file(6, vars=[var_rec(6, "a", "float32", [3], data=bytes(3))]), "3 bytes of constant data"),
    (flow_file(6, vars=[var_rec(6, "a", "float64", [2], data=bytes(2))]), "2 bytes of constant data"),
    (flow_file(6, vars=[var_rec(6, "a", "int16", [0], data=bytes(2))]), "2 bytes of constant data"),
    (flow_file(6, vars=[var_rec(6, "a", "int8", [], data=i32(300))]), "int8 cannot hold"),
    (flow_file(6, vars=[var_rec(6, "a", "bool", [2], data=i32(2, 0))]), "bool cannot hold"),
    (flow_file(6, vars=[var_rec(6, "a", "float16", [], data=struct.pack("<f", 1e6))]), "float16 cannot hold"),
    (flow_file(6, vars=[var_rec(6, "a", "int16", [-1, -1], data=bytes(4))]), "undefined.*batch_size"),
    (flow_file(6, vars=[var_rec(6, "a", "int16", [-1, 3], data=bytes(4))]), "undefined"),
    (
        flow_file(6, vars=[var_rec(6, "a", "int16", [2])], ops=[op_rec(6, "o", "Relu", ["a"], [])] * 2),
        r"op 1 \(o\): duplicate op name",
    ),
    (
        flow_file(6, vars=[var_rec(6, "a", "int16", [2])], ops=[op_rec(6, "o", "Relu", [], ["a"], {})],
                  funcs=[list_rec(6, "f", ["o", "missing"])]),
        r"function 0 \(f\): op 'missing' is not in the file",
    ),
    (
        flow_file(6, vars=[var_rec(6, "a", "int16", [2])],
                  ops=[op_rec(6, "o", "Relu", [], ["a"]), op_rec(6, "p", "Relu", [], ["a"])]),
        "already produced by op 'o'",
    ),
    (flow_file(6, cnxs=[list_rec(6, "c", ["nowhere"])]), r"connector 0 \(c\): link 'nowhere'"),
    (flow_file(6, blobs=[blob_rec(6, "b", "t", {}, b"")] * 2), r"blob 1 \(b\): duplicate blob name"),
]


@pytest.mark.parametrize("data, pattern", MALFORMED, ids=[pattern for _, pattern in MALFORMED])
def test_malformed_file_errors(data, pattern):
    with pytest.raises(FlowFileError, match=pattern):
        load_bytes(data)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        Flow().load(tmp_path / "absent.flow")


def test_foreign_file_on_disk(tmp_path):
    path = tmp_path / "image.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(20))
    with pytest.raises(FlowFileError, match=r"image\.png: header: not a flow file.*magic"):
        Flow().load(path)
    empty = tmp_path / "empty.flow"
    empty.write_bytes(b"")
    with pytest.raises(FlowFileError, match="magic"):
        Flow().load(empty)


@pytest.mark.parametrize("version", [3, 4, 5, 6])
def test_every_truncation_fails_cleanly(version):
    data = small_valid(version) if version >= 4 else flow_file(
        3, vars=[var_rec(3, "v", "&float32", [2], data=struct.pack("<2f", 1.5, -2.25), aliases=["w"])],
        ops=[op_rec(3, "o", "Relu", ["w"], ["v"], {"a": "b"})], funcs=[list_rec(3, "f", ["o"])],
        cnxs=[list_rec(3, "c", ["v"])],
    )
    load_bytes(data)
    for end in range(len(data)):
        with pytest.raises(FlowFileError, match="byte offset"):
            load_bytes(data[:end])


INTERESTING_INT32 = [0, 1, 2, -1, -2, 255, 0x7FFFFFFF, -0x80000000, 0x10000, 4, 8]


def mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] ^= rng.randint(1, 255)
    elif kind == 1:
        at = rng.randrange(len(buf) + 1)
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == 2:
        at = rng.randrange(len(buf))
        del buf[at : at + rng.randint(1, 8)]
    else:
        at = rng.randrange(len(buf) - 3)
        buf[at : at + 4] = struct.pack("<i", rng.choice(INTERESTING_INT32))
    return bytes(buf)


def test_random_mutations_load_or_fail_cleanly():
    bases = [small_valid(4), small_valid(5), small_valid(6)]
    rng = random.Random(2024)
    loaded = failed = 0
    start = time.perf_counter()
    for case in range(600):
        data = mutate(bases[case % len(bases)], rng)
        try:
            load_bytes(data)
            loaded += 1
        except FlowFileError as error:
            assert "byte offset" in str(error) or "already has" in str(error)
            failed += 1
    assert failed > 300 and loaded > 0
    assert time.perf_counter() - start < 5


_tokens = st.one_of(
    st.sampled_from(INTERESTING_INT32).map(i32),
    st.integers(0, 6).map(i32),
    st.sampled_from(["float32", "&int8", "bool", "bfloat16", "a", "b", ""]).map(s),
    st.binary(max_size=8),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version=st.sampled_from([3, 4, 5, 6]), body=st.lists(_tokens, max_size=40).map(b"".join))
def test_random_bytes_after_a_valid_header(version, body):
    try:
        load_bytes(header(version) + body)
    except FlowFileError as error:
        assert "byte offset" in str(error)


@pytest.mark.parametrize(
    "data",
    [
        header(6) + i32(0x7FFFFFFF),
        header(6) + i32(0, 0, 0, 0x7FFFFFFF),
        header(4) + i32(0, 0, 0, 0, 0x7FFFFFFF),
        header(6) + i32(1, 0) + s("v") + i32(0) + s("int8") + i32(1, 4) + i32(0) + u64(2**62),
        header(6) + i32(1, 0) + s("v") + i32(0) + s("int8") + i32(1, 4) + i32(0) + u64(2**64 - 1) + bytes(4),
        header(6) + i32(1, 0) + s("v") + i32(0x7FFFFFFF) + bytes(64),
        header(6) + i32(1, 0) + s("v") + i32(0) + s("int8") + i32(0x7FFFFFFF) + bytes(64),
        header(6) + i32(1, 0) + s("v") + i32(0) + s("int8") + i32(0, 0x7FFFFFFF) + bytes(64),
        header(6) + i32(1, 0, 0x7FFFFFFF) + bytes(64),
        header(6) + i32(0, 1, 0) + s("o") + s("T") + i32(0x7FFFFFFF) + bytes(64),
        header(6) + i32(0, 0, 1, 0) + s("f") + i32(0x7FFFFFFF) + bytes(64),
        header(6) + i32(0, 0, 0, 0, 1, 0) + s("b") + s("t") + i32(0) + u64(2**62) + bytes(64),
        header(6) + i32(1, 0) + s("v") + i32(0) + s("int64") + i32(2, 2**30, 2**30) + i32(0) + u64(4) + bytes(4),
    ],
)
def test_huge_counts_fail_fast_without_allocating(data):
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(FlowFileError, match="byte offset"):
            load_bytes(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 0.5
    assert peak < 1 << 20


# ---- atomic writes ----------------------------------------------------------------------------------------------


def test_failed_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "model.flow"
    golden_flow().save(path)
    before = path.read_bytes()
    broken = rich_flow(3)
    broken.add_var("late/\ud800", dtypes.DT_FLOAT32, [2])  # a lone surrogate cannot be UTF-8
    with pytest.raises(FlowFileError, match="UTF-8"):
        broken.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.flow"]


def test_save_failing_at_fsync_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.flow"
    golden_flow().save(path)
    before = path.read_bytes()

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        rich_flow(4).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.flow"]


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "model.flow"
    golden_flow().save(path, version=4)
    rich_flow(5).save(str(path))
    assert_same_flow(rich_flow(5), Flow().load(str(path)), 6)
    assert os.listdir(tmp_path) == ["model.flow"]
