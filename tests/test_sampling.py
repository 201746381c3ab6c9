"""Logit processors and token sampling vs transformers' warpers and numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from qerl_jax.rollout import SamplingConfig, processed_logits, sample, top_k_filter, top_p_filter
from qerl_jax.rollout.sampling import CDF_BLOCK, inverse_cdf


def _hf_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    x = torch.tensor(logits)
    ids = torch.zeros((x.shape[0], 1), dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(ids, x)
    return x.numpy()


def _numpy_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The sampling distribution of one row, written independently (sorting by index)."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(x.shape, bool)
    candidates = order[:top_k] if top_k else order
    p = np.exp(x[candidates] - x[candidates].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[candidates[before < top_p]] = True
    keep[order[0]] = True
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (7, 1.0), (7, 0.8), (0, 0.3), (40, 0.95)])
def test_processed_logits_match_transformers_warpers(top_k, top_p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 50)) * 2).astype(np.float32)
    sampling = SamplingConfig(temperature=0.7, top_k=top_k, top_p=top_p)
    ours = np.asarray(processed_logits(jnp.asarray(logits), sampling))
    ref = _hf_process(logits, 0.7, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    kept = ~np.isinf(ref)
    np.testing.assert_allclose(ours[kept], ref[kept], rtol=1e-6)
    assert kept.sum(axis=1).min() >= 1 and (~kept).any()


def test_filters_separately_match_transformers():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    ours_k = np.asarray(top_k_filter(jnp.asarray(logits), 5))
    assert np.array_equal(np.isinf(ours_k), np.isinf(_hf_process(logits, 1.0, 5, 1.0)))
    assert (~np.isinf(ours_k)).sum(axis=1).tolist() == [5] * 4
    ours_p = np.asarray(top_p_filter(jnp.asarray(logits), 0.5))
    assert np.array_equal(np.isinf(ours_p), np.isinf(_hf_process(logits, 1.0, 0, 0.5)))
    # A vocabulary-sized k and p = 1 leave the logits untouched.
    np.testing.assert_array_equal(np.asarray(top_k_filter(jnp.asarray(logits), 30)), logits)
    np.testing.assert_array_equal(np.asarray(top_p_filter(jnp.asarray(logits), 1.0)), logits)


def _draw(logits_row: np.ndarray, sampling: SamplingConfig, n: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), n)
    logits = jnp.broadcast_to(jnp.asarray(logits_row), (n, logits_row.size))
    tokens, logp = jax.jit(sample, static_argnums=2)(keys, logits, sampling)
    return np.asarray(tokens), np.asarray(logp)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 0, 0.7), (1.0, 4, 1.0), (0.8, 5, 0.75)],
)
def test_empirical_distribution_matches_chi_square(temperature, top_k, top_p):
    logits = np.array([1.5, 0.2, -0.3, 2.0, 0.9, -1.0, 0.0, 1.1], np.float32)
    expected = _numpy_distribution(logits, temperature, top_k, top_p)
    n = 40_000
    tokens, logp = _draw(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p), n)
    counts = np.bincount(tokens, minlength=logits.size)
    assert counts[expected == 0].sum() == 0  # truncated tokens are never drawn
    support = expected > 0
    stat, pvalue = scipy.stats.chisquare(counts[support], n * expected[support])
    assert pvalue > 1e-3, (counts, n * expected, stat)
    # Log-probs are those of the untruncated tempered distribution.
    full = logits / temperature - np.log(np.sum(np.exp(logits / temperature)))
    np.testing.assert_allclose(logp, full[tokens], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 7])
def test_distribution_over_several_cdf_blocks_matches_chi_square(top_k):
    """A vocabulary of 2.5 blocks (the last padded) whose mass sits on tokens at and around the
    block edges, the rest excluded (-inf): the draws follow softmax, no excluded token is drawn."""
    v = 2 * CDF_BLOCK + CDF_BLOCK // 2
    where = np.array([0, 5, CDF_BLOCK - 1, CDF_BLOCK, CDF_BLOCK + 1, 2 * CDF_BLOCK - 1, 2 * CDF_BLOCK, v - 1])
    logits = np.full((v,), -np.inf, np.float32)
    logits[where] = np.array([0.3, -1.2, 1.0, 0.1, -0.4, 0.8, -2.0, 0.6], np.float32)
    expected = _numpy_distribution(logits[where], 1.0, top_k, 1.0)
    n = 40_000
    tokens, logp = _draw(logits, SamplingConfig(top_k=top_k), n)
    assert np.isin(tokens, where).all()
    counts = np.array([(tokens == w).sum() for w in where])
    support = expected > 0
    assert counts[~support].sum() == 0
    assert scipy.stats.chisquare(counts[support], n * expected[support]).pvalue > 1e-3
    full = logits[where] - np.log(np.sum(np.exp(logits[where])))
    np.testing.assert_allclose(logp, full[np.searchsorted(where, tokens)], rtol=1e-5, atol=1e-6)


def test_inverse_cdf_at_the_ends_of_the_unit_interval_draws_only_tokens_with_mass():
    """r = 0 gives the first token with mass, r = 1 (above any float sum: the rounding case) the
    last; a row's excluded tokens and blocks (leading, trailing, the padding) are never drawn."""
    v = 3 * CDF_BLOCK + 10
    x = np.full((4, v), -np.inf, np.float32)
    x[:, [CDF_BLOCK + 3, CDF_BLOCK + 4, 2 * CDF_BLOCK + 7]] = [0.5, -0.5, 1.0]
    r = np.array([[0.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0]], np.float32)
    got = np.asarray(inverse_cdf(jnp.asarray(r), jnp.asarray(x))[0])
    np.testing.assert_array_equal(got, [CDF_BLOCK + 3, 2 * CDF_BLOCK + 7, CDF_BLOCK + 4, 2 * CDF_BLOCK + 7])
    rng = np.random.default_rng(0)
    x = np.where(rng.random((64, v)) < 0.98, -np.inf, rng.standard_normal((64, v)) * 8).astype(np.float32)
    r = np.concatenate([rng.random((60, 2)), [[0, 0], [1, 1], [1 - 2**-24, 1 - 2**-24], [0.5, 1]]]).astype(np.float32)
    got = np.asarray(inverse_cdf(jnp.asarray(r), jnp.asarray(x))[0])
    assert np.isfinite(x[np.arange(64), got]).all()
    # a row of NaN logits (a numerical blow-up) still gets a token id in range
    x[0] = np.nan
    got = np.asarray(inverse_cdf(jnp.asarray(r), jnp.asarray(x))[0])
    assert got[0] == 0 and np.isfinite(x[np.arange(1, 64), got[1:]]).all()


def test_sampler_is_not_uniform_when_it_should_not_be():
    # Guard against a chi-square test that would pass anything: a wrong temperature is rejected.
    logits = np.array([1.5, 0.2, -0.3, 2.0, 0.9, -1.0, 0.0, 1.1], np.float32)
    tokens, _ = _draw(logits, SamplingConfig(temperature=1.0), 40_000)
    wrong = _numpy_distribution(logits, 0.8, 0, 1.0)
    counts = np.bincount(tokens, minlength=logits.size)
    assert scipy.stats.chisquare(counts, 40_000 * wrong).pvalue < 1e-6


def test_greedy_takes_argmax_and_reports_untempered_logp():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((5, 20)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 5)
    for sampling in (SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, greedy=True)):
        tokens, logp = sample(keys, jnp.asarray(logits), sampling)
        np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(axis=1))
        full = logits - np.log(np.sum(np.exp(logits), axis=1, keepdims=True))
        np.testing.assert_allclose(np.asarray(logp), full.max(axis=1), rtol=1e-5)
    tokens, logp = sample(keys, jnp.asarray(logits), SamplingConfig(temperature=0.5, greedy=True))
    tempered = logits / 0.5 - np.log(np.sum(np.exp(logits / 0.5), axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logp), tempered.max(axis=1), rtol=1e-5)


def test_rows_use_their_own_keys():
    logits = jnp.zeros((2, 1000))
    key = jax.random.key(3)
    same, _ = sample(jnp.stack([key, key]), logits, SamplingConfig())
    different, _ = sample(jax.random.split(key, 2), logits, SamplingConfig())
    assert same[0] == same[1]
    assert different[0] != different[1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(eos_ids=(-1,)), "eos_ids"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (50, 0.9)])
def test_a_rows_draw_over_several_cdf_blocks_depends_only_on_its_key_and_logits(top_k, top_p):
    """What the engine relies on (a row's stream alone decides its tokens, whatever rows share its batch):
    each row of a batch draws what it draws alone, with the same log-prob."""
    v, rows = 3 * CDF_BLOCK + 5, 6
    logits = np.random.default_rng(3).standard_normal((rows, v)).astype(np.float32) * 3
    keys = jax.random.split(jax.random.key(11), rows)
    sampling = SamplingConfig(temperature=0.7, top_k=top_k, top_p=top_p)
    draw = jax.jit(sample, static_argnums=2)
    tokens, logp = map(np.asarray, draw(keys, jnp.asarray(logits), sampling))
    for r in range(rows):
        one_token, one_logp = map(np.asarray, draw(keys[r : r + 1], jnp.asarray(logits[r : r + 1]), sampling))
        assert one_token[0] == tokens[r]
        np.testing.assert_allclose(one_logp[0], logp[r], rtol=1e-5)  # float sums ordered by the batch shape
    ref = jax.nn.log_softmax(jnp.asarray(logits) / 0.7, axis=-1)
    np.testing.assert_allclose(logp, np.asarray(ref)[np.arange(rows), tokens], rtol=1e-5, atol=1e-6)
    assert len(set(tokens.tolist())) > 1  # the rows draw different tokens
