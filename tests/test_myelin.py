"""Myelin programs run with only the import line changed.

The checks are written from Myelin's documented Python API (its guide, builder, nn
cells, runtime handles and gradient functions), in the style of its own op and
gradient checks, and compare against numpy.
"""

import math

import numpy as np
import pytest

import ranvier as myelin
from ranvier import nn

RNG = np.random.default_rng(14)
compiler = myelin.Compiler()


def run(flow, inputs=None, lo=-10.0, hi=10.0, name=None):
    """Compile, fill every data-less input with random numbers, compute; (data, inputs)."""
    net = compiler.compile(flow)
    f = next(iter(flow.funcs.values())) if name is None else flow.func(name)
    data = net.cell(f.name).instance()
    filled = {}
    for v in inputs or flow.inputs(f):
        if v.data is not None:
            continue
        values = RNG.uniform(lo, hi, v.shape)
        if myelin.dtypes.is_float(v.type):
            values = values.astype(v.type)
        else:
            values = np.round(values).astype(v.type)
        data[v] = values
        filled[v.name] = values
    data.compute()
    return data, filled


# ---- the guide -------------------------------------------------------------------------


def test_the_guide_example():
    flow = myelin.Flow()
    f = myelin.Builder(flow, "f")
    W = f.array("W", np.random.rand(64, 256).astype(np.float32))
    b = f.array("b", np.random.rand(256).astype(np.float32))
    x = f.var("x", myelin.DT_FLOAT, [1, 64])
    y = f.softmax(f.relu(f.add(f.matmul(x, W), b)), name="y")
    net = myelin.Compiler().compile(flow)
    cell = net.cell("f")
    data = cell.instance()
    xv = np.random.rand(1, 64).astype(np.float32)
    data[x] = xv
    data.compute()
    logits = np.maximum(xv.astype(np.float64) @ W.data + b.data, 0)
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(data[y], expected, rtol=1e-4, atol=1e-7)
    assert isinstance(data.tensor(y)[0, 3], float)
    assert "cell f" in str(cell)


# ---- op checks, as Myelin's opcheck ---------------------------------------------------

UNARY = {
    "neg": (np.negative, -10, 10), "abs": (np.abs, -10, 10), "square": (np.square, -10, 10),
    "relu": (lambda x: np.maximum(x, 0), -10, 10), "rcp": (lambda x: 1 / x, 1, 10),
    "sqrt": (np.sqrt, 0.1, 10), "rsqrt": (lambda x: 1 / np.sqrt(x), 1, 10), "exp": (np.exp, -10, 10),
    "log": (np.log, 0.1, 10), "sin": (np.sin, -10, 10), "cos": (np.cos, -10, 10), "tanh": (np.tanh, -1, 1),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), -10, 10), "erf": (np.vectorize(math.erf), -2, 2),
    "sign": (np.sign, -10, 10), "floor": (np.floor, -10, 10), "ceil": (np.ceil, -10, 10), "round": (np.round, -10, 10),
    "trunc": (np.trunc, -10, 10), "tan": (np.tan, -1.2, 1.2), "asin": (np.arcsin, -1, 1), "acos": (np.arccos, -1, 1),
    "atan": (np.arctan, -10, 10), "sinh": (np.sinh, -5, 5), "cosh": (np.cosh, -5, 5), "asinh": (np.arcsinh, -1, 1),
    "acosh": (np.arccosh, 1, 10), "atanh": (np.arctanh, -0.9, 0.9), "cot": (lambda x: 1 / np.tan(x), 0.2, 1.4),
    "sec": (lambda x: 1 / np.cos(x), -1.2, 1.2), "csc": (lambda x: 1 / np.sin(x), 0.2, 3), "acot": (lambda x: np.arctan(1 / x), 0.1, 10),
    "asec": (lambda x: np.arccos(1 / x), 1, 10), "acsc": (lambda x: np.arcsin(1 / x), 1, 10), "coth": (lambda x: 1 / np.tanh(x), 0.1, 5),
    "sech": (lambda x: 1 / np.cosh(x), -5, 5), "csch": (lambda x: 1 / np.sinh(x), 0.1, 5),
    "acoth": (lambda x: np.arctanh(1 / x), 1.1, 10), "asech": (lambda x: np.arccosh(1 / x), 0.1, 1),
    "acsch": (lambda x: np.arcsinh(1 / x), 0.1, 10),
}


@pytest.mark.parametrize("dt", [myelin.DT_FLOAT, myelin.DT_DOUBLE])
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_op_check(op, dt):
    reference, lo, hi = UNARY[op]
    for n in (1, 7, 33):
        flow = myelin.Flow()
        f = flow.define(op)
        x = f.var("x", dt, [n])
        y = getattr(f, op)(x)
        data, inputs = run(flow, lo=lo, hi=hi)
        expected = reference(inputs[x.name].astype(np.float64))
        np.testing.assert_allclose(data[y], expected, rtol=1e-5 if dt == myelin.DT_FLOAT else 1e-12, atol=1e-6, err_msg=op)


BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "minimum": np.minimum,
    "maximum": np.maximum, "equal": np.equal, "not_equal": np.not_equal, "less": np.less,
    "less_equal": np.less_equal, "greater": np.greater, "greater_equal": np.greater_equal,
}


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_op_check(op):
    flow = myelin.Flow()
    f = flow.define(op)
    x, y = f.var("x", myelin.DT_FLOAT, [9]), f.var("y", myelin.DT_FLOAT, [9])
    z = getattr(f, op)(x, y)
    data, inputs = run(flow, lo=1, hi=10)
    expected = BINARY[op](inputs[x.name], inputs[y.name])
    # Myelin's comparisons give masks; ranvier's give bool, which read the same way.
    np.testing.assert_allclose(np.array(data[z], dtype=expected.dtype), expected, rtol=1e-6)


def test_reductions_logic_cond_select_and_constants():
    flow = myelin.Flow()
    f = flow.define("mix")
    x = f.var("x", myelin.DT_FLOAT, [3, 4, 5])
    c = f.var("c", myelin.DT_FLOAT, [3, 4, 5])
    outs = {
        "sum1": f.sum(x, 1, True), "max2": f.max(x, axis=2, keepdims=True), "min": f.min(x), "prod": f.product(f.div(x, 10.0)),
        "all": f.all(f.greater(x, f.const(-9.0, myelin.DT_FLOAT))), "any": f.any(f.greater(x, 9.5)),
        "argmax": f.argmax(x), "argmin": f.argmin(x), "mean": f.mean(x, 1), "norm": f.norm(x), "normalize": f.normalize(x),
        "cond": f.cond(f.greater(c, 0.0), x, c), "select": f.select(f.less(c, 0.0), x),
        "logic": f.logical_and(f.logical_not(f.equal(x, c)), f.logical_xor(f.greater(x, c), f.less(x, 0.0))),
        "bcast": f.mul(x, f.const(7, myelin.DT_FLOAT)), "softmax": f.softmax(f.reshape(x, [60])),
    }
    data, inputs = run(flow)
    xv, cv = inputs[x.name].astype(np.float64), inputs[c.name].astype(np.float64)
    expected = {
        "sum1": xv.sum(1, keepdims=True), "max2": xv.max(2, keepdims=True), "min": xv.min(), "prod": np.prod(xv / 10),
        "all": np.all(xv > -9), "any": np.any(xv > 9.5), "argmax": np.argmax(xv), "argmin": np.argmin(xv),
        "mean": xv.mean(1), "norm": np.sqrt((xv**2).sum()), "normalize": xv / np.sqrt((xv**2).sum()),
        "cond": np.where(cv > 0, xv, cv), "select": np.where(cv < 0, xv, 0),
        "logic": (xv != cv) & ((xv > cv) ^ (xv < 0)), "bcast": xv * 7,
        "softmax": np.exp(xv.ravel() - xv.max()) / np.exp(xv.ravel() - xv.max()).sum(),
    }
    for key, out in outs.items():
        np.testing.assert_allclose(np.asarray(data[out], dtype=np.float64), expected[key], rtol=2e-5, atol=1e-6, err_msg=key)


def test_matmul_transpose_concat_split_gather_and_accumulate():
    flow = myelin.Flow()
    f = flow.define("shapes")
    A, B = f.var("A", myelin.DT_FLOAT, [4, 3]), f.var("B", myelin.DT_FLOAT, [5, 3])
    C = f.var("C", myelin.DT_FLOAT, [4, 5])
    a, b = f.var("a", myelin.DT_FLOAT, [1, 3]), f.var("b", myelin.DT_FLOAT, [1, 6])
    emb = f.array("emb", RNG.random((10, 3)).astype(np.float32))
    ind = f.var("ind", myelin.DT_INT32, [1, 4])
    mm = f.matmul(A, f.t(B), "mm")
    tr = f.transpose(f.reshape(A, [2, 2, 3]), perm=[1, 2, 0])
    cat = f.concat([a, b])
    parts = f.split(b, 3, 1)
    g = f.gather(emb, ind)
    f.assign(C, f.add(C, f.matmul(A, f.t(B))))
    data, inputs = run(flow, inputs=[A, B, C, a, b], lo=0, hi=9)
    data[ind] = RNG.integers(0, 10, (1, 4))
    C0 = np.array(data[C])
    data.compute()
    Av, Bv = inputs[A.name], inputs[B.name]
    np.testing.assert_allclose(data[mm], Av @ Bv.T, rtol=1e-5)
    np.testing.assert_allclose(data[tr], np.transpose(Av.reshape(2, 2, 3), (1, 2, 0)))
    np.testing.assert_allclose(data[cat], np.concatenate([inputs[a.name], inputs[b.name]], axis=1))
    for part, piece in zip(parts, np.split(inputs[b.name], 3, 1)):
        np.testing.assert_allclose(data[part], piece)
    np.testing.assert_allclose(data[g], np.take(emb.data, np.asarray(data[ind]), axis=0))
    np.testing.assert_allclose(data[C], C0 + Av @ Bv.T, rtol=1e-5)
    assert mm.name == "shapes/mm:0" and cat.shape == [1, 9]


# ---- builder and flow API ------------------------------------------------------------------

# Every member of SLING's Python classes (python/myelin/flow.py and builder.py): methods, then attributes.
MYELIN_API = {
    "Variable": ("add_attr attr shape_defined elements rank typestr",
                 "input output ref learnable unique name flags aliases type shape attrs data producer consumers"),
    "Operation": ("add_input add_output add_attr attr", "name flags type inputs outputs attrs func"),
    "Function": ("add", "backprop name flags ops"),
    "Connector": ("add", "name flags links"),
    "Blob": ("add_attr get_attr", "name flags type data attrs"),
    "Flow": ("func var op cnx blob define rename_prefix rename_suffix inputs outputs order save load",
             "flags vars ops funcs cnxs blobs"),
    "Builder": ("var rename cnx op rawop const array opname varname concat split reshape add sub mul div minimum "
                "maximum argmin argmax gather pooling_gather gather_sum gather_max gather_avg matmul transpose t log "
                "exp pow erf sigmoid relu sin cos tan cot sec csc asin acos atan acot asec acsc sinh cosh tanh coth "
                "sech csch asinh acosh atanh acoth asech acsch square sqrt rsqrt neg abs sign rcp floor ceil round "
                "trunc equal not_equal less less_equal greater greater_equal logical_and logical_or logical_xor "
                "logical_not cond select identity reduce sum product min max all any count mean norm normalize "
                "softmax ref shape size rank assign assign_add_scatter", "flow func"),
}


@pytest.mark.parametrize("kind", sorted(MYELIN_API))
def test_every_member_of_myelins_python_api_exists(kind):
    flow = myelin.Flow()
    objects = {"Variable": flow.var("v"), "Operation": flow.op("o"), "Function": flow.func("f"),
               "Connector": flow.cnx("c"), "Blob": flow.blob("b"), "Flow": flow, "Builder": flow.define("g")}
    obj = objects[kind]
    methods, attributes = MYELIN_API[kind]
    assert not [m for m in methods.split() if not callable(getattr(obj, m, None))], "missing methods"
    assert not [a for a in attributes.split() if not hasattr(obj, a)], "missing attributes"
    assert isinstance(flow.define("h").var("x", myelin.DT_FLOAT, [2]).var, myelin.Variable)



def test_builder_results_are_variables():
    flow = myelin.Flow()
    f = flow.define("f")
    x = f.var("x", myelin.DT_FLOAT, [1, 4])
    W = f.var("W", myelin.DT_FLOAT, [4, 2])
    y = f.matmul(x, W, "y")
    assert (y.type, y.shape, y.rank(), y.elements()) == ("float32", [1, 2], 2, 2)
    assert y.producer.type == "MatMul" and y.producer.inputs[0] is x.var and x.consumers[0] is y.producer
    y.type, y.shape = myelin.DT_FLOAT, [1, 2]  # Myelin programs restate what the builder inferred
    y.ref = y.input = y.output = True
    assert y.var.ref and y.var.in_ and y.var.out and y.flags & 7 == 7
    W.data = RNG.random((4, 2)).astype(np.float32)
    assert W.var.constant
    y.add_attr("note", True)
    assert y.attr("note") == "1"
    assert f.array("ints", [[1, 2], [3, 4]]).type == "int32" and f.array("floats", [1, 2.5]).type == "float32"
    with pytest.raises(myelin.RanvierError, match="already defined"):
        f.var("x")


def test_flow_api_as_myelin():
    flow = myelin.Flow()
    v = flow.var("made", myelin.DT_INT32, [3])
    assert flow.var("made") is v and v.type == "int32"
    op = flow.op("raw")
    assert flow.op("raw") is op
    f = flow.define("f")
    x = f.var("x", myelin.DT_FLOAT, [2])
    k = f.const(3.0)
    y = f.mul(x, k, "y")
    z = f.neg(y, "z")
    assert flow.inputs(f.func) == [x.var, k.var] and flow.inputs(f.func, const=False) == [x.var]
    assert flow.outputs(f.func) == [z.var]
    ordered_vars, ordered_ops = flow.order(f.func)
    assert [o.name for o in ordered_ops] == ["f/y", "f/z"] and ordered_vars[-1] is z.var
    f.rename(z, "result")
    assert z.name == "f/result" and flow.var("f/result") is z.var
    flow.rename_prefix("f/", "g/")
    flow.rename_suffix(":0", "_out")
    assert "g/x" in flow.vars and "g/y_out" in flow.vars and "g/y" in flow.ops
    assert flow.var("g/x") is x.var


def test_rawop_and_connectors():
    flow = myelin.Flow()
    f = flow.define("f")
    a, b = f.var("a", myelin.DT_FLOAT, [1, 2]), f.var("b", myelin.DT_FLOAT, [1, 3])
    op = f.rawop("Concat")
    for part in (a, b, f.const(1)):
        op.add_input(part.var)
    op.add_attr("N", 2)
    out = flow.var("f/cat", myelin.DT_FLOAT, [1, 5])
    op.add_output(out)
    cnx = f.cnx("link", [a, b])
    assert flow.cnxs["f/link"] is cnx and cnx.links == [a.var, b.var]
    data, inputs = run(flow, inputs=[a, b])
    np.testing.assert_allclose(data[out], np.concatenate([inputs[a.name], inputs[b.name]], 1))


# ---- runtime -------------------------------------------------------------------------------------


def test_tensor_handles_and_profile():
    flow = myelin.Flow()
    f = flow.define("f")
    x = f.var("x", myelin.DT_FLOAT, [3])
    s = f.sum(f.square(x), name="s")
    net = compiler.compile(flow)
    cell = net.cell("f")
    assert x.name in cell and s in cell and "f/nothing" not in cell
    data = cell.instance()
    handle = data.tensor(x)
    assert (handle.name(), handle.rank(), handle.shape(), handle.type(), len(handle)) == ("f/x", 1, [3], "float32", 3)
    np.copyto(np.asarray(handle), [1.0, 2.0, 3.0])  # a view, as Myelin's buffer
    handle[2] = 4.0
    data.compute()
    total = data.tensor(cell.index(s))[()]
    assert isinstance(total, float) and total == 21.0
    assert "profile of cell f" in net.profile()
    assert "float32" in repr(handle)


def test_the_guides_tensor_example_and_numpy_use_of_the_same_tensors():
    """The guide's "Putting it all together": data[x] is a tensor with Myelin's methods,
    written element by element; the same object is ranvier's writable numpy view."""
    flow = myelin.Flow()
    f = myelin.Builder(flow, "f")
    W = f.array("W", RNG.random((64, 256)).astype(np.float32))
    b = f.array("b", RNG.random(256).astype(np.float32))
    x = f.var("x", myelin.DT_FLOAT, [1, 64])
    y = f.softmax(f.relu(f.add(f.matmul(x, W), b)), name="y")
    data = myelin.Compiler().compile(flow).cell("f").instance()
    xdata = data[x]
    for i in range(64):
        xdata[0, i] = 5
    data.compute()
    ydata = data[y]
    logits = np.maximum(np.full((1, 64), 5.0) @ W.data + b.data, 0)
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(np.asarray(ydata), expected, rtol=1e-4, atol=1e-7)
    assert np.asarray(ydata).argmax() == ydata.argmax() == expected.argmax()
    assert (ydata.name(), ydata.rank(), ydata.shape(), ydata.type()) == ("f/y:0", 2, [1, 256], "float32")
    assert ydata.shape == (1, 256) and ydata[0].shape() == [256] and ydata[0].name() == "f/y:0"  # views of it
    dump = str(data).splitlines()
    assert "f/x = [[" + ",".join(["5."] * 64) + "]]" in dump and any(line.startswith("f/y:0 = [[") for line in dump)
    # numpy's own use: what is computed from a tensor is a plain array, written into it stays it.
    data[x][...] = RNG.random((1, 64))
    assert type(ydata * 2) is np.ndarray and type(ydata.sum()) is np.float32
    ydata += 1
    assert ydata.name() == "f/y:0" and np.asarray(data[y]).min() >= 1
    with pytest.raises(myelin.RanvierError, match="a copy of a tensor, not the tensor"):
        ydata.copy().name()


def test_tensor_handles_index_as_pysling_does():
    """data.tensor(x)[i] on a tensor of rank 2 or more is element i in row-major order;
    any index of a scalar is the scalar (pymyelin.cc, PyTensor::GetAddress)."""
    flow = myelin.Flow()
    f = flow.define("f")
    m = f.var("m", myelin.DT_FLOAT, [2, 3])
    s = f.var("s", myelin.DT_FLOAT)
    v = f.var("v", myelin.DT_INT32, [4])
    f.identity(m), f.identity(s), f.identity(v)
    data = compiler.compile(flow).cell("f").instance()
    values = RNG.random((2, 3)).astype(np.float32)
    data[m], data[s], data[v] = values, 0.25, [4, 5, 6, 7]
    t = data.tensor(m)
    assert [t[i] for i in range(6)] == values.reshape(-1).tolist()
    assert t[1, 2] == t[5] and t[(0, 1)] == t[1]
    t[4] = -1.0
    assert data[m][1, 1] == -1
    for bad in (6, -1):
        with pytest.raises(IndexError, match=f"element {bad} of f/m, which has 6 elements"):
            t[bad]
    scalar = data.tensor(s)
    assert scalar[0] == scalar[7] == scalar[()] == 0.25
    scalar[3] = 2.0
    assert data[s] == 2.0
    vector = data.tensor(v)
    assert (vector[-1], vector[1]) == (7, 5) and isinstance(vector[0], int)
    with pytest.raises(IndexError):
        vector[4]


def test_handles_and_variables_find_each_other_in_dicts():
    """SLING's opcheck keys its numpy baseline by the variables and reads it by the builder's handles."""
    flow = myelin.Flow()
    f = flow.define("f")
    x = f.var("x", myelin.DT_FLOAT, [2])
    y = f.relu(x)
    baseline = {var: var.name for var in flow.vars.values()}
    assert baseline[x] == "f/x" and baseline[y] == y.name
    assert {x: 1}[flow.var("f/x")] == 1
    assert x == flow.var("f/x") and flow.var("f/x") == x and x != y and x != "f/x"


def test_network_globals_are_set_by_key():
    flow = myelin.Flow()
    f = flow.define("f")
    x = f.var("x", myelin.DT_FLOAT, [1, 3])
    W = f.array("W", RNG.random((3, 2)).astype(np.float32))
    b = f.array("b", RNG.random(2).astype(np.float32))
    y = f.add(f.matmul(x, W), b)
    net = compiler.compile(flow)
    net[b] = [1.0, -2.0]
    net["f/W"] = np.eye(3, 2)
    assert (net[b].name(), net[b].shape()) == ("f/b", [2])
    data = net.cell("f").instance()
    data[x] = [[3.0, 4.0, 5.0]]
    data.compute()
    np.testing.assert_array_equal(data[y], [[4.0, 2.0]])
    with pytest.raises(myelin.RanvierError, match=r"cannot set f/b: got an array of shape \[3\], expected \[2\]"):
        net[b] = [1.0, 2.0, 3.0]
    with pytest.raises(myelin.RanvierError, match="f/x is not a global of the network"):
        net[x] = 1.0


def test_an_op_type_ranvier_does_not_define_is_built_as_myelin_builds_it():
    """Myelin's builder adds any op type: its output takes the first input's type and the
    highest-rank input's shape; only compiling it fails."""
    flow = myelin.Flow()
    f = flow.define("f")
    x, k = f.var("x", myelin.DT_INT32), f.var("k", myelin.DT_FLOAT, [2, 3])
    y = f.op("Frobnicate", [x, k], "y")
    assert (y.name, y.type, y.shape, y.producer.type) == ("f/y:0", "int32", [2, 3], "Frobnicate")
    with pytest.raises(myelin.UnknownOpError, match="Frobnicate op f/y of function f: ranvier has no definition"):
        compiler.compile(flow)


def test_channels_and_connect_errors():
    flow = myelin.Flow()
    f = flow.define("f")
    h = f.var("h", myelin.DT_FLOAT, [1, 2])
    h.ref = True
    out = f.add(h, 1.0, "out")
    out.ref = True
    net = compiler.compile(flow)
    cell = net.cell("f")
    channel = cell.channel(h, 3)
    assert len(channel) == 3 and channel[0].shape() == [1, 2]
    data = cell.instance()
    for t in range(2):
        data.connect(h, channel, t)
        data.connect(out, channel, t + 1)
        data.compute()
    np.testing.assert_array_equal(np.asarray(channel[2]), [[2.0, 2.0]])
    channel.resize(1)
    assert len(channel) == 1
    with pytest.raises(myelin.RanvierError, match="no element 5"):
        data.connect(h, channel, 5)
    plain = f.var("plain", myelin.DT_FLOAT, [1, 2])
    f.add(plain, 1.0)
    other = compiler.compile(flow).cell("f").instance()
    with pytest.raises(myelin.RanvierError, match="not a reference"):
        other.connect(plain, channel, 0)


def test_nn_ff_with_layer_data_and_hidden_output():
    flow = myelin.Flow()
    f = flow.define("ff")
    x = f.var("x", myelin.DT_FLOAT, [1, 6])
    ff = nn.FF(f, x, [5, 4, 3], hidden=1)
    weights = [RNG.normal(size=w.shape).astype(np.float32) for w in ff.weights]
    biases = [RNG.normal(size=b.shape).astype(np.float32) for b in ff.biases]
    for index, (w, b) in enumerate(zip(weights, biases)):
        ff.set_layer_data(index, w, b)
    data, inputs = run(flow, inputs=[x])
    h = inputs[x.name].astype(np.float64)
    hidden = None
    for index, (w, b) in enumerate(zip(weights, biases)):
        h = h @ w + b
        if index < 2:
            h = np.maximum(h, 0)
        if index == 1:
            hidden = h
    np.testing.assert_allclose(data[ff.output], h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(data[ff.hidden_out], hidden, rtol=1e-5, atol=1e-6)
    assert ff.hidden_out.ref and ff.output.name == "ff/output:0"


def test_nn_lstm_runs_a_sequence_through_channels():
    flow = myelin.Flow()
    f = flow.define("lstm")
    x = f.var("x", myelin.DT_FLOAT, [1, 5])
    lstm = nn.LSTM(f, x, 4)
    cell = compiler.compile(flow).cell("lstm")
    names = ["x2i", "h2i", "c2i", "bi", "x2o", "h2o", "c2o", "bo", "x2c", "h2c", "bc"]
    params = {n: RNG.normal(size=getattr(lstm, n).shape) * 0.5 for n in names}
    steps = 6
    xs = RNG.normal(size=(steps, 1, 5))
    hidden, control = cell.channel(lstm.ht, steps + 1), cell.channel(lstm.ct, steps + 1)
    for t in range(steps):
        data = cell.instance()
        for n, value in params.items():
            data[getattr(lstm, n)] = value
        data[x] = xs[t]
        data.connect("lstm/h_in", hidden, t)
        data.connect("lstm/c_in", control, t)
        data.connect(lstm.ht, hidden, t + 1)
        data.connect(lstm.ct, control, t + 1)
        data.compute()

    def sigmoid(z):
        return 1 / (1 + np.exp(-z))

    p, h, c = params, np.zeros((1, 4)), np.zeros((1, 4))
    for t in range(steps):
        i = sigmoid(xs[t] @ p["x2i"] + h @ p["h2i"] + c @ p["c2i"] + p["bi"])
        c = i * np.tanh(xs[t] @ p["x2c"] + h @ p["h2c"] + p["bc"]) + (1 - i) * c
        o = sigmoid(xs[t] @ p["x2o"] + c @ p["c2o"] + h @ p["h2o"] + p["bo"])
        h = o * np.tanh(c)
    np.testing.assert_allclose(np.asarray(hidden[steps]), h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(control[steps]), c, rtol=1e-5, atol=1e-6)
    assert lstm.cnx_hidden.links[0].name == "lstm/h_in"


# ---- gradients, as Myelin's gradcheck --------------------------------------------------


def adjointvar(v):
    slash = v.name.find("/")
    return "gradients/d_" + v.name if slash == -1 else "gradients/" + v.name[:slash] + "/d_" + v.name[slash + 1:]


def gradcheck(f, inputs, outputs, lo=-3.0, hi=3.0, eps=1e-6):
    """Myelin's procedure: a one-hot output adjoint per output element, the analytical
    input adjoints against central differences, all in float64."""
    for v in inputs:
        v.input = True
    for v in outputs:
        v.output = True
    f.func.backprop = True
    net = compiler.compile(f.flow)
    cell, gcell = net.cell(f.func.name), net.cell("gradients/" + f.func.name)
    primal_name = "gradients/" + f.func.name + "/primal"
    primal = gcell.index(primal_name) if primal_name in gcell else -1
    x = {v.name: RNG.uniform(lo, hi, v.shape) for v in inputs}
    data = cell.instance()
    for v in inputs:
        data[v] = x[v.name]
    data.compute()
    worst = 0.0
    for output in outputs:
        adjoint = gcell.index(adjointvar(output)) if adjointvar(output) in gcell else -1
        for j in range(output.elements()):
            gdata = gcell.instance()
            if primal != -1:
                gdata[primal] = data
            if adjoint != -1:
                gdata.tensor(adjoint)[j] = 1.0
            gdata.compute()
            for v in inputs:
                gradient = gdata.tensor(adjointvar(v))
                for i in range(v.elements()):
                    shifted = []
                    for sign in (1, -1):
                        other = cell.instance()
                        for u in inputs:
                            value = x[u.name].copy()
                            if u is v:
                                value.reshape(-1)[i] += sign * eps
                            other[u] = value
                        other.compute()
                        shifted.append(other.tensor(output)[j])
                    numerical = (shifted[0] - shifted[1]) / (2 * eps)
                    analytical = np.asarray(gradient).flat[i]
                    worst = max(worst, abs(analytical - numerical) / (1 + abs(numerical)))
    return worst


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "minimum", "maximum"])
def test_binary_gradient_check(op):
    flow = myelin.Flow()
    f = flow.define(op)
    x1, x2 = f.var("x1", myelin.DT_DOUBLE, [5]), f.var("x2", myelin.DT_DOUBLE, [5])
    y = getattr(f, op)(x1, x2, "y")
    assert gradcheck(f, [x1, x2], [y], lo=0.5, hi=3.0) < 1e-7


GRADIENT_RANGES = {"asin": (-0.9, 0.9), "acos": (-0.9, 0.9), "atanh": (-0.9, 0.9), "tan": (-1.2, 1.2), "sec": (-1.2, 1.2),
                   "cot": (0.2, 1.4), "asec": (1.1, 10), "acsc": (1.1, 10), "acosh": (1.1, 10), "acoth": (1.1, 10),
                   "asech": (0.1, 0.9)}


@pytest.mark.parametrize("op", ["square", "sqrt", "rcp", "neg", "abs", "exp", "log", "sin", "cos", "tanh", "sigmoid", "relu",
                                "erf", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "asec", "acsc", "sinh",
                                "cosh", "coth", "sech", "csch", "asinh", "acosh", "atanh", "acoth", "asech", "acsch"])
def test_unary_gradient_check(op):
    flow = myelin.Flow()
    f = flow.define(op)
    x = f.var("x", myelin.DT_DOUBLE, [6])
    y = getattr(f, op)(x, "y")
    lo, hi = GRADIENT_RANGES.get(op, (0.2, 3.0))
    assert gradcheck(f, [x], [y], lo=lo, hi=hi) < 1e-7


def test_myelins_shape_counting_pooling_and_scatter_ops():
    flow = myelin.Flow()
    f = flow.define("misc")
    x = f.var("x", myelin.DT_FLOAT, [3, 5])
    emb = f.array("emb", RNG.random((10, 4)).astype(np.float32))
    ind = f.var("ind", myelin.DT_INT32, [1, 3])
    m = f.var("m", myelin.DT_FLOAT, [10, 4])
    v = f.var("v", myelin.DT_FLOAT, [1, 4])
    outs = {"shape": f.shape(x), "size": f.size(x), "rank": f.rank(x), "count": f.count(f.greater(x, 0.0)),
            "sum": f.gather_sum(emb, ind), "max": f.gather_max(emb, ind), "avg": f.gather_avg(emb, ind)}
    f.assign_add_scatter(m, ind, v)
    net = compiler.compile(flow)
    data = net.cell("misc").instance()
    xv, iv = RNG.uniform(-5, 5, (3, 5)).astype(np.float32), np.array([[2, 7, 2]], np.int32)
    mv, vv = RNG.random((10, 4)).astype(np.float32), RNG.random((1, 4)).astype(np.float32)
    data[x], data[ind], data[m], data[v] = xv, iv, mv, vv
    data.compute()
    rows = emb.data[iv[0]]
    expected = {"shape": [3, 5], "size": 15, "rank": 2, "count": np.count_nonzero(xv > 0),
                "sum": rows.sum(0, keepdims=True), "max": rows.max(0, keepdims=True), "avg": rows.mean(0, keepdims=True)}
    for key, out in outs.items():
        np.testing.assert_allclose(np.asarray(data[out]).reshape(np.shape(expected[key])), expected[key], rtol=1e-6, err_msg=key)
    assert outs["count"].type == "float32" and outs["shape"].type == "int32"
    scattered = mv.copy()
    np.add.at(scattered, iv[0], vv[0])
    np.testing.assert_allclose(data[m], scattered, rtol=1e-6)


def test_gradient_of_a_small_network_and_learnable_accumulation():
    flow = myelin.Flow()
    f = flow.define("net")
    x = f.var("x", myelin.DT_DOUBLE, [2, 3])
    W = f.var("W", myelin.DT_DOUBLE, [3, 4])
    y = f.sum(f.tanh(f.matmul(x, W)), 1, name="y")
    assert gradcheck(f, [x, W], [y]) < 1e-7

    # A learnable parameter's adjoint accumulates over computes until the instance is cleared.
    flow = myelin.Flow()
    f = flow.define("fit")
    x = f.var("x", myelin.DT_DOUBLE, [3])
    w = f.array("w", RNG.normal(size=3))
    w.learnable = True
    loss = f.sum(f.mul(x, w), name="loss")
    loss.output = True
    f.func.backprop = True
    net = compiler.compile(flow)
    forward = net.cell("fit").instance()
    forward[x] = [1.0, 2.0, 3.0]
    forward.compute()
    backward = net.cell("gradients/fit").instance()
    backward["gradients/fit/primal"] = forward
    backward["gradients/fit/d_loss:0"] = 1.0
    backward.compute()
    backward.compute()
    np.testing.assert_allclose(backward["gradients/fit/d_w"], [2.0, 4.0, 6.0])
    np.testing.assert_allclose(backward["gradients/fit/d_x"], w.data)
    with pytest.raises(myelin.RanvierError, match="primal"):
        net.cell("gradients/fit").instance().compute()
    with pytest.raises(myelin.RanvierError, match="not of gradients/fit"):
        backward["gradients/fit/primal"] = backward


def test_a_gradient_that_is_its_seed_is_a_value_of_the_gradient_function():
    """d(x1 + x2)/dx1 is the seed itself: autodiff.gradient(..., seed=, into=) copies it into
    the gradient function, as func.backprop's gradients/<f> does (Myelin's gradient cell)."""
    flow = myelin.Flow()
    f = myelin.Builder(flow, "add")
    x1, x2 = f.var("x1", myelin.DT_FLOAT, [4]), f.var("x2", myelin.DT_FLOAT, [4])
    y = f.add(x1, x2, name="y")
    seed = myelin.Builder(flow, "gradients/add").var("d_y", myelin.DT_FLOAT, [4])
    grads = myelin.autodiff.gradient(flow, "add", [x1, x2], loss=y, seed=seed, into="gradients/add")
    net = compiler.compile(flow)
    forward = net.cell("add").instance()
    forward[x1], forward[x2] = RNG.random(4), RNG.random(4)
    forward.compute()
    backward = net.cell("gradients/add").instance()
    seed_values = RNG.standard_normal(4).astype(np.float32)
    backward[seed] = seed_values
    backward.compute()
    np.testing.assert_array_equal(backward[grads[x1.name]], seed_values)
    np.testing.assert_array_equal(backward[grads[x2.name]], seed_values)
    backward.link(forward)  # it reads no forward value: any instance links, unused
    backward.compute()
    np.testing.assert_array_equal(backward[grads[x1.name]], seed_values)


# ---- CPU masks -------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["-avx512-fma3-avx2", "-avx512,-avx2", "-avx2+avx2", "avx+sse4.2"])
def test_cpu_masks_in_myelin_and_ranvier_syntax(mask):
    flow = myelin.Flow()
    f = flow.define("f")
    x = f.var("x", myelin.DT_FLOAT, [37])
    y = f.exp(x)
    net = myelin.Compiler(cpu=mask, cache=False).compile(flow)
    data = net.cell("f").instance()
    values = RNG.uniform(-5, 5, 37).astype(np.float32)
    data[x] = values
    data.compute()
    np.testing.assert_allclose(data[y], np.exp(values.astype(np.float64)), rtol=2e-6)


@pytest.mark.parametrize("mask,message", [("-avx9000", "unknown CPU feature 'avx9000'"), ("-sse4.1-bogus", "'bogus'")])
def test_unknown_cpu_features_are_refused(mask, message):
    with pytest.raises(myelin.RanvierError, match=message):
        myelin.Compiler(cpu=mask)


def test_reference_reads_another_instance():
    flow = myelin.Flow()
    f = flow.define("f")
    x = f.var("x", myelin.DT_FLOAT, [3])
    h = f.exp(x, "h")
    f.sum(h, name="y")
    g = flow.define("g")
    other = g.instance("f")
    z = g.add(g.mul(g.ref(other, h), 2.0), g.ref(other, x), "z")
    net = compiler.compile(flow)
    forward = net.cell("f").instance()
    xv = RNG.uniform(-1, 1, 3).astype(np.float32)
    forward[x] = xv
    forward.compute()
    cell = net.cell("g")
    assert other.name in cell and other.type == "resource"
    reader = cell.instance()
    with pytest.raises(myelin.RanvierError, match="link its primal"):
        reader.compute()
    reader[other] = forward
    reader.compute()
    # 2·exp(x) + x cancels near x = -0.35: a few float32 ulps of 2·exp(x) (up to 5.4) absolute.
    np.testing.assert_allclose(reader[z], 2 * np.exp(xv.astype(np.float64)) + xv, rtol=1e-6, atol=2e-6)

    broken = myelin.Flow()
    b = broken.define("b")
    b.ref(b.instance("nowhere"), b.var("lonely", myelin.DT_FLOAT, [2]))
    with pytest.raises(myelin.CompileError, match="no other function"):
        compiler.compile(broken)


def test_flag_setters_keep_unknown_bits_and_storage_types_keep_bytes(tmp_path):
    flow = myelin.Flow()
    v = flow.var("v")
    v.flags = myelin.flow.VarFlags(512 | 1)
    v.ref, v.input = True, False
    assert int(v.flags) == 512 | 4
    func = flow.func("f")
    func.flags = myelin.flow.FuncFlags(64)
    func.backprop = True
    assert int(func.flags) == 64 | 2
    text = flow.var("lexicon", "string", [])
    text.data = "héllo"
    flow.save(tmp_path / "s.flow")
    assert myelin.Flow().load(tmp_path / "s.flow").vars["lexicon"].data.tobytes().decode() == "héllo"


def test_a_lexical_encoder_built_as_sling_builds_it(tmp_path):
    """SLING's parser builds its features with raw ops and outputs it declares itself,
    saves the flow, and links the feature vector to the LSTMs' inputs by a connector."""
    import ranvier.flow.builder as builder

    flow = myelin.Flow()
    features = builder.Builder(flow, "features")
    parts, tables = [], {}
    for name, vocab, dim, num in [("words", 20, 4, 1), ("suffix", 10, 3, 2)]:
        embedding = features.var(name=name + "_embeddings", shape=[vocab, dim])
        embedding.data = tables[name] = RNG.random((vocab, dim)).astype(np.float32)
        ids = features.var(name=name, dtype="int32", shape=[1, num])
        gather = features.rawop("Gather" if num == 1 else "GatherSum")
        gather.add_input(embedding)
        gather.add_input(ids)
        output = features.var(gather.name + ":0", "float32", [1, dim])
        gather.add_output(output)
        parts.append(output)
    vector = features.concat(parts)
    features.rename(vector, "feature_vector")
    vector.ref = vector.input = vector.output = True
    lr = builder.Builder(flow, "lstm/lr")
    lr_input = lr.var(name="input", shape=[1, 7])
    lr_input.ref = True
    nn.LSTM(lr, input=lr_input, size=5)
    link = flow.cnx("features")
    link.add(vector)
    link.add(lr_input)
    flow.save(tmp_path / "encoder.flow")

    net = compiler.compile(myelin.Flow().load(tmp_path / "encoder.flow"))
    cell = net.cell("features")
    channel = cell.channel("features/feature_vector", 1)
    data = cell.instance()
    data["features/words"], data["features/suffix"] = [[3]], [[1, 4]]
    data.connect("features/feature_vector", channel, 0)
    data.compute()
    expected = np.concatenate([tables["words"][[3]], tables["suffix"][[1, 4]].sum(0, keepdims=True)], axis=1)
    np.testing.assert_allclose(np.asarray(channel[0]), expected, rtol=1e-6)
    lstm = net.cell("lstm/lr").instance()
    lstm.connect("lstm/lr/input", channel, 0)  # the LSTM reads the features where the encoder wrote them
    lstm.compute()


def test_gather_with_an_out_of_vocabulary_row():
    flow = myelin.Flow()
    f = flow.define("lookup")
    emb = f.array("emb", RNG.random((6, 4)).astype(np.float32))
    oov = f.array("oov", RNG.random((1, 4)).astype(np.float32))
    ind = f.var("ind", myelin.DT_INT32, [2, 3])
    rows = f.gather(emb, ind, oov, "rows")
    data = compiler.compile(flow).cell("lookup").instance()
    iv = np.array([[0, 6, 5], [-1, 2, 100]], np.int32)
    data[ind] = iv
    data.compute()
    valid = (iv >= 0) & (iv < 6)
    expected = np.where(valid[..., None], emb.data[np.where(valid, iv, 0)], oov.data[0])
    np.testing.assert_array_equal(data[rows], expected)
    with pytest.raises(myelin.ShapeError, match="out-of-vocabulary row of float32 with 4 elements"):
        f.gather(emb, ind, f.array("short", np.zeros(3, np.float32)))
