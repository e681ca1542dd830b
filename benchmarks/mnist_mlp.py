"""MNIST benchmark: ranvier vs PyTorch CPU eager, the same recipe in the same run.

784-256-10 GELU MLP (or with --model cnn, `ranvier train mnist --model cnn`'s network: two
5 × 5 convolutions of 8 and 16 channels, each with a ReLU and 2 × 2 max pooling, and a dense
layer), Adam lr 1e-3, batch 128, 2,340 steps on the bundled 4,000-digit training split;
test accuracy on the 1,000 test digits. Both sides gather each batch's uint8 pixels and
divide them by 255 in the step, as `ranvier train mnist` does. The two sides alternate for
several repetitions; each side's median accuracy, then its median seconds and how much
faster or slower than PyTorch it is, are printed. Where the CPU has AMX-BF16 or AVX512-BF16,
ranvier also runs with mixed-precision matrix products (`matmul="bfloat16"`: bf16 inputs,
float32 sums) as a third side, "ranvier-bf16", compared with ranvier's float32 too. PyTorch also
trains through torch.compile (Inductor's C++ kernels; --no-torch-compile leaves it out),
compiled before its timed steps as ranvier's step is; each run prints each side's compile
time (as the caches find them; --cold-compile: with nothing cached), and the instructions
each side's libraries run are printed first.
Run: python benchmarks/mnist_mlp.py [--repeats 3] [--steps 2340] [--model cnn] [--no-torch-compile] [--cold-compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import (
    TORCH_COMPILE,
    WARM_CACHES,
    cold_caches,
    comparison,
    compile_options,
    compiles,
    machine,
    match_threads,
    measure_ceilings,
    summary,
    torch_features,
)


def _images(split, model: str) -> np.ndarray:
    """The images as both sides gather them: uint8 pixels, divided by 255 in each step."""
    return split.pixels([784] if model == "mlp" else [1, 28, 28])


Run = tuple[float, float, float | None]  # seconds of the timed steps, test accuracy, seconds to compile (None: eager)


def run_ranvier(steps: int, backend: str, matmul: str = "float32", model: str = "mlp") -> Run:
    from ranvier.jobs.mnist import MnistConfig, make_trainer

    start = time.perf_counter()
    trainer, _, test = make_trainer(MnistConfig(steps=steps, backend=backend, matmul=matmul, model=model))
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    seconds = time.perf_counter() - start
    return seconds, trainer.accuracy(_images(test, model), test.labels), compiled


def torch_model(model: str):
    """The PyTorch network of ranvier's `model` (models/mlp.py, models/cnn.py)."""
    import torch

    if model == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 7 * 7, 10),
    )


def run_torch(steps: int, model_name: str = "mlp", compiled: bool = False) -> Run | None:
    """PyTorch eager, or with `compiled` its model through torch.compile, compiled before
    the timed steps by a forward and backward pass whose gradients are dropped (None, with
    one line why, where Inductor cannot compile here)."""
    import torch

    from ranvier.data import mnist
    from ranvier.data.batches import BatchSampler

    train, test = mnist.load()
    x, y = torch.tensor(_images(train, model_name)), torch.tensor(train.labels.astype(np.int64))
    torch.manual_seed(0)
    model = torch_model(model_name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = BatchSampler(len(x), 128, seed=0)

    def loss(index):
        return torch.nn.functional.cross_entropy(forward(x[index].float() / 255), y[index])

    forward, compile_seconds = model, None
    if compiled:
        forward, start = torch.compile(model), time.perf_counter()
        if not compiles(lambda: loss(torch.arange(128)).backward()):
            return None
        optimizer.zero_grad(set_to_none=True)
        compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss(torch.from_numpy(sampler.next())).backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(torch.tensor(_images(test, model_name)).float() / 255).argmax(1).numpy() == test.labels).mean()
    return seconds, float(accuracy), compile_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2340)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    compile_options(parser)
    args = parser.parse_args()
    compile_times = cold_caches() if args.cold_compile else WARM_CACHES
    import torch

    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.target import host_target

    match_threads(torch)
    torch_compile = args.torch_compile is not False
    print(f"{machine(torch)}; ranvier backend {args.backend}; model {args.model}")
    print(torch_features(torch, torch_compile))
    print(compile_times)
    sides = {"ranvier": lambda: run_ranvier(args.steps, args.backend, model=args.model)}
    if args.backend == "cpu" and bf16_gemm(host_target()):
        sides["ranvier-bf16"] = lambda: run_ranvier(args.steps, args.backend, "bfloat16", args.model)
    sides["pytorch"] = lambda: run_torch(args.steps, args.model)
    if torch_compile:
        sides[TORCH_COMPILE] = lambda: run_torch(args.steps, args.model, compiled=True)
    results: dict[str, list[Run]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name, run in list(sides.items()):
            result = run()
            if result is None:  # torch.compile could not compile here: said why, left out
                del sides[name], results[name]
                continue
            seconds, accuracy, compiled = result
            results[name].append(result)
            compile_note = f"  (compiled in {compiled:.2f} s)" if compiled is not None else ""
            print(f"  run {repeat + 1} {name:13s} {seconds:7.2f} s  accuracy {accuracy:.4f}{compile_note}", flush=True)
    for name, runs in results.items():
        first_compile = f", compiled in {runs[0][2]:.2f} s in its first run" if runs[0][2] is not None else ""
        print(f"{name:13s} median accuracy {statistics.median(a for _, a, _ in runs):.4f}{first_compile}")
    medians = {name: statistics.median(s for s, _, _ in runs) for name, runs in results.items()}
    summary(medians, "s", higher_is_better=False, digits=2)
    if "ranvier-bf16" in medians:
        print(f"{comparison('ranvier-bf16', medians['ranvier-bf16'], 'ranvier', medians['ranvier'], False)} (median s)")
    print(measure_ceilings(megabytes=256, gemm_n=2048, repeats=3, torch=torch).against(step_flops(args.model) * args.steps, medians))


def step_flops(model: str = "mlp") -> int:
    """The arithmetic of one training step as ranvier's compiled step counts it; both
    sides do the same products (neither computes the input's gradient)."""
    from ranvier.jobs.mnist import MnistConfig, make_trainer

    return make_trainer(MnistConfig(steps=1, model=model))[0].cell.flops


if __name__ == "__main__":
    main()
