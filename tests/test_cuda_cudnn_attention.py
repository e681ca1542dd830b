"""cuDNN's fused attention claimed by the CUDA backend (ranvier/backends/cuda/cudnn_attention.py):
the op's mapping to cuDNN's dims, strides, mask and scale, what cuDNN does not take, the
claimed steps run end to end (the emulator runs the plan in numpy; a GPU runs cuDNN) against
float64, and the soft fall back to the own kernels where the device's cuDNN refuses a step."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from helpers import attention_with_gradient, random_array

import ranvier as rv
from ranvier import dtypes
from ranvier.backends.cuda import backend, cudnn_attention, driver, emulator, kernels, resident
from ranvier.errors import RanvierError
from ranvier.ops.attention import attention, attention_grad


def _attention_flow(heads, kv_heads, queries, keys, size, causal=True, dtype="bfloat16", heads_first=False, scale=None,
                    bias=False):
    """Two cells over rows [2, T, heads, size] (or [2, heads, T, size]): "forward",
    attention alone (inference: no statistics), and "training", attention with its
    statistics and the gradient that reads them and its output, as the gradient rule
    builds them."""
    flow = rv.Flow()
    rows = {"q": (heads, queries), "k": (kv_heads, keys), "v": (kv_heads, keys), "dout": (heads, queries)}
    shapes = {name: [2, h, t, size] if heads_first else [2, t, h, size] for name, (h, t) in rows.items()}
    attrs = {"causal": causal, "heads_first": heads_first, **({"scale": scale} if scale is not None else {})}
    for cell in ("forward", "training"):
        f = rv.Builder(flow, cell)
        q, k, v, dout = (f.var(name, dtype, shape) for name, shape in shapes.items())
        score_bias = f.var("bias", dtype, [1, 1, queries, keys]) if bias else None
        if cell == "forward":
            outputs = [f.attention(q, k, v, score_bias, **attrs)]
        else:
            outputs = attention_with_gradient(f, q, k, v, dout, score_bias, **attrs)
        for out in outputs:
            out.var.out = True
    return flow, shapes


def _numpy(var):
    return dtypes.to_numpy(var.dtype)


def _op(flow, cell, op_type="Attention"):
    return next(op for op in flow.ops.values() if op.type == op_type and op.name.startswith(f"{cell}/"))


def _plans(flow):
    """The forward's, the training forward's (with statistics) and the gradient's cuDNN calls."""
    return [cudnn_attention.plan_attention(_op(flow, cell, op_type))
            for cell, op_type in (("forward", "Attention"), ("training", "Attention"), ("training", "AttentionGrad"))]


# ---- the mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads-first", "heads-last"])
def test_a_plan_gives_cudnn_the_ops_dims_and_strides_in_either_layout_with_grouped_heads(heads_first):
    flow, _shapes = _attention_flow(8, 2, 48, 80, 64, heads_first=heads_first)
    forward, training, backward = _plans(flow)
    assert forward is not None and training is not None and backward is not None
    plan = forward.plan
    assert (plan.batch, plan.heads, plan.kv_heads, plan.queries, plan.keys, plan.size) == (2, 8, 2, 48, 80, 64)
    assert plan.q_dims == [2, 8, 48, 64] and plan.kv_dims == [2, 2, 80, 64]
    if heads_first:  # [B, H, T, hd] contiguous
        assert plan.q_strides == (8 * 48 * 64, 48 * 64, 64, 1) and plan.kv_strides == (2 * 80 * 64, 80 * 64, 64, 1)
    else:  # [B, T, H, hd]: a head's rows H·hd apart
        assert plan.q_strides == (48 * 8 * 64, 64, 8 * 64, 1) and plan.kv_strides == (80 * 2 * 64, 64, 2 * 64, 1)
    # the statistics [B, H, T] in either layout: cuDNN's [B, H, T, 1], float32
    assert plan.layout("stats") == ([2, 8, 48, 1], [8 * 48, 48, 1, 1], "float32")
    assert plan.causal and plan.scale == pytest.approx(1 / math.sqrt(64)) and plan.dtype == "bfloat16"
    assert not plan.gradient and not plan.statistics and training.plan.statistics and not training.plan.gradient
    assert backward.plan.gradient and backward.plan.kv_strides == plan.kv_strides
    assert [v.name.split("/")[-1] for v in forward.operands[:3]] == ["q", "k", "v"]
    assert forward.plan.tensors == ("q", "k", "v", "o") and len(forward.operands) == 4
    assert training.plan.tensors == ("q", "k", "v", "o", "stats") and len(training.operands) == 5
    assert backward.plan.tensors == ("q", "k", "v", "o", "stats", "dout", "dq", "dk", "dv")
    assert [v.name.split("/")[-1] for v in (*backward.operands[:3], backward.operands[5])] == ["q", "k", "v", "dout"]
    assert str(plan) == "SDPA forward 2×48×80, 8 heads (2 key/value) of 64, bfloat16, causal, scale 0.125"
    assert str(training.plan).startswith("SDPA forward with statistics 2×48×80")


def test_the_gradients_call_reads_the_forwards_output_and_statistics():
    """cuDNN's backward is bound to the training forward's own outputs, o and the statistics,
    as AttentionGrad's inputs carry them: nothing to recompute."""
    flow, _ = _attention_flow(8, 2, 48, 80, 64)
    _, training, backward = _plans(flow)
    assert backward.operands[3:5] == training.operands[3:5] == tuple(_op(flow, "training").outputs)


def test_a_plan_keeps_the_ops_scale_and_float16():
    flow, _ = _attention_flow(4, 4, 32, 32, 128, causal=False, dtype="float16", scale=0.3)
    for sdpa in _plans(flow):
        plan = sdpa.plan
        assert plan.scale == pytest.approx(0.3) and not plan.causal and plan.dtype == "float16" and plan.size == 128


@pytest.mark.parametrize("options,why", [
    ({"dtype": "float32"}, "float32 operands"),
    ({"dtype": "float64"}, "float64 operands"),
    ({"size": 20}, "head size 20"),
    ({"size": 160}, "head size 160"),
    ({"bias": True}, "a score bias"),
])
def test_cudnn_takes_no_float32_operands_bias_or_head_sizes_it_lacks(options, why):
    settings = {"heads": 4, "kv_heads": 2, "queries": 32, "keys": 32, "size": 64} | options
    flow, _ = _attention_flow(**settings)
    for cell, op_type in (("forward", "Attention"), ("training", "Attention"), ("training", "AttentionGrad")):
        op = _op(flow, cell, op_type)
        assert why in cudnn_attention.refusal(op) and cudnn_attention.plan_attention(op) is None


def test_no_op_is_claimed_without_a_recent_gpu_or_the_frontend_or_when_asked_not_to(monkeypatch):
    monkeypatch.delenv(cudnn_attention.ENVIRONMENT, raising=False)
    assert "capability 8.0" in cudnn_attention.unavailable(None)
    assert "capability 8.0" in cudnn_attention.unavailable((7, 5))
    monkeypatch.setattr(cudnn_attention, "FRONTEND", "no_such_cudnn_frontend")
    assert "nvidia-cudnn-frontend" in cudnn_attention.unavailable((9, 0))
    monkeypatch.setenv(cudnn_attention.ENVIRONMENT, "0")
    assert cudnn_attention.unavailable((9, 0)) == "RANVIER_CUDNN=0"


def test_a_missing_frontend_or_libcudnn_is_a_ranvier_error_naming_the_package():
    with pytest.raises(RanvierError, match="pip install 'ranvier\\[cuda\\]'"):
        cudnn_attention.load_frontend("no_such_cudnn_frontend")


# ---- the emulator's stand-in for cuDNN ----------------------------------------------------------


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads-first", "heads-last"])
def test_the_host_stand_in_writes_the_statistics_and_differentiates_from_the_given_output_and_statistics(heads_first):
    """`run_on_host` over numpy arrays at the operands' addresses, outputs filled with NaN:
    the forward's o and log-sum-exp statistics are the reference's; the backward reads the
    o and statistics it is given (here the reference's with a shift of the statistics,
    which scales each row's probabilities: the gradient follows it, so they are read)."""
    flow, shapes = _attention_flow(4, 2, 24, 40, 32, heads_first=heads_first)
    _, training, backward = _plans(flow)
    values = {name: random_array(shape, "float32", seed=50 + i).astype(ml_dtypes.bfloat16)
              for i, (name, shape) in enumerate(shapes.items())}
    wide = {name: value.astype(np.float64) for name, value in values.items()}
    options = {"causal": True, "heads_first": heads_first}
    out, lse = attention(wide["q"], wide["k"], wide["v"], statistics=True, **options)

    def run(sdpa, given):
        """The plan over arrays: operand i is given[i], the others NaN."""
        arrays = [np.ascontiguousarray(given[i]) if i in given else np.full(v.shape, np.nan, _numpy(v))
                  for i, v in enumerate(sdpa.operands)]
        cudnn_attention.run_on_host(sdpa.plan, [a.ctypes.data for a in arrays])
        return arrays

    _, _, _, got_out, got_lse = run(training, {0: values["q"], 1: values["k"], 2: values["v"]})
    np.testing.assert_allclose(got_out.astype(np.float64), out, atol=0.01 * np.abs(out).max())
    np.testing.assert_allclose(got_lse, lse, rtol=1e-6)
    assert got_lse.dtype == np.float32
    shifted = (lse + 0.5).astype(np.float32)
    given = {0: values["q"], 1: values["k"], 2: values["v"], 3: out.astype(ml_dtypes.bfloat16), 4: shifted,
             5: values["dout"]}
    *_, dq, dk, dv = run(backward, given)
    wants = attention_grad(wide["q"], wide["k"], wide["v"], given[3].astype(np.float64), shifted.astype(np.float64),
                           wide["dout"], **options)
    for got, want in zip((dq, dk, dv), wants):
        np.testing.assert_allclose(got.astype(np.float64), want, atol=0.01 * np.abs(want).max(), rtol=0.01)


# ---- claimed steps run ------------------------------------------------------------------------------


def _claimed_by_cudnn(monkeypatch, on_device):
    """On the emulator the claim is forced (no GPU to ask); on a GPU it must be real."""
    if on_device == "emulator":
        monkeypatch.setattr(backend.CUDABackend, "_cudnn_unavailable", lambda self: "")
        return
    device = driver.find_device()
    why = cudnn_attention.unavailable(device.capability)
    if why:
        pytest.skip(f"cuDNN's attention is not claimed on this GPU: {why}")


def _run_and_compare(flow, shapes, causal, heads_first, scale=None):
    """Both cells computed three times (launched one by one, captured as a graph, the graph
    replayed) over random bfloat16 operands, their outputs filled with NaN before each;
    each output equal to float64's over the same operands within bfloat16's rounding (the
    probabilities and score gradients rounded on the tensor cores), the statistics (float32)
    to 1e-3 of the log-sum-exp."""
    network = rv.Compiler("cuda").compile(flow)
    values = {name: random_array(shape, "float32", seed=30 + i).astype(ml_dtypes.bfloat16)
              for i, (name, shape) in enumerate(shapes.items())}
    wide = {name: value.astype(np.float64) for name, value in values.items()}
    options = {"causal": causal, "scale": scale, "heads_first": heads_first}
    out, lse = attention(wide["q"], wide["k"], wide["v"], statistics=True, **options)
    wants = {("forward", "Attention"): [out], ("training", "Attention"): [out, lse],
             ("training", "AttentionGrad"): attention_grad(wide["q"], wide["k"], wide["v"], out, lse, wide["dout"],
                                                           **options)}
    cells = {}
    for name in ("forward", "training"):
        cell = cells[name] = network.cell(name)
        data = cell.instance()
        steps = [step for step in cell.steps if step.op.type.startswith("Attention")]
        written = {output.name for step in steps for output in step.op.outputs}
        for step in steps:
            for input_ in step.op.inputs:
                if input_.name not in written:
                    data[input_.name] = values[input_.name.split("/")[-1]]
        for compute in ("launched", "captured", "replayed"):
            for output in (output for step in steps for output in step.op.outputs):
                data[output.name] = np.full(output.shape, np.nan, _numpy(output))
            data.compute()
            for step in steps:
                for output, expected in zip(step.op.outputs, wants[name, step.op.type]):
                    got = data[output.name].astype(np.float64)
                    assert np.isfinite(got).all(), f"{output.name} ({compute}): elements left unwritten"
                    if output.dtype == "float32":  # the statistics
                        np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-3, err_msg=f"{output.name} ({compute})")
                    else:
                        np.testing.assert_allclose(got, expected, atol=0.03 * np.abs(expected).max(), rtol=0.03,
                                                   err_msg=f"{output.name} ({compute})")
    return cells


def _attention_steps(cells):
    return [step for cell in cells.values() for step in cell.steps if step.op.type.startswith("Attention")]


@pytest.mark.parametrize("heads,kv_heads,queries,keys,size,causal,heads_first", [
    (4, 2, 40, 40, 64, True, False),  # a Llama's rows [B, T, heads, hd], grouped heads, ragged blocks
    (2, 1, 24, 56, 32, True, True),  # multi-query, fewer queries than keys: the mask aligned to the bottom right
    (2, 2, 33, 47, 128, False, False),  # no mask, the largest head size
])
def test_claimed_attention_its_statistics_and_its_gradient_match_float64(monkeypatch, on_device, heads, kv_heads,
                                                                         queries, keys, size, causal, heads_first):
    """The cells' attention steps are cuDNN's (the printed step says so, with the own
    kernel it falls back to), and compute attention, its statistics (cuDNN's Stats are the
    op's log-sum-exp) and its gradient from them, every element."""
    _claimed_by_cudnn(monkeypatch, on_device)
    flow, shapes = _attention_flow(heads, kv_heads, queries, keys, size, causal=causal, heads_first=heads_first)
    steps = _attention_steps(_run_and_compare(flow, shapes, causal, heads_first))
    assert [step.op.type for step in steps] == ["Attention", "Attention", "AttentionGrad"]
    for step in steps:
        assert step.kernel == cudnn_attention.KIND, f"{step.label}: cuDNN did not run it"
        own = kernels.chosen(step.op).name  # AttentionMMA, or the block kernel where its tiles do not fit
        assert step.variant.startswith("SDPA ") and step.variant.endswith(f"; else {own}")


def test_a_step_the_devices_cudnn_refuses_runs_its_own_kernels_and_says_so(monkeypatch):
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    monkeypatch.setattr(backend.CUDABackend, "_cudnn_unavailable", lambda self: "")
    refusal = "cuDNN refused it: no engine (the test's) " + "and a long list of the engines it asked " * 10
    monkeypatch.setattr(emulator.HostEmulator, "attention_refusal", lambda self, code, call: refusal)
    flow, shapes = _attention_flow(4, 2, 40, 40, 64)
    steps = _attention_steps(_run_and_compare(flow, shapes, causal=True, heads_first=False))
    assert len(steps) == 3
    for step in steps:
        assert step.kernel == "AttentionMMA" and step.variant.startswith("cuDNN refused it: no engine (the test's) and")
        assert len(step.variant) == resident.REFUSAL_CHARACTERS and step.variant.endswith("…")


@pytest.mark.parametrize("why", ["no GPU", "the host emulator"])
def test_without_a_gpu_or_on_the_emulator_no_attention_is_claimed(monkeypatch, why):
    """No GPU found at compile time (here), or cells for the host emulator (which stands in
    for a GPU without cuDNN unless a test asks): the own kernels run, as before."""
    if why == "no GPU":
        monkeypatch.delenv("RANVIER_CUDA_DEVICE", raising=False)
        monkeypatch.setattr(cudnn_attention, "unavailable", lambda capability: "no GPU")
    else:
        monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
        monkeypatch.setattr(cudnn_attention, "unavailable", lambda capability: "")
    flow, _ = _attention_flow(4, 2, 40, 40, 64)
    network = rv.Compiler("cuda").compile(flow)
    kinds = {step.kernel for name in ("forward", "training") for step in network.cell(name).steps
             if step.op.type.startswith("Attention")}
    assert kinds == {"AttentionMMA"}


# ---- the frontend's graphs, described without a device -------------------------------------------


def _described(frontend, sdpa):
    describe = cudnn_attention.describe_backward if sdpa.plan.gradient else cudnn_attention.describe_forward
    return describe(frontend, sdpa.plan)


@pytest.mark.parametrize("which", ["forward", "forward with statistics", "backward"])
@pytest.mark.parametrize("heads_first", [True, False], ids=["heads-first", "heads-last"])
def test_the_frontend_validates_the_graphs_a_plan_describes(which, heads_first):
    """nvidia-cudnn-frontend's own checks of the graphs' tensors and attributes (no device
    or libcudnn needed): the plan speaks the frontend's API of the version installed."""
    frontend = pytest.importorskip(cudnn_attention.FRONTEND, reason="nvidia-cudnn-frontend is not installed here")
    flow, _ = _attention_flow(8, 2, 48, 80, 64, heads_first=heads_first)
    sdpa = _plans(flow)[["forward", "forward with statistics", "backward"].index(which)]
    plan = sdpa.plan
    graph, tensors = _described(frontend, sdpa)
    graph.validate()
    assert len(tensors) == len(plan.tensors) == len(sdpa.operands)
    for name, tensor in zip(plan.tensors, tensors):
        dims, strides, _ = plan.layout(name)
        assert (list(tensor.dim), list(tensor.stride)) == (dims, strides), name
    if plan.statistics:  # one float per query row, [B, H, T, 1]
        assert list(tensors[plan.tensors.index("stats")].dim) == [2, 8, 48, 1]


@pytest.mark.parametrize("which", ["forward", "forward with statistics", "backward"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
def test_libcudnns_own_checks_accept_the_graphs_for_hopper(monkeypatch, which, causal):
    """Where libcudnn is here too, the graphs lowered to cuDNN's C++ frontend without a
    device (sm_90, 132 multiprocessors) pass its validation: the arguments are ones its
    sdpa and sdpa_backward take, and cuDNN accepts the grouped heads, strides, the
    statistics' layout and the mask aligned to the bottom right (a wrong keyword or head
    count fails here)."""
    pytest.importorskip(cudnn_attention.FRONTEND, reason="nvidia-cudnn-frontend is not installed here")
    try:
        frontend = cudnn_attention.load_frontend()
    except RanvierError as error:
        pytest.skip(str(error))
    if not hasattr(frontend.pygraph, "_backend_handle_for_lowering"):
        pytest.skip("this frontend lowers its graphs otherwise")
    # the lowering's handle, which needs a device: none, as the frontend's own device-less path has
    monkeypatch.setattr(frontend.pygraph, "_backend_handle_for_lowering", lambda self, arguments: None)
    flow, _ = _attention_flow(8, 2, 48, 80, 64, causal=causal)
    sdpa = _plans(flow)[["forward", "forward with statistics", "backward"].index(which)]
    graph, _ = _described(frontend, sdpa)
    graph._cpp_graph_kwargs.update(sm_version=90, sm_count=132)
    graph._lower_to_cpp().validate()


class _FakeFrontend:
    """The frontend's surface that CudnnAttention uses, recording what it is asked: the
    graphs it built, and each execute's graph and addresses by tensor name."""

    class data_type:  # (the frontend's spellings)
        BFLOAT16, HALF, FLOAT = "bf16", "f16", "f32"

    class diagonal_alignment:
        BOTTOM_RIGHT = "bottom right"

    class heur_mode:
        A, FALLBACK = "A", "FALLBACK"

    def __init__(self, refuse: str = ""):
        self.refuse, self.graphs, self.executed, self.streams = refuse, [], [], []

    def create_handle(self):
        return "handle"

    def set_stream(self, handle, stream):
        self.streams.append(stream)

    def pygraph(self, **options):
        self.graphs.append(_FakeGraph(self, options))
        return self.graphs[-1]


class _FakeTensor:
    def __init__(self, name, data_type=None):
        self.name, self.data_type = name, data_type

    def set_output(self, output):
        return self

    def set_dim(self, dims):
        self.dim = dims
        return self

    def set_stride(self, strides):
        self.stride = strides
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


class _FakeGraph:
    """A graph of one node: `node` "sdpa" or "sdpa_backward", its attributes, and the
    names of the tensors it reads."""

    def __init__(self, frontend, options):
        self.frontend, self.options, self.node = frontend, options, None

    def tensor(self, name, dim, stride, data_type):
        return _FakeTensor(name, data_type)

    def sdpa(self, q, k, v, **attributes):
        self.node, self.attributes, self.reads = "sdpa", attributes, [t.name for t in (q, k, v)]
        return _FakeTensor("o"), _FakeTensor("stats")

    def sdpa_backward(self, q, k, v, o, dout, stats, **attributes):
        self.node, self.attributes, self.reads = "sdpa_backward", attributes, [t.name for t in (q, k, v, o, dout, stats)]
        return _FakeTensor("dq"), _FakeTensor("dk"), _FakeTensor("dv")

    def validate(self, *heuristics):
        pass

    build_operation_graph = create_execution_plans = build_plans = validate

    def check_support(self):
        if self.frontend.refuse:
            raise RuntimeError(f"{self.frontend.refuse}\nand the engines it asked")

    def get_workspace_size(self):
        return 4096 if self.node == "sdpa_backward" else 1024

    def execute(self, tensors, workspace, handle):
        self.frontend.executed.append((self, {t.name: address for t, address in tensors.items()}, workspace, handle))


def test_a_gradients_plan_is_one_backward_graph_reading_o_and_the_statistics_it_is_given():
    """CudnnAttention with a stand-in frontend: the handle on the device's stream, one
    prepared plan for a model's layers, the backward alone (no forward graph, no scratch:
    only its workspace allocated), reading o and the float32 statistics at the step's
    operands' addresses, every operand bound by name."""
    import ctypes

    frontend, allocated = _FakeFrontend(), []

    def allocate(nbytes):
        allocated.append(nbytes)
        return 1000 * len(allocated)

    sdpa = cudnn_attention.CudnnAttention(ctypes.c_void_p(77), allocate, lambda: frontend)
    flow, _ = _attention_flow(8, 2, 48, 80, 64)
    plan = _plans(flow)[2].plan
    prepared = sdpa.prepare(plan)
    assert sdpa.prepare(plan) is prepared and frontend.streams == [77]
    assert allocated == [4096]  # the workspace: nothing else
    (backward,) = frontend.graphs
    assert backward.node == "sdpa_backward" and backward.reads == ["q", "k", "v", "o", "dout", "stats"]
    assert backward.attributes["attn_scale"] == 0.125 and backward.attributes["diagonal_band_right_bound"] == 0
    assert backward.attributes["diagonal_alignment"] == "bottom right"
    stats = prepared.tensors[plan.tensors.index("stats")]
    assert stats.data_type == "f32" and prepared.tensors[3].data_type == "bf16"
    sdpa.run(prepared, [11, 12, 13, 14, 15, 16, 21, 22, 23])  # q, k, v, o, stats, d out, dq, dk, dv
    ((graph, addresses, workspace, handle),) = frontend.executed
    assert graph is backward and addresses == {"q": 11, "k": 12, "v": 13, "o": 14, "stats": 15, "dout": 16,
                                               "dq": 21, "dk": 22, "dv": 23}
    assert workspace == prepared.workspace == 1000 and handle == "handle"


@pytest.mark.parametrize("statistics", [True, False], ids=["training", "inference"])
def test_a_forward_asks_cudnn_for_the_statistics_only_where_the_op_outputs_them(statistics):
    import ctypes

    frontend = _FakeFrontend()
    sdpa = cudnn_attention.CudnnAttention(ctypes.c_void_p(0), lambda nbytes: 5, lambda: frontend)
    flow, _ = _attention_flow(8, 2, 48, 80, 64)
    plan = _plans(flow)[1 if statistics else 0].plan
    sdpa.run(sdpa.prepare(plan), [1, 2, 3, 4, 5][: len(plan.tensors)])
    ((graph, addresses, _, _),) = frontend.executed
    assert graph.node == "sdpa" and graph.attributes["generate_stats"] is statistics
    assert addresses == dict(zip(("q", "k", "v", "o", "stats"), [1, 2, 3, 4, 5][: len(plan.tensors)]))


def test_a_graph_cudnn_refuses_is_a_ranvier_error_naming_the_plan_and_why():
    import ctypes

    sdpa = cudnn_attention.CudnnAttention(ctypes.c_void_p(0), lambda nbytes: 0,
                                          lambda: _FakeFrontend(refuse="no engine for this graph"))
    flow, _ = _attention_flow(8, 2, 48, 80, 64)
    with pytest.raises(RanvierError, match=r"^cuDNN refused SDPA forward 2×48×80, .*: no engine for this graph$"):
        sdpa.prepare(_plans(flow)[0].plan)


@pytest.mark.parametrize("frontend", ["missing", "stand-in"])
def test_the_driver_runs_claimed_steps_with_cudnn_or_else_their_own_kernels(monkeypatch, frontend):
    """Through the stand-in for libcuda, a training cell (attention with its statistics,
    then its gradient): with no frontend to import, the claimed steps' own kernels are
    launched and their labels say why; with one, each step is one cuDNN call on the
    step's arena addresses, no kernel of its own launched: the forward writes o and the
    statistics, and the gradient's graph, the backward alone, reads them where the
    forward wrote them."""
    import ctypes

    from test_cuda_runtime import _RecordingDriver

    events = []
    gpu = driver.DriverGPU(lambda name: _RecordingDriver(events))
    monkeypatch.delenv("RANVIER_CUDA_DEVICE", raising=False)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    monkeypatch.setattr(backend.CUDABackend, "_cudnn_unavailable", lambda self: "")
    stand_in = _FakeFrontend()
    if frontend == "stand-in":
        monkeypatch.setattr(driver, "CudnnAttention", lambda stream, allocate: cudnn_attention.CudnnAttention(
            stream, allocate, lambda: stand_in))
    else:
        monkeypatch.setattr(driver, "CudnnAttention", lambda stream, allocate: cudnn_attention.CudnnAttention(
            stream, allocate, lambda: cudnn_attention.load_frontend("no_such_cudnn_frontend")))
    flow, shapes = _attention_flow(4, 2, 40, 40, 64)
    cell = rv.Compiler("cuda").compile(flow).cell("training")
    steps = [step for step in cell.steps if step.op.type.startswith("Attention")]
    assert [(step.op.type, step.kernel) for step in steps] == [("Attention", "cuDNN"), ("AttentionGrad", "cuDNN")]
    data = cell.instance()
    for name in ("q", "k", "v", "dout"):
        data[f"training/{name}"] = np.zeros(shapes[name], ml_dtypes.bfloat16)
    data.compute()
    launched = [call for call, _ in events if call == "cuLaunchKernel"]
    if frontend == "missing":
        for step in steps:
            assert step.kernel == "AttentionMMA" and step.variant.startswith("nvidia-cudnn-frontend could not be imported")
        assert launched and not stand_in.executed
        return
    assert all(step.kernel == "cuDNN" for step in steps) and not launched
    device = data.device
    (forward_graph, forward, _, _), (backward_graph, backward, _, _) = stand_in.executed
    attention, gradient = (step.op for step in steps)
    assert forward_graph.node == "sdpa" and forward_graph.attributes["generate_stats"]
    assert forward == dict(zip(("q", "k", "v", "o", "stats"), map(device.address, [*attention.inputs, *attention.outputs])))
    assert backward_graph.node == "sdpa_backward"  # the gradient's step: the backward alone
    assert backward == dict(zip(("q", "k", "v", "o", "stats", "dout", "dq", "dk", "dv"),
                                map(device.address, [*gradient.inputs, *gradient.outputs])))
    assert backward["o"] == forward["o"] and backward["stats"] == forward["stats"]
    assert len({forward["o"], forward["stats"], backward["dq"], backward["dk"], backward["dv"]}) == 5
    assert isinstance(gpu._stream, ctypes.c_void_p) and stand_in.streams == [gpu._stream.value or 0]
