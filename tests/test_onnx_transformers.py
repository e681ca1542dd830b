"""Hugging Face architectures exported to ONNX load in ranvier and match ONNX Runtime.

Each model is built from a small config of its family (two layers, width 64, random
weights: nothing is downloaded) by the installed transformers, exported by both of the
installed PyTorch's exporters (the TorchScript-based one, dynamo=False, and the dynamo
one), loaded by ranvier, compiled on the CPU backend and run on the inputs ORT runs
(float32: max abs error / max abs value < 1e-5, test_onnx_import's `check`). These are
the graphs users bring: transformers' attention masks (IsNaN, GatherND), rotary
embeddings, relative position buckets, Conv1d stems, grouped key/value heads.
"""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_onnx_import import check, export, graph_inputs  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:Converting a tensor to a Python"),
]

WIDTH = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
TOKENS = {"vocab_size": 100, "max_position_embeddings": 32}
BATCH, LENGTH = 2, 8


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (BATCH, LENGTH))


def _padding_mask() -> torch.Tensor:
    """The second sequence is three tokens shorter: its last keys are masked."""
    return torch.tensor([[1] * LENGTH, [1] * (LENGTH - 3) + [0] * 3])


def bert():
    return transformers.BertModel(transformers.BertConfig(**TOKENS, **WIDTH)), [_ids(), _padding_mask()]


def gpt2():
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), [_ids()]


def llama():
    """Grouped key/value heads (4 query heads over 2), rotary positions, RMSNorm, SwiGLU."""
    config = transformers.LlamaConfig(**TOKENS, **WIDTH, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config), [_ids()]


def vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, **WIDTH)
    return transformers.ViTModel(config), [torch.randn(BATCH, 3, 32, 32)]


def whisper_encoder():
    """Whisper's audio encoder: two Conv1d over the mel frames (the second strided), GELU,
    sinusoidal positions, pre-norm layers."""
    config = transformers.WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                                        num_mel_bins=16, max_source_positions=16)
    return transformers.models.whisper.modeling_whisper.WhisperEncoder(config), [torch.randn(BATCH, 16, 32)]


def t5_encoder():
    """T5's encoder: relative position buckets (Log, Min, Where over the positions), RMS
    norm without a mean, ReLU feed-forward, a padding mask."""
    config = transformers.T5Config(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    return transformers.T5EncoderModel(config), [_ids(), _padding_mask()]


class FirstOutput(torch.nn.Module):
    """The model's first output (hidden states or logits) as a plain tensor, without a
    key/value cache: what both exporters take."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        uses_cache = "use_cache" in self.model.forward.__code__.co_varnames
        return (self.model(*inputs, use_cache=False) if uses_cache else self.model(*inputs))[0]


ARCHITECTURES = {"bert": bert, "gpt2": gpt2, "llama": llama, "vit": vit, "whisper-encoder": whisper_encoder,
                 "t5-encoder": t5_encoder}

# Exports that fail in the exporters with the default attention (SDPA) use transformers'
# eager attention instead: the TorchScript exporter has no conversion of SDPA with grouped
# key/value heads, and torch 2.13's decomposition of T5's SDPA output fails ("Cannot view
# a tensor with shape [2, 8, 4, 16] and strides (512, 16, 128, 1)").
EAGER = {("llama", False), ("t5-encoder", True)}
CASES = [(name, dynamo) for name in ARCHITECTURES for dynamo in (False, True)]


@pytest.mark.parametrize("name, dynamo", CASES, ids=[f"{n}-{'dynamo' if d else 'torchscript'}" for n, d in CASES])
def test_exported_architecture(name, dynamo):
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch.onnx's dynamo exporter needs onnxscript")
    torch.manual_seed(0)
    model, inputs = ARCHITECTURES[name]()
    if (name, dynamo) in EAGER:
        model.config._attn_implementation = "eager"
    onnx_model = export(FirstOutput(model).eval(), inputs, dynamo)
    check(onnx_model, {n: t.numpy() for n, t in zip(graph_inputs(onnx_model), inputs)})
