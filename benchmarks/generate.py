"""Decode throughput with a KV cache: ranvier vs PyTorch eager, tokens/s for the Stories shapes.

Random weights of each preset's shape (speed does not depend on their values), the same
for both sides: ranvier's Generator (prefill and decode cells sharing resident caches)
and a PyTorch decoder of the same model written here, with its own preallocated KV
cache, run under torch.inference_mode with as many threads as ranvier. A short prompt is
prefilled, then N tokens are decoded greedily; the sides alternate for several
repetitions and the decode tokens/s medians are compared. The greedy tokens of the two
are compared too (float32 rounding may part them where random weights give near-ties).
With `--llama2c DIR` (a checkout of karpathy/llama2.c), its run.c is a third side: built
here with `cc -O3 -march=native -fopenmp`, on the same weights exported as a llama2.c
.bin, with OMP_NUM_THREADS equal to ranvier's threads; it reports its own decode tok/s.
On the CPU ranvier also runs with `matmul="bfloat16"` (the "ranvier-bf16" side): the weights a
decoded token is multiplied by are kept in bf16 panels, float32 sums, so each token reads half
the bytes; its greedy tokens may part from the float32 ones where the random weights give
near-ties. With `--backend cuda` ranvier's cells run on the GPU and the PyTorch decoder, weights and
cache, on the same GPU where PyTorch sees one (each token's arg-max read back, as a
decoder must); both in float32. Each side's rate is also given as the bytes it streams a
token (the weights, its matrices in bf16 for ranvier-bf16, and the live KV cache) per
second, against the memory bandwidth measured here (on the GPU, its own).
With `--llama-cpp PATH` (a llama.cpp build folder, or its llama-batched-bench), llama.cpp races
ranvier on the same weights written as GGUF files (`ranvier.interop.export_gguf`) in f32, bf16
and q8_0, ranvier's sides float32, bfloat16 and int8 (q8_0 blocks, `matmul="int8"`): a 128-token
prompt (`--prompt`) then 128 tokens decoded one at a time (`--decoded`), batch 1, the same threads,
the sides alternating for `--llama-cpp-repeats` rounds (5); llama.cpp's prefill and decode
tokens/s are its batched-bench's S_PP and S_TG (the prompt as one batch, then each token after it,
no sampling), ranvier's the prompt's cell and its decode steps (each drawing its greedy token in
the cell). Without the flag, that race is skipped with a line saying so.
Run: python benchmarks/generate.py [--presets stories15M stories110M] [--tokens 64] [--llama2c DIR]
     [--llama-cpp PATH] [--backend cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from common import Ceilings, comparison, machine, match_threads, measure_ceilings, measure_gpu_ceilings, summary

PROMPT = [1, 306, 471, 263]


def torch_decoder(config, weights: dict[str, np.ndarray], device: str = "cpu") -> Callable[[list[int], int], Iterator[int]]:
    """`stream(prompt, n)`: greedy tokens of the Llama `config` with ranvier's `weights`
    ([in, out] matrices, llama2.c's rotary pairs (2i, 2i+1)), decoded in PyTorch with a KV
    cache, on `device`."""
    import torch
    import torch.nn.functional as F

    c, hd = config, config.head_dim
    w = {key: torch.from_numpy(np.ascontiguousarray(value, np.float32)).to(device) for key, value in weights.items()}
    classifier = w["tok_embeddings"].T.contiguous() if c.shared_classifier else w["output"]
    angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64),
                         c.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    cos, sin = torch.cos(angles).float().to(device), torch.sin(angles).float().to(device)
    keys = torch.zeros(c.n_layers, c.n_kv_heads, c.max_seq_len, hd, device=device)
    values = torch.zeros_like(keys)

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * g

    def rope(x, at: slice):  # x [T, heads, hd]
        even, odd = x[..., 0::2], x[..., 1::2]
        cs, sn = cos[at, None, :], sin[at, None, :]
        return torch.stack([even * cs - odd * sn, even * sn + odd * cs], dim=-1).flatten(-2)

    def forward(tokens: list[int], start: int) -> torch.Tensor:
        """The logits after `tokens`, which sit at positions start, start + 1, ..."""
        at = slice(start, start + len(tokens))
        x = w["tok_embeddings"][torch.tensor(tokens, device=device)]
        for i in range(c.n_layers):
            p = {name: w[f"layers.{i}.{name}"] for name in ("attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3")}
            h = rms(x, p["attention_norm"])
            q = rope((h @ p["wq"]).view(-1, c.n_heads, hd), at).transpose(0, 1)
            keys[i, :, at] = rope((h @ p["wk"]).view(-1, c.n_kv_heads, hd), at).transpose(0, 1)
            values[i, :, at] = (h @ p["wv"]).view(-1, c.n_kv_heads, hd).transpose(0, 1)
            # Only the prefill (from position 0) needs a mask; one new token sees the whole cache.
            attention = F.scaled_dot_product_attention(q, keys[i, :, : at.stop], values[i, :, : at.stop],
                                                       is_causal=len(tokens) > 1, enable_gqa=True)
            x = x + attention.transpose(0, 1).reshape(-1, c.dim) @ p["wo"]
            h = rms(x, p["ffn_norm"])
            x = x + (F.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        return rms(x[-1], w["norm"]) @ classifier

    def stream(prompt: list[int], n: int) -> Iterator[int]:  # the loop of ranvier's Generator.stream
        with torch.inference_mode():
            logits, position = forward(prompt, 0), len(prompt)
            for _ in range(n):
                token = int(logits.argmax())
                yield token
                if position >= c.max_seq_len:
                    return
                logits, position = forward([token], position), position + 1

    return stream


def decode_rate(stream: Iterator[int]) -> tuple[float, list[int]]:
    """Tokens/s after the first token (which includes the prefill), and the tokens."""
    tokens = [next(stream)]
    start = time.perf_counter()
    tokens += list(stream)
    return (len(tokens) - 1) / (time.perf_counter() - start), tokens


def placeholder_tokenizer(vocab_size: int):
    """A llama2.c vocabulary of `vocab_size` made-up pieces (the special ones, the 256 bytes,
    then "<i>"), for the peers that need one to load random weights."""
    from ranvier.interop import Llama2cTokenizer

    pieces = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % i for i in range(256)]
    pieces += [f"<{i}>".encode() for i in range(len(pieces), vocab_size)]
    return Llama2cTokenizer(pieces, [0.0] * len(pieces))


def llama2c_decoder(source: Path, workdir: Path, config, weights: dict[str, np.ndarray]) -> Callable[[int], float]:
    """`rate(n)`: run.c's own decode tok/s for n tokens on these weights (a built binary,
    the model as a llama2.c .bin, a tokenizer.bin of placeholder pieces)."""
    from ranvier.backends.cpu.parallel import thread_count
    from ranvier.interop.llama2c import export_llama2c

    binary = workdir / "run"
    if not binary.exists():
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-o", str(binary), str(source / "run.c"), "-lm"], check=True)
    model = export_llama2c(config, weights, workdir / "model.bin")
    placeholder_tokenizer(config.vocab_size).save(workdir / "tokenizer.bin")
    environment = {**os.environ, "OMP_NUM_THREADS": str(thread_count())}

    def rate(n: int) -> float:
        done = subprocess.run([str(binary), str(model), "-z", str(workdir / "tokenizer.bin"), "-t", "0", "-n", str(n + len(PROMPT)),
                               "-i", "abcd"], capture_output=True, text=True, env=environment, check=True)
        return float(re.search(r"achieved tok/s: ([0-9.]+)", done.stderr).group(1))

    return rate


# Bytes per element of the weight matrices each side streams: ranvier-bf16 keeps them in bf16 panels.
MATRIX_BYTES = {"ranvier": 4, "ranvier-bf16": 2, "pytorch": 4, "llama2.c": 4}


def bytes_per_token(config, matrix_bytes: int, position: float) -> float:
    """What a decode step at `position` must read: every weight matrix once (the embedding
    table only the token's row, unless it is also the classifier), the float32 norm gains,
    and the cached keys and values of the positions before it."""
    matrices = config.parameter_count() - config.vocab_size * config.dim * (0 if config.shared_classifier else 1)
    gains = (2 * config.n_layers + 1) * config.dim
    cache = 2 * config.n_layers * config.n_kv_heads * config.head_dim * position
    return (matrices - gains) * matrix_bytes + 4 * (gains + config.dim + cache)


def bandwidth_report(config, tokens: int, medians: dict[str, float], ceilings: Ceilings) -> str:
    """Each side's decode rate as the bytes it streams per second, against the memory ceiling:
    a decode step reads every weight once, so bandwidth, not arithmetic, bounds it."""
    position = len(PROMPT) + (tokens - 1) / 2  # the decoded tokens' mean position
    lines = [str(ceilings)]
    for name, rate in medians.items():
        streamed = bytes_per_token(config, MATRIX_BYTES[name], position)
        lines.append(f"{name:12s} {streamed / 1e6:7.1f} MB a token, {rate * streamed / 1e9:6.1f} GB/s, "
                     f"{rate * streamed / ceilings.bandwidth:.0%} of the memory ceiling")
    return "\n".join(lines)


def race(preset: str, tokens: int, repeats: int, ceilings: Ceilings, llama2c: Path | None = None, backend: str = "cpu",
         torch_device: str = "cpu") -> None:
    """Both sides on one preset's shapes, alternating; print each run and the summary."""
    from ranvier.generate import Generator, Sampling
    from ranvier.models.llama import PRESETS, Llama

    config = PRESETS[preset]
    model = Llama(config, seed=0)
    generators = {"ranvier": Generator(model, prefill=16, backend=backend)}
    if backend == "cpu":
        generators["ranvier-bf16"] = Generator(model, prefill=16, backend=backend, matmul="bfloat16")
    decoder = torch_decoder(config, model.initial, torch_device)
    compiled = ", ".join(f"{name} in {g.compile_seconds:.1f}s" for name, g in generators.items())
    print(f"{preset}: {config.parameter_count() / 1e6:.1f}M parameters, ranvier ({backend}) compiled: {compiled}; PyTorch on "
          f"{torch_device}; prompt {len(PROMPT)} tokens, {tokens} decoded greedily, batch 1")
    sides = {name: (lambda g=g: g.stream(PROMPT, tokens, Sampling(temperature=0))) for name, g in generators.items()}
    sides["pytorch"] = lambda: decoder(PROMPT, tokens)
    workdir = tempfile.TemporaryDirectory()
    run_c = llama2c_decoder(llama2c, Path(workdir.name), config, model.initial) if llama2c else None
    for start in sides.values():
        decode_rate(start())  # warm up
    rates, produced = {name: [] for name in [*sides, *(["llama2.c"] if run_c else [])]}, {}
    for repeat in range(repeats):
        for name, start in sides.items():
            rate, produced[name] = decode_rate(start())
            rates[name].append(rate)
            print(f"  run {repeat + 1} {name:12s} {rate:9.1f} tokens/s", flush=True)
        if run_c:
            rates["llama2.c"].append(run_c(tokens))
            print(f"  run {repeat + 1} {'llama2.c':12s} {rates['llama2.c'][-1]:9.1f} tokens/s", flush=True)
    workdir.cleanup()
    theirs = produced["pytorch"]
    for name in generators:
        ours = produced[name]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        print(f"{name} and pytorch: the same greedy tokens for the first {same} of {len(ours)}")
    medians = {name: statistics.median(values) for name, values in rates.items()}
    summary(medians, "tokens/s", higher_is_better=True, digits=1)
    if "llama2.c" in medians:
        print(f"{comparison('ranvier', medians['ranvier'], 'llama2.c', medians['llama2.c'], True)} (median tokens/s)")
    print(bandwidth_report(config, tokens, medians, ceilings))


# ---- llama.cpp ----------------------------------------------------------------------------------

LLAMA_CPP_BENCH = "llama-batched-bench"
# each format raced: ranvier's matmul, the GGUF dtype llama.cpp reads
FORMATS = {"f32": ("float32", "float32"), "bf16": ("bfloat16", "bfloat16"), "q8_0": ("int8", "q8_0")}
# bytes a weight of each format takes in a decode step's products (q8_0: 32 int8 and a float16 scale)
FORMAT_BYTES = {"f32": 4, "bf16": 2, "q8_0": 34 / 32}


def llama_cpp_binary(path: Path | None) -> Path | None:
    """llama.cpp's batched-bench: `path` itself, or in a build folder (its bin/) or checkout (build/bin/)."""
    if path is None:
        return None
    candidates = [path] if path.is_file() else [path / "bin" / LLAMA_CPP_BENCH, path / LLAMA_CPP_BENCH,
                                                path / "build" / "bin" / LLAMA_CPP_BENCH]
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def llama_cpp_build(binary: Path) -> str:
    """llama.cpp's version line, and whether its CPU code was built for this machine (GGML_NATIVE)."""
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True).stderr.strip().splitlines()
    cache = next((folder / "CMakeCache.txt" for folder in binary.parents if (folder / "CMakeCache.txt").is_file()), None)
    native = "unknown build flags"
    if cache is not None:
        native = ("built -march=native (GGML_NATIVE=ON: this CPU's AVX-512, VNNI, BF16)"
                  if "GGML_NATIVE:BOOL=ON" in cache.read_text() else "built without GGML_NATIVE")
    return f"{' '.join(version[-2:])}; {native}"


def llama_cpp_rates(binary: Path, model: Path, threads: int, prompt: int, decoded: int) -> tuple[float, float]:
    """llama.cpp's (prefill, decode) tokens/s: batched-bench's S_PP (the prompt as one batch)
    and S_TG (then `decoded` tokens one at a time), batch 1."""
    done = subprocess.run([str(binary), "-m", str(model), "-c", str(prompt + decoded), "-b", str(prompt), "-ub", str(prompt),
                           "-npp", str(prompt), "-ntg", str(decoded), "-npl", "1", "-t", str(threads), "-tb", str(threads),
                           "--output-format", "jsonl"], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{binary} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    result = json.loads(lines[-1])
    return result["speed_pp"], result["speed_tg"]


def ranvier_rates(generator, prompt: list[int], decoded: int) -> tuple[float, float]:
    """ranvier's (prefill, decode) tokens/s: the prompt through the prefill cell (one chunk),
    then `decoded` decode steps after it, each drawing its greedy token in the cell."""
    from ranvier.generate import Sampling

    start = time.perf_counter()
    stream = generator.stream(prompt, decoded + 1, Sampling(temperature=0))
    next(stream)
    prefilled = time.perf_counter()
    count = sum(1 for _ in stream)
    return len(prompt) / (prefilled - start), count / (time.perf_counter() - prefilled)


def decode_kernels(generator) -> str:
    """The kernels of the decode cell's products by the weights, e.g. "Q8Gemm"."""
    weights = f"{generator.model.name}/"
    steps = generator.network.cell("decode").steps
    return "+".join(sorted({s.kernel.split("[")[0] for s in steps
                            if s.op.type.startswith("MatMul") and s.op.inputs[1].name.startswith(weights)}))


def race_llama_cpp(preset: str, binary: Path, prompt_length: int, decoded: int, repeats: int, ceilings: Ceilings) -> None:
    """ranvier against llama.cpp on one preset's random weights in each format, alternating."""
    from ranvier.backends.cpu.parallel import thread_count
    from ranvier.generate import Generator
    from ranvier.interop import export_gguf
    from ranvier.models.llama import PRESETS, Llama

    config = PRESETS[preset]
    if prompt_length + decoded > config.max_seq_len:
        raise SystemExit(f"{preset} holds {config.max_seq_len} positions: --prompt {prompt_length} and --decoded {decoded} "
                         "do not fit")
    model = Llama(config, seed=0)
    threads = thread_count()
    prompt = np.random.default_rng(1).integers(3, config.vocab_size, prompt_length).tolist()
    workdir = tempfile.TemporaryDirectory()
    tokenizer = placeholder_tokenizer(config.vocab_size)
    files, generators = {}, {}
    for name, (matmul, dtype) in FORMATS.items():
        files[name] = export_gguf(config, model.initial, tokenizer, Path(workdir.name) / f"{name}.gguf", dtype)
        generators[name] = Generator(model, prefill=prompt_length, matmul=matmul)
    print(f"\n{preset} against llama.cpp: the same random weights (GGUF f32, bf16, q8_0), prompt {prompt_length} tokens "
          f"then {decoded} decoded, batch 1, {threads} threads each, {repeats} alternating rounds")
    print(f"llama.cpp: {binary}, {llama_cpp_build(binary)}")
    print("ranvier's decode products: " + ", ".join(f"{name} {decode_kernels(g)}" for name, g in generators.items()))
    sides = {}
    for name in FORMATS:
        sides[f"ranvier {name}"] = lambda g=generators[name]: ranvier_rates(g, prompt, decoded)
        sides[f"llama.cpp {name}"] = lambda f=files[name]: llama_cpp_rates(binary, f, threads, prompt_length, decoded)
    for side in sides.values():
        side()  # warm up: caches, and the page cache's copy of each file
    rates = {name: [] for name in sides}
    for repeat in range(repeats):
        for name, side in sides.items():
            rates[name].append(side())
            print(f"  run {repeat + 1} {name:15s} prefill {rates[name][-1][0]:9.1f} tokens/s, decode {rates[name][-1][1]:7.1f} "
                  "tokens/s", flush=True)
    workdir.cleanup()
    medians = {name: (statistics.median(r[0] for r in values), statistics.median(r[1] for r in values))
               for name, values in rates.items()}
    weights = config.parameter_count() - config.vocab_size * config.dim * (0 if config.shared_classifier else 1)
    print(f"{'format':6s} {'prefill tokens/s: ranvier':>26s} {'llama.cpp':>10s} {'ratio':>6s}   "
          f"{'decode tokens/s: ranvier':>25s} {'llama.cpp':>10s} {'ratio':>6s}   {'weights streamed: ranvier':>25s} {'llama.cpp':>10s}")
    for name in FORMATS:
        (ours_pp, ours_tg), (theirs_pp, theirs_tg) = medians[f"ranvier {name}"], medians[f"llama.cpp {name}"]
        streamed = weights * FORMAT_BYTES[name]
        print(f"{name:6s} {ours_pp:26.1f} {theirs_pp:10.1f} {ours_pp / theirs_pp:5.2f}×   {ours_tg:25.1f} {theirs_tg:10.1f} "
              f"{ours_tg / theirs_tg:5.2f}×   {ours_tg * streamed / 1e9:20.1f} GB/s {theirs_tg * streamed / 1e9:5.1f} GB/s")
    float32 = medians["ranvier f32"][1]
    print(f"ranvier's decode against its own float32: bf16 {medians['ranvier bf16'][1] / float32:.2f}×, "
          f"int8 {medians['ranvier q8_0'][1] / float32:.2f}×; {ceilings}")


def main() -> None:
    import torch

    from ranvier.models.llama import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["stories15M", "stories110M"], choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama2c", type=Path, metavar="DIR", help="a llama2.c checkout: its run.c races too")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--llama-cpp", type=Path, metavar="PATH",
                        help="a llama.cpp build folder (or its llama-batched-bench): it races ranvier in f32, bf16 and q8_0")
    parser.add_argument("--prompt", type=int, default=128, help="the llama.cpp race's prompt tokens (default: %(default)s)")
    parser.add_argument("--decoded", type=int, default=128, help="the llama.cpp race's decoded tokens (default: %(default)s)")
    parser.add_argument("--llama-cpp-repeats", type=int, default=5, help="the llama.cpp race's rounds (default: %(default)s)")
    args = parser.parse_args()
    match_threads(torch)
    print(machine(torch))
    torch_device = "cuda" if args.backend == "cuda" and torch.cuda.is_available() else "cpu"
    if args.backend == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}" if torch_device == "cuda" else "GPU: none that PyTorch sees; its side runs on the CPU")
    on_gpu = torch_device == "cuda"
    ceilings = measure_gpu_ceilings(torch) if on_gpu else measure_ceilings(megabytes=256, gemm_n=2048, repeats=3, torch=torch)
    binary = llama_cpp_binary(args.llama_cpp)
    for preset in args.presets:
        race(preset, args.tokens, args.repeats, ceilings, args.llama2c, args.backend, torch_device)
        if binary is not None and args.backend == "cpu":
            race_llama_cpp(preset, binary, args.prompt, args.decoded, args.llama_cpp_repeats, ceilings)
    if binary is None or args.backend != "cpu":
        reason = ("no --llama-cpp PATH given" if args.llama_cpp is None else f"no {LLAMA_CPP_BENCH} at {args.llama_cpp}"
                  if binary is None else "its CPU side races ranvier's CPU backend")
        print(f"llama.cpp: skipped ({reason}; build it from source with cmake -DGGML_NATIVE=ON and give its build folder)")


if __name__ == "__main__":
    main()
