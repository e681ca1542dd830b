"""The `ranvier` command."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _demo(args: argparse.Namespace) -> int:
    """Build Myelin's example cell y = softmax(relu(x W + b)), print its layout and run it."""
    import ranvier as myelin

    rng = np.random.default_rng(args.seed)
    flow = myelin.Flow()
    f = myelin.Builder(flow, "f")
    W = f.array("W", rng.random((64, 256), dtype=np.float32))
    b = f.array("b", rng.random(256, dtype=np.float32))
    x = f.var("x", myelin.DT_FLOAT, [1, 64])
    y = f.softmax(f.relu(f.add(f.matmul(x, W), b)), name="y")
    net = myelin.Compiler(backend=args.backend, cpu=args.cpu).compile(flow)
    cell = net.cell("f")
    print(cell)
    data = cell.instance()
    data[x] = 5.0
    data.compute()
    result = np.asarray(data[y])
    print(f"argmax={int(result.argmax())} max={float(result.max()):.6f} sum={float(result.sum()):.6f}")
    return 0


def _train_mnist(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .train.mnist_job import MnistConfig, resume_mnist, train_mnist

    if args.resume:
        resume_mnist(Path(args.resume), args.steps, progress=not args.quiet)
        return 0
    config = MnistConfig(
        model=args.model,
        steps=args.steps if args.steps is not None else MnistConfig.steps,
        batch=args.batch,
        lr=args.lr,
        optimizer=args.optimizer,
        backend=args.backend,
        cpu=args.cpu,
        seed=args.seed,
        data=args.data,
        checkpoint_every=args.checkpoint_every,
    )
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime(f"mnist-{args.model}-%Y%m%d-%H%M%S")
    print(f"run directory: {run_dir}")
    train_mnist(config, run_dir, progress=not args.quiet, profile=args.profile)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .train.mnist_job import evaluate_run

    evaluate_run(Path(args.run_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ranvier", description="Neural-network JIT compiler and trainer.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="build, print and run Myelin's example cell")
    demo.add_argument("--backend", default="cpu", choices=["cpu", "reference"])
    demo.add_argument("--cpu", default="", metavar="MASK", help="CPU features to mask, e.g. -avx512")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)

    train = commands.add_parser("train", help="train a model")
    tasks = train.add_subparsers(dest="task", required=True)
    mnist = tasks.add_parser("mnist", help="an MNIST classifier (bundled 5,000-digit subset by default)")
    mnist.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    mnist.add_argument("--steps", type=int, default=None, help="total optimizer steps (default 2340)")
    mnist.add_argument("--batch", type=int, default=128)
    mnist.add_argument("--lr", type=float, default=1e-3)
    mnist.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam")
    mnist.add_argument("--backend", default="cpu", choices=["cpu", "reference"])
    mnist.add_argument("--cpu", default="", metavar="MASK", help="CPU features to mask, e.g. -avx512 or -avx512,-avx2")
    mnist.add_argument("--profile", action="store_true", help="print the train step's per-kernel profile at the end")
    mnist.add_argument("--seed", type=int, default=0)
    mnist.add_argument("--data", default=None, help="folder with the four MNIST IDX files (plain or .gz)")
    mnist.add_argument("--run-dir", default=None, help="where to write config, metrics and checkpoints")
    mnist.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its checkpoint")
    mnist.add_argument("--checkpoint-every", type=int, default=500)
    mnist.add_argument("--quiet", action="store_true", help="no progress bar")
    mnist.set_defaults(run=_train_mnist)

    evaluate = commands.add_parser("eval", help="re-evaluate a run directory's checkpoint")
    evaluate.add_argument("run_dir")
    evaluate.set_defaults(run=_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
