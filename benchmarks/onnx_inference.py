"""ranvier vs ONNX Runtime and OpenVINO, inference of ONNX models exported from PyTorch.

Four random-initialised models, exported with torch.onnx.export (dynamo): a
BERT-base-shaped encoder (12 layers, hidden 768, sequence 128, with an attention
mask), a ResNet-18-shaped CNN (224×224), a GPT-2-small-shaped decoder (a 128-token
prefill) and a ViT-B/16-shaped vision transformer (224×224: 197 tokens). Each is timed at batch 1 (latency) and batch 32 (throughput) in ranvier
(`ranvier.onnx.load`, CPU backend), in ONNX Runtime (CPU, default session options: all
graph optimizations) and, where it is installed, in OpenVINO (its CPU plugin on the
same .onnx file, as many threads as ranvier, its default precision: bf16 where the CPU
has AVX512_BF16 or AMX), on the same inputs, alternating, medians of several runs.
With --matmul bfloat16 ranvier also runs with its products in bfloat16 (the
"ranvier-bf16" side), its output's error measured against ranvier's float32 output;
--profile prints where each ranvier side's time went, kernel by kernel.

    python benchmarks/onnx_inference.py                       # all four, batch 1 and 32
    python benchmarks/onnx_inference.py --matmul bfloat16     # ranvier-bf16 beside them
    python benchmarks/onnx_inference.py --models resnet18 --batches 1 --repeats 5
    python benchmarks/onnx_inference.py --quick               # small shapes: checks it runs
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from common import machine, measure_ceilings

import ranvier
import ranvier.onnx
from ranvier.backends.cpu.parallel import thread_count
from ranvier.modelrun import comparison, race


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


class VisionTransformer(torch.nn.Module):
    """ViT-B/16's shape: 16×16 patches as tokens behind a class token, learned positions,
    pre-norm GELU layers, the class token's output classified."""

    def __init__(self, image=224, patch=16, width=768, layers=12, heads=12, classes=1000):
        super().__init__()
        self.patches = torch.nn.Conv2d(3, width, patch, patch)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.positions = torch.nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True, dropout=0.0, activation="gelu",
                                                 norm_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, images):
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.positions
        return self.head(self.norm(self.layers(x))[:, 0])


def models(quick: bool):
    """name → (module, example inputs for a batch size)."""
    if quick:
        return {
            "bert-base": (Encoder(1000, 64, 2, 4, 64), lambda n: [torch.randint(0, 1000, (n, 16)), torch.ones(n, 16, dtype=torch.int64)]),
            "resnet18": (ResNet((8, 16, 16, 32), 10), lambda n: [torch.randn(n, 3, 32, 32)]),
            "gpt2-small": (Decoder(1000, 64, 4, 2, 64), lambda n: [torch.randint(0, 1000, (n, 16))]),
            "vit-b16": (VisionTransformer(32, 8, 64, 2, 4, 10), lambda n: [torch.randn(n, 3, 32, 32)]),
        }
    return {
        "bert-base": (Encoder(), lambda n: [torch.randint(0, 30522, (n, 128)), torch.ones(n, 128, dtype=torch.int64)]),
        "resnet18": (ResNet(), lambda n: [torch.randn(n, 3, 224, 224)]),
        "gpt2-small": (Decoder(), lambda n: [torch.randint(0, 50257, (n, 128))]),
        "vit-b16": (VisionTransformer(), lambda n: [torch.randn(n, 3, 224, 224)]),
    }


def openvino_core():
    """OpenVINO's runtime, or None where it is not installed."""
    try:
        import openvino
    except ImportError:
        return None
    return openvino.Core()


def openvino_side(core, path: Path, feeds: dict[str, np.ndarray]) -> tuple[Callable[[], object], Callable[[], np.ndarray], str]:
    """OpenVINO's CPU plugin on the .onnx file at `path`, as many threads as ranvier, its
    own default precision: a call that infers on `feeds`, one that reads the first
    output, and the precision it compiled the model in."""
    compiled = core.compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": thread_count()})
    request = compiled.create_infer_request()
    return (lambda: request.infer(feeds)), (lambda: np.array(request.get_output_tensor(0).data)), \
        compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


def relative_error(output: np.ndarray, reference: np.ndarray) -> float:
    """The largest difference from `reference`, as a share of its largest magnitude."""
    return float(np.abs(np.asarray(output, np.float64) - reference).max() / np.abs(reference).max())


@dataclass
class Result:
    times: dict[str, float]  # median seconds per inference, by side
    errors: dict[str, str]  # max relative error and what it was measured against, by side
    flops: int
    openvino_precision: str | None
    profiles: dict[str, str]  # each ranvier side's time by kernel over its calls in the race


def compare(module, inputs, repeats: int, matmul: str, core) -> Result:
    """Export `module` on `inputs` to one .onnx file and time every side on it: ranvier
    (float32, and with its products in `matmul` where that is not float32), ONNX Runtime
    and, given its `core`, OpenVINO."""
    model = torch.onnx.export(module, tuple(inputs), dynamo=True, verbose=False).model_proto
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.onnx"
        path.write_bytes(model.SerializeToString())
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
        output = model.graph.output[0].name
        instances = {"ranvier": "float32"} | ({"ranvier-bf16": matmul} if matmul != "float32" else {})
        for side, precision in instances.items():
            data = ranvier.Compiler(matmul=precision).compile(ranvier.onnx.load(model)).cell("main").instance()
            for name, value in feeds.items():
                data[name] = value
            instances[side] = data
        sides = {side: data.compute for side, data in instances.items()}
        sides["onnxruntime"] = lambda: session.run(None, feeds)
        outputs = {side: (lambda data=data: np.asarray(data[output])) for side, data in instances.items()}
        outputs["onnxruntime"] = lambda: session.run(None, feeds)[0]
        openvino_precision = None
        if core is not None:
            sides["openvino"], outputs["openvino"], openvino_precision = openvino_side(core, path, feeds)
        for data in instances.values():
            data.reset_profile()
        times = race(sides, repeats)
    results = {side: read() for side, read in outputs.items()}
    errors = {"ranvier": f"{relative_error(results['ranvier'], results['onnxruntime']):.1e} against onnxruntime"}
    errors |= {side: f"{relative_error(results[side], results['ranvier']):.1e} against ranvier's float32"
               for side in results if side not in ("ranvier", "onnxruntime")}
    profiles = {side: data.profile().by_kernel() for side, data in instances.items()}
    return Result(times, errors, instances["ranvier"].cell.flops, openvino_precision, profiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = ["bert-base", "resnet18", "gpt2-small", "vit-b16"]
    parser.add_argument("--models", nargs="+", default=names, choices=names)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side (medians are compared)")
    parser.add_argument("--matmul", default="float32", choices=["float32", "bfloat16"],
                        help="bfloat16: ranvier also runs with its products in bfloat16 (the ranvier-bf16 side)")
    parser.add_argument("--profile", action="store_true", help="print each ranvier side's time by kernel")
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
    core = openvino_core()
    if core is None:
        print("OpenVINO: not installed (pip install openvino), its side left out")
    else:
        import openvino

        print(f"OpenVINO {openvino.__version__.split('-')[0]}: CPU plugin, {thread_count()} threads (INFERENCE_NUM_THREADS), "
              f"its default precision (INFERENCE_PRECISION_HINT) and {core.get_property('CPU', 'PERFORMANCE_HINT').name} hint")
    ranvier_sides = ["ranvier", "ranvier-bf16"] if args.matmul != "float32" else ["ranvier"]
    for name in args.models:
        module, make_inputs = catalogue[name]
        module.eval()
        for batch in args.batches:
            with torch.no_grad():
                result = compare(module, make_inputs(batch), args.repeats, args.matmul, core)
            precision = f"; OpenVINO in {result.openvino_precision}" if result.openvino_precision else ""
            print(f"{name}, batch {batch}: {result.flops / 1e9:.1f} GFLOP{precision}")
            for side, seconds in result.times.items():
                error = f"; max rel. error {result.errors[side]}" if side in result.errors else ""
                print(f"  {side:12s} {seconds * 1e3:10.1f} ms {batch / seconds:10.1f} items/s  "
                      f"{result.flops / seconds / ceilings.gemm:4.0%} of the fp32 GEMM ceiling{error}")
            for ours in ranvier_sides:
                for peer in ("onnxruntime", "openvino"):
                    if peer in result.times:
                        print(f"  {comparison(ours, result.times[ours], peer, result.times[peer], higher_is_better=False)} "
                              f"(median time: {result.times[ours] / result.times[peer]:.2f} of {peer}'s)", flush=True)
            if args.profile:
                for side, profile in result.profiles.items():
                    print(f"  {side}'s {profile}", flush=True)


if __name__ == "__main__":
    main()
