"""SampleToken: greedy, temperature, top-k and top-p sampling against distributions written
here (softmax of the scaled logits, the k largest, the shortest nucleus), every backend
against the reference with the uniform numbers and nucleus masses placed well inside the
intervals they select (so no rounding can move a token), the rounding guard at the end of
the row, the sampled frequencies against the probabilities, and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_mentions, check, rng, run_flow, shape_error

import ranvier
from ranvier.ops.sampling import sample_distribution

TESTED_OPS = {"SampleToken"}


def _scalars(temperature: float, top_k: int, top_p: float) -> list[np.ndarray]:
    return [np.array(temperature, np.float32), np.array(top_k, np.int32), np.array(top_p, np.float32)]


def _sample(logits, uniform, temperature, top_k, top_p):
    return run_flow(lambda f, *inputs: f.sample_token(*inputs), [logits, uniform, *_scalars(temperature, top_k, top_p)])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _nucleus_between(p: np.ndarray, count: int) -> float:
    """A top_p whose nucleus is the `count` largest of p: halfway between the masses of the
    `count - 1` and `count` largest."""
    masses = np.cumsum(np.sort(p)[::-1])
    return float((masses[count - 2] + masses[count - 1]) / 2)


def _middle_of(p: np.ndarray, token: int) -> float:
    """A uniform number in the middle of `token`'s share of the running sum of p."""
    running = np.cumsum(p)
    return float(running[token] - p[token] / 2)


CASES = {  # temperature, top_k, nucleus size (None: no top-p)
    "temperature": (0.7, 0, None),
    "top-k": (1.0, 5, None),
    "top-p": (0.9, 0, 6),
    "top-k and top-p": (1.3, 40, 12),
    "top-k of one": (0.5, 1, None),
}


@pytest.mark.parametrize("vocabulary", [50, 1000, 7001])
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_matches_the_distribution_written_here(case, vocabulary):
    temperature, top_k, nucleus = CASES[case]
    g = rng(vocabulary)
    values = (g.standard_normal(vocabulary) * 2).astype(np.float32)
    # rows of the same values in other orders: one top_p lies well inside every row's nucleus
    logits = np.stack([values, g.permutation(values), g.permutation(values)])
    scaled = logits.astype(np.float64) / temperature
    want = []
    for row in scaled:
        kept = row >= np.sort(row)[-top_k] if top_k else np.ones(vocabulary, bool)
        want.append(np.where(kept, _softmax(np.where(kept, row, -np.inf)), 0.0))
    top_p = 1.0
    if nucleus is not None:
        top_p = _nucleus_between(want[0], nucleus)
        for r, p in enumerate(want):
            keep = np.argsort(-p)[: np.searchsorted(np.cumsum(np.sort(p)[::-1]), top_p) + 1]
            want[r] = np.zeros_like(p)
            want[r][keep] = p[keep] / p[keep].sum()
    picks = [int(g.choice(np.flatnonzero(p))) for p in want]
    uniform = np.array([_middle_of(p, t) for p, t in zip(want, picks, strict=True)], np.float32)
    tokens, probabilities = _sample(logits, uniform, temperature, top_k, top_p)
    check(tokens, np.array(picks, np.int32))
    check(probabilities, np.array(want, np.float32), atol=1e-6)
    kept = (probabilities > 0).sum(axis=1)
    assert np.all(kept == (nucleus or top_k or vocabulary))


def test_greedy_takes_the_first_largest_logit():
    logits = rng(1).standard_normal((4, 30)).astype(np.float32)
    logits[1, [3, 17]] = 9.0  # a tie: the first wins
    for temperature in (0.0, -1.0):
        tokens, probabilities = _sample(logits, np.full(4, 0.5, np.float32), temperature, 7, 0.5)
        want = np.argmax(logits, axis=1)
        check(tokens, want.astype(np.int32))
        check(probabilities, np.eye(30, dtype=np.float32)[want])
    assert want[1] == 3


def test_a_uniform_number_at_the_end_of_the_row_picks_the_last_kept_token():
    logits = np.array([[0.5, 3.0, 0.1, 2.0, -1.0, 0.0]], np.float32)
    top_k = 3
    tokens, probabilities = _sample(logits, np.array([np.nextafter(np.float32(1), np.float32(0))]), 1.0, top_k, 1.0)
    check(tokens, np.array([3], np.int32))  # the kept logits are 3.0, 2.0 and 0.5 (position 0): position 3 is last
    assert np.flatnonzero(probabilities[0]).tolist() == [0, 1, 3]


def test_top_p_one_and_top_k_past_the_vocabulary_keep_everything():
    logits = rng(2).standard_normal((2, 20)).astype(np.float32)
    _, probabilities = _sample(logits, np.full(2, 0.3, np.float32), 1.0, 20, 1.0)
    check(probabilities, np.stack([_softmax(row.astype(np.float64)) for row in logits]).astype(np.float32), atol=1e-6)
    np.testing.assert_allclose(sample_distribution(logits[0], 1.0, 25, 0.0), _softmax(logits[0].astype(np.float64)))


def test_sampled_tokens_follow_the_probabilities():
    """Tokens drawn for 4,000 evenly spread uniform numbers land in each kept token as often
    as its probability says (to within one draw's share of the spread)."""
    draws, vocabulary = 4000, 64
    logits = np.tile(rng(3).standard_normal(vocabulary).astype(np.float32), (draws, 1))
    uniform = ((np.arange(draws) + 0.5) / draws).astype(np.float32)
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    inputs = [f.var("logits", "float32", logits.shape), f.var("uniform", "float32", [draws]), f.var("t", "float32", []),
              f.var("k", "int32", []), f.var("p", "float32", [])]
    tokens, probabilities = f.sample_token(*inputs)
    tokens.var.out = probabilities.var.out = True
    data = ranvier.Compiler("cpu").compile(flow).cell("f").instance()
    for var, value in zip(inputs, [logits, uniform, *_scalars(0.8, 10, 0.95)], strict=True):
        data[var] = value
    data.compute()
    p = np.array(data[probabilities])[0]
    counts = np.bincount(np.array(data[tokens]), minlength=vocabulary) / draws
    assert np.abs(counts - p).max() <= 1.5 / draws
    assert set(np.flatnonzero(counts)) == set(np.flatnonzero(p)) and (p > 0).sum() <= 10


@pytest.mark.parametrize(("inputs", "expected"), [
    ((("l", "float64", [2, 5]), ("u", "float32", [2])), "float32 logits"),
    ((("l", "float32", [2, 5]), ("u", "float32", [3])), "uniform numbers [2]"),
    ((("l", "float32", [5]), ("u", "float32", [1])), "float32 logits [rows, vocabulary]"),
])
def test_bad_logits_and_uniform_numbers_are_named(inputs, expected):
    def build(f, logits, uniform):
        return f.sample_token(logits, uniform, f.const(np.float32(1)), f.const(np.int32(0)), f.const(np.float32(1)))

    assert_mentions(shape_error(build, inputs), "SampleToken", expected)


def test_settings_of_the_wrong_kind_are_named():
    def build(f, logits, uniform):
        return f.sample_token(logits, uniform, f.const(np.float32(1)), f.const(np.float32(3)), f.const(np.float32(1)))

    assert_mentions(shape_error(build, [("l", "float32", [1, 5]), ("u", "float32", [1])]), "int32 scalar top_k")
