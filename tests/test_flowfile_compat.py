"""Myelin's leniency: .flow files from every writer in the wild load and compute, the reader
accepts what Myelin's C++ reader (flow.cc, Flow::Read) accepts, and the writer takes the
data SLING's Python writer takes without ever writing a count that differs from its bytes.

The files are assembled byte by byte with each writer's conventions (flowbytes.py), not
with ranvier's writer.
"""

from __future__ import annotations

import array
import logging
import math
import os
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest
from flowbytes import blob_rec, flow_file, header, i32, list_rec, load_bytes, op_rec, s, strs, u64, var_rec

import ranvier
from ranvier import dtypes
from ranvier.errors import CompileError, FlowFileError
from ranvier.flow import Flow, VarFlags
from ranvier.flow.fileformat import FlowFileWarning, parse_flow

RNG = np.random.default_rng(14)
W = RNG.standard_normal((3, 2)).astype(np.float32)
B = RNG.standard_normal(2).astype(np.float32)
X = RNG.standard_normal((2, 3)).astype(np.float32)
IN, OUT, REF, LEARNABLE = 1, 2, 4, 8


def le(values: np.ndarray, dtype) -> bytes:
    return np.asarray(values, np.dtype(dtype).newbyteorder("<")).tobytes()


# ---- files as each writer lays them out ------------------------------------------------------------


def cpp_file(version: int) -> bytes:
    """Myelin's C++ writer (Flow::Save) after a Flow::Read: '&' types before version 5, the
    op name as an alias of its first output, a void variable, raw string data, flag bits
    ranvier has no name for (bit 512 and bit 31), -1 for the batch dimension."""
    ref = "&float32" if version < 5 else "float32"
    return flow_file(
        version,
        vars=[
            var_rec(version, "f/x", "float32", [-1, 3], flags=IN, var_attrs={"input": "1"}),
            var_rec(version, "f/W", "float32", [3, 2], data=le(W, "f4"), flags=LEARNABLE | 512),
            var_rec(version, "f/b", "float32", [2], data=le(B, "f4")),
            var_rec(version, "f/h:0", "float32", [-1, 2], aliases=["f/MatMul"]),
            var_rec(version, "f/y:0", "float32", [-1, 2], flags=OUT | -(2**31), aliases=["f/y"]),
            var_rec(version, "f/state", ref, [2], flags=REF),
            var_rec(version, "f/nothing", "void", []),
            var_rec(version, "f/words", "string", [2], data=b"ab\0cd\0\0\0" * 2),
        ],
        ops=[
            op_rec(version, "f/MatMul", "MatMul", ["f/x", "f/W"], ["f/h:0"], flags=512 | 1),
            op_rec(version, "f/y", "Add", ["f/MatMul", "f/b"], ["f/y:0"], {"task": "0"}),
        ],
        funcs=[list_rec(version, "f", ["f/MatMul", "f/y"], flags=1 << 20)],
        cnxs=[list_rec(version, "c", ["f/y:0", "f/y"], flags=-1)],
        blobs=[blob_rec(version, "vocab", "dict", {"delimiter": "\n"}, b"a\nb\n")] if version >= 4 else [],
    )


def python_file() -> bytes:
    """SLING's Python writer (python/myelin/flow.py, Flow.save): version 6 only, the flow's
    own header flags, no variable attributes (its loop over them writes an op's), a None
    type as an empty string, "float" where the program said so, and constants as
    write_object makes them: a numpy array's bytes, an array.array's in its own type
    whatever the variable's, a Python float as 4 float32 bytes and an int as 4 int32 bytes."""
    return (
        b"flow" + i32(6, 7)
        + i32(10)
        + var_rec(6, "f/x", "float32", [-1, 3])
        + var_rec(6, "f/W", "float32", [3, 2], data=W.tobytes())
        + var_rec(6, "f/b", "float", [2], data=array.array("d", B.astype(np.float64)).tobytes())
        + var_rec(6, "f/scale", "float32", [], data=struct.pack("f", 2.0))
        + var_rec(6, "f/h:0", "float32", [-1, 2])
        + var_rec(6, "f/s:0", "float32", [-1, 2])
        + var_rec(6, "f/y:0", "float32", [-1, 2])
        + var_rec(6, "g/u", "float64", [-1])
        + var_rec(6, "g/c", "float64", [], data=struct.pack("f", 0.375))
        + var_rec(6, "g/z:0", "", [])
        + i32(4)
        + op_rec(6, "f/MatMul", "MatMul", ["f/x", "f/W"], ["f/h:0"])
        + op_rec(6, "f/Add", "Add", ["f/h:0", "f/b"], ["f/s:0"])
        + op_rec(6, "f/y", "Mul", ["f/s:0", "f/scale"], ["f/y:0"])
        + op_rec(6, "g/z", "Mul", ["g/u", "g/c"], ["g/z:0"])
        + i32(2) + list_rec(6, "f", ["f/MatMul", "f/Add", "f/y"]) + list_rec(6, "g", ["g/z"])
        + i32(0)
        + i32(1) + blob_rec(6, "config", "json", {}, struct.pack("i", 42))
    )


def run(flow: Flow, func: str, inputs: dict, output: str) -> np.ndarray:
    data = ranvier.Compiler().compile(flow).cell(func).instance()
    for name, value in inputs.items():
        data[name][...] = value
    data.compute()
    return np.array(data[output])


@pytest.mark.parametrize("version", [3, 4, 5, 6])
def test_cpp_writer_files_load_and_compute(tmp_path, version):
    path = tmp_path / "cpp.flow"
    path.write_bytes(cpp_file(version))
    flow = Flow().load(path, batch_size=2)
    assert flow.vars["f/x"].shape == [2, 3] and flow.vars["f/y:0"].shape == [2, 2]
    assert flow.vars["f/state"].ref and flow.var("f/MatMul") is flow.vars["f/h:0"]
    assert (flow.vars["f/nothing"].dtype, flow.vars["f/words"].dtype) == ("void", "string")
    assert flow.vars["f/words"].data.tobytes() == b"ab\0cd\0\0\0" * 2
    if version >= 5:
        assert int(flow.vars["f/W"].flags) == LEARNABLE | 512
        assert int(flow.vars["f/y:0"].flags) == OUT | 2**31
        assert int(flow.ops["f/MatMul"].flags) == 513 and int(flow.funcs["f"].flags) == 1 << 20
        assert flow.cnxs["c"].flags == -1
    assert flow.cnxs["c"].links == [flow.vars["f/y:0"]]  # linked twice, by name and by alias: once
    np.testing.assert_allclose(run(flow, "f", {"f/x": X}, "f/y:0"), X @ W + B, rtol=1e-6)


def test_python_writer_file_loads_and_computes(tmp_path):
    path = tmp_path / "python.flow"
    path.write_bytes(python_file())
    with pytest.warns(FlowFileWarning) as record:
        flow = Flow().load(path, batch_size=2)
    notes = "\n".join(str(w.message) for w in record)
    assert "variable 2 (f/b): 16 bytes of data for float32[2], which takes 8: read as 2 float64 values" in notes
    assert "variable 8 (g/c): 4 bytes of data for float64, which takes 8: read as 1 float32 value" in notes
    assert flow.flags == 7 and flow.vars["f/b"].dtype == "float32" and flow.vars["g/z:0"].dtype == "void"
    assert flow.vars["g/c"].data == 0.375 and flow.vars["g/c"].data.dtype == np.float64
    assert flow.blobs["config"].data == struct.pack("<i", 42)
    # g/z:0 has no type in the file (None in the Python program): nothing computes it.
    with pytest.raises(CompileError, match="g/z:0 is void, a type ranvier loads and saves but cannot compute with"):
        ranvier.Compiler().compile(flow)
    flow.vars["g/z:0"].dtype = dtypes.DT_FLOAT64
    np.testing.assert_allclose(run(flow, "f", {"f/x": X}, "f/y:0"), (X @ W + B) * 2, rtol=1e-6)
    u = np.array([1.0, -2.0])
    np.testing.assert_array_equal(run(flow, "g", {"g/u": u}, "g/z:0"), u * 0.375)


# ---- ops as SLING's builders declare them ------------------------------------------------------------------


def sling_builder_file(ops: list[tuple[str, str, list[str], str, list[int]]], inputs: dict[str, tuple[str, list[int]]],
                       consts: dict[str, tuple[str, list[int], bytes]] | None = None) -> bytes:
    """A function f as SLING's Python Builder saves it: each op's output declared by the
    builder (Builder.op: the first input's type; the gather and matmul helpers' shapes),
    given here as (op type, name, inputs, declared type, declared shape); every result is an output."""
    variables = [var_rec(6, f"f/{n}", t, shape, flags=IN) for n, (t, shape) in inputs.items()]
    consts = consts or {}
    variables += [var_rec(6, f"f/{n}", t, shape, data=raw) for n, (t, shape, raw) in consts.items()]
    variables += [var_rec(6, f"f/{name}:0", dtype, shape, flags=OUT) for _, name, _, dtype, shape in ops]
    names = {n: f"f/{n}" for n in [*inputs, *consts]} | {name: f"f/{name}:0" for _, name, *_ in ops}
    records = [op_rec(6, f"f/{name}", optype, [names[i] for i in args], [names[name]]) for optype, name, args, *_ in ops]
    return flow_file(6, vars=variables, ops=records, funcs=[list_rec(6, "f", [f"f/{op[1]}" for op in ops])])


def compute_all(flow: Flow, inputs: dict) -> dict[str, np.ndarray]:
    data = ranvier.Compiler().compile(flow).cell("f").instance()
    for name, value in inputs.items():
        data[f"f/{name}"] = value
    data.compute()
    return {v.name[2:].removesuffix(":0"): np.array(data[v]) for v in flow.vars.values() if v.producer is not None}


def test_comparisons_and_logic_declared_with_their_inputs_type_compute_0_or_1_in_it():
    """SLING's builders declare Less(float32, float32) a float32 tensor, and And, Not, All,
    Cond's condition read such tensors; ranvier computes 0 or 1 in the declared type
    (Myelin writes all-one bit masks there: the same booleans)."""
    f4, i4 = ("float32", [4]), ("int32", [4])
    flow = load_bytes(sling_builder_file([
        ("Less", "lt", ["x", "y"], *f4), ("Equal", "eq", ["x", "y"], *f4), ("Not", "ne", ["eq"], *f4),
        ("And", "and", ["lt", "ne"], *f4), ("Or", "or", ["lt", "eq"], *f4), ("Xor", "xor", ["lt", "x"], *f4),
        ("Cond", "cond", ["lt", "x", "y"], *f4), ("Select", "sel", ["eq", "y"], *f4),
        ("All", "all", ["lt"], "float32", []), ("Any", "any", ["eq"], "float32", []),
        ("GreaterEqual", "ge", ["i", "j"], *i4), ("Mul", "masked", ["ge", "i"], *i4), ("Not", "nge", ["ge"], *i4),
    ], {"x": f4, "y": f4, "i": i4, "j": i4}))
    x, y = np.array([1.5, 2, -3, 0], np.float32), np.array([2, 2, -4, 1], np.float32)
    i, j = np.array([3, -1, 7, 0], np.int32), np.array([3, 0, 2, 9], np.int32)
    got = compute_all(flow, {"x": x, "y": y, "i": i, "j": j})
    lt, eq, ge = x < y, x == y, i >= j
    expected = {
        "lt": lt, "eq": eq, "ne": ~eq, "and": lt & ~eq, "or": lt | eq, "xor": lt ^ (x != 0), "cond": np.where(lt, x, y),
        "sel": np.where(eq, y, 0), "all": np.all(lt), "any": np.any(eq), "ge": ge, "masked": ge * i, "nge": ~ge,
    }
    for name, value in expected.items():
        declared = flow.vars[f"f/{name}:0"].dtype
        assert got[name].dtype == dtypes.to_numpy(declared), name
        np.testing.assert_array_equal(got[name], np.asarray(value).astype(declared), err_msg=name)


def test_gather_keeps_the_shape_sling_declares():
    """SLING's builders declare Gather(emb[5, 3], ind[1, 2]) as [2, 3] (ranvier's own gather
    gives numpy's [1, 2, 3]) and a MatMul of it as [2, 4]; a lookup of one scalar index
    (the C++ FlowBuilder) as [1, 3]."""
    emb = RNG.standard_normal((5, 3)).astype(np.float32)
    weights = RNG.standard_normal((3, 4)).astype(np.float32)
    flow = load_bytes(sling_builder_file(
        [("Gather", "rows", ["emb", "ind"], "float32", [2, 3]), ("MatMul", "y", ["rows", "W"], "float32", [2, 4]),
         ("Gather", "one", ["emb", "k"], "float32", [1, 3])],
        {"ind": ("int32", [1, 2]), "k": ("int32", [])},
        {"emb": ("float32", [5, 3], emb.tobytes()), "W": ("float32", [3, 4], weights.tobytes())},
    ))
    got = compute_all(flow, {"ind": [[4, 1]], "k": 2})
    np.testing.assert_array_equal(got["rows"], emb[[4, 1]])
    np.testing.assert_allclose(got["y"], emb[[4, 1]] @ weights, rtol=1e-6)
    np.testing.assert_array_equal(got["one"], emb[[2]])


# ---- batch size ----------------------------------------------------------------------------------------


def test_minus_one_binds_to_the_batch_size_given(tmp_path, caplog):
    path = tmp_path / "cpp.flow"
    path.write_bytes(cpp_file(6))
    unbound = Flow().load(path)
    assert unbound.vars["f/x"].shape == [-1, 3]
    # Without a batch size the compiler gives -1 batch size 1, as Myelin does (flow.cc reads
    # -1 as its batch_size_, 1 by default; pysling's compiler makes -1 a 1); the flow keeps -1.
    with caplog.at_level(logging.INFO, logger="ranvier.compiler.compiler"):
        np.testing.assert_allclose(run(unbound, "f", {"f/x": X[:1]}, "f/y:0"), X[:1] @ W + B, rtol=1e-6)
    assert "bound the -1 dimensions of 3 variables to batch size 1" in caplog.text and "f/x, f/h:0, f/y:0" in caplog.text
    assert unbound.vars["f/x"].shape == [-1, 3]
    with caplog.at_level(logging.INFO, logger="ranvier.flow.fileformat"):
        bound = Flow().load(path, batch_size=5)
    assert "bound the -1 dimensions of 3 variables to batch size 5: f/x, f/h:0, f/y:0" in caplog.text
    assert [bound.vars[n].shape for n in ("f/x", "f/h:0", "f/W")] == [[5, 3], [5, 2], [3, 2]]
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(FlowFileError, match="batch_size must be a positive integer"):
            Flow().load(path, batch_size=bad)


def test_constant_with_an_undefined_dimension_takes_it_from_its_data():
    data = flow_file(6, vars=[var_rec(6, "t", "int16", [-1, 2], data=le([[1, 2], [3, 4], [5, 6]], "i2"))])
    with pytest.warns(FlowFileWarning, match=r"variable 0 \(t\): its -1 dimension is 3"):
        flow = load_bytes(data)
    np.testing.assert_array_equal(flow.vars["t"].data, [[1, 2], [3, 4], [5, 6]])
    # With a batch size the dimension is bound first, and the bytes must fit it.
    assert parse_flow(Flow(), data, "t.flow", batch_size=3).vars["t"].shape == [3, 2]
    with pytest.raises(FlowFileError, match=r"t.flow: variable 0 \(t\): 12 bytes of constant data, but int16\[2x2\]"):
        parse_flow(Flow(), data, "t.flow", batch_size=2)


# ---- type names --------------------------------------------------------------------------------------


ALL_TYPE_NAMES = [
    "void", "", "float16", "float32", "float64", "float", "bfloat16", "int8", "int16", "int32", "int64", "int",
    "uint8", "uint16", "bool", "string", "complex64", "complex128", "qint8", "qint32", "qint16", "quint8",
    "quint16", "resource",
]


@pytest.mark.parametrize("version", [3, 6])
def test_every_type_name_of_myelin_loads_and_saves(tmp_path, version):
    data = flow_file(version, vars=[var_rec(version, f"v{i}", name, [2]) for i, name in enumerate(ALL_TYPE_NAMES)]
                     + [var_rec(version, "r", "&", [])])
    flow = load_bytes(data)
    loaded = [flow.vars[f"v{i}"].dtype for i in range(len(ALL_TYPE_NAMES))]
    canonical = {"": "void", "float": "float32", "int": "int32"}
    assert loaded == [canonical.get(name, name) for name in ALL_TYPE_NAMES]
    assert flow.vars["r"].ref and flow.vars["r"].dtype == "void"
    path = tmp_path / "types.flow"
    flow.save(path)
    assert [v.dtype for v in Flow().load(path).vars.values()] == [*loaded, "void"]


@pytest.mark.parametrize("dtype", sorted(dtypes.STORAGE_DTYPES))
def test_storage_only_types_keep_their_bytes_and_refuse_to_compute(tmp_path, dtype):
    raw = bytes(range(1, 13))
    flow = load_bytes(flow_file(6, vars=[
        var_rec(6, "f/v", dtype, [3], data=raw), var_rec(6, "f/y", dtype, [3]),
    ], ops=[op_rec(6, "f/id", "Identity", ["f/v"], ["f/y"])], funcs=[list_rec(6, "f", ["f/id"])]))
    assert flow.vars["f/v"].data.tobytes() == raw
    path = tmp_path / "s.flow"
    flow.save(path)
    assert Flow().load(path).vars["f/v"].data.tobytes() == raw
    with pytest.raises(CompileError, match=f"Identity op f/id: f/v is {dtype}, a type ranvier loads and saves but cannot"):
        ranvier.Compiler().compile(flow)


# ---- what Myelin's reader takes that a strict reader would not --------------------------------------------


def test_repeated_attributes_take_the_last_value_at_the_first_place():
    twice = i32(3) + s("k") + s("v") + s("j") + s("1") + s("k") + s("w")
    data = (
        header(6) + i32(1, 0) + s("a") + strs([]) + s("int8") + i32(0) + twice + u64(0)
        + i32(1, 0) + s("o") + s("T") + strs([]) + strs(["a"]) + twice
        + i32(0, 0, 1, 0) + s("b") + s("t") + twice + u64(0)
    )
    flow = load_bytes(data)
    for attrs in (flow.vars["a"].attrs, flow.ops["o"].attrs, flow.blobs["b"].attrs):
        assert list(attrs.items()) == [("k", "w"), ("j", "1")]


def test_trailing_bytes_are_ignored():
    data = cpp_file(6)
    assert list(load_bytes(data + b"\0" * 3 + b"garbage").vars) == list(load_bytes(data).vars)


@pytest.mark.parametrize("version", [5, 6])
def test_every_flag_bit_survives_a_round_trip(tmp_path, version):
    bits = [512, 1 << 12, 1 << 30, -(2**31), -1, 0x7FFFFFFF]
    data = flow_file(
        version,
        vars=[var_rec(version, f"v{i}", "float32", [1], flags=b) for i, b in enumerate(bits)],
        ops=[op_rec(version, f"o{i}", "T", [], [], flags=b) for i, b in enumerate(bits)],
        funcs=[list_rec(version, f"f{i}", [], flags=b) for i, b in enumerate(bits)],
        cnxs=[list_rec(version, f"c{i}", [], flags=b) for i, b in enumerate(bits)],
        blobs=[blob_rec(version, f"b{i}", "", {}, b"", flags=b) for i, b in enumerate(bits)],
    )
    flow = load_bytes(data)
    assert [int(v.flags) for v in flow.vars.values()] == [b & 0xFFFFFFFF for b in bits]
    assert [c.flags for c in flow.cnxs.values()] == bits
    path = tmp_path / "flags.flow"
    flow.save(path, version=version)
    assert path.read_bytes() == data


def test_names_that_are_not_utf8_survive_byte_for_byte(tmp_path):
    data = flow_file(6, vars=[var_rec(6, b"caf\xe9", "int8", [1], aliases=[b"\xff\xfe"])],
                     blobs=[blob_rec(6, "b", b"\x80", {b"\xc3": b"\xa9"}, b"")])
    flow = load_bytes(data)
    assert flow.var("\udcff\udcfe") is flow.vars["caf\udce9"]
    path = tmp_path / "latin1.flow"
    flow.save(path)
    assert path.read_bytes() == data


def test_a_model_whose_names_are_not_utf8_compiles_runs_and_prints(tmp_path):
    """Its names reach the compile cache's key and the printed outputs: encoded as they are,
    and shown escaped on a stdout that takes only UTF-8."""
    path = tmp_path / "names.flow"
    saved = Flow()
    f = ranvier.Builder(saved, "f")
    f.relu(f.var("x", "float32", [2, 3]), name="y").var.out = True
    saved.save(path)
    path.write_bytes(path.read_bytes().replace(b"f/x", b"f/\xff").replace(b"f/y", b"f/\xfe"))
    flow = Flow().load(path)
    x = np.array([[1, -2, 3], [-4, 5, -6]], np.float32)
    np.testing.assert_array_equal(run(flow, "f", {"f/\udcff": x}, "f/\udcfe:0"), np.maximum(x, 0))
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-m", "ranvier.cli", "run", str(path), "--input", f"f/\udcff={tmp_path / 'x.npy'}"],
                          capture_output=True, check=False, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.decode().startswith("f/\\udcfe:0: float32[2x3]\n[[1. 0. 3.]")


# ---- constants as SLING's Python writer stores them --------------------------------------------------------

F32_TENTH = float(np.float32(0.1))

# (dtype, shape, stored bytes, the array they load as)
PYTHON_WRITER_CONSTANTS = [
    ("float64", [], struct.pack("<f", 0.1), np.float64(F32_TENTH)),  # const(0.1, dtype=DT_DOUBLE)
    ("float64", [3], struct.pack("<f", 0.5), np.full(3, 0.5)),  # const(0.5, DT_DOUBLE, shape=[3])
    ("float16", [], struct.pack("<f", -2.5), np.float16(-2.5)),
    ("bfloat16", [3], struct.pack("<f", 1.5), np.full(3, 1.5, dtypes.to_numpy("bfloat16"))),
    ("float64", [], struct.pack("<i", 7), np.float64(7)),  # const(7, dtype=DT_DOUBLE): an int's bytes
    ("float64", [2, 2], struct.pack("<4i", 1, 0, 3, 4), np.array([[1, 0], [3, 4]], np.float64)),  # an int array
    # A negative int's bytes are a float32 NaN (-1 is 0xFFFFFFFF): still an int, not NaN.
    ("float64", [], struct.pack("<i", -1), np.float64(-1)),  # const(-1, dtype=DT_DOUBLE)
    ("float16", [], struct.pack("<i", -300), np.float16(-300)),
    ("bfloat16", [3], struct.pack("<i", -2), np.full(3, -2, dtypes.to_numpy("bfloat16"))),
    ("float64", [3], struct.pack("<3i", -7, 0, 5), np.array([-7, 0, 5], np.float64)),  # np.int32 data
    ("float32", [2], struct.pack("<2q", -1, 3), np.array([-1, 3], np.float32)),  # array('q') data
    # A float's own NaN and infinities stay floats.
    ("float64", [], struct.pack("<f", math.nan), np.float64(math.nan)),
    ("float64", [2], struct.pack("<2f", -math.inf, 1.5), np.array([-math.inf, 1.5])),
    ("int64", [], struct.pack("<i", -5), np.int64(-5)),  # const(-5, dtype=DT_INT64)
    ("int8", [], struct.pack("<i", -128), np.int8(-128)),
    ("uint16", [4], struct.pack("<i", 65535), np.full(4, 65535, np.uint16)),
    ("bool", [], struct.pack("<i", 1), np.bool_(True)),  # const(True): bool is an int
    ("int64", [2], struct.pack("<2i", 2**31 - 1, -(2**31)), np.array([2**31 - 1, -(2**31)], np.int64)),
    ("float32", [3], struct.pack("<3d", 0.25, -1, 3e38), np.array([0.25, -1, 3e38], np.float32)),  # array('d')
    ("int32", [2], struct.pack("<2q", -3, 9), np.array([-3, 9], np.int32)),  # array('q') for an int32 var
    ("float32", [], struct.pack("<f", 0.1), np.float32(0.1)),  # the sizes match: no note
]


@pytest.mark.parametrize("dtype, shape, stored, expected", PYTHON_WRITER_CONSTANTS)
def test_python_writer_constants_are_read_as_their_values(dtype, shape, stored, expected):
    data = flow_file(6, vars=[var_rec(6, "c", dtype, shape, data=stored)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        var = load_bytes(data).vars["c"]
    assert var.data.dtype == dtypes.to_numpy(dtype) and list(var.data.shape) == shape
    np.testing.assert_array_equal(var.data, expected)
    notes = [str(w.message) for w in caught if w.category is FlowFileWarning]
    if len(stored) == var.nbytes:
        assert notes == []
    else:
        assert len(notes) == 1 and f"converted to {dtype} (at byte offset" in notes[0]


# ---- what the writer takes -------------------------------------------------------------------------------------

INT32S = array.array("i", [1, -2, 3, 2**31 - 1])

# (blob data as a program may set it, the bytes SLING's Python writer writes for it)
BLOB_DATA = [
    (b"\0raw", b"\0raw"),
    (bytearray(b"abc"), b"abc"),
    ("héllo", "héllo".encode()),
    (2.5, struct.pack("<f", 2.5)),
    (-7, struct.pack("<i", -7)),
    (True, struct.pack("<i", 1)),
    (None, b""),
    (INT32S, INT32S.tobytes()),
    (memoryview(INT32S), INT32S.tobytes()),  # the issue's corrupt file: a count of 4 and 16 bytes
    (memoryview(np.arange(12.0).reshape(3, 4)[::2, 1::2]), le([[1, 3], [9, 11]], "f8")),  # strided, 2-D
    (memoryview(b"xyz").cast("c"), b"xyz"),
    (np.arange(6, dtype=np.int16).reshape(2, 3).T, np.arange(6, dtype=np.int16).reshape(2, 3).T.tobytes()),
    (np.float64(1.25), struct.pack("<f", 1.25)),  # a float like any other, as in SLING
    (np.int32(3), struct.pack("<i", 3)),
    (np.zeros(3, dtypes.to_numpy("bfloat16")), bytes(6)),
]


@pytest.mark.parametrize("version", [4, 5, 6])
def test_blob_data_of_every_kind_writes_its_bytes_and_count(tmp_path, version):
    flow = Flow()
    for i, (value, _) in enumerate(BLOB_DATA):
        flow.blob(f"b{i}").data = value
    path = tmp_path / "blobs.flow"
    flow.save(path, version=version)
    expected = [raw for _, raw in BLOB_DATA]
    assert [b.data for b in Flow().load(path).blobs.values()] == expected
    assert path.read_bytes() == flow_file(version, blobs=[blob_rec(version, f"b{i}", "", {}, raw)
                                                           for i, raw in enumerate(expected)])


# (variable dtype and shape, data as a program may set it, the array it is saved as)
VAR_DATA = [
    ("int32", [4], memoryview(INT32S), np.array(INT32S, np.int32)),
    ("int32", [2, 2], INT32S, np.array(INT32S, np.int32).reshape(2, 2)),
    ("float32", [2], bytes(le([1.5, -2], "f4")), np.array([1.5, -2], np.float32)),
    ("float32", [2], bytearray(le([1.5, -2], "f4")), np.array([1.5, -2], np.float32)),
    ("float32", [2], memoryview(le([1.5, -2], "f4")), np.array([1.5, -2], np.float32)),
    ("float64", [], 0.1, np.float64(0.1)),  # by value: no float32 rounding here
    ("float64", [2, 3], 0.5, np.full((2, 3), 0.5)),
    ("int64", [], 2**40, np.int64(2**40)),
    ("bool", [3], True, np.ones(3, bool)),
    ("float16", [2], array.array("d", [0.5, 4]), np.array([0.5, 4], np.float16)),
    ("float32", [2, 2], memoryview(np.eye(2)), np.eye(2, dtype=np.float32)),
    ("int16", [3], np.array([1, -1, 7], ">i2"), np.array([1, -1, 7], np.int16)),
    ("bfloat16", [2], np.array([1, 2.5]), np.array([1, 2.5], dtypes.to_numpy("bfloat16"))),
]


@pytest.mark.parametrize("dtype, shape, value, expected", VAR_DATA)
def test_variable_data_of_every_kind_saves_as_its_values(tmp_path, dtype, shape, value, expected):
    flow = Flow()
    flow.add_var("v", dtype, shape).data = value
    path = tmp_path / "v.flow"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowFileWarning)
        flow.save(path)
    data = Flow().load(path).vars["v"].data
    assert data.dtype == dtypes.to_numpy(dtype) and list(data.shape) == shape
    np.testing.assert_array_equal(data, expected)
    assert path.read_bytes() == flow_file(6, vars=[var_rec(6, "v", dtype, shape, data=le(expected, data.dtype))])


def bad_var(dtype, shape, value):
    flow = Flow()
    flow.add_var("bad", dtype, shape).data = value
    return flow


def bad_blob(value):
    flow = Flow()
    flow.blob("bad").data = value
    return flow


@pytest.mark.parametrize(
    "flow, pattern",
    [
        (bad_var("float32", [3], np.arange(2)), "variable bad: its data has 2 elements but its type is float32\\[3\\]"),
        (bad_var("float32", [-1], np.zeros(2)), "variable bad: constant data needs a defined shape"),
        (bad_var("float32", [2], np.array(["a", "b"])), "variable bad: its data cannot be read as float32"),
        (bad_blob(2**31), "blob 'bad': the int 2147483648 does not fit in the 4 bytes"),
        (bad_blob(object()), "blob 'bad': its data is a object, not bytes, a string, a number or an array"),
        (bad_blob("\ud800"), "surrogates not allowed"),
    ],
)
def test_writer_refuses_data_it_cannot_write_and_leaves_no_file(tmp_path, flow, pattern):
    with pytest.raises((FlowFileError, UnicodeEncodeError), match=pattern):
        flow.save(tmp_path / "bad.flow")
    assert list(tmp_path.iterdir()) == []


def test_writer_takes_none_strings_and_alias_dtypes(tmp_path):
    flow = Flow()
    var = flow.add_var("v", "float32", [1])
    var.dtype = "float"  # a program may set Myelin's spelling directly
    var.attrs["empty"] = None
    flow.blob("b").type = None
    path = tmp_path / "n.flow"
    flow.save(path)
    loaded = Flow().load(path)
    assert loaded.vars["v"].dtype == "float32" and loaded.vars["v"].attrs == {"empty": ""}
    assert loaded.blobs["b"].type == ""
    assert VarFlags(loaded.vars["v"].flags) == VarFlags.NONE
