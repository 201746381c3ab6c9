"""Sequence packing: first-fit-decreasing and slack-fit rows, the packed layout, and attention confined to segments."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qerl_jax
from qerl_jax.models.qwen2 import positions_from_segments
from qerl_jax.rl.packing import first_fit_decreasing, pack_batch, pack_rows, slack_fit_decreasing, token_counts


def test_first_fit_decreasing_known_case_and_one_long_many_short():
    assert first_fit_decreasing([5, 3, 7, 2, 4, 1], 8) == [[2, 5], [0, 1], [4, 3]]  # 7+1 | 5+3 | 4+2
    lengths = [100] + [3] * 30 + [0, 0]
    rows = first_fit_decreasing(lengths, 100)
    assert rows[0] == [0] and len(rows) == 2  # the long one alone; the 30 short ones (90 tokens) in one row
    placed = sorted(i for r in rows for i in r)
    assert placed == list(range(31))  # every non-empty sequence exactly once, the empty ones nowhere
    with pytest.raises(ValueError, match="101 tokens does not fit rows of 100"):
        first_fit_decreasing([101], 100)


def _check_rows(rows, lengths, row_len):
    assert sorted(i for r in rows for i in r) == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[i] for i in r) <= row_len for r in rows)


def test_slack_fit_fills_the_rows_first_fit_leaves_a_stray_in():
    # The gsm8k --tiny workload's sequence lengths: 550 tokens, rows of 112 (one sequence at the cap).
    lengths = [112, 72, 50, 38, 31, 31, 29, 26, 25, 22, 21, 20, 20, 18, 18, 17]
    assert len(first_fit_decreasing(lengths, 112)) == 6  # ... | 21+20+20+18+18 | 17
    rows = slack_fit_decreasing(lengths, 112)
    _check_rows(rows, lengths, 112)
    assert len(rows) == 5 == -(-sum(lengths) // 112)  # 560 slots for 550 tokens
    assert pack_rows(lengths, 112) == rows
    assert pack_rows([5, 3, 7, 2, 4, 1], 8) == first_fit_decreasing([5, 3, 7, 2, 4, 1], 8)  # first-fit is optimal
    with pytest.raises(ValueError, match="101 tokens does not fit rows of 100"):
        slack_fit_decreasing([101], 100)


def test_slack_fit_rows_are_the_best_subset_sums_by_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        row_len = 30
        lengths = rng.integers(0, 21, 8).tolist()
        rows = slack_fit_decreasing(lengths, row_len)
        _check_rows(rows, lengths, row_len)
        assert len(pack_rows(lengths, row_len)) <= len(first_fit_decreasing(lengths, row_len))
        left = [i for i, n in enumerate(lengths) if n > 0]
        for row in rows:
            first = max(left, key=lambda j: (lengths[j], -j))
            assert row[0] == first  # each row starts with the longest sequence left
            others = [i for i in left if i != first]
            subsets = (c for k in range(len(others) + 1) for c in itertools.combinations(others, k))
            fills = [sum(lengths[i] for i in c) for c in subsets]
            best = max(f for f in fills if f <= row_len - lengths[first])
            assert sum(lengths[i] for i in row) == lengths[first] + best
            left = [i for i in left if i not in row]


def test_pack_batch_places_every_token_once():
    rng = np.random.default_rng(0)
    b, t = 6, 10
    lengths = np.array([10, 2, 3, 7, 4, 0])
    attn = (np.arange(t)[None] >= t - lengths[:, None]).astype(np.int32)  # left-padded rows
    ids = (rng.integers(1, 50, (b, t)) * attn).astype(np.int32)
    resp = attn * (np.arange(t)[None] >= t - lengths[:, None] + 1)
    old = np.where(resp > 0, rng.normal(size=(b, t)), 0).astype(np.float32)
    batch = dict(input_ids=ids, attention_mask=attn, response_mask=resp, old_logp=old, advantages=np.ones(b))
    p = pack_batch(batch, 12, rows_multiple=4)
    assert p["input_ids"].shape == (4, 12)  # 3 rows (10+2 | 7+4 | 3) rounded up to 4
    flat = p["input_ids"].reshape(-1)
    for i in range(b):
        n = lengths[i]
        index = p["token_index"][i]
        assert (index[:n] >= 0).all() and (index[n:] == -1).all()
        np.testing.assert_array_equal(flat[index[:n]], ids[i, t - n :])  # the sequence's tokens, in order
        np.testing.assert_array_equal(p["response_mask"][i, :n], resp[i, t - n :])
        np.testing.assert_array_equal(p["old_logp"][i, :n], old[i, t - n :])
        seg = p["segment_ids"].reshape(-1)[index[:n]]
        assert len(set(seg.tolist())) <= 1  # one segment per sequence
    used = p["token_index"][p["token_index"] >= 0]
    assert len(np.unique(used)) == lengths.sum()  # no slot holds two tokens
    assert token_counts(p) == {"real": int(lengths.sum()), "computed": 48}
    pos = np.asarray(positions_from_segments(jnp.asarray(p["segment_ids"])))
    for i in range(b):  # RoPE positions restart at 0 in each sequence
        np.testing.assert_array_equal(pos.reshape(-1)[p["token_index"][i, : lengths[i]]], np.arange(lengths[i]))


def test_segment_mask_never_attends_across_sequences(tiny_qwen2_dir):
    """Perturbing one packed sequence changes no other sequence's outputs; each sequence's outputs
    equal its own unpacked forward (positions restart, attention stays within it)."""
    config, params = qerl_jax.load_model(tiny_qwen2_dir[0], dtype="float32")
    rng = np.random.default_rng(1)
    seg = np.array([[1] * 5 + [2] * 3 + [3] * 4 + [4] * 2])  # three sequences and a tail segment
    ids = rng.integers(0, config.vocab_size, seg.shape).astype(np.int32)
    fwd = jax.jit(lambda i: qerl_jax.forward(config, params, i, segment_ids=jnp.asarray(seg)))
    out = np.asarray(fwd(ids))
    for s in (1, 2, 3):
        perturbed = ids.copy()
        perturbed[seg == s] = (perturbed[seg == s] + 7) % config.vocab_size
        out_p = np.asarray(fwd(perturbed))
        others = seg[0] != s
        np.testing.assert_array_equal(out_p[0, others], out[0, others])
        assert np.abs(out_p[0, ~others] - out[0, ~others]).max() > 1e-3  # the perturbation shows where it may
    for s in (1, 2, 3):
        alone = ids[:, seg[0] == s]
        ref = np.asarray(jax.jit(lambda i: qerl_jax.forward(config, params, i))(alone))
        np.testing.assert_allclose(out[0, seg[0] == s], ref[0], rtol=1e-5, atol=1e-5)
