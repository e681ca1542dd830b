"""Attention and its gradient through cuDNN's fused scaled-dot-product attention (SDPA),
NVIDIA's FlashAttention, by the `nvidia-cudnn-frontend` package: the plan made at compile
time (`plan_attention`), its graphs built and run on a GPU (`CudnnAttention`), and the same
plan in numpy on the host emulator (`run_on_host`; a compile for the emulator claims nothing,
as on a GPU without cuDNN, unless a test asks, so its other tests run the own kernels).

The CUDA backend claims an Attention or AttentionGrad op for cuDNN as it claims a MatMul
for cuBLASLt, where cuDNN's SDPA takes it (`refusal` says why not): bfloat16 or float16
q, k, v (cuDNN's SDPA reads no float32; casting would cost a pass over every operand and
gradient and change what the op means, so float32 operands stay with the own kernels,
`attention_mma.py` where the compile's products run in bfloat16); no score bias; head sizes
a multiple of 8 up to 128; and only where a GPU of compute capability 8.0 or newer and the
frontend are here (`unavailable`), and `RANVIER_CUDNN` is not "0". Either layout is one set
of dims [B, heads, T, hd] with its strides: [B, T, heads, hd] rows are read in place.
Grouped- and multi-query attention (KV < H key/value heads) is cuDNN's own: query head h
reads key/value head h // (H / KV), as the op's. ranvier's causal mask lets query t see
keys s ≤ t + S − T (the queries are the last T positions): cuDNN's mask aligned to the
bottom right with a right bound of 0. The scale is the op's (1/√hd by default).

The gradient: cuDNN's backward reads the forward's output O and its softmax statistics
(each query row's max + log Σ exp), which AttentionGrad's inputs (q, k, v, d out) do not
carry, so the claimed gradient runs cuDNN's forward again first, its O and statistics into
scratch memory of the plan's (B·H·T·hd elements and B·H·T floats), then the backward. That
costs one more forward (the causal half of 4·B·H·T·S·hd FLOPs, about 2/5 of the backward's
own) and those bytes written and read once; in exchange the op, the graph and every other
backend stay as they are (the own kernels recompute the same statistics in their first
launch).

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
from ...ops.attention import attention, attention_grad, bias_of, heads_first_shape, scale_of

KIND = "cuDNN"  # what a cell printout calls a step cuDNN runs
ENVIRONMENT = "RANVIER_CUDNN"  # "0": the own attention kernels, never cuDNN's
FRONTEND = "cudnn"  # the nvidia-cudnn-frontend package's module
MINIMUM_CAPABILITY = (8, 0)  # cuDNN's fused attention runs on Ampere and newer
MAX_HEAD_SIZE = 128
_DATA_TYPES = {dtypes.DT_BFLOAT16: "BFLOAT16", dtypes.DT_FLOAT16: "HALF"}  # cudnn.data_type members


@dataclass(frozen=True)
class SdpaPlan:
    """Attention or its gradient as cuDNN is asked for it: dims [B, heads, T, hd] and
    element strides of q (the output and dq alike) and of k and v (dk and dv alike)."""

    gradient: bool
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

    def __str__(self) -> str:
        """What a step printout shows: pass, shape, heads, dtype, mask and scale."""
        heads = f"{self.heads} heads" + (f" ({self.kv_heads} key/value)" if self.kv_heads != self.heads else "")
        mask = ", causal" if self.causal else ""
        return (f"SDPA {'backward' if self.gradient else 'forward'} {self.batch}×{self.queries}×{self.keys}, {heads} of "
                f"{self.size}, {self.dtype}{mask}, scale {self.scale:.6g}")


@dataclass(frozen=True)
class Sdpa:
    """A claimed step's cuDNN call: its plan and the variables in cuDNN's q, k, v (and d out)
    and the outputs (o; or dq, dk, dv), in that order."""

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
    operand_types = {v.dtype for v in (*op.inputs, *op.outputs)}
    if bias_of(op) is not None:
        return "a score bias (cuDNN's takes none here)"
    if len(operand_types) != 1 or operand_types.pop() not in _DATA_TYPES:
        return f"{'/'.join(sorted({v.dtype for v in op.inputs}))} operands (cuDNN's SDPA reads bfloat16 or float16)"
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
    gradient = op.type == "AttentionGrad"
    plan = SdpaPlan(gradient, q.dtype, batch, heads, kv_heads, queries, keys, size, _strides(list(q.shape), first),
                    _strides(list(k.shape), first), attrs["causal"], scale_of(attrs, size))
    operands = (*op.inputs[: 4 if gradient else 3], *op.outputs)
    return Sdpa("a_" + "".join(c if c.isalnum() else "_" for c in op.name), plan, operands)


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


def _host_view(address: int, dims: list[int], strides: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The strided tensor at host `address` as a writable numpy view."""
    extent = sum((d - 1) * s for d, s in zip(dims, strides)) + 1
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (extent * dtype.itemsize)).from_address(address)).view(dtype)
    return np.lib.stride_tricks.as_strided(raw, dims, [s * dtype.itemsize for s in strides])


def run_on_host(plan: SdpaPlan, addresses: list[int]) -> None:
    """What cuDNN computes for the plan, over host memory at its operands' addresses (in
    `Sdpa.operands`' order), in float64 then rounded: the emulator's SDPA, and the check
    that a plan's dims, strides, mask and scale mean the op."""
    dtype = np.dtype(dtypes.to_numpy(plan.dtype))
    layouts = [(plan.q_dims, plan.q_strides), (plan.kv_dims, plan.kv_strides), (plan.kv_dims, plan.kv_strides)]
    layouts += [(plan.q_dims, plan.q_strides), *layouts] if plan.gradient else [(plan.q_dims, plan.q_strides)]
    views = [_host_view(address, dims, strides, dtype) for address, (dims, strides) in zip(addresses, layouts)]
    if plan.gradient:
        q, k, v, dout, *outputs = views
        out, lse = attention(q, k, v, causal=plan.causal, scale=plan.scale, statistics=True)
        results = attention_grad(q, k, v, out, lse, dout, causal=plan.causal, scale=plan.scale)
    else:
        q, k, v, *outputs = views
        results = attention(q, k, v, causal=plan.causal, scale=plan.scale)
    for output, result in zip(outputs, results):
        output[...] = np.asarray(result).astype(dtype)


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


def _layout(frontend: Any, plan: SdpaPlan, name: str) -> tuple[list[int], list[int], Any]:
    """Dims, strides and data type of a graph tensor by its role: q's (the output, d out and
    dq alike), k's (v, dk, dv), or the softmax statistics (one float per query row,
    [B, H, T, 1] contiguous)."""
    if name == "stats":
        rows = [plan.batch, plan.heads, plan.queries, 1]
        return rows, [plan.heads * plan.queries, plan.queries, 1, 1], frontend.data_type.FLOAT
    data_type = getattr(frontend.data_type, _DATA_TYPES[plan.dtype])
    if name in ("k", "v", "dk", "dv"):
        return plan.kv_dims, list(plan.kv_strides), data_type
    return plan.q_dims, list(plan.q_strides), data_type


def _graph(frontend: Any, plan: SdpaPlan, handle: Any, inputs: tuple[str, ...]) -> tuple[Any, list[Any]]:
    """An empty graph in the plan's dtype (float32 sums and softmax), and its input tensors."""
    graph = frontend.pygraph(io_data_type=_layout(frontend, plan, "q")[2], intermediate_data_type=frontend.data_type.FLOAT,
                             compute_data_type=frontend.data_type.FLOAT, handle=handle)
    tensors = []
    for name in inputs:
        dims, strides, data_type = _layout(frontend, plan, name)
        tensors.append(graph.tensor(name=name, dim=dims, stride=strides, data_type=data_type))
    return graph, tensors


def _outputs(frontend: Any, plan: SdpaPlan, tensors: dict[str, Any]) -> list[Any]:
    """The graph's outputs, each laid out as its role says (`_layout`)."""
    for name, tensor in tensors.items():
        dims, strides, data_type = _layout(frontend, plan, name)
        tensor.set_output(True).set_dim(dims).set_stride(strides).set_data_type(data_type)
    return list(tensors.values())


def describe_forward(frontend: Any, plan: SdpaPlan, handle: Any = None) -> tuple[Any, list[Any]]:
    """The forward's graph (with the statistics for a gradient's plan) and its tensors in
    the order they are bound: q, k, v, o (, stats)."""
    graph, inputs = _graph(frontend, plan, handle, ("q", "k", "v"))
    o, stats = graph.sdpa(*inputs, attn_scale=plan.scale, generate_stats=plan.gradient, name="sdpa", **_mask(frontend, plan))
    return graph, inputs + _outputs(frontend, plan, {"o": o, "stats": stats} if plan.gradient else {"o": o})


def describe_backward(frontend: Any, plan: SdpaPlan, handle: Any = None) -> tuple[Any, list[Any]]:
    """The backward's graph and its tensors in binding order: q, k, v, d out, o, stats, dq,
    dk, dv."""
    graph, inputs = _graph(frontend, plan, handle, ("q", "k", "v", "dout", "o", "stats"))
    q, k, v, dout, o, stats = inputs
    dq, dk, dv = graph.sdpa_backward(q, k, v, o, dout, stats, attn_scale=plan.scale, name="sdpa_backward",
                                     **_mask(frontend, plan))
    return graph, inputs + _outputs(frontend, plan, {"dq": dq, "dk": dk, "dv": dv})


@dataclass
class Prepared:
    """A plan's graphs, built for the device, with their tensors in binding order; the
    workspace they share; and a gradient's scratch for the recomputed o and statistics."""

    plan: SdpaPlan
    graphs: list[tuple[Any, list[Any]]]
    workspace: int
    o: int = 0
    stats: int = 0


class CudnnAttention:
    """cuDNN's SDPA through the frontend, on a device's stream: one handle for every step
    (they run one after another on that stream), each plan's graphs built when its cell is
    loaded (before any graph capture, which may not allocate), and its workspace and
    scratch allocated then. The handle is made in the current context, which the driver
    has made its device's primary context: the one the CUDA runtime, and so cuDNN, uses."""

    def __init__(self, stream: ctypes.c_void_p, allocate: Callable[[int], int],
                 load: Callable[[], Any] = load_frontend):
        self.frontend = load()
        self._allocate = allocate
        try:
            self._handle = self.frontend.create_handle()
            self.frontend.set_stream(self._handle, stream.value or 0)
        except Exception as error:  # noqa: BLE001  (the frontend raises many kinds; its message says what)
            raise RanvierError(f"cuDNN could not make a handle on the device's stream: {error}") from None
        self._prepared: dict[SdpaPlan, Prepared] = {}  # a model's layers share one plan's graphs

    def prepare(self, plan: SdpaPlan) -> Prepared:
        """The plan's graphs, validated, built and planned for this device; a RanvierError
        saying why where cuDNN refuses one."""
        if plan in self._prepared:
            return self._prepared[plan]
        frontend = self.frontend
        workspace = 0
        try:
            described = [describe_forward(frontend, plan, self._handle)]
            if plan.gradient:
                described.append(describe_backward(frontend, plan, self._handle))
            for graph, _ in described:
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([frontend.heur_mode.A, frontend.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
                workspace = max(workspace, int(graph.get_workspace_size()))
        except Exception as error:  # noqa: BLE001  (cudnnGraphNotSupportedError and the rest: the message says why)
            raise RanvierError(f"cuDNN refused {plan}: {_first_line(error)}") from None
        prepared = Prepared(plan, described, self._allocate(workspace))
        if plan.gradient:
            item = np.dtype(dtypes.to_numpy(plan.dtype)).itemsize
            prepared.o = self._allocate(plan.batch * plan.heads * plan.queries * plan.size * item)
            prepared.stats = self._allocate(plan.batch * plan.heads * plan.queries * 4)
        self._prepared[plan] = prepared
        return prepared

    def run(self, prepared: Prepared, addresses: list[int]) -> None:
        """The step on the stream (`addresses`: its `Sdpa.operands`'): the forward; or the
        forward into the scratch o and statistics, then the backward."""
        if not prepared.plan.gradient:
            self._execute(prepared, 0, addresses)
            return
        q, k, v, dout, dq, dk, dv = addresses
        self._execute(prepared, 0, [q, k, v, prepared.o, prepared.stats])
        self._execute(prepared, 1, [q, k, v, dout, prepared.o, prepared.stats, dq, dk, dv])

    def _execute(self, prepared: Prepared, which: int, addresses: list[int]) -> None:
        graph, tensors = prepared.graphs[which]
        try:
            graph.execute(dict(zip(tensors, addresses)), prepared.workspace, handle=self._handle)
        except Exception as error:  # noqa: BLE001  (as in `prepare`)
            raise RanvierError(f"cuDNN failed to run {prepared.plan}: {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    """An error's message, its first line (the frontend appends long engine lists)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
