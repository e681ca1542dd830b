"""The `ranvier` command."""

from __future__ import annotations

import argparse
import sys

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
    net = myelin.Compiler(backend=args.backend).compile(flow)
    cell = net.cell("f")
    print(cell)
    data = cell.instance()
    data[x] = 5.0
    data.compute()
    result = np.asarray(data[y])
    print(f"argmax={int(result.argmax())} max={float(result.max()):.6f} sum={float(result.sum()):.6f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ranvier", description="Neural-network JIT compiler and trainer.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="build, print and run Myelin's example cell")
    demo.add_argument("--backend", default="reference")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
