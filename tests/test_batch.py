"""rollout/batch.py: `to_train_batch` lays a rollout out as the train step's batch."""

import jax
import numpy as np
from rollout_helpers import f32_options, prompts

from qerl_jax.rollout import SamplingConfig, generate, prompt_bucket, to_train_batch

F32 = f32_options()
STOPS = tuple(range(10, 40))


def _sampling(**kw):
    return SamplingConfig(**{**dict(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=16, eos_ids=()), **kw})


def test_train_batch_layout(f32_model):
    config, params, _ = f32_model
    ids, mask = prompts(config.vocab_size)
    sampling = _sampling(max_new_tokens=10, eos_ids=STOPS[:10], pad_id=0)
    batch = generate(config, params, ids, mask, jax.random.key(5), sampling, group_size=2, options=F32)
    p = prompt_bucket(9)
    assert batch.prompt_ids.shape == (6, p)
    train = to_train_batch(batch)
    assert {k: v.shape for k, v in train.items()} == {k: (6, p + 10) for k in train}
    np.testing.assert_array_equal(np.asarray(train["input_ids"][:, :p]), np.asarray(batch.prompt_ids))
    np.testing.assert_array_equal(np.asarray(train["input_ids"][:, p:]), np.asarray(batch.tokens))
    np.testing.assert_array_equal(np.asarray(train["input_ids"][::2, p - 9 : p]), ids)  # left-padded prompt
    np.testing.assert_array_equal(np.asarray(train["attention_mask"][::2, p - 9 : p]), mask)
    np.testing.assert_array_equal(np.asarray(train["response_mask"][:, p:]), np.asarray(batch.response_mask))
    assert int(train["response_mask"][:, :p].sum()) == 0
    np.testing.assert_array_equal(np.asarray(train["old_logp"][:, p:]), np.asarray(batch.logprobs))
    np.testing.assert_array_equal(np.asarray(train["attention_mask"][:, p:]), np.asarray(batch.response_mask))
    trimmed = to_train_batch(batch, trim_to_multiple=4)
    longest = int(np.asarray(batch.lengths).max())
    assert trimmed["input_ids"].shape[1] == p + min(10, -(-longest // 4) * 4)
    assert int(trimmed["response_mask"].sum()) == int(train["response_mask"].sum())


def _rows(n: int, prompt_len: int, first: int):
    """A RolloutBatch of n rows whose prompts and tokens carry their row number (first, first + 1, ...)."""
    import jax.numpy as jnp

    from qerl_jax.rollout.batch import RolloutBatch

    row = jnp.arange(first, first + n, dtype=jnp.int32)
    return RolloutBatch(
        prompt_ids=jnp.tile(row[:, None], (1, prompt_len)), prompt_mask=jnp.ones((n, prompt_len), jnp.int32),
        tokens=jnp.tile(row[:, None], (1, 3)), logprobs=-jnp.ones((n, 3)), response_mask=jnp.ones((n, 3), jnp.int32),
        lengths=jnp.full((n,), 3), decoded=jnp.full((n,), 3), truncated=jnp.zeros((n,), bool), prompt_index=row, steps=jnp.asarray([first + 4]),
        segment_s=jnp.asarray([[first, 1.0]]),
    )  # fmt: skip


def test_select_and_concat_keep_rows_in_order_and_left_pad_the_prompts():
    from qerl_jax.rollout.batch import concat, select_rows

    joined = concat([_rows(2, 4, first=0), select_rows(_rows(3, 6, first=10), np.array([0, 2]))])
    assert np.asarray(joined.tokens)[:, 0].tolist() == [0, 1, 10, 12]
    assert np.asarray(joined.prompt_index).tolist() == [0, 1, 10, 12]
    assert joined.prompt_ids.shape == (4, 6)
    assert np.asarray(joined.prompt_mask)[:2].tolist() == [[0, 0, 1, 1, 1, 1]] * 2  # padded on the left
    assert np.asarray(joined.prompt_ids)[3].tolist() == [12] * 6
    assert np.asarray(joined.steps).tolist() == [4, 14]
    assert np.asarray(joined.segment_s).tolist() == [[0, 1], [10, 1]] and joined.segment_rows is None
    untimed = _rows(2, 4, first=0).replace(segment_s=None)
    assert concat([untimed, _rows(1, 4, first=5)]).segment_s is None  # not every batch timed


def test_concat_and_select_rows_of_any_row_count_compile_nothing():
    """Joined and selected on the host (numpy fields): a rollout's row count changes from step to step,
    and each new one compiled a gather, a pad and a concatenation on the device (~50 ms each on an H200)."""
    from qerl_jax.rollout.batch import concat, select_rows

    compiles = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    first, second = jax.device_get((_rows(5, 4, first=0), _rows(7, 6, first=20)))  # host rows, as the engine's
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for n in (3, 5):
            joined = select_rows(concat([select_rows(first, np.arange(n)), second]), np.arange(n + 7)[::-1])
            assert isinstance(joined.tokens, np.ndarray) and joined.prompt_ids.shape == (n + 7, 6)
            assert joined.tokens[:, 0].tolist() == [26, 25, 24, 23, 22, 21, 20, *range(n - 1, -1, -1)]
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
