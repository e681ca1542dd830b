"""Activation precision (`Compiler(precision="bfloat16")`, `compiler/activations.py`): a
training step's activations and their gradients stored in bfloat16, its parameters,
optimizer state, gradients the trainer reads and losses in float32, every op still well
typed; on the CUDA backend (the host emulator here) the losses follow float32's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ranvier as rv
from ranvier.compiler.compiler import check_types
from ranvier.errors import RanvierError


def _llama_trainer(backend: str, precision: str, heads: int = 4):
    """A stories260K-shaped Llama with `heads` heads (of 16 features at 4), AdamW and
    clipping, 2 × 16 tokens."""
    from ranvier.models import llama
    from ranvier.train.losses import softmax_cross_entropy
    from ranvier.train.optimizers import AdamW
    from ranvier.train.trainer import Trainer

    config = dataclasses.replace(llama.PRESETS["stories260K"], n_heads=heads, n_kv_heads=heads // 2)
    model = llama.Llama(config, seed=0)
    flow = rv.Flow()
    f = rv.Builder(flow, "train")
    f.func.training = True
    tokens, targets = f.var("tokens", "int32", [2, 16]), f.var("targets", "int32", [2, 16])
    params = model.parameters(f)
    loss = softmax_cross_entropy(model(f, tokens, params).reshape([32, config.vocab_size]), targets.reshape([32]))
    trainer = Trainer(loss, list(params.values()), AdamW(lr=1e-3), clip_norm=1.0, inputs=[tokens, targets], backend=backend,
                      precision=precision)
    return trainer, config.vocab_size


def test_bfloat16_activations_leave_parameters_gradients_and_the_loss_in_float32(monkeypatch):
    """Every product takes bfloat16 inputs, the logits and their gradient are bfloat16, so is
    attention and its gradient on tensor cores, the parameters (globals), the gradients the
    trainer reads and the loss stay float32, and each op of the compiled step is typed as
    its definition says."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    trainer, vocabulary = _llama_trainer("cuda", "bfloat16")
    assert trainer.precision == "bfloat16" and trainer.matmul == "bfloat16"
    steps = trainer.network.cell("train").steps
    for step in steps:
        check_types(step.op)
    products = [step.op for step in steps if step.op.type == "MatMul"]
    assert products and all(v.dtype == "bfloat16" for op in products for v in (*op.inputs, *op.outputs))
    (loss_step,) = [step.op for step in steps if step.op.type == "SoftmaxCrossEntropyGrad"]
    assert loss_step.inputs[0].dtype == "bfloat16" and loss_step.inputs[0].shape == [32, vocabulary]
    assert [v.dtype for v in loss_step.outputs] == ["bfloat16", "float32"]  # the logits' gradient, the per-example losses
    flow = trainer.network.flow
    assert {v.dtype for v in flow.vars.values() if v.is_global and v.dtype in ("float32", "bfloat16")} == {"float32"}
    assert flow.vars[trainer.loss_var.name].dtype == "float32"
    attention = [step for step in steps if step.op.type.startswith("Attention")]
    assert {step.kernel for step in attention} == {"AttentionMMA"}
    statistics = {step.op.outputs[1].name for step in attention if step.op.type == "Attention"}  # float32 always
    assert {v.dtype for step in attention for v in (*step.op.inputs, *step.op.outputs) if v.name not in statistics} == {"bfloat16"}
    assert {step.op.inputs[4].name for step in attention if step.op.type == "AttentionGrad"} == statistics


def test_bfloat16_activations_give_a_moe_layers_grouped_products_bfloat16_operands(monkeypatch):
    """The grouped expert products and their weight gradients are products too: bfloat16
    operands, the expert weights rounded once a step as a MatMul's are (their float32
    weights, their largest input, had kept them float32: twice the bytes, and not the
    tensor cores' copy path); the steps follow the CPU's float32 losses."""
    from helpers import language_model_trainer

    from ranvier.models import moe

    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    trainer = language_model_trainer(moe.MoE(moe.PRESETS["moe-tiny"], seed=0), "cuda", 2, 16, 1e-3, precision="bfloat16")
    steps = trainer.network.cell("train").steps
    grouped = [step for step in steps if step.op.type.startswith("GroupedMatMul")]
    assert grouped and {step.kernel for step in grouped} == {"GroupedProductMMA"}
    for step in grouped:
        check_types(step.op)
        assert [v.dtype for v in step.op.inputs if v.dtype != "int32"] == ["bfloat16", "bfloat16"], step.op
    assert {step.op.type for step in grouped} == {"GroupedMatMul", "GroupedMatMulWeightGrad"}
    exact = language_model_trainer(moe.MoE(moe.PRESETS["moe-tiny"], seed=0), "cpu", 2, 16, 1e-3)
    rng = np.random.default_rng(1)
    for _ in range(3):
        batch = [rng.integers(0, moe.PRESETS["moe-tiny"].vocab_size, (2, 16)).astype(np.int32) for _ in range(2)]
        assert trainer.step(batch) == pytest.approx(exact.step(batch), rel=1e-3)


def test_bfloat16_activations_train_to_float32s_losses_on_the_device(monkeypatch):
    """Ten steps on the CUDA backend's emulator follow the CPU's float32 losses to
    bfloat16's rounding (measured: within 1.0e-4; 5.0e-4 while the per-example losses
    were stored in bfloat16)."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    low, vocabulary = _llama_trainer("cuda", "bfloat16")
    exact, _ = _llama_trainer("cpu", "float32")
    rng = np.random.default_rng(1)
    for _ in range(10):
        batch = [rng.integers(0, vocabulary, (2, 16)).astype(np.int32) for _ in range(2)]
        assert low.step(batch) == pytest.approx(exact.step(batch), rel=3e-4)


def test_a_backend_without_bfloat16_activations_keeps_float32():
    trainer, _ = _llama_trainer("cpu", "bfloat16")
    assert trainer.precision == "float32"
    assert all(v.dtype != "bfloat16" for v in trainer.network.flow.vars.values())


def test_an_unknown_precision_is_named():
    with pytest.raises(RanvierError, match="unknown precision .fp8.; available: float32, bfloat16, float16"):
        rv.Compiler("cpu", precision="fp8")


def test_an_op_that_cannot_take_bfloat16_keeps_float32_and_the_casts_tried_for_it_go():
    """SampleToken takes float32 numbers beside its logits: the logits are widened back for
    it, and the casts of its other inputs tried first leave no trace."""
    from ranvier.compiler.activations import use_activation_precision

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    logits = f.matmul(f.var("x", "float32", [64, 32]), f.var("w", "float32", [32, 16]))
    tokens, _ = f.sample_token(logits, f.var("u", "float32", [64]), f.var("t", "float32", []), f.var("k", "int32", []),
                               f.var("p", "float32", []))
    (tokens + 1).var.out = True
    use_activation_precision(flow, flow.func("f"), {v.name for v in flow.vars.values() if v.out or v.in_})
    ops = flow.func("f").ops
    for op in ops:
        check_types(op)
    (sample,) = [op for op in ops if op.type == "SampleToken"]
    assert [v.dtype for v in sample.inputs] == ["float32", "float32", "float32", "int32", "float32"]
    casts = [(op.inputs[0].name, op.outputs[0].dtype) for op in ops if op.type == "Cast"]
    assert sorted(casts) == [("f/MatMul:0", "float32"), ("f/w", "bfloat16"), ("f/x", "bfloat16")]


def test_float16_activations_train_with_dynamic_loss_scaling(monkeypatch):
    """float16 turns loss scaling on (its gradients would underflow): the step's activations
    are float16, attention's gradient too (the block kernels', in float32 arithmetic), no
    step is skipped on this model, and ten steps follow float32's losses."""
    from ranvier.train.loss_scale import DynamicLossScale

    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    half, vocabulary = _llama_trainer("cuda", "float16")
    assert half.precision == "float16"
    flow = half.network.flow
    assert flow.vars["train/loss_scale"].data == DynamicLossScale().initial
    products = [step.op for step in half.network.cell("train").steps if step.op.type == "MatMul"]
    assert products and all(v.dtype == "float16" for op in products for v in op.inputs)
    gradients = [step for step in half.network.cell("train").steps if step.op.type == "AttentionGrad"]
    assert gradients and all(step.op.inputs[0].dtype == "float16" and step.kernel == "Attention" for step in gradients)
    exact, _ = _llama_trainer("cpu", "float32")
    rng = np.random.default_rng(2)
    for _ in range(10):
        batch = [rng.integers(0, vocabulary, (2, 16)).astype(np.int32) for _ in range(2)]
        assert half.step(batch) == pytest.approx(exact.step(batch), rel=2e-3)
    assert half.skipped_steps == 0 and half.step_count == 10


def test_an_op_without_a_half_precision_kernel_stays_float32():
    """A backend that runs no attention gradient in half precision (its `runs_whole`
    refusing one): the gradient stays float32, its inputs widened back, while the forward
    takes bfloat16; the statistics between them float32 throughout."""
    from helpers import attention_with_gradient

    from ranvier.compiler.activations import use_activation_precision

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    q, k, v, dout = (f.matmul(f.var(f"x{i}", "float32", [64, 8]), f.var(f"w{i}", "float32", [8, 8])).reshape([2, 2, 16, 8])
                     for i in range(4))  # products: bfloat16 activations
    for result in attention_with_gradient(f, q, k, v, dout):
        (result * 2.0).var.out = True
    use_activation_precision(flow, flow.func("f"), {v.name for v in flow.vars.values() if v.out or v.in_}, "bfloat16",
                             lambda op: op.type != "AttentionGrad" or op.inputs[0].dtype == "float32")
    ops = {op.type: op for op in flow.func("f").ops}
    for op in ops.values():
        check_types(op)
    assert [v.dtype for v in ops["Attention"].inputs] == ["bfloat16"] * 3
    assert [v.dtype for v in ops["Attention"].outputs] == ["bfloat16", "float32"]
    assert {v.dtype for v in (*ops["AttentionGrad"].inputs, *ops["AttentionGrad"].outputs)} == {"float32"}


def test_attention_no_tensor_core_kernel_takes_runs_in_bfloat16_on_the_block_kernels(monkeypatch):
    """Heads of 8 features, which no tensor-core kernel takes: the CUDA block kernels run
    the attention and its gradient on bfloat16 operands (in float32 arithmetic), the
    statistics float32, and ten steps follow the CPU's float32 losses to bfloat16's
    rounding."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    low, vocabulary = _llama_trainer("cuda", "bfloat16", heads=8)
    steps = {step.op.type: step for step in low.network.cell("train").steps if step.op.type.startswith("Attention")}
    assert {step.kernel for step in steps.values()} == {"Attention"}
    assert [v.dtype for v in steps["AttentionGrad"].op.inputs] == ["bfloat16"] * 4 + ["float32", "bfloat16"]
    assert [v.dtype for v in steps["Attention"].op.outputs] == ["bfloat16", "float32"]
    exact, _ = _llama_trainer("cpu", "float32", heads=8)
    rng = np.random.default_rng(1)
    for _ in range(10):
        batch = [rng.integers(0, vocabulary, (2, 16)).astype(np.int32) for _ in range(2)]
        assert low.step(batch) == pytest.approx(exact.step(batch), rel=3e-4)
