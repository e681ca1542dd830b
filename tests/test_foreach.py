"""ForEach (one op over several sets of operands) and the horizontal fusion pass that makes
it: the op means its members on every backend (the CPU runs them one by one, the CUDA
backend as one kernel: on the host emulator, and on a GPU where there is one), the pass
groups only ops that cannot reach one another, and a training step's per-parameter work
becomes a few kernels."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check, random_array, run_flow

import ranvier as rv
from ranvier.backends.cuda import kernels, maps, ptx
from ranvier.compiler.foreach import fuse_foreach
from ranvier.compiler.schedule import schedule
from ranvier.ops.foreach import members

TESTED_OPS = {"ForEach"}


def _foreach(f, op_type: str, operands: list[list], attrs: dict | None = None):
    return f.op("ForEach", [v for group in operands for v in group], None,
                {"op": op_type, "count": len(operands), **(attrs or {})})


def _on_cuda(build, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], list[str]]:
    """The outputs of `build(f, *inputs)` computed on the CUDA backend, and its steps'
    kernel kinds."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", rv.dtypes.from_numpy(a.dtype), a.shape) for i, a in enumerate(inputs)]
    outputs = build(f, *handles)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    for t in outputs:
        t.var.out = True
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    data = cell.instance()
    for handle, value in zip(handles, inputs):
        data[handle] = value
    data.compute()
    return [np.array(data[t]) for t in outputs], [step.kernel for step in cell.steps]


# ---- the op ---------------------------------------------------------------------------------

MEMBER_CASES = {
    # op type, attributes, each member's input shapes: maps, a thread per reduced output,
    # a block per reduced output, and a block per row
    "Cast": ({"dtype": "bfloat16"}, [[(3, 5)], [(7,)], [(2, 2, 33)]]),
    "Calculate": ({"expr": "$0=Mul(%0,%1);@0=Tanh($0);@1=Exp($0)"}, [[(4, 6), (6,)], [(50,), (50,)]]),
    "Sum": ({"axis": [0]}, [[(5, 9)], [(100, 3)]]),
    "SumSquares": ({"axis": [1]}, [[(4, 300)], [(2, 70)], [(1, 1000)]]),
    "RMSNorm": ({"eps": 1e-5}, [[(6, 40), (40,)], [(3, 96), (96,)]]),
    "Pad": ({"before": [1, 0], "after": [2, 3], "value": 0.5}, [[(4, 6)], [(4, 6)], [(7, 2)]]),  # two of one signature
}


def _member_inputs(shapes: list[list[tuple]], seed: int) -> list[np.ndarray]:
    return [random_array(shape, "float32", seed=seed + i) for i, shape in enumerate(s for member in shapes for s in member)]


def _build_group(op_type: str, attrs: dict, shapes: list[list[tuple]]):
    widths = [len(member) for member in shapes]

    def build(f, *handles):
        operands, at = [], 0
        for width in widths:
            operands.append(list(handles[at:at + width]))
            at += width
        return _foreach(f, op_type, operands, attrs)

    return build


def _separately(op_type: str, attrs: dict, shapes: list[list[tuple]], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Each member as an op of its own, on the reference backend."""
    widths = [len(member) for member in shapes]

    def build(f, *handles):
        results, at = [], 0
        for width in widths:
            made = f.op(op_type, list(handles[at:at + width]), None, attrs)
            results += list(made) if isinstance(made, tuple) else [made]
            at += width
        return results

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", "float32", a.shape) for i, a in enumerate(inputs)]
    outputs = build(f, *handles)
    data = rv.Compiler("reference").compile(flow).cell("f").instance()
    for handle, value in zip(handles, inputs):
        data[handle] = value
    data.compute()
    return [np.array(data[t]) for t in outputs]


@pytest.mark.parametrize("op_type", sorted(MEMBER_CASES))
def test_a_foreach_computes_what_its_members_compute_one_by_one(op_type):
    attrs, shapes = MEMBER_CASES[op_type]
    inputs = _member_inputs(shapes, seed=3)
    result = run_flow(_build_group(op_type, attrs, shapes), inputs)  # the reference, and the CPU's members
    expected = _separately(op_type, attrs, shapes, inputs)
    assert len(result) == len(expected)
    for got, want in zip(result, expected):
        check(got, want.astype(np.float64), rv.dtypes.from_numpy(want.dtype))


def test_a_foreach_of_one_member_runs_everywhere(on_device):
    # its count is the attribute's default, which the op does not store
    x, y = random_array((37,), "float32", seed=1), random_array((37,), "float32", seed=2)
    (got,), kinds = _on_cuda(lambda f, a, b: _foreach(f, "Add", [[a, b]]), [x, y])
    assert kinds == ["ForEach"]
    check(got, x.astype(np.float64) + y, rv.dtypes.DT_FLOAT32)
    (got,) = run_flow(lambda f, a, b: _foreach(f, "Add", [[a, b]]), [x, y])
    check(got, x.astype(np.float64) + y, rv.dtypes.DT_FLOAT32)


@pytest.mark.parametrize("op_type", sorted(MEMBER_CASES))
def test_the_gpu_runs_a_foreach_as_one_kernel_with_its_members_arithmetic(on_device, op_type):
    attrs, shapes = MEMBER_CASES[op_type]
    inputs = _member_inputs(shapes, seed=5)
    got, kinds = _on_cuda(_build_group(op_type, attrs, shapes), inputs)
    want = _separately(op_type, attrs, shapes, inputs)
    grouped = op_type != "Sum"  # Sum's members run a thread and a block per output: kernels of two kinds
    assert ("ForEach" in kinds) == grouped, kinds
    for g, w in zip(got, want):
        check(g, w.astype(np.float64), rv.dtypes.from_numpy(w.dtype))


def _adam_like(f, count: int, shapes: list[tuple]):
    """`count` parameters each updated in place by its gradient and a shared scalar: an
    optimizer's step, nothing reading the updates."""
    rng = np.random.default_rng(7)
    lr = f.var("lr", "float32", [])
    params = []
    for k in range(count):
        p = f.parameter(f"p{k}", rng.standard_normal(shapes[k]).astype(np.float32))
        m = f.parameter(f"m{k}", rng.standard_normal(shapes[k]).astype(np.float32))
        g = f.var(f"g{k}", "float32", list(shapes[k]))
        params.append((p, m, g))
    update = "$0=Mul(%2,%2);$1=Add(%1,$0);%1=Identity($1);$2=Mul($1,%3);%0=Sub(%0,$2)"
    _foreach(f, "Calculate", [[p, m, g, lr] for p, m, g in params], {"expr": update})
    return lr, params


@pytest.mark.parametrize("backend", ["reference", "cpu", "cuda"])
def test_a_foreach_writes_its_members_parameters_in_place(on_device, backend):
    shapes = [(3, 4), (17,), (2, 2, 5)]
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    lr, params = _adam_like(f, 3, shapes)
    network = rv.Compiler(backend).compile(flow)
    data = network.cell("f").instance()
    data[lr] = np.float32(0.1)
    before = {t.name: np.array(network[t]) for p, m, _ in params for t in (p, m)}
    grads = []
    for k, (_, _, g) in enumerate(params):
        grads.append(random_array(shapes[k], "float32", seed=20 + k))
        data[g] = grads[-1]
    data.compute()
    if backend == "cuda":
        assert [step.kernel for step in network.cell("f").steps] == ["ForEach"]
    for (p, m, _), grad in zip(params, grads):
        moment = before[m.name].astype(np.float64) + grad.astype(np.float64) ** 2
        check(np.array(network[m]), moment, "float32")
        check(np.array(network[p]), before[p.name] - 0.1 * moment, "float32")


# ---- a ForEach of flat maps on the GPU: one body per member program, members from a table ----------

# a member's inputs: its bfloat16 parameter and gradient, its float32 moment, the shared float32
# step; its outputs: the parameter updated (bfloat16) and the moment (float32)
TABLE_UPDATE = ("$0=Cast[dtype=float32](%1);$1=Mul($0,$0);$2=Add(%2,$1);@1=Identity($2);$3=Sqrt($2);"
                "$4=Mul($3,%3);$5=Cast[dtype=float32](%0);$6=Sub($5,$4);@0=Cast[dtype=bfloat16]($6)")
CHUNK_ELEMENTS = 256 * 8  # a chunk's launch elements (a block's threads) of 8-lane vectors
# sizes under, at and past a vector, a block's vectors and a chunk (the scalar tail), and shaped ones
TABLE_SIZES = [(1,), (7,), (8,), (9,), (255,), (257,), (CHUNK_ELEMENTS - 1,), (CHUNK_ELEMENTS,),
               (CHUNK_ELEMENTS + 1,), (3, 5), (33, 65), (2, CHUNK_ELEMENTS + 9)]


def _table_update(shapes: list[tuple], seed: int) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """A ForEach of `TABLE_UPDATE` over members of `shapes`, on the CUDA backend: its outputs,
    their float64 expectation, and the steps' kernel kinds."""
    inputs = [random_array((), "float32", seed=seed, low=0.01, high=0.1)]
    for k, shape in enumerate(shapes):
        inputs += [random_array(shape, "bfloat16", seed=seed + 3 * k + 1), random_array(shape, "bfloat16", seed=seed + 3 * k + 2),
                   random_array(shape, "float32", seed=seed + 3 * k + 3, low=0.1, high=2.0)]

    def build(f, step, *handles):
        members = [[*handles[3 * k:3 * k + 3], step] for k in range(len(shapes))]
        return _foreach(f, "Calculate", members, {"expr": TABLE_UPDATE})

    got, kinds = _on_cuda(build, inputs)
    want = []
    step = np.float64(inputs[0])
    for k in range(len(shapes)):
        p, g, m = (inputs[1 + 3 * k + i].astype(np.float64) for i in range(3))
        moment = m + g * g
        want += [p - np.sqrt(moment) * step, moment]
    return got, want, kinds


def _check_table_update(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for k, (g, w) in enumerate(zip(got, want)):
        assert not np.isnan(g.astype(np.float32)).any(), f"output {k}: elements left unwritten (NaN)"
        check(g, w, "bfloat16" if k % 2 == 0 else "float32")


@pytest.mark.parametrize("count", [2, 5, 12, 40])
def test_a_table_driven_foreach_computes_every_member_at_any_count_and_size(on_device, count):
    """bfloat16 parameters with float32 state, members of every size of `TABLE_SIZES` in
    turn (vector members with and without a tail; members smaller than a vector, scalar),
    their outputs on fresh (NaN) device memory: each element the float64 update's."""
    shapes = [TABLE_SIZES[k % len(TABLE_SIZES)] for k in range(count)]
    got, want, kinds = _table_update(shapes, seed=11 * count)
    assert kinds == ["ForEach"]
    _check_table_update(got, want)


def test_each_chunk_of_a_table_driven_foreach_runs_its_own_member(on_device):
    """Members of one chunk, exactly, of a chunk and one element, and of a chunk less one
    element, side by side, each of other values: a chunk given its neighbour's member (its
    record, or its first chunk, off by one) reads and writes the wrong member, or leaves
    elements unwritten."""
    shapes = [(CHUNK_ELEMENTS,), (CHUNK_ELEMENTS + 1,), (CHUNK_ELEMENTS - 1,), (CHUNK_ELEMENTS,), (3,), (2 * CHUNK_ELEMENTS,)]
    got, want, _ = _table_update(shapes, seed=5)
    _check_table_update(got, want)


def _table_op(shapes: list[tuple]):
    """A ForEach of `TABLE_UPDATE` over members of `shapes` (not compiled)."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    step = f.var("step", "float32", [])
    members = [[f.var(f"p{k}", "bfloat16", list(s)), f.var(f"g{k}", "bfloat16", list(s)), f.var(f"m{k}", "float32", list(s)), step]
               for k, s in enumerate(shapes)]
    return _foreach(f, "Calculate", members, {"expr": TABLE_UPDATE})[0].var.producer


def test_a_table_driven_foreachs_code_is_one_body_per_member_program():
    """The kernel of 40 members is the kernel of 2 of the same programs (vector members,
    and members smaller than a vector): its size does not grow with its members (a body
    per member made stories110M's AdamW ForEach 10,776 lines of PTX); the table holds
    each member's record, and each chunk's."""
    few, (few_kernel,) = kernels.kernel_module(_table_op([(4096,), (5,)]))
    many, (kernel,) = kernels.kernel_module(_table_op([(4096 + k,) if k % 2 == 0 else (2 + k % 6,) for k in range(40)]))
    assert len(str(many).splitlines()) == len(str(few).splitlines())
    assert few_kernel.table is not None and kernel.table is not None and len(kernel.table.records) == 40
    assert kernel.elements == kernel.table.chunks * 256
    assert kernel.pointers == 1 and len(kernel.operands) == 1 + 3 * 40 + 2 * 40
    # 8-lane vectors (bf16 beside float32) with a scalar tail, or, under a vector, scalars
    assert [maps.flat_map(m).lanes for m in members(_table_op([(4096,), (5,), (9,)]))] == [8, 1, 8]


@pytest.mark.skipif(ptx.ptxas_path() is None, reason="ptxas (CUDA toolkit or nvidia-cuda-nvcc) not installed")
def test_a_table_driven_foreach_assembles_with_16_byte_accesses():
    text = ptx.emit_ptx(kernels.kernel_module(_table_op([(4096,), (5,), (33, 65)]))[0], ptx.ARCHITECTURE)
    assert "ld.global.v4" in text and "st.global.v4" in text
    ptx.assemble(text)


def test_a_foreach_names_what_is_wrong_with_its_operands():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, y, z = (f.var(n, "float32", [4]) for n in "xyz")
    with pytest.raises(rv.ShapeError, match=r"ForEach op f/ForEach.*2 members' inputs, as many each \(got 3"):
        f.op("ForEach", [x, y, z], None, {"op": "Add", "count": 2})
    with pytest.raises(rv.ShapeError, match=r"f/ForEach\S*\.1.*f/z: float32\[4\].*f/w: float32\[3\]"):
        f.op("ForEach", [x, y, z, f.var("w", "float32", [3])], None, {"op": "Add", "count": 2})
    with pytest.raises(rv.ShapeError, match="a member op type other than ForEach"):
        f.op("ForEach", [x], None, {"op": "ForEach", "count": 1})


# ---- the pass -------------------------------------------------------------------------------


def _any_elementwise(op) -> int | None:
    """A backend's key that groups every elementwise op, fused program and reduction."""
    return 0 if op.type in ("Neg", "Exp", "Cast", "Calculate", "SumSquares") else None


def _grouped(func) -> list[tuple[str, list[str]]]:
    return [(op.attrs["op"], [m.outputs[0].name if m.outputs else m.inputs[0].name for m in members(op)])
            for op in func.ops if op.type == "ForEach"]


def test_updates_nothing_reads_are_one_group():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    lr = f.var("lr", "float32", [])
    for k in range(3):
        p, m = f.parameter(f"p{k}", np.ones(3 + k, np.float32)), f.parameter(f"m{k}", np.ones(3 + k, np.float32))
        f.op("Calculate", [p, m, lr], None, {"expr": "$0=Mul(%1,%2);%0=Sub(%0,$0)"})
    func = flow.func("f")
    fuse_foreach(flow, func, _any_elementwise, 64)
    assert _grouped(func) == [("Calculate", ["f/p0", "f/p1", "f/p2"])]
    schedule(flow, func)


def _siblings_and_sources(f):
    """Three parameters' casts (sources), each read by its own product; their gradients'
    sums of squares (siblings: one Add reads them all); and a chain of Negs (each reads the
    one before: never one group)."""
    rng = np.random.default_rng(1)
    x = f.var("x", "float32", [5, 4])
    losses = []
    for k in range(3):
        w = f.parameter(f"w{k}", rng.standard_normal((4, 4)).astype(np.float32))
        y = x @ f.cast(f.cast(w, "float64"), "float32")
        losses.append(f.sum_squares(y))
    total = losses[0] + losses[1] + losses[2]
    chain = f.neg(f.neg(f.neg(x)))
    return total, chain


def test_sources_and_siblings_are_grouped_and_chains_are_not():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    for t in _siblings_and_sources(f):
        t.var.out = True
    func = flow.func("f")
    fuse_foreach(flow, func, _any_elementwise, 64)
    grouped = {kind: len(names) for kind, names in _grouped(func)}
    # the float64 casts read parameters (sources); the float32 casts back are read by one
    # product each (different readers: apart); the sums of squares all by the adds' first
    assert grouped == {"Cast": 3, "SumSquares": 2}, grouped
    order = schedule(flow, func)
    assert len(order) == len(func.ops)


def test_a_group_is_cut_where_a_kernel_would_take_too_many_variables():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [3])
    outs = [f.neg(f.var(f"v{k}", "float32", [3])) for k in range(5)]
    total = outs[0]
    for out in outs[1:]:
        total = total + out
    del x
    func = flow.func("f")
    fuse_foreach(flow, func, _any_elementwise, 4)  # two members' inputs and outputs each
    assert sorted(len(names) for _, names in _grouped(func)) == [2, 2]


def test_a_reader_of_a_variable_written_in_place_is_left_alone():
    """Two sums read by one product, one of them reading a parameter an update then
    overwrites: that one must run before the update, so it stays apart."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    p = f.parameter("p", np.ones(4, np.float32))
    q, x = f.var("q", "float32", [4]), f.var("x", "float32", [4])
    u = f.neg(x)
    a, b = (f.op("Calculate", [u, v], None, {"expr": "@0=Add(%0,%1)"}) for v in (p, q))
    (a * b).var.out = True
    f.op("Calculate", [p, q], None, {"expr": "%0=Add(%0,%1)"})
    func = flow.func("f")
    fuse_foreach(flow, func, _any_elementwise, 64)
    assert _grouped(func) == []
    schedule(flow, func)


# ---- on the GPU's code ----------------------------------------------------------------------


def test_a_foreach_may_write_over_an_input_only_within_one_member():
    from ranvier.backends.cuda.backend import CUDABackend

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, y = f.var("x", "float32", [8]), f.var("y", "float32", [8])
    op = _foreach(f, "Exp", [[x], [y]])[0].var.producer
    first, second = op.outputs
    gpu = CUDABackend()
    assert gpu.in_place(op, x.var, first) and gpu.in_place(op, y.var, second)
    assert not gpu.in_place(op, x.var, second) and not gpu.in_place(op, y.var, first)


def test_row_members_share_one_shared_array_and_assemble():
    attrs, shapes = MEMBER_CASES["RMSNorm"]
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", "float32", s) for i, s in enumerate(s for member in shapes for s in member)]
    group = _foreach(f, "RMSNorm", [handles[0:2], handles[2:4]], attrs)
    op = group[0].var.producer
    assert kernels.supports(op) and kernels.kernel_kind(op) == "ForEach"
    module, made = kernels.kernel_module(op)
    text = str(module)
    assert text.count("addrspace(3) global") == 1, "every fold of every member reuses one array of partials"
    # rows of up to 1,024 elements are a warp's, four to a 128-thread block: 6 rows take 2 blocks, 3 rows 1
    assert made[0].elements == 2 + 1 and made[0].threads == 128
    if ptx.ptxas_path() is not None:
        ptx.assemble(ptx.emit_ptx(module, ptx.ARCHITECTURE))


def test_a_training_steps_parameter_work_is_a_few_kernels(on_device):
    """A small Llama's step with clipping and AdamW: every parameter's update in two
    kernels (matrices, decayed; norms' gains, not), and its values those of the step
    computed without grouping (the CPU backend)."""
    import dataclasses

    from ranvier.models.llama import PRESETS, Llama
    from ranvier.train.losses import softmax_cross_entropy
    from ranvier.train.optimizers import AdamW
    from ranvier.train.trainer import Trainer

    config = dataclasses.replace(PRESETS["stories260K"], dim=32, hidden_dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 vocab_size=48, max_seq_len=8)
    losses = {}
    for backend in ("cpu", "cuda"):
        model = Llama(config, seed=0)
        flow = rv.Flow()
        f = rv.Builder(flow, "train")
        f.func.training = True
        tokens, targets = f.var("tokens", "int32", [2, 8]), f.var("targets", "int32", [2, 8])
        params = model.parameters(f)
        loss = softmax_cross_entropy(model(f, tokens, params).reshape([16, 48]), targets.reshape([16]))
        trainer = Trainer(loss, list(params.values()), AdamW(lr=1e-2, weight_decay=0.1, decay_matrices_only=True),
                          clip_norm=0.5, inputs=[tokens, targets], backend=backend)
        rng = np.random.default_rng(0)
        batch = [rng.integers(0, 48, (2, 8)).astype(np.int32), rng.integers(0, 48, (2, 8)).astype(np.int32)]
        losses[backend] = [float(trainer.step(batch)) for _ in range(4)]
        if backend == "cuda":
            steps = trainer.network.cell("train").steps
            updates = [s.op for s in steps if s.kernel == "ForEach" and any("adam_m" in v.name for v in s.op.inputs)]
            assert sum(int(op.attrs["count"]) for op in updates) == len(params) and len(updates) <= 3
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=2e-5)


def test_the_pipeline_groups_last_and_only_for_a_backend_that_runs_groups():
    import types

    from ranvier.backends import Capabilities, CompileOptions
    from ranvier.compiler.pipeline import PassContext, run_pipeline

    def ran_with(capabilities):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        lr = f.var("lr", "float32", [])
        for k in range(2):
            f.op("Calculate", [f.parameter(f"p{k}", np.ones(3, np.float32)), lr], None, {"expr": "%0=Sub(%0,%1)"})
        backend = types.SimpleNamespace(capabilities=capabilities, runs_whole=lambda op: True)
        ran = run_pipeline(PassContext(flow, flow.func("f"), backend, CompileOptions(), set()))
        return ran, [op.type for op in flow.func("f").ops]

    assert ran_with(Capabilities()) == (["fuse-attention", "decompose", "fold", "cse", "row-transposes", "attention-layout", "fold-views", "column-products", "fuse", "chunk-lm-head", "fuse-loss", "fuse-router",
                                         "fuse-epilogue"], ["Calculate", "Calculate"])
    ran, ops = ran_with(Capabilities(foreach=_any_elementwise, foreach_operands=16))
    assert ran[-1] == "fuse-foreach" and ops == ["ForEach"]
