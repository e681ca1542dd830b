"""Sampling the next token inside a compiled cell: SampleToken draws one token per row of
logits, as a language model's decoding does, so a decode step hands back a token id rather
than a vocabulary's logits for the host to sample from.

    token, probabilities = SampleToken(logits [N, V], uniform [N], temperature [], top_k [], top_p [])

The settings are inputs, not attributes, so one compiled cell serves every setting:

- temperature ≤ 0 is greedy: the first largest logit (its probability 1);
- else the logits are divided by the temperature; top_k > 0 keeps the logits at least the
  k-th largest (ties at the cut all stay); top_p in (0, 1) then keeps the probabilities at
  least as large as the smallest one the nucleus needs — sorted largest first, the
  shortest run whose mass reaches top_p (again ties at the cut stay);
- the kept probabilities, renormalised, are `probabilities` (zeros elsewhere), and the
  token is the first index whose running sum of them exceeds `uniform` (a number in
  [0, 1) the caller draws: a seeded generator makes runs reproducible).

Nothing is sorted: the kernels find both cuts and the token by bisection over the row
(`ranvier.backends.llvm.rows.sample_rows`).
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .registry import TensorType, define

# Row positions travel through float32 sums in the kernels: exact below 2^24.
MAX_VOCABULARY = 1 << 24


def _infer_sample(ctx):
    logits, uniform, temperature, top_k, top_p = ctx.inputs
    if logits.dtype != dtypes.DT_FLOAT32 or logits.rank != 2 or not 0 < logits.shape[1] < MAX_VOCABULARY:
        raise ctx.fail(f"float32 logits [rows, vocabulary] with a vocabulary of 1 to {MAX_VOCABULARY - 1}")
    if uniform.dtype != dtypes.DT_FLOAT32 or list(uniform.shape) != [logits.shape[0]]:
        raise ctx.fail(f"float32 uniform numbers [{logits.shape[0]}], one per row")
    for var, dtype, name in ((temperature, dtypes.DT_FLOAT32, "temperature"), (top_k, dtypes.DT_INT32, "top_k"),
                             (top_p, dtypes.DT_FLOAT32, "top_p")):
        if var.dtype != dtype or var.rank != 0:
            raise ctx.fail(f"a {dtype} scalar {name}")
    return [TensorType(dtypes.DT_INT32, (logits.shape[0],)), TensorType(dtypes.DT_FLOAT32, tuple(logits.shape))]


def sample_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The probabilities one row is sampled from (module docstring), in float64."""
    x = np.asarray(logits, np.float64)
    if temperature <= 0:
        one_hot = np.zeros_like(x)
        one_hot[np.argmax(x)] = 1.0
        return one_hot
    kept = x >= np.sort(x)[-top_k] if 0 < top_k < x.size else np.ones(x.size, bool)
    e = np.where(kept, np.exp((x - x.max()) / temperature), 0.0)
    if 0 < top_p < 1:
        largest_first = np.sort(e[kept])[::-1]
        before = np.cumsum(largest_first) - largest_first
        cut = largest_first[before < top_p * e.sum()][-1]
        e = np.where(e >= cut, e, 0.0)
    return e / e.sum()


def pick(probabilities: np.ndarray, uniform: float) -> int:
    """The first index whose running sum of `probabilities` exceeds `uniform`; the last
    index with any probability when rounding leaves the sum short of it."""
    index = int(np.searchsorted(np.cumsum(probabilities), uniform, side="right"))
    return index if index < probabilities.size and probabilities[index] > 0 else int(np.flatnonzero(probabilities)[-1])


def _sample(attrs, args, outs):
    logits, uniform, temperature, top_k, top_p = args
    probabilities = np.stack([sample_distribution(row, float(temperature), int(top_k), float(top_p)) for row in logits])
    tokens = np.array([pick(p, float(u)) for p, u in zip(probabilities, uniform, strict=True)], np.int32)
    return [tokens, probabilities.astype(np.float32)]


define(
    "SampleToken", _infer_sample, _sample, 5, "sampling",
    "(token, probabilities) of each row of logits: greedy, temperature, top-k and top-p sampling by a given uniform number",
    flops=lambda op: 40 * op.inputs[0].size,
    method="sample_token",
)
