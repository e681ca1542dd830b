"""The Myelin-style runtime: Compiler → Network → Cell → Instance."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ranvier as myelin


def myelin_example(seed=0):
    rng = np.random.default_rng(seed)
    flow = myelin.Flow()
    f = myelin.Builder(flow, "f")
    W = f.array("W", rng.random((64, 256), dtype=np.float32))
    b = f.array("b", rng.random(256, dtype=np.float32))
    x = f.var("x", myelin.DT_FLOAT, [1, 64])
    y = f.softmax(f.relu(f.add(f.matmul(x, W), b)), name="y")
    return flow, x, y, W, b


def test_seed_example_runs_as_written():
    flow, x, y, W, b = myelin_example()
    net = myelin.Compiler().compile(flow)
    data = net.cell("f").instance()
    xdata = data[x]
    for i in range(64):
        xdata[0, i] = 5
    data.compute()
    expected = np.maximum(np.full((1, 64), 5.0) @ W.var.data + b.var.data, 0)
    expected = np.exp(expected - expected.max())
    expected /= expected.sum()
    np.testing.assert_allclose(data[y], expected, rtol=1e-4, atol=1e-12)
    assert np.asarray(data[y]).argmax() == expected.argmax()
    # An op's name resolves to its first output, as in Myelin.
    assert data["f/y"] is not None and np.shares_memory(data["f/y"], data[y])


def test_cell_printout_shows_layout_and_kernels():
    flow, *_ = myelin_example()
    cell = myelin.Compiler("reference").compile(flow).cell("f")
    text = str(cell)
    assert text.startswith(f"cell f {{  // size {cell.size}")
    assert "input var f/x: float32[1x64]    // offset 0 size 256 alignment 64 row-major" in text
    assert "output var f/y:0: float32[1x256]" in text
    assert "  union " in text  # intermediates share storage
    assert "const f/W: float32[64x256]    // size 65536" in text
    assert "f/y:0 = Softmax[reference](f/Relu:0)" in text


def test_cpu_printout_shows_fused_kernels_and_their_expression():
    flow, *_ = myelin_example()
    text = str(myelin.Compiler("cpu").compile(flow).cell("f"))
    # the bias and ReLU after the product (one row: the streamed GEMV) run as its epilogue, the program beside it
    assert "f/Relu:0 = Gemv[" in text
    assert "// $0=Add(%0,%1);@0=Relu($0)" in text
    assert "f/y:0 = SoftmaxRow[" in text


def test_instances_are_independent_and_share_globals():
    flow, x, y, W, b = myelin_example()
    net = myelin.Compiler().compile(flow)
    cell = net.cell("f")
    a, c = cell.instance(), cell.instance()
    a[x] = 1.0
    c[x] = 2.0
    a.compute()
    c.compute()
    assert not np.allclose(a[y], c[y])
    assert np.shares_memory(a[W], c[W]) and np.shares_memory(a[W], net[W])
    net[W][...] = 0.0  # globals are the network's: both instances see the change
    net[b][...] = 0.0
    a.compute()
    np.testing.assert_allclose(a[y], np.full((1, 256), 1 / 256), rtol=1e-5)


def test_index_views_and_clear():
    flow, x, _y, *_ = myelin_example()
    cell = myelin.Compiler().compile(flow).cell("f")
    data = cell.instance()
    index = cell.index("f/x")
    assert np.shares_memory(data[index], data[x])
    data[x] = 3.0
    data.clear()
    assert not data[x].any()
    with pytest.raises(myelin.RanvierError, match="no variable 'nope'"):
        data["nope"]
    with pytest.raises(myelin.RanvierError, match=r"expected \[1x64\]"):
        data[x] = np.ones(5)
    with pytest.raises(myelin.RanvierError, match="no cell 'g'"):
        cell.network.cell("g")


def test_minus_one_is_batch_size_one_and_unknown_backends_are_refused():
    flow = myelin.Flow()
    f = myelin.Builder(flow, "f")
    x = f.var("x", myelin.DT_FLOAT, [-1, 3])
    y = f.op("Identity", [x])
    assert y.shape == [-1, 3]
    data = myelin.Compiler().compile(flow).cell("f").instance()  # as Myelin compiles -1
    assert data[x].shape == data[y].shape == (1, 3)
    assert flow.var("f/x").shape == [-1, 3]  # the flow as built
    with pytest.raises(myelin.RanvierError, match="unknown backend"):
        myelin.Compiler(backend="tpu")


def test_compiling_leaves_the_flow_as_built():
    flow, *_ = myelin_example()
    before = str(flow)
    myelin.Compiler().compile(flow)
    assert str(flow) == before


def test_shared_data_is_the_network_global_itself_where_it_is_aligned():
    """compile(share_data=True): an aligned, writable array of the variable's dtype is the
    global (no copy: writes reach both sides); anything else is still copied; by default
    every global is a copy, so running the network leaves the flow's data alone."""
    from ranvier.runtime import aligned_array, is_aligned

    rng = np.random.default_rng(4)
    weights = aligned_array(rng.standard_normal((64, 256)), np.float32)
    assert aligned_array(weights, np.float32) is weights and is_aligned(weights)
    bias = aligned_array(rng.standard_normal(257), np.float32)[1:]  # 4 bytes past a boundary
    assert not is_aligned(bias) and is_aligned(aligned_array(bias, np.float32))
    flow = myelin.Flow()
    f = myelin.Builder(flow, "f")
    w, b = f.parameter("W", weights), f.array("b", bias)
    x = f.var("x", myelin.DT_FLOAT, [2, 64])
    y = f.add(f.matmul(x, w), b, name="y")
    inputs = rng.standard_normal((2, 64)).astype(np.float32)
    for share in (False, True):
        network = myelin.Compiler().compile(flow, share_data=share)
        assert np.shares_memory(network[w], weights) == share
        assert not np.shares_memory(network[b], b.var.data)
        data = network.cell("f").instance()
        data[x] = inputs
        data.compute()
        np.testing.assert_allclose(data[y], inputs @ weights + b.var.data, rtol=1e-5, atol=1e-5)
    network[w][0, 0] += 1.0  # the shared network's weights are the flow's
    assert weights[0, 0] == network[w][0, 0]


def test_demo_command_prints_a_cell_and_a_result():
    out = subprocess.run([sys.executable, "-m", "ranvier.cli", "demo"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("cell f {") and "sum=1.000000" in out


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_profile_reports_every_step(backend):
    flow, x, _y, *_ = myelin_example()
    cell = myelin.Compiler(backend).compile(flow).cell("f")
    data = cell.instance()
    data[x] = 1.0
    for _ in range(5):
        data.compute()
    profile = data.profile()
    assert profile.computes == 5 and len(profile.steps) == len(cell.steps)
    assert all(s.seconds >= 0 for s in profile.steps) and profile.total > 0
    # on the cpu the product runs with the bias and ReLU as its epilogue (an add and a max per element)
    matmul = next(s for s in profile.steps if s.op.type in ("MatMul", "MatMulCalculate"))
    assert matmul.flops == 2 * 64 * 256 + (2 * 256 if matmul.op.type == "MatMulCalculate" else 0)
    text = str(profile)
    assert text.startswith("profile of cell f: 5 computes") and "GFLOP/s" in text and "MatMul" in text
    # the same time by kernel: each kernel's steps summed, largest first, every step counted once
    summary = profile.by_kernel().splitlines()
    kernels = {s.kernel.split("[")[0] for s in profile.steps}
    assert summary[0].startswith("cell f:") and len(summary) == 2 + len(kernels)
    rows = [line.split() for line in summary[2:]]
    assert sum(int(row[1]) for row in rows) == len(profile.steps)
    times = [float(row[2]) for row in rows]
    assert times == sorted(times, reverse=True) and abs(sum(times) - profile.total * 1e6) <= 0.1 * len(rows)
    data.reset_profile()
    assert data.profile().computes == 0 and data.profile().total == 0


def test_state_written_by_one_cell_is_no_constant_of_another():
    """A global that one function updates in place is read live by the others, never folded."""
    flow = myelin.Flow()
    write = myelin.Builder(flow, "write")
    state = flow.add_var("counter", "float32", [3])
    state.set_data(np.zeros(3, np.float32))
    s = write.wrap(state)
    write.op("Assign", [s, s + 1.0])
    read = myelin.Builder(flow, "read")
    offset = read.var("offset", "float32", [3])
    doubled = read.wrap(state) * 2.0 + offset
    doubled.var.out = True
    network = myelin.Compiler().compile(flow)
    writer, reader = network.cell("write").instance(), network.cell("read").instance()
    writer.compute()
    writer.compute()
    reader[offset] = [0.5, 1.5, 2.5]
    reader.compute()
    np.testing.assert_array_equal(reader[doubled], [4.5, 5.5, 6.5])
