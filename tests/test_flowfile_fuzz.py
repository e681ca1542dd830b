"""Writer/reader agreement, fuzzed: random flows go through ranvier's writer (versions 4 to
6) and, laid out as SLING's Python writer lays them out (flowbytes.py), straight to the
reader; either way the reader must give back exactly what was written.

A case is a plain description (names, types, shapes, flags, attributes, data in every
form a program may give it, and the values that form stands for), so what the reader
must give is known without asking the code under test. The run is seeded and stops
after a time budget, so it costs the same few seconds on any machine.
"""

from __future__ import annotations

import array
import io
import random
import struct
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from flowbytes import i32, list_rec, s, strs, u64

from ranvier import dtypes
from ranvier.flow import Flow, FuncFlags, OpFlags, VarFlags
from ranvier.flow.fileformat import FlowFileWarning, parse_flow, write_flow

SEED = 14
BUDGET_S = 2.5
MIN_CASES = 40

# Names mix ASCII, accents, CJK, astral characters, and surrogate escapes (bytes that are
# not UTF-8, which Myelin's files may hold).
ALPHABET = "abxyz09/:_-. éüß✓中文🙂𝔘" + "\udc80\udcff"
DTYPE_NAMES = [*dtypes.ALL_DTYPES, *dtypes.ALIASES, *dtypes.STORAGE_DTYPES]
TYPECODES = {"float32": "f", "float64": "d", "int8": "b", "int16": "h", "int32": "i", "int64": "q",
             "uint8": "B", "uint16": "H", "uint32": "I", "uint64": "Q", "float16": "f", "bfloat16": "f"}
INT32_RANGE = (-(2**31), 2**31 - 1)


@dataclass
class Var:
    name: str
    aliases: list[str]
    dtype_name: str  # as the program spells it: "float", "" and the like too
    shape: list[int]
    flags: int
    attrs: list[tuple[str, str]]
    form: object = None  # the data as the program gives it
    sling: bytes | None = None  # the bytes SLING's Python writer writes for it
    expected: np.ndarray | bytes | None = None  # what the reader must give: values, or raw bytes

    def expected_size(self, dtype: str) -> int:
        return int(np.prod(self.shape)) * dtypes.itemsize(dtype)


@dataclass
class Case:
    flags: int = 0  # the header's
    vars: list[Var] = field(default_factory=list)
    ops: list[tuple] = field(default_factory=list)  # name, type, inputs, outputs, attrs, flags
    funcs: list[tuple] = field(default_factory=list)  # name, op names, flags
    cnxs: list[tuple] = field(default_factory=list)  # name, variable names, flags
    blobs: list[tuple] = field(default_factory=list)  # name, type, attrs, form, expected bytes, flags


# ---- random cases ------------------------------------------------------------------------------


def text(rng: random.Random, longest: int = 6) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, longest)))


def fresh(rng: random.Random, taken: set[str]) -> str:
    while (name := text(rng)) in taken:
        pass
    taken.add(name)
    return name


def attr_pairs(rng: random.Random) -> list[tuple[str, str]]:
    """Attributes as a writer may list them: a name may come twice (the last value wins)."""
    names = [text(rng, 3) for _ in range(rng.randint(0, 4))]
    return [(name, text(rng)) for name in names]


def values_of(nrng: np.random.Generator, dtype: str, shape: list[int]) -> np.ndarray:
    native = dtypes.to_numpy(dtype)
    if dtype == dtypes.DT_BOOL:
        return nrng.random(shape) < 0.5
    if dtypes.is_float(dtype):  # values float32 holds exactly, so every writer's form is lossless
        return (nrng.standard_normal(shape) * 10).astype(native).astype(np.float32).astype(native)
    info = np.iinfo(native)
    return nrng.integers(info.min, info.max, size=shape, endpoint=True, dtype=native)


def numeric_data(rng: random.Random, nrng: np.random.Generator, var: Var, dtype: str) -> None:
    """A constant in one of the forms a program gives ranvier, with the bytes SLING's Python
    writer makes of the same form (None where it cannot write it) and the values it stands for."""
    count = int(np.prod(var.shape))
    values = values_of(nrng, dtype, var.shape)
    kinds = ["array", "fortran", "big-endian", "wider", "array.array", "memoryview", "bytes", "list"]
    if count:
        kinds.append("scalar")
    kind = rng.choice(kinds)
    if kind == "scalar":
        values = np.full(var.shape, values.flat[0], values.dtype)
        number = values.flat[0].item()  # a Python bool, int or float
        var.form = number
        # None where SLING cannot write it, or where its 4 bytes are the elements themselves, to Myelin too.
        if isinstance(number, float):
            var.sling = struct.pack("<f", number)
        elif INT32_RANGE[0] <= number <= INT32_RANGE[1]:
            var.sling = struct.pack("<i", number)
        if count > 1 and var.expected_size(dtype) == 4:
            var.sling = None
    elif kind == "wider":
        wide = np.float64 if dtypes.is_float(dtype) else np.int64 if dtype != dtypes.DT_BOOL else np.bool_
        var.form = values.astype(wide)
        var.sling = var.form.tobytes()
    elif kind == "array.array":
        source = values.astype(np.float32) if dtype in ("float16", "bfloat16") else values
        var.form = array.array(TYPECODES.get(dtype, "b"), source.reshape(-1).tolist())
        var.sling = var.form.tobytes()
    elif kind == "memoryview" and dtype != dtypes.DT_BFLOAT16:  # bfloat16 has no buffer format
        var.form = memoryview(values)
        var.sling = values.tobytes()
    elif kind in ("bytes", "memoryview"):
        var.form = rng.choice([bytes, bytearray, memoryview])(values.tobytes())
        var.sling = values.tobytes()
    elif kind == "fortran":
        var.form = np.asfortranarray(values)
        var.sling = values.tobytes()
    elif kind == "big-endian" and dtype not in ("bool", "bfloat16"):
        var.form = values.astype(values.dtype.newbyteorder(">"))  # SLING would write these bytes as they are
    elif kind == "list":
        var.form = values.tolist()  # SLING's writer takes no lists
    else:
        var.form = values
        var.sling = values.tobytes()
    var.expected = values if count else None  # no bytes is no data


def raw_data(rng: random.Random, nrng: np.random.Generator) -> tuple[object, bytes]:
    """Data in every form SLING's Python writer takes, and the bytes it writes for it."""
    kind = rng.randrange(9)
    if kind == 0:
        return None, b""
    if kind == 1:
        raw = nrng.bytes(rng.randint(0, 20))
        return rng.choice([bytes, bytearray])(raw), raw
    if kind == 2:
        value = text(rng, 8).replace("\udc80", "").replace("\udcff", "")
        return value, value.encode()
    if kind == 3:
        value = float(np.float32(rng.uniform(-1e6, 1e6)))
        return value, struct.pack("<f", value)
    if kind == 4:
        value = rng.randint(*INT32_RANGE)
        return value, struct.pack("<i", value)
    if kind == 5:
        form = array.array(rng.choice("bBhHiIlLqQfd"), [rng.randint(0, 100) for _ in range(rng.randint(0, 5))])
        return form, form.tobytes()
    dtype = rng.choice(["uint8", "int16", "float32", "float64", "complex64", "bool"])
    values = nrng.integers(0, 100, size=[rng.randint(0, 3) for _ in range(rng.randint(0, 3))]).astype(dtype)
    if kind == 6:
        return values, values.tobytes()
    if kind == 7 and values.ndim == 2:
        strided = values[:, ::2]
        return memoryview(strided), strided.tobytes()
    return memoryview(values), values.tobytes()


def random_case(rng: random.Random, nrng: np.random.Generator) -> Case:
    case = Case(rng.randint(*INT32_RANGE))
    var_names: set[str] = set()
    for _ in range(rng.randint(0, 8)):
        dtype_name = rng.choice(DTYPE_NAMES)
        dtype = dtypes.normalize(dtype_name)
        shape = [rng.choice([0, 1, 2, 3, 5, -1]) for _ in range(rng.randint(0, 3))]
        var = Var(fresh(rng, var_names), [fresh(rng, var_names) for _ in range(rng.randint(0, 2))],
                  dtype_name, shape, rng.getrandbits(32), attr_pairs(rng))
        if dtype in dtypes.STORAGE_DTYPES:
            if rng.random() < 0.7:  # Variable.data holds an array; its bytes are kept as they are
                var.form = nrng.integers(0, 256, size=rng.randint(1, 9), dtype=np.uint8)
                var.sling = var.expected = var.form.tobytes()
        elif -1 not in shape and rng.random() < 0.7:
            numeric_data(rng, nrng, var, dtype)
        case.vars.append(var)

    producers: dict[str, str] = {}
    op_names: set[str] = set()
    names = [v.name for v in case.vars]
    for _ in range(rng.randint(0, 6)):
        name = fresh(rng, op_names)
        free = [n for n in names if n not in producers]
        outputs = rng.sample(free, min(len(free), rng.randint(0, 2)))
        producers.update(dict.fromkeys(outputs, name))
        inputs = [rng.choice(names) for _ in range(rng.randint(0, 3))] if names else []
        case.ops.append((name, text(rng), inputs, outputs, attr_pairs(rng), rng.getrandbits(32)))

    unassigned = [op[0] for op in case.ops]
    rng.shuffle(unassigned)
    func_names: set[str] = set()
    for _ in range(rng.randint(0, 3)):
        taken = [unassigned.pop() for _ in range(rng.randint(0, len(unassigned)))]
        case.funcs.append((fresh(rng, func_names), taken, rng.getrandbits(32)))
    cnx_names: set[str] = set()
    for _ in range(rng.randint(0, 3)):
        links = rng.sample(names, rng.randint(0, len(names)))
        case.cnxs.append((fresh(rng, cnx_names), links, rng.randint(*INT32_RANGE)))
    blob_names: set[str] = set()
    for _ in range(rng.randint(0, 3)):
        form, raw = raw_data(rng, nrng)
        case.blobs.append((fresh(rng, blob_names), text(rng), attr_pairs(rng), form, raw, rng.randint(*INT32_RANGE)))
    return case


# ---- two writers --------------------------------------------------------------------------------


def ranvier_bytes(case: Case, version: int) -> bytes:
    flow = Flow()
    flow.flags = case.flags
    for v in case.vars:
        var = flow.add_var(v.name, v.dtype_name, v.shape)
        var.flags, var.attrs, var.data = VarFlags(v.flags), dict(v.attrs), v.form
        for alias in v.aliases:
            flow.add_alias(var, alias)
    for name, optype, inputs, outputs, attrs, flags in case.ops:
        op = flow.add_op(name, optype)
        for input in inputs:
            op.add_input(flow.vars[input])
        for output in outputs:
            op.add_output(flow.vars[output])
        op.attrs, op.flags = dict(attrs), OpFlags(flags)
    for name, ops, flags in case.funcs:
        func = flow.func(name)
        for op in ops:
            func.add(flow.ops[op])
        func.flags = FuncFlags(flags)
    for name, links, flags in case.cnxs:
        cnx = flow.cnx(name)
        for link in links:
            cnx.add(flow.vars[link])
        cnx.flags = flags
    for name, blobtype, attrs, form, _, flags in case.blobs:
        blob = flow.blob(name)
        blob.type, blob.attrs, blob.data, blob.flags = blobtype, dict(attrs), form, flags
    stream = io.BytesIO()
    write_flow(flow, stream, version)
    return stream.getvalue()


def pairs(items: list[tuple[str, str]]) -> bytes:
    return i32(len(items)) + b"".join(s(k) + s(v) for k, v in items)


def sling_python_bytes(case: Case, rng: random.Random) -> bytes:
    """The case as SLING's Python writer (Flow.save) lays it out: version 6, the flow's flags
    in the header, every attribute as listed (repeats too), none for variables (its loop
    over them writes an op's), data as write_object makes it; then, sometimes, stray bytes."""
    out = b"flow" + i32(6, case.flags) + i32(len(case.vars))
    for v in case.vars:
        out += struct.pack("<I", v.flags) + s(v.name) + strs(v.aliases) + s(v.dtype_name)
        out += i32(len(v.shape), *v.shape) + i32(0) + u64(len(v.sling or b"")) + (v.sling or b"")
    out += i32(len(case.ops))
    for name, optype, inputs, outputs, attrs, flags in case.ops:
        out += struct.pack("<I", flags) + s(name) + s(optype) + strs(inputs) + strs(outputs) + pairs(attrs)
    out += i32(len(case.funcs)) + b"".join(struct.pack("<I", f) + s(n) + strs(ops) for n, ops, f in case.funcs)
    out += i32(len(case.cnxs)) + b"".join(list_rec(6, n, links, f) for n, links, f in case.cnxs)
    out += i32(len(case.blobs))
    for name, blobtype, attrs, _, raw, flags in case.blobs:
        out += i32(flags) + s(name) + s(blobtype) + pairs(attrs) + u64(len(raw)) + raw
    return out + (rng.randbytes(rng.randint(1, 9)) if rng.random() < 0.3 else b"")


# ---- what the reader must give ------------------------------------------------------------------


def assert_reads_back(case: Case, loaded: Flow, version: int, sling: bool) -> None:
    assert loaded.flags == (case.flags if version >= 5 else 0)
    assert list(loaded.vars) == [v.name for v in case.vars]
    for v in case.vars:
        var = loaded.vars[v.name]
        assert var.aliases == v.aliases and all(loaded.var(a) is var for a in v.aliases)
        assert var.dtype == dtypes.normalize(v.dtype_name) and var.shape == v.shape
        assert int(var.flags) == (v.flags if version >= 5 else v.flags & VarFlags.REF)
        assert var.attrs == (dict(v.attrs) if version >= 6 and not sling else {})
        expected = v.expected if not sling or v.sling is not None else None
        if expected is None:
            assert var.data is None
        elif isinstance(expected, bytes):
            assert var.data.tobytes() == expected
        else:
            assert var.data.dtype == expected.dtype and var.data.shape == expected.shape
            assert var.data.tobytes() == expected.tobytes()

    assert list(loaded.ops) == [op[0] for op in case.ops]
    for name, optype, inputs, outputs, attrs, flags in case.ops:
        op = loaded.ops[name]
        assert op.type == optype and op.attrs == dict(attrs)
        assert [v.name for v in op.inputs] == inputs and [v.name for v in op.outputs] == outputs
        assert int(op.flags) == (flags if version >= 5 else 0)
    assert [(f.name, [op.name for op in f.ops], int(f.flags)) for f in loaded.funcs.values()] == [
        (name, ops, flags if version >= 5 else 0) for name, ops, flags in case.funcs
    ]
    assert [(c.name, [v.name for v in c.links], c.flags) for c in loaded.cnxs.values()] == [
        (name, links, flags if version >= 5 else 0) for name, links, flags in case.cnxs
    ]
    assert [(b.name, b.type, b.attrs, b.data, b.flags) for b in loaded.blobs.values()] == [
        (name, blobtype, dict(attrs), raw, flags if version >= 5 else 0)
        for name, blobtype, attrs, _, raw, flags in case.blobs
    ]


def test_fuzz_writer_and_reader_agree():
    rng = random.Random(SEED)
    nrng = np.random.default_rng(SEED)
    start = time.perf_counter()
    cases = 0
    while time.perf_counter() - start < BUDGET_S:
        case = random_case(rng, nrng)
        for version in (4, 5, 6):
            assert_reads_back(case, parse_flow(Flow(), ranvier_bytes(case, version), f"case {cases}"), version, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FlowFileWarning)  # its constants are reinterpreted: that is the point
            sling = parse_flow(Flow(), sling_python_bytes(case, rng), f"case {cases}, SLING's Python writer")
        assert_reads_back(case, sling, 6, True)
        cases += 1
    assert cases >= MIN_CASES
