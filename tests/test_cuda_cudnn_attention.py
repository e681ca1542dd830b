"""cuDNN's fused attention claimed by the CUDA backend (ranvier/backends/cuda/cudnn_attention.py):
the op's mapping to cuDNN's dims, strides, mask and scale, what cuDNN does not take, the
claimed steps run end to end (the emulator runs the plan in numpy; a GPU runs cuDNN) against
float64, and the soft fall back to the own kernels where the device's cuDNN refuses a step."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from helpers import random_array

import ranvier as rv
from ranvier.backends.cuda import backend, cudnn_attention, driver, emulator, resident
from ranvier.errors import RanvierError
from ranvier.ops.attention import attention, attention_grad


def _attention_flow(heads, kv_heads, queries, keys, size, causal=True, dtype="bfloat16", heads_first=False, scale=None,
                    bias=False):
    """Attention and its gradient, each a cell of its own ("forward", "backward"), over rows
    [2, T, heads, size] (or [2, heads, T, size])."""
    flow = rv.Flow()
    rows = {"q": (heads, queries), "k": (kv_heads, keys), "v": (kv_heads, keys), "dout": (heads, queries)}
    shapes = {name: [2, h, t, size] if heads_first else [2, t, h, size] for name, (h, t) in rows.items()}
    attrs = {"causal": causal, "heads_first": heads_first, **({"scale": scale} if scale is not None else {})}
    for cell, op_type, names in (("forward", "Attention", "qkv"), ("backward", "AttentionGrad", ["q", "k", "v", "dout"])):
        f = rv.Builder(flow, cell)
        inputs = [f.var(name, dtype, shapes[name]) for name in names]
        if bias:
            inputs.append(f.var("bias", dtype, [1, 1, queries, keys]))
        outputs = f.op(op_type, inputs, None, attrs)
        for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
            out.var.out = True
    return flow, shapes


def _op(flow, cell):
    return next(op for op in flow.ops.values() if op.name.startswith(f"{cell}/Attention"))


# ---- the mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads-first", "heads-last"])
def test_a_plan_gives_cudnn_the_ops_dims_and_strides_in_either_layout_with_grouped_heads(heads_first):
    flow, _shapes = _attention_flow(8, 2, 48, 80, 64, heads_first=heads_first)
    forward, backward = (cudnn_attention.plan_attention(_op(flow, cell)) for cell in ("forward", "backward"))
    assert forward is not None and backward is not None
    plan = forward.plan
    assert (plan.batch, plan.heads, plan.kv_heads, plan.queries, plan.keys, plan.size) == (2, 8, 2, 48, 80, 64)
    assert plan.q_dims == [2, 8, 48, 64] and plan.kv_dims == [2, 2, 80, 64]
    if heads_first:  # [B, H, T, hd] contiguous
        assert plan.q_strides == (8 * 48 * 64, 48 * 64, 64, 1) and plan.kv_strides == (2 * 80 * 64, 80 * 64, 64, 1)
    else:  # [B, T, H, hd]: a head's rows H·hd apart
        assert plan.q_strides == (48 * 8 * 64, 64, 8 * 64, 1) and plan.kv_strides == (80 * 2 * 64, 64, 2 * 64, 1)
    assert plan.causal and plan.scale == pytest.approx(1 / math.sqrt(64)) and plan.dtype == "bfloat16"
    assert not plan.gradient and backward.plan.gradient
    assert [v.name.split("/")[-1] for v in forward.operands[:3]] == ["q", "k", "v"]
    assert [v.name.split("/")[-1] for v in backward.operands[:4]] == ["q", "k", "v", "dout"]
    assert len(backward.operands) == 7 and backward.plan.kv_strides == plan.kv_strides
    assert str(plan) == "SDPA forward 2×48×80, 8 heads (2 key/value) of 64, bfloat16, causal, scale 0.125"


def test_a_plan_keeps_the_ops_scale_and_float16():
    flow, _ = _attention_flow(4, 4, 32, 32, 128, causal=False, dtype="float16", scale=0.3)
    plan = cudnn_attention.plan_attention(_op(flow, "forward")).plan
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
    for cell in ("forward", "backward"):
        op = _op(flow, cell)
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
    probabilities and score gradients rounded on the tensor cores)."""
    network = rv.Compiler("cuda").compile(flow)
    values = {name: random_array(shape, "float32", seed=30 + i).astype(ml_dtypes.bfloat16)
              for i, (name, shape) in enumerate(shapes.items())}
    wide = {name: value.astype(np.float64) for name, value in values.items()}
    wants = {"forward": [attention(wide["q"], wide["k"], wide["v"], causal=causal, scale=scale, heads_first=heads_first)],
             "backward": attention_grad(wide["q"], wide["k"], wide["v"], wide["dout"], causal=causal, scale=scale,
                                        heads_first=heads_first)}
    cells = {}
    for name, want in wants.items():
        cell = cells[name] = network.cell(name)
        data = cell.instance()
        step = next(step for step in cell.steps if step.op.type.startswith("Attention"))
        for input_ in step.op.inputs:
            data[input_.name] = values[input_.name.split("/")[-1]]
        for compute in ("launched", "captured", "replayed"):
            for output in step.op.outputs:
                data[output.name] = np.full(output.shape, np.nan, ml_dtypes.bfloat16)
            data.compute()
            for output, expected in zip(step.op.outputs, want):
                got = data[output.name].astype(np.float64)
                assert np.isfinite(got).all(), f"{output.name} ({compute}): elements left unwritten"
                np.testing.assert_allclose(got, expected, atol=0.03 * np.abs(expected).max(), rtol=0.03,
                                           err_msg=f"{output.name} ({compute})")
    return cells


@pytest.mark.parametrize("heads,kv_heads,queries,keys,size,causal,heads_first", [
    (4, 2, 40, 40, 64, True, False),  # a Llama's rows [B, T, heads, hd], grouped heads, ragged blocks
    (2, 1, 24, 56, 32, True, True),  # multi-query, fewer queries than keys: the mask aligned to the bottom right
    (2, 2, 33, 47, 128, False, False),  # no mask, the largest head size
])
def test_claimed_attention_and_its_gradient_match_float64(monkeypatch, on_device, heads, kv_heads, queries, keys, size,
                                                          causal, heads_first):
    """The cells' attention steps are cuDNN's (the printed step says so, with the own
    kernel it falls back to), and compute attention and its gradient, every element."""
    _claimed_by_cudnn(monkeypatch, on_device)
    flow, shapes = _attention_flow(heads, kv_heads, queries, keys, size, causal=causal, heads_first=heads_first)
    cells = _run_and_compare(flow, shapes, causal, heads_first)
    for cell in cells.values():
        (step,) = [step for step in cell.steps if step.op.type.startswith("Attention")]
        assert step.kernel == cudnn_attention.KIND, f"{step.label}: cuDNN did not run it"
        assert step.variant.startswith("SDPA ") and step.variant.endswith("; else AttentionMMA")


def test_a_step_the_devices_cudnn_refuses_runs_its_own_kernels_and_says_so(monkeypatch):
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    monkeypatch.setattr(backend.CUDABackend, "_cudnn_unavailable", lambda self: "")
    refusal = "cuDNN refused it: no engine (the test's) " + "and a long list of the engines it asked " * 10
    monkeypatch.setattr(emulator.HostEmulator, "attention_refusal", lambda self, code, call: refusal)
    flow, shapes = _attention_flow(4, 2, 40, 40, 64)
    cells = _run_and_compare(flow, shapes, causal=True, heads_first=False)
    for cell in cells.values():
        (step,) = [step for step in cell.steps if step.op.type.startswith("Attention")]
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
    kinds = {step.kernel for name in ("forward", "backward") for step in network.cell(name).steps
             if step.op.type.startswith("Attention")}
    assert kinds == {"AttentionMMA"}


# ---- the frontend's graphs, described without a device -------------------------------------------


@pytest.mark.parametrize("cell", ["forward", "backward"])
@pytest.mark.parametrize("heads_first", [True, False], ids=["heads-first", "heads-last"])
def test_the_frontend_validates_the_graphs_a_plan_describes(cell, heads_first):
    """nvidia-cudnn-frontend's own checks of the graphs' tensors and attributes (no device
    or libcudnn needed): the plan speaks the frontend's API of the version installed."""
    frontend = pytest.importorskip(cudnn_attention.FRONTEND, reason="nvidia-cudnn-frontend is not installed here")
    flow, _ = _attention_flow(8, 2, 48, 80, 64, heads_first=heads_first)
    plan = cudnn_attention.plan_attention(_op(flow, cell)).plan
    describe = cudnn_attention.describe_backward if plan.gradient else cudnn_attention.describe_forward
    graphs = [cudnn_attention.describe_forward(frontend, plan), *([describe(frontend, plan)] if plan.gradient else [])]
    for graph, tensors in graphs:
        graph.validate()
        assert [list(t.dim) for t in tensors[:3]] == [plan.q_dims, plan.kv_dims, plan.kv_dims]
        assert [list(t.stride) for t in tensors[:3]] == [list(plan.q_strides), list(plan.kv_strides), list(plan.kv_strides)]
    if plan.gradient:
        *_, dq, dk, dv = graphs[1][1]
        assert [list(dq.dim), list(dk.dim), list(dv.dim)] == [plan.q_dims, plan.kv_dims, plan.kv_dims]
        assert list(graphs[0][1][-1].dim) == [2, 8, 48, 1]  # the statistics, one float per query row


@pytest.mark.parametrize("cell", ["forward", "backward"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
def test_libcudnns_own_checks_accept_the_graphs_for_hopper(monkeypatch, cell, causal):
    """Where libcudnn is here too, the graphs lowered to cuDNN's C++ frontend without a
    device (sm_90, 132 multiprocessors) pass its validation: the arguments are ones its
    sdpa and sdpa_backward take, and cuDNN accepts the grouped heads, strides and the mask
    aligned to the bottom right (a wrong keyword or head count fails here)."""
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
    plan = cudnn_attention.plan_attention(_op(flow, cell)).plan
    graphs = [cudnn_attention.describe_forward(frontend, plan)]
    if plan.gradient:
        graphs.append(cudnn_attention.describe_backward(frontend, plan))
    for graph, _ in graphs:
        graph._cpp_graph_kwargs.update(sm_version=90, sm_count=132)
        graph._lower_to_cpp().validate()


class _FakeFrontend:
    """The frontend's surface that CudnnAttention uses, recording what it is asked: its
    graphs' tensors by name, and each execute's addresses by tensor name."""

    class data_type:  # (the frontend's spellings)
        BFLOAT16, HALF, FLOAT = "bf16", "f16", "f32"

    class diagonal_alignment:
        BOTTOM_RIGHT = "bottom right"

    class heur_mode:
        A, FALLBACK = "A", "FALLBACK"

    def __init__(self, refuse: str = ""):
        self.refuse, self.executed, self.streams = refuse, [], []

    def create_handle(self):
        return "handle"

    def set_stream(self, handle, stream):
        self.streams.append(stream)

    def pygraph(self, **options):
        return _FakeGraph(self, options)


class _FakeTensor:
    def __init__(self, name):
        self.name = name

    def set_output(self, output):
        return self

    def set_dim(self, dims):
        self.dim = dims
        return self

    def set_stride(self, strides):
        self.stride = strides
        return self

    def set_data_type(self, data_type):
        return self


class _FakeGraph:
    def __init__(self, frontend, options):
        self.frontend, self.options = frontend, options

    def tensor(self, name, dim, stride, data_type):
        return _FakeTensor(name)

    def sdpa(self, q, k, v, **attributes):
        self.attributes = attributes
        return _FakeTensor("o"), _FakeTensor("stats")

    def sdpa_backward(self, q, k, v, o, dout, stats, **attributes):
        self.attributes = attributes
        return _FakeTensor("dq"), _FakeTensor("dk"), _FakeTensor("dv")

    def validate(self, *heuristics):
        pass

    build_operation_graph = create_execution_plans = build_plans = validate

    def check_support(self):
        if self.frontend.refuse:
            raise RuntimeError(f"{self.frontend.refuse}\nand the engines it asked")

    def get_workspace_size(self):
        return 4096 if "sdpa_backward" in str(self.attributes.get("name")) else 1024

    def execute(self, tensors, workspace, handle):
        self.frontend.executed.append(({t.name: address for t, address in tensors.items()}, workspace, handle))


def test_the_gradient_runs_cudnns_forward_into_scratch_then_its_backward_on_the_devices_stream():
    """CudnnAttention with a stand-in frontend: the handle on the device's stream, one
    prepared plan for a model's layers, the workspace the largest graph asks, the scratch
    o and statistics the forward writes and the backward reads, every operand bound by name."""
    import ctypes

    frontend, allocated = _FakeFrontend(), []

    def allocate(nbytes):
        allocated.append(nbytes)
        return 1000 * len(allocated)

    sdpa = cudnn_attention.CudnnAttention(ctypes.c_void_p(77), allocate, lambda: frontend)
    flow, _ = _attention_flow(8, 2, 48, 80, 64)
    plan = cudnn_attention.plan_attention(_op(flow, "backward")).plan
    prepared = sdpa.prepare(plan)
    assert sdpa.prepare(plan) is prepared and frontend.streams == [77]
    assert allocated == [4096, 2 * 8 * 48 * 64 * 2, 2 * 8 * 48 * 4]  # the workspace, o in bfloat16, the statistics
    forward, backward = (graph for graph, _ in prepared.graphs)
    assert forward.attributes["generate_stats"] and forward.attributes["diagonal_band_right_bound"] == 0
    assert forward.attributes["diagonal_alignment"] == "bottom right" and backward.attributes["attn_scale"] == 0.125
    sdpa.run(prepared, [11, 12, 13, 14, 21, 22, 23])  # q, k, v, d out, dq, dk, dv
    (first, workspace, handle), (second, _, _) = frontend.executed
    assert first == {"q": 11, "k": 12, "v": 13, "o": prepared.o, "stats": prepared.stats}
    assert second == {"q": 11, "k": 12, "v": 13, "dout": 14, "o": prepared.o, "stats": prepared.stats,
                      "dq": 21, "dk": 22, "dv": 23}
    assert workspace == prepared.workspace == 1000 and handle == "handle"


def test_a_graph_cudnn_refuses_is_a_ranvier_error_naming_the_plan_and_why():
    import ctypes

    sdpa = cudnn_attention.CudnnAttention(ctypes.c_void_p(0), lambda nbytes: 0,
                                          lambda: _FakeFrontend(refuse="no engine for this graph"))
    flow, _ = _attention_flow(8, 2, 48, 80, 64)
    plan = cudnn_attention.plan_attention(_op(flow, "forward")).plan
    with pytest.raises(RanvierError, match=r"^cuDNN refused SDPA forward 2×48×80, .*: no engine for this graph$"):
        sdpa.prepare(plan)


@pytest.mark.parametrize("frontend", ["missing", "stand-in"])
def test_the_driver_runs_a_claimed_step_with_cudnn_or_else_its_own_kernels(monkeypatch, frontend):
    """Through the stand-in for libcuda: with no frontend to import, the claimed step's own
    kernels are launched and its label says why; with one, the step is one cuDNN call on
    the step's arena addresses and no kernel of its own is launched."""
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
    cell = rv.Compiler("cuda").compile(flow).cell("forward")
    (step,) = [step for step in cell.steps if step.op.type == "Attention"]
    assert step.kernel == "cuDNN"
    data = cell.instance()
    for name in "qkv":
        data[f"forward/{name}"] = np.zeros(shapes[name], ml_dtypes.bfloat16)
    data.compute()
    launched = [call for call, _ in events if call == "cuLaunchKernel"]
    if frontend == "missing":
        assert step.kernel == "AttentionMMA" and step.variant.startswith("nvidia-cudnn-frontend could not be imported")
        assert launched and not stand_in.executed
    else:
        assert step.kernel == "cuDNN" and not launched
        ((addresses, _, _),) = stand_in.executed
        device = data.device
        assert addresses == {"q": device.address(step.op.inputs[0]), "k": device.address(step.op.inputs[1]),
                             "v": device.address(step.op.inputs[2]), "o": device.address(step.op.outputs[0])}
        assert isinstance(gpu._stream, ctypes.c_void_p) and stand_in.streams == [gpu._stream.value or 0]
