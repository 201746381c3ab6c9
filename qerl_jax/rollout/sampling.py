"""Sampling settings and logit processors for rollouts.

The processors follow transformers' order and semantics: temperature, then top-k (keep the k
largest logits; ties with the k-th are kept), then top-p (keep the smallest prefix of tokens,
sorted by probability, whose mass reaches p; the most likely token always stays).

Log-probs: `sample` returns log_softmax(logits / temperature) of the sampled token, computed
BEFORE top-k/top-p truncation. That is the quantity the train-time forward recomputes (it
knows nothing about truncation), so the GRPO importance ratio is exactly 1 on the first
update when the policy has not moved. Greedy decoding (greedy=True or temperature 0) takes the
argmax and reports its log_softmax(logits / T), with T = 1 when the temperature is 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


# Tokens of a vocabulary of more than one block of this many are drawn by inverse transform over
# the blocks (`inverse_cdf`): two random numbers a row, where the Gumbel-max trick
# (`jax.random.categorical`) draws one per vocabulary entry, threefry over [rows, 152k] at every
# decode step (0.93x a 256-row 1.5B step; benchmarks/KERNEL_NOTES.md, sampling). A vocabulary of
# one block (the tiny test models') keeps the Gumbel-max draw, which costs nothing there: the
# tiny models' learning tests hold on few seeds with either draw, and keep their streams.
CDF_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn; hashable, so it is a static argument of the jitted rollout.

    temperature: > 0, or 0 for greedy. top_p: in (0, 1]; 1 disables. top_k: >= 0; 0 disables.
    max_new_tokens: response length limit. eos_ids: stop ids; None takes the model config's
    eos_token_id, () never stops early. ignore_eos: generate max_new_tokens for every row
    (benchmarks). greedy: argmax decoding whatever the temperature. pad_id: written after a
    row stopped; None takes the model config's pad_token_id, else 0.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    eos_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    greedy: bool = False
    pad_id: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 = greedy); got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise ValueError(f"SamplingConfig.top_k must be an integer >= 0 (0 disables it); got {self.top_k}")
        if self.max_new_tokens < 1 or int(self.max_new_tokens) != self.max_new_tokens:
            raise ValueError(f"SamplingConfig.max_new_tokens must be an integer >= 1; got {self.max_new_tokens}")
        if self.eos_ids is not None:
            eos = tuple(int(e) for e in self.eos_ids)
            if any(e < 0 for e in eos):
                raise ValueError(f"SamplingConfig.eos_ids must be non-negative token ids; got {self.eos_ids}")
            object.__setattr__(self, "eos_ids", eos)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @property
    def logp_temperature(self) -> float:
        """The temperature of the reported log-probs (1 for greedy at temperature 0)."""
        return self.temperature if self.temperature > 0.0 else 1.0


def top_k_filter(logits_BxV: jax.Array, k: int) -> jax.Array:
    """Sets every logit below the k-th largest of its row to -inf; k = 0 or k >= V is a no-op."""
    if k <= 0 or k >= logits_BxV.shape[-1]:
        return logits_BxV
    kth_Bx1 = jax.lax.top_k(logits_BxV, k)[0][..., -1:]
    return jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)


def _nucleus_threshold(sorted_BxK: jax.Array, p: float) -> jax.Array:
    """[B, 1] smallest logit kept by top-p, from logits sorted in descending order."""
    probs_BxK = jax.nn.softmax(sorted_BxK, axis=-1)
    mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
    num_kept_B = jnp.maximum(jnp.sum(mass_before_BxK < p, axis=-1), 1)
    return jnp.take_along_axis(sorted_BxK, num_kept_B[:, None] - 1, axis=-1)


def top_p_filter(logits_BxV: jax.Array, p: float) -> jax.Array:
    """Nucleus filter: keeps token i iff the probability mass of the tokens sorted before it is < p.

    Works on logits already at -inf (after top-k): they have zero mass and stay -inf.
    """
    if p >= 1.0:
        return logits_BxV
    threshold_Bx1 = _nucleus_threshold(-jnp.sort(-logits_BxV, axis=-1), p)
    return jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)


def processed_logits(logits_BxV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """float32 [B, V] logits whose softmax is the distribution tokens are drawn from (non-greedy).

    With both top-k and top-p, the nucleus is found among the k sorted top values only, which
    avoids sorting the whole vocabulary every step.
    """
    x = logits_BxV.astype(jnp.float32) / sampling.logp_temperature
    k, p = sampling.top_k, sampling.top_p
    if 0 < k < x.shape[-1]:
        top_BxK = jax.lax.top_k(x, k)[0]  # descending
        threshold_Bx1 = top_BxK[:, -1:]
        if p < 1.0:
            threshold_Bx1 = _nucleus_threshold(top_BxK, p)
        return jnp.where(x < threshold_Bx1, -jnp.inf, x)
    return top_p_filter(x, p)


def sample(keys_B: jax.Array, logits_BxV: jax.Array, sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row, each row with its own PRNG key: over more than CDF_BLOCK tokens two
    uniforms a row (`inverse_cdf`), else the Gumbel-max trick (`jax.random.categorical`); greedy
    takes the argmax.

    Args:
      keys_B: [B] PRNG keys (typed or raw uint32 [B, 2]).
      logits_BxV: float32 raw model logits.
    Returns:
      (int32 tokens [B], float32 log-probs [B] of those tokens under log_softmax(logits / T),
      before top-k/top-p truncation; see the module docstring).
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    if sampling.is_greedy or logits_BxV.shape[-1] <= CDF_BLOCK:
        logp_BxV = jax.nn.log_softmax(logits_BxV / sampling.logp_temperature, axis=-1)
        if sampling.is_greedy:
            tokens_B = jnp.argmax(logits_BxV, axis=-1)
        else:
            tokens_B = jax.vmap(jax.random.categorical)(keys_B, processed_logits(logits_BxV, sampling))
        tokens_B = tokens_B.astype(jnp.int32)
        return tokens_B, jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
    z_BxV = logits_BxV / sampling.logp_temperature
    r_Bx2 = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys_B)
    unfiltered = sampling.top_k == 0 and sampling.top_p >= 1.0
    tokens_B, log_total_B = inverse_cdf(r_Bx2, z_BxV if unfiltered else processed_logits(logits_BxV, sampling))
    # log_softmax(z) of the drawn token only, in its terms (no [B, V] array); the mass of filtered
    # logits is not z's
    m_B = jnp.max(z_BxV, axis=-1)
    if not unfiltered:
        log_total_B = jnp.log(jnp.sum(jnp.exp(z_BxV - m_B[:, None]), axis=-1))
    z_B = jnp.take_along_axis(z_BxV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, (z_B - m_B) - log_total_B


def inverse_cdf(r_Bx2: jax.Array, x_BxV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int32 [B] tokens, float32 [B] log of sum(exp(x - max x))): per row a token drawn from
    softmax(x) (float32 x, -inf for excluded tokens, at least one finite a row) by inverse transform
    in two stages, with r's two numbers in [0, 1]: a block of CDF_BLOCK tokens with probability its
    mass (r[0]), then a token of the block with probability its share of the block's mass (r[1]).
    Each stage takes the first index whose cumulative mass exceeds r times the total, among those
    with mass; where float rounding leaves none, the last with mass. So a token of zero mass is
    never drawn."""
    b, v = x_BxV.shape
    blocks = -(-v // CDF_BLOCK)
    e_BxV = jnp.exp(x_BxV - jnp.max(x_BxV, axis=-1, keepdims=True))
    e_BxNxC = jnp.pad(e_BxV, ((0, 0), (0, blocks * CDF_BLOCK - v))).reshape(b, blocks, CDF_BLOCK)
    mass_BxN = jnp.sum(e_BxNxC, axis=-1)
    block_B = _first_above(r_Bx2[:, 0], mass_BxN)
    e_BxC = jnp.take_along_axis(e_BxNxC, block_B[:, None, None], axis=1)[:, 0]
    token_B = (block_B * CDF_BLOCK + _first_above(r_Bx2[:, 1], e_BxC)).astype(jnp.int32)
    return token_B, jnp.log(jnp.sum(mass_BxN, axis=-1))


def _first_above(r_B: jax.Array, mass_BxN: jax.Array) -> jax.Array:
    """int32 [B]: the first index with mass whose cumulative mass exceeds r * the row's total; the
    last index with mass where rounding leaves none; 0 in a row without mass (NaN logits), so a
    token id stays in range. One max-reduction: an index j above scores 2N - j (> any other score),
    one with mass only scores j, one without mass 0."""
    n = mass_BxN.shape[-1]
    cum_BxN = jnp.cumsum(mass_BxN, axis=-1)
    has_BxN = mass_BxN > 0
    above_BxN = (cum_BxN > (r_B * cum_BxN[:, -1])[:, None]) & has_BxN
    index_N = jnp.arange(n, dtype=jnp.int32)
    best_B = jnp.max(jnp.where(above_BxN, 2 * n - index_N, jnp.where(has_BxN, index_N, 0)), axis=-1)
    return jnp.where(best_B >= n, 2 * n - best_B, best_B)
