"""rollout/weights.py: the decode weights `generate` builds once per call (per-layer copies read in
place, bf16 copies, repacked copies for the Hopper wgmma kernel, q/k/v and gate/up fused, LoRA
stacked), which projections get which at which row counts, and that each choice samples what the
packed path samples (the Mosaic kernel replaced by its CPU twin)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen_shapes import qwen25_config, random_params
from rollout_helpers import f32_options, fake_hopper_kernel, prompts, random_lora, recomputed_logp

import qerl_jax
from qerl_jax.models.qwen2 import PROJECTIONS
from qerl_jax.quant.packed import dequantize
from qerl_jax.rollout import RolloutOptions, SamplingConfig, generate
from qerl_jax.rollout import weights as weights_module

F32 = f32_options()  # exact KV cache for the parity tests


def _sampling(**kw):
    return SamplingConfig(**{**dict(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=16, eos_ids=()), **kw})


def test_packed_weights_are_read_in_place_by_the_pallas_kernel(tiny_qwen2_dir):
    """The unrolled decode passes the stacked packed weights with a layer index (no per-layer
    copies); with the Pallas kernel (interpreted on CPU) its log-probs are those of one full
    forward over the sampled tokens."""
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    split = weights_module.split_layers(params)
    assert set(split["packed"]) == set(params["base"]["layers"])
    assert all("w" not in p for p in split["layers"][0]["base"].values())
    packed_bytes = sum(x.nbytes for x in jax.tree.leaves(split["packed"]))
    all_bytes = sum(x.nbytes for x in jax.tree.leaves([params["base"]["layers"], params["norms"]["layers"]]))
    assert weights_module.layer_copy_bytes(params) == all_bytes - packed_bytes
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, eos_ids=())
    opts = RolloutOptions(backend="pallas", dense_weights=False)
    unrolled = generate(config, params, ids, mask, jax.random.key(3), sampling, group_size=2, options=opts)
    recomputed, old, resp = recomputed_logp(config, params, unrolled, 1.0)
    np.testing.assert_allclose(old[resp == 1], recomputed[resp == 1], atol=0.05)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_dense_weight_copies_sample_what_the_packed_path_samples(tiny_qwen2_dir, backend):
    """dense_weights=True dequantizes the packed linears once (by the backend's own
    dequantization) instead of every step: the same tokens, and the same log-probs (exactly
    on the XLA path; the Pallas path rounds its matmul outputs to bf16, the dense dot not)."""
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    split = weights_module.split_layers(params, backend)
    assert not split["packed"] and split["layers"][1]["base"]["o_proj"]["w"].dtype == jnp.bfloat16
    assert weights_module.dense_copy_bytes(params) == sum(  # q/k/v and gate/up concatenated, same bytes
        x.nbytes
        for layer in split["layers"]
        for p in layer["base"].values()
        if "w" in p
        for x in jax.tree.leaves(p["w"])
    )
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(greedy=True, max_new_tokens=6, eos_ids=())
    run = lambda dense: generate(  # noqa: E731
        config, params, ids, mask, jax.random.key(5), sampling, group_size=2,
        options=RolloutOptions(backend=backend, dense_weights=dense),
    )  # fmt: skip
    packed, dense = run(False), run(True)
    np.testing.assert_array_equal(np.asarray(dense.tokens), np.asarray(packed.tokens))
    atol = 0.0 if backend == "xla" else 0.05
    np.testing.assert_allclose(np.asarray(dense.logprobs), np.asarray(packed.logprobs), atol=atol)


def test_dense_groups_are_fused_with_their_adapters_stacked_and_sample_the_same(f32_model, monkeypatch):
    """A dense policy's q/k/v and gate/up are concatenated once per call (one dot each, biases
    kept per projection, the adapters stacked with a block-diagonal B, their stacked A below the
    weight's rows), o_proj and down_proj each with its adapter's A below its rows; float32: the
    same tokens and log-probs as the projections one by one, and the estimate counts the stacked
    adapters and the A rows."""
    from qerl_jax.linear import Fused

    config, params, _ = f32_model
    params = {**params, "lora": random_lora(config, scale=0.2)}
    split = weights_module.split_layers(params)
    base, lora = split["layers"][1]["base"], split["layers"][1]["lora"]
    qkv, gate_up = base["q_proj+k_proj+v_proj"]["w"], base["gate_proj+up_proj"]["w"]
    hd, d = config.head_dim, config.hidden_size
    sizes = (config.num_attention_heads * hd, config.num_key_value_heads * hd, config.num_key_value_heads * hd)
    assert isinstance(qkv, Fused) and qkv.sizes == sizes and qkv.w.shape == (sum(sizes) + 12, d)
    assert qkv.lora_rows == 12 and gate_up.lora_rows == 8
    assert isinstance(gate_up, Fused) and gate_up.w.shape == (2 * config.intermediate_size + 8, d)
    assert "w" not in base["k_proj"] and "b" in base["k_proj"]
    w_k = params["base"]["layers"]["k_proj"]["w"][1]
    np.testing.assert_array_equal(np.asarray(qkv.w[sizes[0] : sizes[0] + sizes[1]]), np.asarray(w_k))
    stacked = lora["q_proj+k_proj+v_proj"]
    assert stacked["a"].shape == (12, d) and stacked["b"].shape == (sum(sizes), 12)
    assert not np.asarray(stacked["b"][sizes[0] : sizes[0] + sizes[1], :4]).any()  # block-diagonal
    np.testing.assert_array_equal(np.asarray(qkv.w[sum(sizes) :]), np.asarray(stacked["a"]))
    for name in ("o_proj", "down_proj"):
        alone = base[name]["w"]
        w_name = params["base"]["layers"][name]["w"][1]
        assert isinstance(alone, Fused) and alone.sizes == (w_name.shape[0],) and alone.lora_rows == 4
        np.testing.assert_array_equal(np.asarray(alone.w[: w_name.shape[0]]), np.asarray(w_name))
        np.testing.assert_array_equal(np.asarray(alone.w[w_name.shape[0] :]), np.asarray(lora[name]["a"]))
    made = sum(x.nbytes for layer in split["layers"] for g in ("q_proj+k_proj+v_proj", "gate_proj+up_proj")
               for x in jax.tree.leaves(layer["lora"][g]))  # fmt: skip
    made += sum(
        w.lora_rows * w.w.shape[1] * w.w.dtype.itemsize
        for layer in split["layers"] for p in layer["base"].values() if isinstance(w := p.get("w"), Fused)
    )  # fmt: skip
    assert weights_module.fused_lora_bytes(params, (), ()) == made
    ids, mask = prompts(config.vocab_size)
    run = lambda: generate(  # noqa: E731
        config, params, ids, mask, jax.random.key(4), _sampling(), group_size=2, lora_scale=0.5, options=F32
    )
    fused = run()
    monkeypatch.setattr(weights_module, "dense_fused_groups", lambda *a: ())
    monkeypatch.setattr(weights_module, "UNGROUPED", ())
    unfused = weights_module.split_layers(params)["layers"][0]["base"]
    assert "q_proj+k_proj+v_proj" not in unfused and not isinstance(unfused["o_proj"]["w"], Fused)
    one_by_one = run()
    np.testing.assert_array_equal(np.asarray(fused.tokens), np.asarray(one_by_one.tokens))
    np.testing.assert_allclose(np.asarray(fused.logprobs), np.asarray(one_by_one.logprobs), atol=1e-5)
    recomputed, old, resp = recomputed_logp(config, params, fused, 0.8, lora_scale=0.5)
    np.testing.assert_allclose(old[resp == 1], recomputed[resp == 1], atol=1e-4)


def test_dense_fused_groups_need_every_member_dense(tiny_qwen2_dir):
    """NVFP4: a group is fused only where all its projections have bf16 copies."""
    path, _ = tiny_qwen2_dir
    _, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    qkv, gate_up = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    assert weights_module.dense_fused_groups(params) == ()  # all packed, no copies
    assert weights_module.dense_fused_groups(params, ("q_proj", "k_proj", "gate_proj")) == ()
    assert weights_module.dense_fused_groups(params, (*qkv, "gate_proj")) == (qkv,)
    assert weights_module.dense_fused_groups(params, tuple(PROJECTIONS)) == (qkv, gate_up)
    split = weights_module.split_layers(params, "xla", (*qkv, "o_proj"))
    base = split["layers"][0]["base"]
    assert "q_proj+k_proj+v_proj" in base and "gate_proj+up_proj" not in base


def test_small_projections_get_dense_copies_by_default_on_pallas(tiny_qwen2_dir, monkeypatch):
    """Below DENSE_FROM_ROWS the default densifies only the packed matrices of at most
    SMALL_DENSE_WEIGHTS weights (where the kernel loses to a bf16 dot); the others stay packed
    and are read in place (a model large enough for the kernels: KERNEL_MIN_LAYER_WEIGHTS)."""
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    monkeypatch.setattr(weights_module, "KERNEL_MIN_LAYER_WEIGHTS", 0)
    sizes = {n: p["w"].codes.shape[-2] * 2 * p["w"].codes.shape[-1] for n, p in params["base"]["layers"].items()}
    monkeypatch.setattr(weights_module, "SMALL_DENSE_WEIGHTS", min(sizes.values()))
    small = weights_module.small_packed_names(params)
    assert small and set(small) == {n for n, size in sizes.items() if size == min(sizes.values())}
    seen = []
    real_split = weights_module.split_layers
    monkeypatch.setattr(weights_module, "split_layers", lambda *a: seen.append(a[1:]) or real_split(*a))
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(greedy=True, max_new_tokens=6, eos_ids=())
    auto = generate(config, params, ids, mask, jax.random.key(6), sampling, options=RolloutOptions(backend="pallas"))
    assert seen[-1] == ("pallas", small, (), None)  # no wgmma copies off Hopper, no FP8 copies by default
    split = real_split(params, "pallas", small)
    assert set(split["packed"]) == set(sizes) - set(small)
    opts = RolloutOptions(backend="pallas", dense_weights=False)
    packed = generate(config, params, ids, mask, jax.random.key(6), sampling, options=opts)
    assert seen[-1] == (None, None, (), None)
    np.testing.assert_array_equal(np.asarray(auto.tokens), np.asarray(packed.tokens))
    np.testing.assert_allclose(np.asarray(auto.logprobs), np.asarray(packed.logprobs), atol=0.05)


def test_lora_layer_copies_take_the_activation_dtype(tiny_qwen2_dir):
    """float32 adapters on a bf16 model: the per-layer copies are bf16 (the matmuls cast to it
    anyway) and sample with the log-probs of one full forward over the float32 stacks."""
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16")
    params = {**params, "lora": random_lora(config, scale=0.2)}
    split = weights_module.split_layers(params)
    dtypes = {x.dtype for x in jax.tree.leaves(split["layers"][0]["lora"])}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    lora_bytes = sum(x.nbytes for x in jax.tree.leaves(params["lora"]))
    plain = {k: v for k, v in params.items() if k != "lora"}
    assert weights_module.layer_copy_bytes(params) == weights_module.layer_copy_bytes(plain) + lora_bytes // 2
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, eos_ids=())
    kw = dict(group_size=2, lora_scale=0.5)
    unrolled = generate(config, params, ids, mask, jax.random.key(5), sampling, **kw)
    recomputed, old, resp = recomputed_logp(config, params, unrolled, 1.0, lora_scale=0.5)
    np.testing.assert_allclose(old[resp == 1], recomputed[resp == 1], atol=5e-2)
    without = generate(config, plain, ids, mask, jax.random.key(5), sampling, **kw)
    assert not np.array_equal(np.asarray(without.tokens), np.asarray(unrolled.tokens))


def test_dense_weights_default_only_where_the_step_would_dequantize_and_it_fits():
    choose = functools.partial(weights_module.use_dense_weights, None, dense_bytes=1, fits=True)
    assert choose(backend="xla", rows=1)  # the XLA path dequantizes every step at any batch
    assert not choose(backend="pallas", rows=64)  # the kernels read packed weights up to M = 64
    assert choose(backend="pallas", rows=weights_module.DENSE_FROM_ROWS)
    assert not weights_module.use_dense_weights(None, backend="pallas", rows=256, dense_bytes=1, fits=False)
    assert not weights_module.use_dense_weights(
        None, backend="xla", rows=256, dense_bytes=0, fits=True
    )  # nothing packed
    assert not weights_module.use_dense_weights(False, backend="xla", rows=256, dense_bytes=1, fits=True)


def test_wgmma_weight_names_default_and_overrides(tiny_qwen2_dir):
    """Repacked copies for the Hopper kernel: only on "pallas" with unrolled layers, the kernel
    available, at most WGMMA_MAX_ROWS rows by default, fitting; NVFP4 [N, K] with N, K % 64 == 0
    (the tiny model: q/o 64 x 64 qualify, k/v 32 x 64 and the MLP's 96 do not), minus dense ones."""
    path, _ = tiny_qwen2_dir
    _, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    names = functools.partial(weights_module.wgmma_weight_names, params, backend="pallas")
    assert names(None, rows=64, kernel_available=True) == ("o_proj", "q_proj")
    assert names(None, rows=16, kernel_available=True, exclude=("q_proj",)) == ("o_proj",)
    assert names(None, rows=65, kernel_available=True) == ()  # above WGMMA_MAX_ROWS: the Triton kernel
    assert names(True, rows=64, kernel_available=True) == ("o_proj", "q_proj")
    assert names(None, rows=1, kernel_available=False) == ()  # CPU, or a GPU other than Hopper
    assert names(False, rows=1, kernel_available=True) == ()
    assert names(None, rows=1, kernel_available=True, fits=lambda extra: False) == ()
    assert weights_module.wgmma_weight_names(params, None, backend="xla", rows=1) == ()
    q = params["base"]["layers"]["q_proj"]["w"]
    assert weights_module.wgmma_copy_bytes(params, ("q_proj",)) == q.codes.nbytes + q.scales.nbytes


def test_wgmma_copies_sample_what_the_packed_path_samples(tiny_qwen2_dir, monkeypatch):
    """generate with the repacked copies (kernel availability faked, the Mosaic kernel replaced
    by its CPU twin: per-CTA partial sums of the dequantized repacked words) samples the tokens
    of the packed path;
    decode rows go through the copies, the prefill through the packed stack."""
    from pallas_kernels import wgmma_nvfp4
    from qerl_jax.linear import ByRows, Fused, LayerOf

    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")
    calls = []
    fake_hopper_kernel(monkeypatch, calls, small_kv_dense=False)
    split = weights_module.split_layers(params, wgmma_names=("o_proj", "q_proj"))
    assert set(split["packed"]) == set(params["base"]["layers"])  # the prefill reads the stacks
    alone = split["layers"][1]["base"]["q_proj"]["w"]  # a fused call of one projection
    assert isinstance(alone, Fused) and isinstance(alone.w, wgmma_nvfp4.WgmmaWeight)
    assert alone.sizes == (alone.w.shape[0],)
    assert "w" not in split["layers"][1]["base"]["k_proj"]
    w = weights_module.layer_vars(split, 1)["base"]["q_proj"]["w"]
    assert isinstance(w, ByRows) and isinstance(w.small, Fused) and isinstance(w.large, LayerOf)
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(greedy=True, max_new_tokens=6, eos_ids=())
    opts = lambda wgmma: RolloutOptions(backend="pallas", dense_weights=False, wgmma_weights=wgmma)  # noqa: E731
    repacked = generate(config, params, ids, mask, jax.random.key(8), sampling, group_size=2, options=opts(True))
    assert calls and all(shape[0] <= wgmma_nvfp4.MAX_ROWS for shape, _, _ in calls)  # decode steps only
    packed = generate(config, params, ids, mask, jax.random.key(8), sampling, group_size=2, options=opts(False))
    np.testing.assert_array_equal(np.asarray(repacked.tokens), np.asarray(packed.tokens))
    np.testing.assert_allclose(np.asarray(repacked.logprobs), np.asarray(packed.logprobs), atol=0.05)


@pytest.fixture(scope="module")
def fusable_nvfp4_model(tmp_path_factory):
    """A tiny Qwen2 whose projections all have N, K multiples of 64 (k/v: 2 heads x 32), NVFP4."""
    from conftest import make_hf_model, save_hf_model

    model = make_hf_model(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    path = save_hf_model(model, tmp_path_factory.mktemp("tiny_fusable"))
    return qerl_jax.load_model(path, dtype="bfloat16", quant="nvfp4")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_weight_copies_compile_one_program_for_all_layers(fusable_nvfp4_model, backend, monkeypatch):
    """The bf16 and wgmma copies come from one compiled program each, run once a layer (one
    program over the layers held every layer's kernels: 196 dequantization kernels for
    the 1.5B), and each layer's copy is that layer's own weight."""
    import pallas_kernels
    from pallas_kernels import wgmma_nvfp4

    _, params = fusable_nvfp4_model
    monkeypatch.setattr(wgmma_nvfp4, "available", lambda: True)
    dense_names, wgmma_names = ("o_proj", "down_proj"), ("gate_proj", "up_proj")
    before = weights_module._dense_layer_jit._cache_size(), weights_module._wgmma_layer_jit._cache_size()
    split = weights_module.split_layers(params, backend, dense_names, wgmma_names)
    after = weights_module._dense_layer_jit._cache_size(), weights_module._wgmma_layer_jit._cache_size()
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1
    stacks = params["base"]["layers"]
    num_layers = stacks["o_proj"]["w"].codes.shape[0]
    assert len(split["layers"]) == num_layers > 1
    for layer in range(num_layers):
        base = split["layers"][layer]["base"]
        for name in dense_names:
            stack = stacks[name]["w"]
            want = (
                pallas_kernels.dequantize_bf16(stack, layer=layer)
                if backend == "pallas"
                else dequantize(jax.tree.map(lambda a, i=layer: a[i], stack), jnp.bfloat16)
            )
            np.testing.assert_array_equal(np.asarray(base[name]["w"], np.float32), np.asarray(want, np.float32))
        fused = base["gate_proj+up_proj"]["w"].w
        want = wgmma_nvfp4.concat(
            [wgmma_nvfp4.from_packed(jax.tree.map(lambda a, i=layer: a[i], stacks[n]["w"])) for n in wgmma_names]
        )
        for got_leaf, want_leaf in zip(jax.tree.leaves(fused), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(want_leaf))


def test_wgmma_weight_names_take_fusable_groups_whole(fusable_nvfp4_model):
    """The small k/v (dense copies by default) join q in the kernel: one fused q/k/v call."""
    _, params = fusable_nvfp4_model
    names = functools.partial(weights_module.wgmma_weight_names, params, backend="pallas")
    every = tuple(sorted(PROJECTIONS))
    assert names(None, rows=16, kernel_available=True, exclude=("k_proj", "v_proj")) == every
    assert names(None, rows=16, kernel_available=True, exclude=("gate_proj", "q_proj")) == every
    assert names(None, rows=16, kernel_available=True, exclude=every) == ()
    assert weights_module.fused_groups(every) == (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    assert weights_module.fused_groups(("q_proj", "k_proj", "up_proj")) == ()
    with pytest.MonkeyPatch.context() as mp:  # generate's choice: k/v small (dense), then fused
        mp.setattr(weights_module, "SMALL_DENSE_WEIGHTS", 64 * 128)
        mp.setattr(weights_module, "KERNEL_MIN_LAYER_WEIGHTS", 0)
        mp.setattr("pallas_kernels.wgmma_nvfp4.available", lambda: True)
        choice = dict(backend="pallas", rows=16)
        assert weights_module.decode_weight_names(params, None, None, **choice) == ((), every)
        assert weights_module.decode_weight_names(params, None, False, **choice) == (("k_proj", "v_proj"), ())


def _shapes_of(size: str) -> dict:
    """Shape-only NVFP4 params of a Qwen2.5 size with LoRA r16 on every projection."""
    from qerl_jax.lora import LoraConfig, init_lora, with_lora

    config = qwen25_config(size)
    lora = LoraConfig(rank=16, alpha=32.0)
    params = lambda: random_params(config, quant="nvfp4", dtype=jnp.bfloat16)  # noqa: E731
    return jax.eval_shape(lambda: with_lora(params(), init_lora(jax.random.key(1), config, lora)))


@pytest.mark.parametrize("size", ["1.5B", "7B"])
def test_a_call_with_smaller_buckets_gives_the_kernel_what_its_small_bucket_alone_gets(size, monkeypatch):
    """A rollout of 128 rows compacted to 64 and 16 decodes its small buckets with the projections a
    16-row call gives the kernel: at the 1.5B's shapes (taken as large enough for the kernel) the
    MLP only (the small q/k/v/o decode from their bf16 copies; all seven in the kernel made the H200
    claims rollout 2.73 s against 2.26 s from the copies alone), at the 7B's every one (q/o are
    large, the small k/v join q)."""
    monkeypatch.setattr("pallas_kernels.wgmma_nvfp4.available", lambda: True)
    monkeypatch.setattr(weights_module, "KERNEL_MIN_LAYER_WEIGHTS", 0)
    params = _shapes_of(size)
    every = tuple(sorted(PROJECTIONS))
    choose = functools.partial(weights_module.decode_weight_names, params, None, None, backend="pallas")
    dense_alone, kernel_alone = choose(rows=16)
    dense_all, kernel_all = choose(rows=(128, 64, 16))
    assert dense_all == every  # the 128-row bucket decodes from copies
    assert kernel_all == kernel_alone
    if size == "1.5B":
        assert kernel_all == ("down_proj", "gate_proj", "up_proj")
        assert dense_alone == ("k_proj", "o_proj", "q_proj", "v_proj")
    else:
        assert kernel_all == every and dense_alone == ()
    requested = functools.partial(weights_module.decode_weight_names, params, None, True, backend="pallas")
    assert requested(rows=(128, 64, 16))[1] == requested(rows=16)[1]


@pytest.mark.parametrize("size", ["0.5B", "1.5B", "7B"])
def test_models_below_the_kernel_floor_decode_every_bucket_from_bf16_copies(size, monkeypatch):
    """By default the 0.5B and 1.5B (6M / 47M packed weights a layer, under
    KERNEL_MIN_LAYER_WEIGHTS) decode every bucket from bf16 copies of all seven projections, with
    no wgmma kernel (it compiles in every process and gained nothing in the 1.5B rollout); the 7B
    (233M) keeps the kernel. Asked for, the kernel still runs; copies that do not fit fall back to
    the per-bucket plan."""
    monkeypatch.setattr("pallas_kernels.wgmma_nvfp4.available", lambda: True)
    params = _shapes_of(size)
    every = tuple(sorted(PROJECTIONS))
    per_layer = weights_module.layer_packed_weights(params)
    choose = functools.partial(weights_module.decode_weight_names, params, backend="pallas")
    small = size != "7B"
    assert (per_layer < weights_module.KERNEL_MIN_LAYER_WEIGHTS) == small
    for rows in (1, 16, (64, 16), (128, 64, 16)):
        dense, kernel = choose(None, None, rows=rows)
        if small:
            assert (dense, kernel) == (every, ())
        else:
            assert kernel == every
    if small:
        assert choose(None, True, rows=16)[1] != ()  # asked for
        all_copies = weights_module.dense_copy_bytes(params, every)
        dense, _ = choose(None, None, rows=16, fits=lambda extra: extra < all_copies)
        assert dense != every


def test_wgmma_weight_names_take_the_largest_units_that_fit(fusable_nvfp4_model):
    """When not every copy fits, whole units (a fused group or a lone projection) are taken,
    largest first, while they fit: never a k/v without its q, never more than the budget."""
    _, params = fusable_nvfp4_model
    size = functools.partial(weights_module.wgmma_copy_bytes, params)
    names = functools.partial(weights_module.wgmma_weight_names, params, None, backend="pallas", rows=16)
    qkv, mlp = ("k_proj", "q_proj", "v_proj"), ("gate_proj", "up_proj")
    assert size(qkv) == size(mlp) > size(("down_proj",)) == size(("o_proj",))  # the tiny model's sizes
    both = tuple(sorted(qkv + mlp))
    assert names(kernel_available=True, fits=lambda b: b <= size(both)) == both
    one_group = names(kernel_available=True, fits=lambda b: b < size(qkv) + size(("o_proj",)))
    assert one_group in (qkv, mlp)
    group_and_one = names(kernel_available=True, fits=lambda b: b <= size(qkv) + size(("o_proj",)))
    assert len(group_and_one) == 4 and set(group_and_one) & {"down_proj", "o_proj"}
    assert set(qkv) <= set(group_and_one) or set(mlp) <= set(group_and_one)
    assert names(kernel_available=True, fits=lambda b: b <= size(("down_proj",))) in (("down_proj",), ("o_proj",))
    assert names(kernel_available=True, fits=lambda b: b < size(("down_proj",))) == ()
    every = tuple(sorted(PROJECTIONS))
    assert names(kernel_available=True, fits=lambda b: b <= size(every)) == every
    assert (
        weights_module.wgmma_weight_names(  # requested: all of them, whatever the budget
            params, True, backend="pallas", rows=16, kernel_available=True, fits=lambda b: False
        )
        == every
    )


def test_generate_takes_the_wgmma_copies_that_fit_its_budget(fusable_nvfp4_model, monkeypatch):
    """A budget with room for one fused group's copies: generate repacks that group only, decodes
    it with the kernel (its CPU twin) and the rest from the packed stacks, and samples the tokens
    of the packed path."""
    from qerl_jax.rollout import MEMORY_MARGIN, plan_rollout
    from qerl_jax.rollout import sampler as sampler_module

    config, params = fusable_nvfp4_model
    calls, plans = [], []
    fake_hopper_kernel(monkeypatch, calls)
    real_plan = sampler_module.plan_rollout
    monkeypatch.setattr(sampler_module, "plan_rollout", lambda *a, **k: plans.append((a, k)) or real_plan(*a, **k))
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(greedy=True, max_new_tokens=6, eos_ids=())
    kw = dict(group_size=2, max_batch=6)
    pallas = RolloutOptions(backend="pallas")
    no_wgmma = RolloutOptions(backend="pallas", wgmma_weights=False)
    packed = generate(config, params, ids, mask, jax.random.key(9), sampling, **kw, options=no_wgmma)
    args, plan_kw = plans[-1]
    no_copies = plan_rollout(*args, **plan_kw)  # the packed path's plan: small k/v copies only
    assert no_copies.wgmma_names == () and no_copies.dense_names == ("k_proj", "v_proj")
    size = functools.partial(weights_module.wgmma_copy_bytes, params)
    qkv, mlp = ("k_proj", "q_proj", "v_proj"), ("gate_proj", "up_proj")
    budget = int((no_copies.memory.total + size(mlp) + size(("down_proj",)) // 2) * MEMORY_MARGIN) + 1
    budgeted = dataclasses.replace(pallas, memory_budget_bytes=budget)
    partial = generate(config, params, ids, mask, jax.random.key(9), sampling, **kw, options=budgeted)
    assert plans[-1][1]["options"] == budgeted  # the plan below is the one the call ran
    chosen = real_plan(*args, **{**plan_kw, "options": budgeted})
    assert chosen.wgmma_names in (qkv, mlp)
    assert size(chosen.wgmma_names) > 0
    assert chosen.memory.total * MEMORY_MARGIN <= budget
    assert calls and {n for *_, n in calls} == {256}  # one fused call per layer and step (q/k/v or gate/up)
    np.testing.assert_array_equal(np.asarray(partial.tokens), np.asarray(packed.tokens))
    np.testing.assert_allclose(np.asarray(partial.logprobs), np.asarray(packed.logprobs), atol=0.05)


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_fused_wgmma_copies_sample_what_the_packed_path_samples(fusable_nvfp4_model, monkeypatch, with_lora):
    """Decode steps run q/k/v and gate/up as one kernel call each (the Mosaic kernel replaced by
    its CPU twin) over concatenated copies with per-row global scales; biases and LoRA deltas are
    added per projection. The same tokens as the packed path, which runs them one by one."""
    from qerl_jax.linear import Fused

    config, params = fusable_nvfp4_model
    if with_lora:
        params = {**params, "lora": random_lora(config, scale=0.1)}
    calls = []
    fake_hopper_kernel(monkeypatch, calls)
    split = weights_module.split_layers(params, wgmma_names=tuple(PROJECTIONS))
    fused = split["layers"][1]["base"]["q_proj+k_proj+v_proj"]["w"]
    assert isinstance(fused, Fused) and fused.sizes == (128, 64, 64) and fused.w.global_scale.shape == (256,)
    assert "w" not in split["layers"][1]["base"]["k_proj"]  # the prefill reads the packed stack
    if with_lora:  # each fused call's adapters stacked once: A's [3r, K], B's block-diagonal
        stacked = split["layers"][1]["lora"]["q_proj+k_proj+v_proj"]
        assert stacked["a"].shape == (12, 128) and stacked["b"].shape == (256, 12)
        np.testing.assert_array_equal(
            np.asarray(stacked["b"][128:192, 4:8]), np.asarray(split["layers"][1]["lora"]["k_proj"]["b"])
        )
        assert not np.asarray(stacked["b"][128:192, :4]).any()
        act = jnp.dtype(params["base"]["embed"].dtype).itemsize
        # per layer: q/k/v A [12, 128] + B [256, 12]; gate/up A [8, 128] + B [256, 8]
        extra = config.num_hidden_layers * (12 + 8) * (128 + 256) * act
        names = tuple(PROJECTIONS)
        plain = {k: v for k, v in params.items() if k != "lora"}
        assert weights_module.wgmma_copy_bytes(params, names) == weights_module.wgmma_copy_bytes(plain, names) + extra
    ids, mask = prompts(config.vocab_size)
    sampling = SamplingConfig(greedy=True, max_new_tokens=6, eos_ids=())
    kw = dict(group_size=2, lora_scale=0.5)
    repacked = generate(  # auto: k/v fused too
        config, params, ids, mask, jax.random.key(8), sampling, **kw, options=RolloutOptions(backend="pallas")
    )
    assert sorted({n for *_, n in calls}) == [128, 256]  # o and down alone; q/k/v and gate/up fused
    no_wgmma = RolloutOptions(backend="pallas", wgmma_weights=False)
    packed = generate(config, params, ids, mask, jax.random.key(8), sampling, **kw, options=no_wgmma)
    np.testing.assert_array_equal(np.asarray(repacked.tokens), np.asarray(packed.tokens))
    np.testing.assert_allclose(np.asarray(repacked.logprobs), np.asarray(packed.logprobs), atol=0.05)


def test_a_group_with_wgmma_and_dense_copies_reads_each_for_its_rows(fusable_nvfp4_model, monkeypatch):
    """A call with both copies (a large bucket on bf16 copies, small ones on the kernel): each
    group is a `ByRows` of two `Fused` weights, the kernel's copy up to its rows, the concatenated
    bf16 copies above them (before, those rows ran the projections one by one), with the stacked
    adapters' A below the bf16 rows."""
    from pallas_kernels import wgmma_nvfp4
    from qerl_jax.linear import ByRows, Fused, base_matmul

    config, params = fusable_nvfp4_model
    params = {**params, "lora": random_lora(config, scale=0.2)}
    fake_hopper_kernel(monkeypatch, [])
    split = weights_module.split_layers(params, "xla", None, tuple(PROJECTIONS))
    w = split["layers"][1]["base"]["gate_proj+up_proj"]["w"]
    assert isinstance(w, ByRows) and w.max_rows == wgmma_nvfp4.MAX_ROWS
    assert isinstance(w.small, Fused) and isinstance(w.small.w, wgmma_nvfp4.WgmmaWeight) and not w.small.lora_rows
    assert isinstance(w.large, Fused) and w.large.max_rows == weights_module.ANY_ROWS and w.large.lora_rows == 8
    x = jax.random.normal(jax.random.key(0), (wgmma_nvfp4.MAX_ROWS + 8, config.hidden_size), jnp.bfloat16)
    layer_1 = lambda n: jax.tree.map(lambda a: a[1], params["base"]["layers"][n]["w"])  # noqa: E731
    dense = [dequantize(layer_1(n), jnp.bfloat16) for n in ("gate_proj", "up_proj")]
    want = jnp.concatenate([x.astype(jnp.float32) @ w.astype(jnp.float32).T for w in dense], axis=1)
    got = base_matmul(x, w.large.w)[:, : want.shape[1]]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
    folded = sum(
        w.lora_rows * w.w.shape[1] * w.w.dtype.itemsize
        for layer in split["layers"] for p in layer["base"].values()
        for w in ([p["w"].large] if isinstance(p.get("w"), ByRows) else [p.get("w")]) if isinstance(w, Fused)
    )  # fmt: skip
    assert folded > 0  # the stacked adapters themselves are the wgmma copies' (wgmma_copy_bytes)
    every = tuple(PROJECTIONS)
    assert weights_module.fused_lora_bytes(params, every, every) == folded


def test_copy_bytes_count_what_one_device_holds_of_tensor_parallel_weights():
    """A (1, 2) tensor-parallel policy's per-layer and bf16 copies are made per device: each device
    holds half of a split weight, so the rollout's budget counts half (it counted the whole model:
    a 32B bf16 policy over 2 H100s was refused for 58 GiB of copies that are 29 GiB a device)."""
    from jax.sharding import AbstractMesh, NamedSharding

    from qerl_jax import sharding

    config = qwen25_config("0.5B")  # shapes only (eval_shape): nothing is allocated
    mesh = AbstractMesh((1, 2), sharding.AXES)
    for quant in (None, "nvfp4"):
        params = jax.eval_shape(functools.partial(random_params, config, quant=quant, dtype=jnp.bfloat16))
        specs = sharding.param_specs(params, mesh, "tp")
        placed = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            params, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )  # fmt: skip
        whole, per_device = weights_module.layer_copy_bytes(params), weights_module.layer_copy_bytes(placed)
        if quant is None:  # the copies are the linears (split in two) and the norms (replicated)
            assert 0.45 * whole < per_device < 0.6 * whole, (whole, per_device)
        else:  # the copies are the norms and biases (q/k/v's split); the bf16 copies of the linears halve
            assert per_device < whole
            assert weights_module.dense_copy_bytes(placed) == weights_module.dense_copy_bytes(params) // 2
