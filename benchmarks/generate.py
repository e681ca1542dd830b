"""Decode throughput with the KV cache: tokens/s for the Stories model shapes.

Random weights of each preset's shape (speed does not depend on their values); a short
prompt is prefilled, then N tokens are decoded greedily, several repetitions, median
printed. llama2.c's run.c (fp32, 2 OpenMP threads) measured 95–99 tokens/s for
stories15M and 25–26 for stories110M on this machine, per the issue.
Run: python benchmarks/generate.py [--presets stories15M stories110M] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import machine


def main() -> None:
    from ranvier.generate import Generator, Sampling
    from ranvier.models.llama import PRESETS, Llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["stories15M", "stories110M"], choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    for preset in args.presets:
        config = PRESETS[preset]
        generator = Generator(Llama(config, seed=0), prefill=16)
        print(f"{preset}: {config.parameter_count() / 1e6:.1f}M parameters, compiled in {generator.compile_seconds:.1f}s")
        rates = []
        for repeat in range(args.repeats):
            stream = generator.stream([1, 306, 471, 263], args.tokens, Sampling(temperature=0))
            next(stream)  # the prefill and the first token
            start = time.perf_counter()
            produced = 1 + sum(1 for _ in stream)
            rates.append((produced - 1) / (time.perf_counter() - start))
            print(f"  run {repeat + 1}: {rates[-1]:.1f} tokens/s", flush=True)
        print(f"{preset} median {statistics.median(rates):.1f} tokens/s (decode, batch 1)")


if __name__ == "__main__":
    main()
