"""Attention and its gradient through cuDNN's fused scaled-dot-product attention (SDPA),
NVIDIA's FlashAttention, by the `nvidia-cudnn-frontend` package: the plan made at compile
time (`plan_attention`), its graph built and run on a GPU (`CudnnAttention`), and the same
plan in numpy on the host emulator (`run_on_host`; a compile for the emulator claims nothing,
as on a GPU without cuDNN, unless a test asks, so its other tests run the own kernels).

The CUDA backend claims an Attention or AttentionGrad op for cuDNN as it claims a MatMul
for cuBLASLt, where cuDNN's SDPA takes it (`refusal` says why not): bfloat16 or float16
q, k, v, output and gradients beside float32 statistics (cuDNN's SDPA reads no float32
operands; casting would cost a pass over every operand and gradient and change what the
op means, so float32 operands stay with the own kernels, `attention_mma.py` where the
compile's products run in bfloat16); no score bias; head sizes
a multiple of 8 up to 128; and only where a GPU of compute capability 8.0 or newer and the
frontend are here (`unavailable`), and `RANVIER_CUDNN` is not "0". Either layout is one set
of dims [B, heads, T, hd] with its strides: [B, T, heads, hd] rows are read in place.
Grouped- and multi-query attention (KV < H key/value heads) is cuDNN's own: query head h
reads key/value head h // (H / KV), as the op's. ranvier's causal mask lets query t see
keys s ≤ t + S − T (the queries are the last T positions): cuDNN's mask aligned to the
bottom right with a right bound of 0. The scale is the op's (1/√hd by default).

The softmax statistics: cuDNN's Stats output (`generate_stats`) is each query row's
max + ln Σ exp of its scaled, masked scores, in natural log (not log2 unless the graph
asks `stats_use_log2`), float32 [B, H, T, 1] with strides (H·T, T, 1, 1) whatever the
layout of q (nvidia-cudnn-frontend 1.32: `sdpa/graph_analyzer.py` and `sdpa/fwd/engines.py`
on the `stats_use_log2` convention, `sdpa/fwd/torch_op.py`'s dense stats tensor and
strides, `_sdpa_validate.py`: "The Stats output of sdpa must be an FP32 tensor"): the op's
log-sum-exp L [B, H, T], contiguous in either layout, read as those dims. A row that sees
no key is −∞ in cuDNN's and +∞ in the op's; no claimed op has one (no bias, and a causal
mask needs no more queries than keys, so each row sees key 0). A forward with statistics
(a training step's) asks cuDNN for them straight into the op's second output; one without
(inference) does not. The gradient binds the op's inputs to cuDNN's backward as they are:
q, k, v, the forward's output O and statistics, d out; cuDNN finds D = Σ d out ∘ O itself.

Soft fall back: each claimed step keeps its own kernels (`attention_mma.py`, else
`attention.py`), compiled into the cell's module beside the plan. Where the frontend cannot
be imported, libcudnn cannot be found, or cuDNN refuses to build the step's graph (a shape
or layout none of its engines take), the step runs them instead, and its label says so:
"cuDNN" with the plan where cuDNN runs it, the own kernel's name and why ("cuDNN refused
SDPA forward …: no engine …", "the cuDNN frontend found no libcudnn …") where it does not.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import dtypes
from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ...ops.attention import attention, attention_grad, bias_of, heads_first_shape, scale_of, statistics_of

KIND = "cuDNN"  # what a cell printout calls a step cuDNN runs
ENVIRONMENT = "RANVIER_CUDNN"  # "0": the own attention kernels, never cuDNN's
FRONTEND = "cudnn"  # the nvidia-cudnn-frontend package's module
MINIMUM_CAPABILITY = (8, 0)  # cuDNN's fused attention runs on Ampere and newer
MAX_HEAD_SIZE = 128
STATS = dtypes.DT_FLOAT32  # cuDNN's softmax statistics, as the op's for half-precision operands
_DATA_TYPES = {dtypes.DT_BFLOAT16: "BFLOAT16", dtypes.DT_FLOAT16: "HALF", STATS: "FLOAT"}  # cudnn.data_type members


@dataclass(frozen=True)
class SdpaPlan:
    """Attention or its gradient as cuDNN is asked for it: dims [B, heads, T, hd] and
    element strides of q (the output, d out and dq alike) and of k and v (dk and dv
    alike); whether the forward writes the softmax statistics (a gradient reads them)."""

    gradient: bool
    statistics: bool
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    size: int
    q_strides: tuple[int, int, int, int]
    kv_strides: tuple[int, int, int, int]
    causal: bool
    scale: float

    @property
    def q_dims(self) -> list[int]:
        return [self.batch, self.heads, self.queries, self.size]

    @property
    def kv_dims(self) -> list[int]:
        return [self.batch, self.kv_heads, self.keys, self.size]

    @property
    def tensors(self) -> tuple[str, ...]:
        """The graph's tensors by role, in binding order (`Sdpa.operands`')."""
        if self.gradient:
            return "q", "k", "v", "o", "stats", "dout", "dq", "dk", "dv"
        return ("q", "k", "v", "o", "stats") if self.statistics else ("q", "k", "v", "o")

    def layout(self, name: str) -> tuple[list[int], list[int], str]:
        """Dims, element strides and dtype of a graph tensor by its role: q's (o, d out and
        dq alike), k's (v, dk, dv), or the statistics' (module docstring: cuDNN's
        [B, H, T, 1] over the op's [B, H, T], float32)."""
        if name == "stats":
            return [self.batch, self.heads, self.queries, 1], [self.heads * self.queries, self.queries, 1, 1], STATS
        if name in ("k", "v", "dk", "dv"):
            return self.kv_dims, list(self.kv_strides), self.dtype
        return self.q_dims, list(self.q_strides), self.dtype

    def __str__(self) -> str:
        """What a step printout shows: pass, shape, heads, dtype, mask and scale."""
        heads = f"{self.heads} heads" + (f" ({self.kv_heads} key/value)" if self.kv_heads != self.heads else "")
        mask = ", causal" if self.causal else ""
        role = "backward" if self.gradient else "forward with statistics" if self.statistics else "forward"
        return (f"SDPA {role} {self.batch}×{self.queries}×{self.keys}, {heads} of "
                f"{self.size}, {self.dtype}{mask}, scale {self.scale:.6g}")


@dataclass(frozen=True)
class Sdpa:
    """A claimed step's cuDNN call: its plan and the variables bound to its graph, the op's
    inputs then its outputs: q, k, v, o (, stats) for the forward; q, k, v, o, stats,
    d out, dq, dk, dv for the gradient."""

    name: str
    plan: SdpaPlan
    operands: tuple[Variable, ...]


def _strides(shape: list[int], heads_first: bool) -> tuple[int, int, int, int]:
    """Element strides of dims [B, heads, T, hd] over a contiguous tensor of `shape`
    ([B, heads, T, hd], or [B, T, heads, hd] where the heads come second)."""
    if heads_first:
        _, heads, rows, size = shape
        return heads * rows * size, rows * size, size, 1
    _, rows, heads, size = shape
    return rows * heads * size, size, heads * size, 1


def refusal(op: Operation) -> str:
    """Why cuDNN's SDPA does not take the op ("" where it does; module docstring)."""
    if op.type not in ("Attention", "AttentionGrad"):
        return f"{op.type} is not attention"
    if bias_of(op) is not None:
        return "a score bias (cuDNN's takes none here)"
    # (the statistics of half-precision operands are float32 by the op's rule, as cuDNN's are)
    operand_types = sorted({v.dtype for v in (*op.inputs, *op.outputs) if v is not statistics_of(op)})
    if len(operand_types) != 1 or operand_types[0] not in (dtypes.DT_BFLOAT16, dtypes.DT_FLOAT16):
        return f"{'/'.join(operand_types)} operands (cuDNN's SDPA reads bfloat16 or float16)"
    size = op.inputs[0].shape[-1]
    if size % 8 or not 8 <= size <= MAX_HEAD_SIZE:
        return f"head size {size} (cuDNN's SDPA takes a multiple of 8 up to {MAX_HEAD_SIZE})"
    return ""


def plan_attention(op: Operation) -> Sdpa | None:
    """The op as one cuDNN SDPA call, or None where cuDNN does not take it (`refusal`)."""
    if refusal(op):
        return None
    attrs = attrs_of(op)
    first = attrs["heads_first"]
    q, k = op.inputs[:2]
    batch, heads, queries, size = heads_first_shape(q.shape, first)
    _, kv_heads, keys, _ = heads_first_shape(k.shape, first)
    plan = SdpaPlan(op.type == "AttentionGrad", statistics_of(op) is not None, q.dtype, batch, heads, kv_heads, queries,
                    keys, size, _strides(list(q.shape), first), _strides(list(k.shape), first), attrs["causal"],
                    scale_of(attrs, size))
    return Sdpa("a_" + "".join(c if c.isalnum() else "_" for c in op.name), plan, (*op.inputs, *op.outputs))


def unavailable(capability: tuple[int, int] | None) -> str:
    """Why the backend claims no op for cuDNN on this machine ("" where it may): asked not
    to, no GPU (or one older than Ampere), or no frontend package to import."""
    if os.environ.get(ENVIRONMENT) == "0":
        return f"{ENVIRONMENT}=0"
    if capability is None or capability < MINIMUM_CAPABILITY:
        return "no GPU of compute capability 8.0 or newer"
    if importlib.util.find_spec(FRONTEND) is None:
        return "no nvidia-cudnn-frontend (pip install 'ranvier[cuda]')"
    return ""


# ---- the plan on the host (the emulator) ---------------------------------------------------


def _host_view(address: int, dims: list[int], strides: list[int], dtype: str) -> np.ndarray:
    """The strided tensor at host `address` as a writable numpy view."""
    item = np.dtype(dtypes.to_numpy(dtype))
    extent = sum((d - 1) * s for d, s in zip(dims, strides)) + 1
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (extent * item.itemsize)).from_address(address)).view(item)
    return np.lib.stride_tricks.as_strided(raw, dims, [s * item.itemsize for s in strides])


def run_on_host(plan: SdpaPlan, addresses: list[int]) -> None:
    """What cuDNN computes for the plan, over host memory at its operands' addresses (in
    `Sdpa.operands`' order), in float64 then rounded: the forward (with the statistics
    where the plan asks), or the backward from the o and statistics it is given; the
    emulator's SDPA, and the check that a plan's dims, strides, mask and scale mean the op."""
    views = {name: _host_view(address, *plan.layout(name)) for name, address in zip(plan.tensors, addresses)}
    q, k, v = views["q"], views["k"], views["v"]
    if plan.gradient:
        gradients = attention_grad(q, k, v, views["o"], views["stats"][..., 0], views["dout"], causal=plan.causal,
                                   scale=plan.scale)
        results = dict(zip(("dq", "dk", "dv"), gradients))
    else:
        results = dict(zip(("o", "stats"), attention(q, k, v, causal=plan.causal, scale=plan.scale,
                                                     statistics=plan.statistics)))
    for name, result in results.items():
        views[name][...] = np.asarray(result).reshape(views[name].shape).astype(views[name].dtype)


# ---- the plan on a GPU ------------------------------------------------------------------------


def load_frontend(name: str = FRONTEND) -> Any:
    """The frontend's module, whose import finds libcudnn (NVIDIA's nvidia-cudnn-cu12/13
    wheel, or LD_LIBRARY_PATH); a RanvierError naming what is missing where it cannot."""
    try:
        frontend = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001  (its import also asserts what it finds of libcudnn)
        raise RanvierError(f"nvidia-cudnn-frontend could not be imported ({error!r}): pip install 'ranvier[cuda]'") from None
    try:
        frontend.backend_version()
    except Exception as error:  # noqa: BLE001  (a RuntimeError where no libcudnn was loaded)
        raise RanvierError(f"the cuDNN frontend found no libcudnn ({error}): pip install nvidia-cudnn-cu13 (or -cu12 "
                           "for CUDA 12), or put its lib folder on LD_LIBRARY_PATH") from None
    return frontend


def _mask(frontend: Any, plan: SdpaPlan) -> dict[str, Any]:
    """The causal mask as cuDNN's diagonal band: query t sees keys s ≤ t + S − T."""
    if not plan.causal:
        return {}
    return {"diagonal_alignment": frontend.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}


def _data_type(frontend: Any, dtype: str) -> Any:
    return getattr(frontend.data_type, _DATA_TYPES[dtype])


def _graph(frontend: Any, plan: SdpaPlan, handle: Any, inputs: tuple[str, ...]) -> tuple[Any, list[Any]]:
    """An empty graph in the plan's dtype (float32 sums and softmax), and its input tensors."""
    graph = frontend.pygraph(io_data_type=_data_type(frontend, plan.dtype), intermediate_data_type=frontend.data_type.FLOAT,
                             compute_data_type=frontend.data_type.FLOAT, handle=handle)
    tensors = []
    for name in inputs:
        dims, strides, dtype = plan.layout(name)
        tensors.append(graph.tensor(name=name, dim=dims, stride=strides, data_type=_data_type(frontend, dtype)))
    return graph, tensors


def _outputs(frontend: Any, plan: SdpaPlan, tensors: dict[str, Any]) -> list[Any]:
    """The graph's outputs, each laid out as its role says (`SdpaPlan.layout`)."""
    for name, tensor in tensors.items():
        dims, strides, dtype = plan.layout(name)
        tensor.set_output(True).set_dim(dims).set_stride(strides).set_data_type(_data_type(frontend, dtype))
    return list(tensors.values())


def describe_forward(frontend: Any, plan: SdpaPlan, handle: Any = None) -> tuple[Any, list[Any]]:
    """The forward's graph, with the statistics where the plan asks for them, and its
    tensors in binding order: q, k, v, o (, stats)."""
    graph, inputs = _graph(frontend, plan, handle, ("q", "k", "v"))
    o, stats = graph.sdpa(*inputs, attn_scale=plan.scale, generate_stats=plan.statistics, name="sdpa",
                          **_mask(frontend, plan))
    return graph, inputs + _outputs(frontend, plan, {"o": o, "stats": stats} if plan.statistics else {"o": o})


def describe_backward(frontend: Any, plan: SdpaPlan, handle: Any = None) -> tuple[Any, list[Any]]:
    """The backward's graph, reading the forward's o and statistics, and its tensors in
    binding order: q, k, v, o, stats, d out, dq, dk, dv."""
    graph, inputs = _graph(frontend, plan, handle, ("q", "k", "v", "o", "stats", "dout"))
    q, k, v, o, stats, dout = inputs
    dq, dk, dv = graph.sdpa_backward(q, k, v, o, dout, stats, attn_scale=plan.scale, name="sdpa_backward",
                                     **_mask(frontend, plan))
    return graph, inputs + _outputs(frontend, plan, {"dq": dq, "dk": dk, "dv": dv})


@dataclass
class Prepared:
    """A plan's graph, built for the device, with its tensors in binding order, and its workspace."""

    plan: SdpaPlan
    graph: Any
    tensors: list[Any]
    workspace: int


class CudnnAttention:
    """cuDNN's SDPA through the frontend, on a device's stream: one handle for every step
    (they run one after another on that stream), each plan's graph built when its cell is
    loaded (before any graph capture, which may not allocate), and its workspace
    allocated then. The handle is made in the current context, which the driver has made
    its device's primary context: the one the CUDA runtime, and so cuDNN, uses."""

    def __init__(self, stream: ctypes.c_void_p, allocate: Callable[[int], int],
                 load: Callable[[], Any] = load_frontend):
        self.frontend = load()
        self._allocate = allocate
        try:
            self._handle = self.frontend.create_handle()
            self.frontend.set_stream(self._handle, stream.value or 0)
        except Exception as error:  # noqa: BLE001  (the frontend raises many kinds; its message says what)
            raise RanvierError(f"cuDNN could not make a handle on the device's stream: {error}") from None
        self._prepared: dict[SdpaPlan, Prepared] = {}  # a model's layers share one plan's graph

    def prepare(self, plan: SdpaPlan) -> Prepared:
        """The plan's graph, validated, built and planned for this device; a RanvierError
        saying why where cuDNN refuses it."""
        if plan in self._prepared:
            return self._prepared[plan]
        frontend = self.frontend
        describe = describe_backward if plan.gradient else describe_forward
        try:
            graph, tensors = describe(frontend, plan, self._handle)
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([frontend.heur_mode.A, frontend.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
            workspace = int(graph.get_workspace_size())
        except Exception as error:  # noqa: BLE001  (cudnnGraphNotSupportedError and the rest: the message says why)
            raise RanvierError(f"cuDNN refused {plan}: {_first_line(error)}") from None
        prepared = self._prepared[plan] = Prepared(plan, graph, tensors, self._allocate(workspace))
        return prepared

    def run(self, prepared: Prepared, addresses: list[int]) -> None:
        """The step's graph on the stream, over `addresses` (its `Sdpa.operands`')."""
        try:
            prepared.graph.execute(dict(zip(prepared.tensors, addresses)), prepared.workspace, handle=self._handle)
        except Exception as error:  # noqa: BLE001  (as in `prepare`)
            raise RanvierError(f"cuDNN failed to run {prepared.plan}: {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    """An error's message, its first line (the frontend appends long engine lists)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
