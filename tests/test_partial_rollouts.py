"""Partial rollouts (`rollout.max_staleness`): a call paused mid-decode and resumed by later calls draws
what one uninterrupted call draws; the step's carried groups, their forced finish, their metrics and
their round trip through a checkpoint."""

import jax
import numpy as np
from rollout_helpers import f32_options, prompts

from qerl_jax.rollout import SamplingConfig, generate, sampler

BATCHING_STOPS = tuple(range(10, 25))  # test_sampler's: rows stop at scattered steps, some run to the limit


def _sampling():
    return SamplingConfig(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=24, eos_ids=BATCHING_STOPS)


class _PauseAfter:
    """Says `done` at its `checks`-th question: the call pauses there."""

    def __init__(self, checks):
        self.checks, self.stopped = checks, []

    def finished(self, seqs, tokens, lengths):
        assert (lengths > 0).all()
        self.stopped += seqs.tolist()

    def bounds(self, wait):
        return 12, 12

    def done(self):
        self.checks -= 1
        return self.checks <= 0


def _next_partial(batch, paused):
    """The sequences the next call carries: the finished ones of `batch` and the `paused` ones."""
    lengths = np.asarray(batch.lengths)
    done = np.flatnonzero(lengths > 0)
    return sampler.Partial(
        seqs_K=np.concatenate([done, paused.seqs_K]),
        tokens_KxM=np.concatenate([np.asarray(batch.tokens)[done], paused.tokens_KxM]),
        logprobs_KxM=np.concatenate([np.asarray(batch.logprobs)[done], paused.logprobs_KxM]),
        lengths_K=np.concatenate([lengths[done], paused.lengths_K]),
        finished_K=np.concatenate([np.ones(len(done), bool), paused.finished_K]),
        stopped_K=np.concatenate([~np.asarray(batch.truncated)[done], paused.stopped_K]),
    )


def test_paused_and_resumed_calls_draw_what_one_call_draws(f32_model, monkeypatch):
    """Calls paused every few decode steps (rows decoding, rows never admitted), each resuming the last
    one's sequences (re-prefilled) under the same weights and key: the tokens of one uninterrupted call,
    their log-probs to float32 rounding; the finished ones reported to the monitor at once."""
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size, pads=(0, 3, 5, 1))
    key = jax.random.key(7)
    plain = generate(config, params, ids, mask, key, _sampling(), group_size=3, options=f32_options())
    monkeypatch.setattr(sampler, "MONITOR_STEPS", 4)
    none = np.zeros((0,), bool)
    partial = sampler.Partial(none.astype(int), np.zeros((0, 24), np.int32), np.zeros((0, 24), np.float32),
                              none.astype(np.int32), none, none)  # fmt: skip
    calls, paused_ever = 0, 0
    while len(partial.seqs_K) < 12 or not partial.finished_K.all():
        monitor = _PauseAfter(checks=3)
        batch, paused = generate(
            config, params, ids, mask, key, _sampling(), group_size=3, max_batch=4, monitor=monitor,
            options=f32_options(smaller_rows=(2,)), partial=partial,
        )  # fmt: skip
        # the finished carried ones were reported first
        assert monitor.stopped[: int(partial.finished_K.sum())] == partial.seqs_K[partial.finished_K].tolist()
        lengths = np.asarray(batch.lengths)
        assert (lengths[paused.seqs_K] == 0).all() and (paused.lengths_K >= 1).all()
        paused_ever += len(paused.seqs_K)
        if calls == 0:
            never = (lengths == 0) & ~np.isin(np.arange(12), paused.seqs_K)
            assert never.any(), "the first call must leave sequences it never admitted"
        partial, calls = _next_partial(batch, paused), calls + 1
        assert calls < 12
    assert calls >= 3 and paused_ever >= 4
    order = np.argsort(partial.seqs_K)
    np.testing.assert_array_equal(partial.lengths_K[order], np.asarray(plain.lengths))
    np.testing.assert_array_equal(partial.tokens_KxM[order], np.asarray(plain.tokens))
    np.testing.assert_allclose(partial.logprobs_KxM[order], np.asarray(plain.logprobs), atol=2e-5)
    np.testing.assert_array_equal(partial.stopped_K[order], ~np.asarray(plain.truncated))
