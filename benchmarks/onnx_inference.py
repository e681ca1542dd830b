"""ranvier vs ONNX Runtime, inference of ONNX models exported from PyTorch.

Three random-initialised models, exported with torch.onnx.export (dynamo): a
BERT-base-shaped encoder (12 layers, hidden 768, sequence 128, with an attention
mask), a ResNet-18-shaped CNN (224×224) and a GPT-2-small-shaped decoder (a 128-token
prefill). Each is timed at batch 1 (latency) and batch 32 (throughput) in ranvier
(`ranvier.onnx.load`, CPU backend) and in ONNX Runtime (CPU, default session options:
all graph optimizations), on the same inputs, alternating, medians of several runs.

    python benchmarks/onnx_inference.py                       # all three, batch 1 and 32
    python benchmarks/onnx_inference.py --models resnet18 --batches 1 --repeats 5
    python benchmarks/onnx_inference.py --quick               # small shapes: checks it runs
"""

from __future__ import annotations

import argparse
import logging
import warnings

import numpy as np
import onnxruntime
import torch
from common import machine, measure_ceilings

import ranvier
import ranvier.onnx
from ranvier.modelrun import race


class BasicBlock(torch.nn.Module):
    def __init__(self, channels: int, out: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(out)
        self.conv2 = torch.nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(out)
        self.down = (torch.nn.Sequential(torch.nn.Conv2d(channels, out, 1, stride, bias=False), torch.nn.BatchNorm2d(out))
                     if stride != 1 or channels != out else torch.nn.Identity())

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + self.down(x))


class ResNet(torch.nn.Module):
    """ResNet-18's shape: a 7×7 stem, four stages of two basic blocks, global pooling."""

    def __init__(self, widths=(64, 128, 256, 512), classes: int = 1000):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), torch.nn.BatchNorm2d(widths[0]),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
        blocks, channels = [], widths[0]
        for index, width in enumerate(widths):
            blocks += [BasicBlock(channels, width, 1 if index == 0 else 2), BasicBlock(width, width, 1)]
            channels = width
        self.blocks = torch.nn.Sequential(*blocks)
        self.fc = torch.nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class Encoder(torch.nn.Module):
    """BERT's shape: token and position embeddings, LayerNorm, post-norm GELU layers."""

    def __init__(self, vocab=30522, width=768, layers=12, heads=12, positions=512):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(positions, width)
        self.norm = torch.nn.LayerNorm(width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True, dropout=0.0, activation="gelu")
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, ids, mask):
        x = self.norm(self.tokens(ids) + self.positions(torch.arange(ids.shape[1])))
        return self.layers(x, src_key_padding_mask=mask == 0)


class Decoder(torch.nn.Module):
    """GPT-2's shape: pre-norm blocks of causal attention and a tanh-GELU MLP, tied sizes."""

    def __init__(self, vocab=50257, width=768, heads=12, layers=12, positions=1024):
        super().__init__()
        self.heads = heads
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(positions, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "ln1": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width), "proj": torch.nn.Linear(width, width),
            "ln2": torch.nn.LayerNorm(width), "fc": torch.nn.Linear(width, 4 * width), "out": torch.nn.Linear(4 * width, width),
        }) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        batch, steps = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(steps))
        for block in self.blocks:
            q, k, v = block["qkv"](block["ln1"](x)).split(x.shape[-1], -1)
            q, k, v = (t.view(batch, steps, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["proj"](y.transpose(1, 2).reshape(batch, steps, -1))
            x = x + block["out"](torch.nn.functional.gelu(block["fc"](block["ln2"](x)), approximate="tanh"))
        return self.head(self.norm(x))


def models(quick: bool):
    """name → (module, example inputs for a batch size)."""
    if quick:
        return {
            "bert-base": (Encoder(1000, 64, 2, 4, 64), lambda n: [torch.randint(0, 1000, (n, 16)), torch.ones(n, 16, dtype=torch.int64)]),
            "resnet18": (ResNet((8, 16, 16, 32), 10), lambda n: [torch.randn(n, 3, 32, 32)]),
            "gpt2-small": (Decoder(1000, 64, 4, 2, 64), lambda n: [torch.randint(0, 1000, (n, 16))]),
        }
    return {
        "bert-base": (Encoder(), lambda n: [torch.randint(0, 30522, (n, 128)), torch.ones(n, 128, dtype=torch.int64)]),
        "resnet18": (ResNet(), lambda n: [torch.randn(n, 3, 224, 224)]),
        "gpt2-small": (Decoder(), lambda n: [torch.randint(0, 50257, (n, 128))]),
    }


def compare(module, inputs, repeats: int) -> tuple[dict[str, float], float, int]:
    model = torch.onnx.export(module, tuple(inputs), dynamo=True, verbose=False).model_proto
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    data = ranvier.Compiler().compile(ranvier.onnx.load(model)).cell("main").instance()
    for name, value in feeds.items():
        data[name] = value
    times = race({"ranvier": data.compute, "onnxruntime": lambda: session.run(None, feeds)}, repeats)
    output = model.graph.output[0].name
    reference = session.run(None, feeds)[0]
    error = float(np.abs(np.asarray(data[output]) - reference).max() / np.abs(reference).max())
    return times, error, data.cell.flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert-base", "resnet18", "gpt2-small"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side (medians are compared)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script runs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # torch.onnx's progress lines
    torch.manual_seed(0)
    catalogue = models(args.quick)
    print(machine())
    ceilings = measure_ceilings(megabytes=256, gemm_n=2048, repeats=3, torch=torch)
    print(ceilings)
    print(f"ONNX Runtime {onnxruntime.__version__}: default session options (all graph optimizations), CPUExecutionProvider")
    print(f"{'model':<11} {'batch':>5} {'ranvier ms':>11} {'ORT ms':>9}  {'items/s ranvier':>16} {'items/s ORT':>12}  ratio")
    for name in args.models:
        module, make_inputs = catalogue[name]
        module.eval()
        for batch in args.batches:
            with torch.no_grad():
                times, error, flops = compare(module, make_inputs(batch), args.repeats)
            ours, theirs = times["ranvier"], times["onnxruntime"]
            verdict = f"ranvier {theirs / ours:.2f}× faster" if ours <= theirs else f"ranvier {ours / theirs:.2f}× slower"
            print(f"{name:<11} {batch:>5} {ours * 1e3:>11.1f} {theirs * 1e3:>9.1f}  {batch / ours:>16.1f} {batch / theirs:>12.1f}  "
                  f"{verdict} (ranvier/ORT time {ours / theirs:.2f}; max rel. error {error:.1e}; "
                  f"{flops / 1e9:.1f} GFLOP: ranvier {flops / ours / ceilings.gemm:.0%}, ORT {flops / theirs / ceilings.gemm:.0%} "
                  f"of the GEMM ceiling)", flush=True)


if __name__ == "__main__":
    main()
