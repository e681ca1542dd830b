"""PyTorch modules trained as compiled ranvier steps (`from_torch(..., trainable=True)`,
`ranvier.train.compile_step`): from the same weights and batches, 20 steps in ranvier and
in PyTorch give the same losses (float32, relative difference ≤ 1e-4 at every step) and
the same weights, which load back into the module (`load_state_dict`, strict) and out of
a checkpoint; batch norm trains on the batch's statistics and updates its running ones,
dropout drops at its rate. A CNN with batch norm here; ResNet-18, BERT-, GPT-2-, ViT- and
Llama-style models from random-initialised Hugging Face configs (no download) are slow.

The optimizers' learning rates keep each model out of the regime where float32 rounding
alone sends PyTorch's own float32 and float64 runs apart (ResNet-18's batch norms over a
few values per channel at these small images: 1e-5, where PyTorch's two runs stay within
2e-6 of each other; at 1e-3 they part by 0.38).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import torch.nn.functional as F  # noqa: E402

import ranvier  # noqa: E402
import ranvier.train  # noqa: E402
from ranvier.errors import RanvierError  # noqa: E402
from ranvier.flow.builder import Builder  # noqa: E402
from ranvier.train.optimizers import AdamW  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
STEPS = 20
LOSS_TOLERANCE = 1e-4


class SmallCNN(torch.nn.Module):
    """Two convolutions with batch norm (bias-free, as before every batch norm), max
    pooling and a linear classifier."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(16, momentum=0.2)
        self.fc = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = F.max_pool2d(torch.relu(self.bn2(self.conv2(y))), 2)
        return self.fc(y.flatten(1))


def images(batch: int, size: int, classes: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 3, size, size)).astype(np.float32), rng.integers(0, classes, batch))
            for _ in range(STEPS)]


def tokens(batch: int, length: int, vocabulary: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Language-model batches: each sequence's next tokens are its targets."""
    rng = np.random.default_rng(seed)
    return [(t[:, :-1], t[:, 1:]) for t in (rng.integers(0, vocabulary, (batch, length + 1)) for _ in range(STEPS))]


def race(module, batches, lr: float):
    """Train `module` in ranvier and a copy of it in PyTorch (AdamW, cross-entropy) on the
    same batches: (the step, the PyTorch copy, ranvier's losses, PyTorch's losses)."""
    reference = copy.deepcopy(module).train()
    step = ranvier.train.compile_step(module, "cross_entropy", AdamW(lr=lr), batch=batches[0])
    optimizer = torch.optim.AdamW(reference.parameters(), lr=lr)
    ours, theirs = [], []
    for x, y in batches:
        ours.append(step(x, y))
        optimizer.zero_grad()
        logits = reference(torch.from_numpy(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    return step, reference, np.array(ours), np.array(theirs)


def assert_same_losses(ours: np.ndarray, theirs: np.ndarray) -> None:
    relative = np.abs(ours - theirs) / np.abs(theirs)
    assert relative.max() <= LOSS_TOLERANCE, f"relative differences per step: {np.array2string(relative, precision=2)}"


def assert_weights_round_trip(step, module, reference, lr: float) -> None:
    """The step's state dict loads into the module strictly, holds what it loaded exactly,
    and is PyTorch's: every parameter within a tenth of the furthest an AdamW step may move
    it over the run (lr per step), the running statistics within 1e-4 of their size."""
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    state = step.state_dict()
    loaded = copy.deepcopy(module)
    loaded.load_state_dict(state)
    trained = reference.state_dict()
    assert set(state) == set(trained)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name].to(value.dtype)), name
        want = trained[name]
        if name.endswith("num_batches_tracked"):
            assert int(value) == int(want) == int(initial[name]) + STEPS
        elif name.endswith(("running_mean", "running_var")):
            assert float((value - want).abs().max()) <= 1e-4 * float(want.abs().max()), name
        else:
            assert float((value - want).abs().max()) <= 0.1 * lr * STEPS, name


def test_a_cnn_with_batch_norm_trains_as_pytorch_does(tmp_path):
    torch.manual_seed(0)
    module = SmallCNN().eval()
    before = copy.deepcopy(module.state_dict())
    step, reference, ours, theirs = race(module, images(8, 16, 10), lr=1e-2)
    assert_same_losses(ours, theirs)
    assert not module.training, "compile_step leaves the module in the mode it was in"
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items()), "and its weights as they were"
    assert_weights_round_trip(step, module, reference, lr=1e-2)
    # A checkpoint of the step is read by PyTorch, by the module's names.
    step.save(tmp_path / "checkpoint")
    saved = ranvier.train.read_state_dict(tmp_path / "checkpoint")
    loaded = copy.deepcopy(module)
    loaded.load_state_dict({name: torch.from_numpy(array) for name, array in saved.items()})
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in step.state_dict().items())
    # And PyTorch's weights load into the step: its next step is PyTorch's next step.
    step.load_state_dict(reference.state_dict())
    x, y = images(8, 16, 10, seed=1)[0]
    logits = reference(torch.from_numpy(x))
    expected = F.cross_entropy(logits, torch.from_numpy(y)).item()
    assert abs(step(x, y) - expected) <= LOSS_TOLERANCE * expected


def test_dropout_drops_at_its_rate_with_new_masks_each_step():
    rate, width = 0.3, 4096
    module = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Dropout(rate))
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    flow = ranvier.from_torch(module, [torch.from_numpy(x)], trainable=True)
    data = ranvier.Compiler().compile(flow).cell("main").instance()
    output = flow.outputs(flow.funcs["main"])[0]
    dense = module[0](torch.from_numpy(x)).detach().numpy()
    masks = []
    for _ in range(2):
        data[flow.inputs(flow.funcs["main"])[0]] = x
        data.compute()
        y = np.array(data[output])
        dropped = y == 0
        assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / y.size)
        np.testing.assert_allclose(y[~dropped], dense[~dropped] / (1 - rate), rtol=1e-5, atol=1e-6)
        masks.append(dropped)
    assert (masks[0] != masks[1]).mean() > 0.3, "each step draws a new mask"


def test_frozen_parameters_stay_constants():
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    module[0].weight.requires_grad_(False)
    flow = ranvier.from_torch(module, [torch.zeros(2, 6)], trainable=True)
    learnable = {alias for var in flow.vars.values() if var.learnable for alias in var.aliases}
    assert learnable == {"0.bias", "2.weight", "2.bias"}


def _flow_with_a_weight(shape=(4, 3)) -> ranvier.Flow:
    flow = ranvier.Flow()
    b = Builder(flow, "main")
    x = b.var("x", "float32", [2, shape[0]])
    y = x @ b.parameter("w", np.ones(shape, np.float32))
    y.var.out = True
    return flow


def test_what_compile_step_refuses_is_named():
    with pytest.raises(RanvierError, match=r"needs batch=\(inputs\.\.\., target\)"):
        ranvier.train.compile_step(torch.nn.Linear(2, 2), "cross_entropy")
    with pytest.raises(RanvierError, match=r"cross_entropy takes integer classes of shape \[2\]"):
        ranvier.train.compile_step(_flow_with_a_weight(), batch=(np.zeros((2, 4), np.float32), np.zeros((2, 3), np.float32)))
    with pytest.raises(RanvierError, match="unknown loss 'hinge'"):
        ranvier.train.compile_step(_flow_with_a_weight(), "hinge")
    with pytest.raises(RanvierError, match="the flow has no learnable variables"):
        ranvier.train.compile_step(ranvier.from_torch(torch.nn.Linear(2, 2), [torch.zeros(1, 2)]))
    with pytest.raises(RanvierError, match="with loss=None the model's output is the loss, a scalar"):
        ranvier.train.compile_step(_flow_with_a_weight(), None)
    with pytest.raises(RanvierError, match="takes a torch module, an ONNX file or a trainable flow, not int"):
        ranvier.train.compile_step(12)


def test_a_loss_function_and_mse_train_a_flow():
    flow = _flow_with_a_weight()
    batch = (np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32))
    step = ranvier.train.compile_step(flow, lambda output, target: ranvier.train.losses.mse(output, target) * 2.0,
                                      ranvier.train.optimizers.SGD(lr=0.01), batch=batch)
    assert step(*batch) == pytest.approx(2 * 16.0)  # each output 4, the target 0
    assert step.weights()["main/w"] == pytest.approx(np.full((4, 3), 1 - 0.01 * 16 / 3, np.float32))
    with pytest.raises(RanvierError, match="state dict's main/w has shape \\[3\\], expected \\[4, 3\\]"):
        step.load_state_dict({"main/w": np.zeros(3)})
    with pytest.raises(RanvierError, match=r"missing \['main/w'\], unexpected \['v'\]"):
        step.load_state_dict({"v": np.zeros(3)})


# ---- models people have: random-initialised Hugging Face configs ----------------------------------


class Logits(torch.nn.Module):
    """A Hugging Face model's logits, the output a loss is taken of."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits


def _hugging_face(name: str):
    """(module, batches, learning rate) of a small model of the family."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    width = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    if name == "resnet18":  # ResNet-18's stages and widths, at small images
        config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                           embedding_size=64, num_labels=10)
        return Logits(transformers.ResNetForImageClassification(config)), images(8, 32, 10), 1e-5
    if name == "bert":  # token 0 is the padding token: its embedding row learns nothing, as in PyTorch
        config = transformers.BertConfig(vocab_size=100, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **width)
        batches = [(x, y[:, 0] % 2) for x, y in tokens(4, 16, 100)]
        return Logits(transformers.BertForSequenceClassification(config)), batches, 1e-3
    if name == "gpt2":  # the embedding tied to the output layer
        config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        return Logits(transformers.GPT2LMHeadModel(config)), tokens(4, 16, 100), 1e-3
    if name == "vit":
        config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        num_labels=10, **width)
        return Logits(transformers.ViTForImageClassification(config)), images(4, 32, 10), 1e-3
    config = transformers.LlamaConfig(vocab_size=100, max_position_embeddings=64, num_key_value_heads=2, **width)
    return Logits(transformers.LlamaForCausalLM(config)), tokens(4, 16, 100), 1e-3


def test_a_gpt2_step_keeps_one_copy_of_its_weights_and_no_scores():
    """The exported attention fuses before the gradient (its backward recomputes the
    probabilities: no [B, H, T, S] scores kept), the tied LM head reads the embedding
    untransposed (no copy of it transposed); the logits are no result of the step (no
    storage of their own for the whole step); the network trains the imported flow's weights, not a copy of them."""
    module, batches, lr = _hugging_face("gpt2")
    step = ranvier.train.compile_step(module, "cross_entropy", AdamW(lr=lr), batch=batches[0])
    kernels = {s.kernel for s in step.cell.steps}
    assert {"AttentionGemm", "AttentionGradGemm"} <= kernels and "SoftmaxRow" not in kernels
    assert not [s.op.name for s in step.cell.steps if s.op.type == "Transpose" and s.op.inputs[0].is_global]  # the tied head's
    results = {name for name, role in step.cell.roles.items() if role == "output"}
    assert not {v.name for v in step.model_outputs} & results
    weight = step.names["model.transformer.h.0.mlp.c_fc.weight"]
    assert step.network.globals[weight] is step.flow.vars[weight].data


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "bert", "gpt2", "vit", "llama"])
def test_a_hugging_face_model_trains_as_pytorch_does(name):
    module, batches, lr = _hugging_face(name)
    step, reference, ours, theirs = race(module, batches, lr)
    assert_same_losses(ours, theirs)
    assert_weights_round_trip(step, module, reference, lr)
