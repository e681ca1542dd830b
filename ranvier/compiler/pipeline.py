"""The pass pipeline: the rewrites of one function, in order, between the function as
`Compiler.compile` hands it over and the steps a backend runs. Before it, over the whole
flow, `Compiler.compile` derives the gradient functions (`autodiff`) and resolves
references and declared conditions. Each pass is a small rewrite in a module of its own,
tested on its own; a backend only states what it can do (`Capabilities`, `runs_whole`),
and the pipeline decides which passes apply.

    fuse-attention   softmax(scale · Q Kᵀ + mask) V written out op by op → one Attention
    decompose        composites the backend cannot run whole → the ops they are made of
    fold             ops of constants → constants
    cse              the same op on the same inputs → computed once
    activation-precision  float32 activations → stored in bfloat16 (Compiler(precision=...))
    fuse             chains of elementwise ops, and loops of one shape reading one value → one Calculate (one loop)
    chunk-lm-head    logits = x·W into a cross-entropy and its gradient → a chunk of rows at a time, never stored whole
    fuse-loss        cross-entropy beside its gradient → one op, one read of the logits
    fuse-router      a softmax read by a TopK → one SoftmaxTopK (a MoE router's row pass)
    mixed-precision  float32 GEMMs → bfloat16 inputs, float32 sums (Compiler(matmul=...))
    fuse-epilogue    a MatMul or Conv2D and the elementwise op that alone reads its product → one op
    fuse-conv-pool   a Conv2DCalculate and the MaxPool that alone reads it → one op (inference)
    fuse-foreach     independent ops of one type (each parameter's update, cast, norm) → one ForEach

`RANVIER_DEBUG=passes` prints the function after each pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import debug
from ..backends import Backend, CompileOptions
from ..flow.graph import Flow, Function
from .activations import use_activation_precision
from .attention import fuse_attention
from .attention_layout import use_rows_layout
from .column_products import split_column_products
from .conv_pool import fuse_conv_pools
from .decompose import decompose
from .epilogue import fuse_epilogues
from .foreach import fuse_foreach
from .fuse import fuse_elementwise
from .lm_head import chunk_lm_head
from .loss import fuse_loss_with_gradient
from .precision import use_matmul_precision
from .router import fuse_softmax_top_k
from .row_transposes import move_transposes_past_products
from .simplify import eliminate_common_subexpressions, fold_constants
from .views import fold_view_chains


@dataclass
class PassContext:
    """What a pass works on: the flow and function, the backend and the compile options,
    and `keep`, the variables that must stay visible (outputs, values other cells read)."""

    flow: Flow
    func: Function
    backend: Backend
    options: CompileOptions
    keep: set[str]


def _rewrites(ctx: PassContext) -> bool:
    return ctx.backend.capabilities.rewrites


def _mixed_precision(ctx: PassContext) -> bool:
    capabilities = ctx.backend.capabilities
    return (_rewrites(ctx) and ctx.options.matmul != "float32"
            and ctx.options.matmul in (*capabilities.matmul_precisions, *capabilities.narrow_weights))


def _activation_precision(ctx: PassContext) -> bool:
    return _rewrites(ctx) and ctx.options.precision != "float32" and ctx.options.precision in ctx.backend.capabilities.activation_precisions


def _epilogues(ctx: PassContext) -> bool:
    return _rewrites(ctx) and ctx.backend.capabilities.epilogues


def _conv_pools(ctx: PassContext) -> bool:
    return _epilogues(ctx) and ctx.backend.capabilities.pools_convolution is not None


def _fuse_conv_pools(ctx: PassContext) -> None:
    accepts = ctx.backend.capabilities.pools_convolution
    if accepts is not None:
        fuse_conv_pools(ctx.flow, ctx.func, ctx.keep, accepts)


def _foreach(ctx: PassContext) -> bool:
    return _rewrites(ctx) and ctx.backend.capabilities.foreach is not None


def _fuse_foreach(ctx: PassContext) -> None:
    capabilities = ctx.backend.capabilities
    if capabilities.foreach is not None:
        fuse_foreach(ctx.flow, ctx.func, capabilities.foreach, capabilities.foreach_operands)


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[PassContext], None]
    applies: Callable[[PassContext], bool] = _rewrites


PIPELINE: tuple[Pass, ...] = (
    Pass("fuse-attention", lambda c: fuse_attention(c.flow, c.func, c.keep)),
    Pass("decompose", lambda c: decompose(c.flow, c.func, c.backend.runs_whole)),
    Pass("fold", lambda c: fold_constants(c.flow, c.func, c.keep)),
    Pass("cse", lambda c: eliminate_common_subexpressions(c.flow, c.func, c.keep)),
    Pass("activation-precision",
         lambda c: use_activation_precision(c.flow, c.func, c.keep, c.options.precision, c.backend.runs_whole),
         _activation_precision),
    Pass("row-transposes", lambda c: move_transposes_past_products(c.flow, c.func, c.keep)),
    Pass("attention-layout", lambda c: use_rows_layout(c.flow, c.func, c.keep)),
    Pass("fold-views", lambda c: fold_view_chains(c.flow, c.func, c.keep, c.backend.runs_whole), _rewrites),
    Pass("column-products", lambda c: split_column_products(c.flow, c.func, c.keep)),
    Pass("fuse", lambda c: fuse_elementwise(c.flow, c.func, c.flow.op_order(c.func), c.keep)),
    Pass("chunk-lm-head", lambda c: chunk_lm_head(c.flow, c.func, c.keep)),
    Pass("fuse-loss", lambda c: fuse_loss_with_gradient(c.flow, c.func)),
    Pass("fuse-router", lambda c: fuse_softmax_top_k(c.flow, c.func)),
    Pass("mixed-precision", lambda c: use_matmul_precision(c.func, c.options.matmul, c.backend.capabilities), _mixed_precision),
    Pass("fuse-epilogue", lambda c: fuse_epilogues(c.flow, c.func, c.keep, c.backend.capabilities.fuses_epilogue),
         _epilogues),
    Pass("fuse-conv-pool", _fuse_conv_pools, _conv_pools),
    Pass("fuse-foreach", _fuse_foreach, _foreach),
)


def run_pipeline(ctx: PassContext, passes: tuple[Pass, ...] = PIPELINE) -> list[str]:
    """Run the passes that apply, in order; returns their names."""
    ran = []
    for step in passes:
        if step.applies(ctx):
            step.run(ctx)
            ran.append(step.name)
            debug.dump("passes", f"{ctx.func.name} after {step.name}", str(ctx.func))
    return ran
