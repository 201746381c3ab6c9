"""The memory plan against hand computations, published parameter counts and real array sizes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from qerl_jax import memory, sharding
from qerl_jax.lora import LoraConfig, init_lora
from qerl_jax.models.qwen2 import PROJECTIONS, ModelConfig, projection_shapes
from qerl_jax.quant import quantize, quantize_params

GIB = 1024**3


def qwen(hidden, inter, layers, heads, kv, vocab=152064, tied=False, head_dim=128):
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=tied,
        attention_bias=True,
    )


# From the public Qwen2.5 config.json files.
QWEN_7B = qwen(3584, 18944, 28, 28, 4)
QWEN_14B = qwen(5120, 13824, 48, 40, 8)
QWEN_32B = qwen(5120, 27648, 64, 40, 8)
QWEN_72B = qwen(8192, 29568, 80, 64, 8)
QWEN_05B = qwen(896, 4864, 24, 14, 2, vocab=151936, tied=True, head_dim=64)

# Per-layer projection shapes (N, K) written out by hand from the configs above:
# q = heads*128, k = v = kv_heads*128 (64 for 0.5B), o = [D, heads*128], MLP [I, D] / [D, I].
HAND_SHAPES = {
    "7B": [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944)],
    "14B": [(5120, 5120), (1024, 5120), (1024, 5120), (5120, 5120), (13824, 5120), (13824, 5120), (5120, 13824)],
    "32B": [(5120, 5120), (1024, 5120), (1024, 5120), (5120, 5120), (27648, 5120), (27648, 5120), (5120, 27648)],
    "72B": [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (29568, 8192), (29568, 8192), (8192, 29568)],
    "0.5B": [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)],
}
CONFIGS = {"7B": QWEN_7B, "14B": QWEN_14B, "32B": QWEN_32B, "72B": QWEN_72B, "0.5B": QWEN_05B}
# Parameter counts of the released checkpoints (safetensors total_size / 2 bytes).
PUBLISHED_PARAMS = {
    "7B": 7_615_616_512,
    "14B": 14_770_033_664,
    "32B": 32_763_876_352,
    "72B": 72_706_203_648,
    "0.5B": 494_032_768,
}


def hand_frozen_bytes(name: str, fmt: str) -> int:
    """Frozen bytes with every linear in `fmt` (embeddings, biases, norms bf16), by hand."""
    c = CONFIGS[name]
    scale_bytes, block = {"nvfp4": (1, 16), "mxfp4": (1, 32), "nf4": (4, 64)}.get(fmt, (None, None))
    per_layer = 0
    for n, k in HAND_SHAPES[name]:
        if fmt == "bf16":
            per_layer += 2 * n * k
        else:  # K/2 code bytes + K/block scales per row, one float32 global scale
            per_layer += n * k // 2 + n * (k // block) * scale_bytes + 4
    q, kv = HAND_SHAPES[name][0][0], HAND_SHAPES[name][1][0]
    biases = c.num_hidden_layers * (q + 2 * kv) * 2
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size * 2
    embeds = (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size * 2
    return c.num_hidden_layers * per_layer + biases + norms + embeds


def _plan(config: ModelConfig, device_bytes: int | None = None, **inputs) -> memory.MemoryPlan:
    return memory.plan_memory(config, memory.PlanInputs(**inputs), device_bytes)


def frozen(plan):
    return plan.base_linear + plan.embeddings + plan.biases_norms


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_plan_matches_published_parameter_counts(name):
    plan = _plan(CONFIGS[name], quant="bf16", lora_rank=0)
    assert frozen(plan) == 2 * PUBLISHED_PARAMS[name]
    assert frozen(plan) == hand_frozen_bytes(name, "bf16")


@pytest.mark.parametrize("name", ["7B", "14B", "32B", "72B"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_packed_plan_matches_hand_computation(name, fmt):
    plan = _plan(CONFIGS[name], quant=fmt)
    assert frozen(plan) == hand_frozen_bytes(name, fmt)


def test_nvfp4_32b_numbers_written_out():
    # 32B, per layer: 5120*12288 (q,k,v,o) + 3*5120*27648 (MLP) = 487,587,840 weights.
    weights = 64 * (5120 * (5120 + 1024 + 1024 + 5120) + 3 * 5120 * 27648)
    assert weights == 31_205_621_760
    nvfp4_linear = weights * 9 // 16 + 64 * 7 * 4  # 4.5 bits per weight + 7 global scales per layer
    plan = _plan(QWEN_32B, quant="nvfp4", lora_rank=32, rollout_batch=64, prompt_len=512, max_new_tokens=1024)
    assert plan.base_linear == nvfp4_linear == 17_553_164_032
    assert plan.embeddings == 2 * 152064 * 5120 * 2
    # LoRA r=32 on all 7 projections: r * sum(N + K) per layer, float32.
    lora = 64 * 32 * (10240 + 6144 + 6144 + 10240 + 32768 + 32768 + 32768) * 4
    assert plan.lora_params == lora == 1_073_741_824
    assert plan.optimizer_state == 2 * lora
    # KV cache: 2 * L * B * S * KVH * head_dim * 2 bytes.
    assert plan.kv_cache == 2 * 64 * 64 * 1536 * 8 * 128 * 2 == 24 * GIB


def test_kv_cache_and_lora_for_7b_and_72b():
    p7 = _plan(
        QWEN_7B, rollout_batch=16, prompt_len=256, max_new_tokens=768, lora_rank=8, lora_targets=("q_proj", "v_proj")
    )
    assert p7.kv_cache == 2 * 28 * 16 * 1024 * 4 * 128 * 2
    assert p7.lora_params == 28 * 8 * ((3584 + 3584) + (512 + 3584)) * 4
    p72 = _plan(QWEN_72B, rollout_batch=64, max_batch=32, prompt_len=512, max_new_tokens=1024)
    assert p72.kv_cache == 2 * 80 * 32 * 1536 * 8 * 128 * 2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_packed_weight_nbytes_equals_plan_formula(fmt, lead):
    w = jax.random.normal(jax.random.key(0), (*lead, 48, 192), jnp.float32)
    packed = quantize(w, fmt)
    copies = int(np.prod(lead)) if lead else 1
    assert packed.nbytes == copies * memory.packed_matrix_bytes(48, 192, fmt)
    expected_bits = {"nvfp4": 4.5, "mxfp4": 4.25, "nf4": 4.5}[fmt]
    assert (packed.nbytes - 4 * copies) * 8 == expected_bits * w.size


def _tiny_dense_params(config: ModelConfig, key):
    shapes = memory.projection_shapes(config)
    keys = iter(jax.random.split(key, 32))
    L = config.num_hidden_layers
    layers = {}
    for proj, (n, k) in shapes.items():
        layers[proj] = {"w": 0.05 * jax.random.normal(next(keys), (L, n, k), jnp.bfloat16)}
        if proj in ("q_proj", "k_proj", "v_proj"):
            layers[proj]["b"] = jnp.zeros((L, n), jnp.bfloat16)
    base = {
        "embed": jax.random.normal(next(keys), (config.vocab_size, config.hidden_size), jnp.bfloat16),
        "lm_head": jax.random.normal(next(keys), (config.vocab_size, config.hidden_size), jnp.bfloat16),
        "layers": layers,
    }
    d = config.hidden_size
    norms = {
        "final_norm": jnp.ones((d,), jnp.bfloat16),
        "layers": {
            "input_layernorm": jnp.ones((L, d), jnp.bfloat16),
            "post_attention_layernorm": jnp.ones((L, d), jnp.bfloat16),
        },
    }
    return {"base": base, "norms": norms}


def _tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nf4"])
def test_plan_equals_bytes_of_real_arrays(fmt):
    config = qwen(128, 192, 3, 4, 2, vocab=200, head_dim=32)
    params = _tiny_dense_params(config, jax.random.key(1))
    skip = ("embed", "lm_head", "down_proj")
    q = quantize_params(params, fmt, skip=skip)
    plan = _plan(config, quant=fmt, quant_skip=skip, lora_rank=4, lora_targets=("q_proj", "down_proj"))
    biases = _tree_bytes({p: q["base"]["layers"][p]["b"] for p in ("q_proj", "k_proj", "v_proj")})
    assert _tree_bytes(q["base"]["layers"]) - biases == plan.base_linear
    assert biases + _tree_bytes(q["norms"]) == plan.biases_norms
    assert _tree_bytes({"e": q["base"]["embed"], "h": q["base"]["lm_head"]}) == plan.embeddings

    lora = init_lora(jax.random.key(2), config, LoraConfig(rank=4, targets=("q_proj", "down_proj")))
    assert _tree_bytes(lora) == plan.lora_params
    opt_state = optax.adamw(1e-3).init(lora)
    moments = [s for s in jax.tree.leaves(opt_state) if s.ndim > 0]
    assert sum(x.size * x.dtype.itemsize for x in moments) == plan.optimizer_state


def _bytes_per_device(tree, specs, axis_sizes) -> int:
    """Bytes of `tree` on one device when placed with PartitionSpecs `specs`."""

    def one(x, spec):
        split = np.prod([axis_sizes[a] for a in jax.tree.leaves(tuple(spec)) if a is not None], dtype=np.int64)
        return x.size * x.dtype.itemsize // int(split)

    return sum(jax.tree.leaves(jax.tree.map(one, tree, specs, is_leaf=lambda x: isinstance(x, P))))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("model_shards", [2, 4])
def test_plan_per_model_device_equals_the_tensor_parallel_placement(fmt, model_shards):
    """With mesh.model = M the plan counts what `sharding.param_specs` ("tp") leaves on each
    device: the base and LoRA split along N (q/k/v/gate/up) or K (o/down) where the dimension
    divides, the embeddings along the vocabulary."""
    config = qwen(128, 192, 3, 4, 2, vocab=200, head_dim=32)
    params = _tiny_dense_params(config, jax.random.key(1))
    q = quantize_params(params, fmt, skip=("embed", "lm_head")) if fmt != "bf16" else params
    lora = init_lora(jax.random.key(2), config, LoraConfig(rank=4, targets=PROJECTIONS))
    mesh = AbstractMesh((1, model_shards), ("data", "model"))
    sizes = dict(mesh.shape)
    specs = sharding.param_specs({"base": q["base"], "lora": lora}, mesh, "tp")
    plan = _plan(config, quant=fmt, lora_rank=4, lora_targets=PROJECTIONS, model_shards=model_shards)
    layers, layer_specs = q["base"]["layers"], specs["base"]["layers"]
    weights = {p: layers[p]["w"] for p in PROJECTIONS}
    assert _bytes_per_device(weights, {p: layer_specs[p]["w"] for p in PROJECTIONS}, sizes) == plan.base_linear
    embed = {n: q["base"][n] for n in ("embed", "lm_head")}
    assert _bytes_per_device(embed, {n: specs["base"][n] for n in embed}, sizes) == plan.embeddings
    assert _bytes_per_device(lora, specs["lora"], sizes) == plan.lora_params
    whole = _plan(config, quant=fmt, lora_rank=4, lora_targets=PROJECTIONS)
    assert plan.base_linear < whole.base_linear and plan.embeddings < whole.embeddings


def test_data_shards_split_the_rollout_rows_and_the_micro_batch():
    """mesh.data = 2: each shard rolls out half the batch (its KV cache and rows) and trains half
    of each micro-batch; the weights are whole on every device."""
    kw = dict(rollout_batch=256, group_size=8, prompt_len=256, max_new_tokens=2048, micro_batch_size=16)
    one, two = _plan(QWEN_7B, **kw), _plan(QWEN_7B, **kw, data_shards=2)
    assert two.inputs.max_batch == 128 and two.kv_cache == _plan(QWEN_7B, **{**kw, "max_batch": 128}).kv_cache
    assert two.persistent == one.persistent
    half = _plan(QWEN_7B, **{**kw, "micro_batch_size": 8, "rollout_batch": 128})
    assert (two.train_saved_activations, two.train_logits) == (half.train_saved_activations, half.train_logits)
    assert two.train_sequence_arrays == half.train_sequence_arrays
    assert _plan(QWEN_7B, **kw, data_shards=2, max_batch=64).inputs.max_batch == 64  # per shard


def test_a_32b_bf16_policy_fits_two_80gb_devices_only_when_split():
    """The paper's bf16 32B baseline: refused on one 80 GB device, planned on two (mesh.model=2)."""
    kw = dict(quant="bf16", rollout_batch=64, group_size=8, prompt_len=256, max_new_tokens=1024, lora_rank=16)
    with pytest.raises(memory.DoesNotFitError):
        memory.fit(_plan(QWEN_32B, **kw), 74 * GIB, remat_fallback=True, auto_micro_batch=True)
    r = memory.fit(_plan(QWEN_32B, **kw, model_shards=2), 74 * GIB, remat_fallback=True, auto_micro_batch=True)
    whole = _plan(QWEN_32B, **kw, max_batch=r.max_batch)
    assert (r.plan.base_linear * 2, r.plan.kv_cache * 2) == (whole.base_linear, whole.kv_cache)
    assert "mesh data=1 x model=2" in r.plan.table()


def test_kv_cache_matches_the_rollout_engine():
    from qerl_jax.rollout import cache_bytes

    for config in (QWEN_7B, QWEN_32B):
        plan = _plan(config, rollout_batch=32, max_batch=16, prompt_len=512, max_new_tokens=1024)
        assert plan.kv_cache == cache_bytes(config, 16, 1536)


def test_phases_and_total():
    plan = _plan(QWEN_14B, rollout_batch=64, group_size=8, micro_batch_size=4)
    assert plan.rollout_peak == (
        plan.persistent + plan.kv_cache + plan.rollout_activations + plan.rollout_layer_copies + plan.dequant_workspace
    )
    # Packed linears are read in place by the rollout; only norms, biases and LoRA are copied.
    c = QWEN_14B
    norms_biases = (
        2 * c.num_hidden_layers * c.hidden_size
        + c.num_hidden_layers * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    ) * 2
    assert plan.rollout_layer_copies == norms_biases + plan.lora_params
    bf16 = _plan(QWEN_14B, quant="bf16", rollout_batch=64, group_size=8, micro_batch_size=4)
    assert bf16.rollout_layer_copies == bf16.base_linear + norms_biases + bf16.lora_params
    assert plan.train_peak == plan.persistent + plan.lora_grads + plan.train_activations + plan.dequant_workspace
    assert plan.total == max(plan.rollout_peak, plan.train_peak)
    # Activations grow with the micro-batch; the frozen part does not.
    bigger = _plan(QWEN_14B, rollout_batch=64, group_size=8, micro_batch_size=8)
    assert bigger.train_activations > plan.train_activations and bigger.persistent == plan.persistent
    # Per-layer checkpointing saves memory.
    no_remat = _plan(QWEN_14B, rollout_batch=64, group_size=8, micro_batch_size=4, remat=False)
    assert no_remat.train_activations > 3 * plan.train_activations
    # The pallas backend needs no dequantized-layer workspace.
    assert _plan(QWEN_14B, backend="pallas").dequant_workspace == 0
    assert _plan(QWEN_14B, quant="bf16").dequant_workspace == 0


def test_table_lists_terms_in_gib():
    plan = _plan(QWEN_32B, device_bytes=80 * GIB)
    table = plan.table()
    assert "base linear weights (nvfp4)" in table and "KV cache" in table and "TOTAL" in table
    assert f"{plan.base_linear / GIB:9.2f} GiB" in table
    assert ("fits" in table) == bool(plan.fits)
    assert plan.as_dict()["total"] == plan.total


def test_fit_keeps_sizes_that_fit():
    plan = _plan(QWEN_14B, rollout_batch=64, group_size=8, micro_batch_size=2)
    result = memory.fit(plan, 140 * GIB)
    assert (result.micro_batch_size, result.max_batch, result.changed) == (2, 64, ())
    assert result.plan.total <= 0.95 * 140 * GIB


def test_fit_lowers_micro_batch_and_chunk_to_the_largest_that_fit():
    device = int(60 * GIB)
    plan = _plan(QWEN_14B, quant="bf16", rollout_batch=64, group_size=8, micro_batch_size=16)
    result = memory.fit(plan, device)
    budget = 0.95 * device
    assert set(result.changed) == {"rl.micro_batch_size", "rollout.max_batch"}
    assert "rl.micro_batch_size 16 -> " in result.message
    assert result.plan.total <= budget
    # Maximal: the next larger divisor of 64 does not fit its phase.
    up_chunk = _plan(QWEN_14B, quant="bf16", rollout_batch=64, group_size=8, max_batch=2 * result.max_batch)
    assert up_chunk.rollout_peak > budget
    up_mb = _plan(
        QWEN_14B,
        quant="bf16",
        rollout_batch=64,
        group_size=8,
        micro_batch_size=2 * result.micro_batch_size,
        max_batch=result.max_batch,
    )
    assert up_mb.train_peak > budget


def test_fit_validate_names_the_value_to_lower():
    plan = _plan(QWEN_14B, rollout_batch=64, group_size=8, micro_batch_size=64)
    with pytest.raises(memory.DoesNotFitError, match=r"lower rl\.micro_batch_size from 64 to \d+"):
        memory.fit(plan, 40 * GIB, adjust=False)
    plan = _plan(QWEN_32B, rollout_batch=64, group_size=8, micro_batch_size=1)
    with pytest.raises(memory.DoesNotFitError, match=r"lower rollout\.max_batch from 64 to \d+"):
        memory.fit(plan, 40 * GIB, adjust=False)


def test_fit_names_quant_when_bf16_rollout_copies_do_not_fit():
    # bf16 32B: 61 GiB of linears fit an 80 GB H100, but not twice (the decode's per-layer copies).
    plan = _plan(QWEN_32B, quant="bf16", micro_batch_size=1)
    assert plan.persistent < 0.95 * 80 * GIB < plan.persistent + plan.rollout_layer_copies
    with pytest.raises(memory.DoesNotFitError, match=r"per-layer copies.*model\.quant='nvfp4'"):
        memory.fit(plan, 80 * GIB)


def test_fit_names_quant_when_bf16_weights_do_not_fit():
    plan = _plan(QWEN_32B, quant="bf16")
    with pytest.raises(memory.DoesNotFitError, match=r"model\.quant='nvfp4'"):
        memory.fit(plan, 60 * GIB)
    # The same model in NVFP4 does fit the same device.
    assert memory.fit(_plan(QWEN_32B, quant="nvfp4", group_size=8), 60 * GIB).plan.total <= 0.95 * 60 * GIB


def test_fit_names_max_new_tokens_when_one_sequence_does_not_fit():
    # one sequence's KV cache (~53 GiB) alone is over the device: the rollout phase names the field
    plan = _plan(QWEN_7B, prompt_len=512, max_new_tokens=1_000_000, rollout_batch=8)
    with pytest.raises(memory.DoesNotFitError, match=r"rollout\.max_new_tokens \(now 1000000\)"):
        memory.fit(plan, 40 * GIB)


def test_fit_names_multi_gpu_when_packed_72b_exceeds_the_device():
    with pytest.raises(memory.DoesNotFitError, match="more GPUs"):
        memory.fit(_plan(QWEN_72B), 40 * GIB)


def test_fit_needs_a_device_size(monkeypatch):
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: None)
    with pytest.raises(ValueError, match="device memory size is unknown"):
        memory.fit(_plan(QWEN_7B))


def test_device_memory_bytes_reads_bytes_limit():
    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    assert memory.device_memory_bytes(Dev({"bytes_limit": 123, "bytes_in_use": 4})) == 123
    assert memory.device_memory_bytes(Dev(None)) is None
    assert memory.device_memory_bytes(Dev({})) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quant="fp8"), "model.quant 'fp8'"),
        (dict(lora_targets=("qkv",)), "lora_targets"),
        (dict(quant_skip=("norm",)), "quant_skip"),
        (dict(micro_batch_size=0), "rl.micro_batch_size"),
        (dict(max_batch=-1), "rollout.max_batch"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_inputs_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.").replace("(", r"\(")):
        memory.PlanInputs(**kwargs)


def test_embeddings_stay_bf16_whatever_quant_skip_says():
    a = _plan(QWEN_7B, quant="nvfp4", quant_skip=())
    b = _plan(QWEN_7B, quant="nvfp4", quant_skip=("embed", "lm_head"))
    assert a.embeddings == b.embeddings == 2 * 152064 * 3584 * 2
    c = _plan(QWEN_7B, quant="nvfp4", quant_skip=("down_proj",))
    assert c.base_linear - a.base_linear == 28 * (3584 * 18944 * 2 - memory.packed_matrix_bytes(3584, 18944, "nvfp4"))


def test_block_divisibility_is_checked():
    with pytest.raises(ValueError, match="K=40"):
        memory.packed_matrix_bytes(8, 40, "nvfp4")
    assert set(PROJECTIONS) == set(memory.projection_shapes(QWEN_7B))


def test_packed_step_per_sequence_grids_count_batch_times_row_length():
    kw = dict(group_size=8, max_new_tokens=512, prompt_len=256)
    plan = _plan(QWEN_7B, rollout_batch=64, micro_batch_size=4, **kw)
    assert plan.train_sequence_arrays == 12 * 64 * 768 * 4  # 12 [B, T] f32/int32 arrays, T = 256 + 512 slots
    assert plan.train_activations == (
        plan.train_saved_activations + plan.train_layer_activations + plan.train_logits + plan.train_sequence_arrays
    )
    # Whatever the micro-batch; with the batch and with the packed row length actually used.
    assert _plan(QWEN_7B, rollout_batch=64, micro_batch_size=8, **kw).train_sequence_arrays == (
        plan.train_sequence_arrays
    )
    assert _plan(QWEN_7B, rollout_batch=128, micro_batch_size=4, **kw).train_sequence_arrays == (
        2 * plan.train_sequence_arrays
    )
    short = _plan(QWEN_7B, rollout_batch=64, micro_batch_size=4, train_seq_len=384, **kw)
    assert short.train_sequence_arrays == plan.train_sequence_arrays // 2
    assert "per-sequence grids (64 seqs x 768, f32)" in plan.table()


def test_proj_remat_saves_every_projection_output_and_flash_drops_the_scores():
    kw = dict(rollout_batch=64, group_size=8, micro_batch_size=4, max_new_tokens=512, prompt_len=256)
    full = _plan(QWEN_7B, remat="full", **kw)
    proj = _plan(QWEN_7B, remat="proj", **kw)
    c, tokens = QWEN_7B, 4 * 768
    out_features = sum(n for n, _ in projection_shapes(c).values())
    assert (
        proj.train_saved_activations - full.train_saved_activations == c.num_hidden_layers * tokens * out_features * 2
    )
    assert _plan(QWEN_7B, remat=True, **kw) == full  # a bool is still accepted
    flash = _plan(QWEN_7B, remat="full", attention="flash", **kw)
    scores = 4 * c.num_attention_heads * 768 * 768 * memory.ATTN_SCORE_BYTES
    assert full.train_layer_activations - flash.train_layer_activations == scores - 4 * c.num_attention_heads * 768 * 4
    with pytest.raises(ValueError, match="attention 'sdpa'"):
        _plan(QWEN_7B, attention="sdpa")


def test_fit_keeps_proj_remat_where_it_fits_and_falls_back_to_full():
    kw = dict(rollout_batch=64, group_size=8, micro_batch_size=8, max_new_tokens=512, prompt_len=256)
    roomy = memory.fit(_plan(QWEN_7B, remat="proj", **kw), 80 * GIB, remat_fallback=True)
    assert (roomy.remat, roomy.micro_batch_size, roomy.changed) == ("proj", 8, ())
    # 72B: the projection outputs of even an efficient micro-batch (>= PROJ_REMAT_MIN_TOKENS tokens) do
    # not fit next to the packed base on 80 GB: "full" at the largest micro-batch that fits.
    tight = memory.fit(_plan(QWEN_72B, remat="proj", **kw), 80 * GIB, remat_fallback=True)
    assert tight.remat == "full" and "rl.remat" in tight.changed and "rl.remat proj -> full" in tight.message
    assert tight.plan.inputs.remat == "full" and tight.plan.train_peak <= 0.95 * 80 * GIB
    proj_min = -(-memory.PROJ_REMAT_MIN_TOKENS // 768)
    assert _plan(QWEN_72B, remat="proj", **{**kw, "micro_batch_size": proj_min}).train_peak > 0.95 * 80 * GIB
    # Without the fallback the plan's mode is kept (the micro-batch is lowered instead).
    assert memory.fit(_plan(QWEN_72B, remat="proj", **kw), 80 * GIB).remat == "proj"


def test_trained_norms_add_their_masters_moments_and_grads():
    from qerl_jax.lora import init_trained_norms
    from qerl_jax.optim import make_optimizer
    from qerl_jax.rl.step import optimizer_params

    config = qwen(128, 192, 3, 4, 2, vocab=200, head_dim=32)
    params = _tiny_dense_params(config, jax.random.key(1))
    kw = dict(quant="bf16", lora_rank=4, lora_targets=("q_proj", "down_proj"))
    off, on = _plan(config, **kw), _plan(config, **kw, train_norms=True)
    lora = init_lora(jax.random.key(2), config, LoraConfig(rank=4, targets=("q_proj", "down_proj")))
    norms = init_trained_norms(params["norms"])
    assert _tree_bytes((lora, norms)) == on.lora_params > off.lora_params
    opt_state = make_optimizer(1e-3, warmup_steps=0, total_steps=2).init(optimizer_params(lora, norms))
    moments = [s for s in jax.tree.leaves(opt_state) if s.ndim > 0]
    assert sum(x.size * x.dtype.itemsize for x in moments) == on.optimizer_state
    assert on.lora_grads - off.lora_grads == 2 * _tree_bytes(norms)
    assert "trained norms" in on.table() and "trained norms" not in off.table()


# Qwen2.5-1.5B (public config.json) and a GRPO step of 16 prompts x 8 samples in rows of 256 + 768 slots.
QWEN_15B = qwen(1536, 8960, 28, 12, 2, vocab=151936, tied=True)
STEP_15B = dict(
    quant="nvfp4", lora_rank=16, rollout_batch=128, group_size=8, prompt_len=256, max_new_tokens=768, attention="flash"
)


def _train_peak(mb: int, chunk: int, remat: str = "proj") -> int:
    plan = _plan(QWEN_15B, **STEP_15B, micro_batch_size=mb, logprob_chunk=chunk, remat=remat)
    return plan.train_peak


@pytest.mark.parametrize("device_gib", [60, 105.75, 141])
def test_auto_micro_batch_and_chunk_are_the_largest_that_fit_a_large_device(device_gib):
    device = int(device_gib * GIB)
    budget = 0.95 * device
    plan = _plan(QWEN_15B, **STEP_15B, remat="proj")  # micro-batch 8, chunk 256 planned
    result = memory.fit(plan, device, remat_fallback=True, auto_micro_batch=True, auto_logprob_chunk=True)
    mb, chunk = result.micro_batch_size, result.logprob_chunk
    assert mb > 8 and result.remat == "proj" and 128 % mb == 0 and mb * 1024 <= memory.AUTO_MICRO_BATCH_TOKENS
    assert result.plan.inputs.micro_batch_size == mb and result.plan.inputs.logprob_chunk == chunk
    assert result.plan.train_peak <= budget and result.changed == ()
    assert f"auto rl.micro_batch_size = {mb}, rl.logprob_chunk = {chunk}" in result.message
    # Maximal: the next divisor of 128 up is past the token cap or does not fit (at the planned chunk).
    assert 2 * mb * 1024 > memory.AUTO_MICRO_BATCH_TOKENS or _train_peak(2 * mb, 256) > budget
    # The chunk then grows beside that micro-batch: a power of two below the 1023 predicted
    # positions (1024 would take the unchunked path), the next one up not fitting or unchunked.
    assert chunk >= 256 and chunk & (chunk - 1) == 0 and chunk < 1023
    assert 2 * chunk >= 1023 or _train_peak(mb, 2 * chunk) > budget


def test_auto_micro_batch_shrinks_on_a_small_device_with_smaller_chunks_if_needed():
    device = 16 * GIB
    plan = _plan(QWEN_15B, **STEP_15B, remat="proj")
    result = memory.fit(plan, device, remat_fallback=True, auto_micro_batch=True, auto_logprob_chunk=True)
    assert result.micro_batch_size < 8 and result.plan.train_peak <= 0.95 * device
    assert _train_peak(8, 256, result.remat) > 0.95 * device
    # So small that the planned chunk of 256 leaves no micro-batch room: auto lowers the chunk.
    tight = _plan(QWEN_15B, **{**STEP_15B, "max_new_tokens": 8192 - 256}, remat="full")
    one_row = _plan(QWEN_15B, **{**STEP_15B, "max_new_tokens": 8192 - 256}, remat="full", micro_batch_size=1)
    device = int((one_row.train_peak - one_row.train_logits // 4) / 0.95)  # a chunk of 64 fits, 256 does not
    with pytest.raises(memory.DoesNotFitError, match="training on even 1 sequence"):
        memory.fit(tight, device, auto_micro_batch=True)
    low = memory.fit(tight, device, auto_micro_batch=True, auto_logprob_chunk=True)
    assert low.micro_batch_size == 1 and low.logprob_chunk < 256 and low.plan.train_peak <= 0.95 * device


def test_auto_micro_batch_is_a_multiple_of_the_data_axis():
    kw = {**STEP_15B, "rollout_batch": 96}
    plan = _plan(QWEN_15B, **kw, remat="full")
    for multiple in (1, 3, 4):
        result = memory.fit(plan, 141 * GIB, auto_micro_batch=True, micro_batch_multiple=multiple)
        assert result.micro_batch_size % multiple == 0 and 96 % result.micro_batch_size == 0
        assert result.micro_batch_size == memory.micro_batch_candidates(96, 1024, multiple)[0]
    assert memory.micro_batch_candidates(96, 1024, 3) == [24, 12, 6, 3]
    assert memory.micro_batch_candidates(128, 1024) == [32, 16, 8, 4, 2, 1]


def test_explicit_sizes_are_kept_where_they_fit():
    plan = _plan(QWEN_15B, **STEP_15B, remat="proj", micro_batch_size=4, logprob_chunk=128)
    result = memory.fit(plan, 141 * GIB, remat_fallback=True)
    assert (result.micro_batch_size, result.logprob_chunk, result.changed) == (4, 128, ())
    assert "auto" not in result.message and "lowered" not in result.message
    # Auto chunk beside an explicit micro-batch: the micro-batch stays, the chunk grows.
    chunk_only = memory.fit(plan, 141 * GIB, remat_fallback=True, auto_logprob_chunk=True)
    assert chunk_only.micro_batch_size == 4 and chunk_only.logprob_chunk == 512


def test_auto_on_a_device_of_unknown_size_is_the_default():
    assert (memory.DEFAULT_MICRO_BATCH, memory.DEFAULT_LOGPROB_CHUNK) == (8, 256)
    assert memory.default_micro_batch(128) == memory.default_micro_batch(16, 2) == 8
    assert memory.default_micro_batch(12) == 6 and memory.default_micro_batch(96, 3) == 6
    assert memory.logprob_chunk_candidates(1024) == [512, 256, 128, 64, 32, 16, 8, 4, 2, 1]


def _check_memory(monkeypatch, device_bytes, max_batch=0, **rl):
    """(what the run resolves, its config) for a 1.5B policy of 16 x 8 sequences on a device of device_bytes."""
    import types

    from qerl_jax import config as config_lib
    from qerl_jax import run_config, train

    cfg = config_lib.default_config()
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 16, 8
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = 256, 768
    cfg.rollout.max_batch = max_batch
    for k, v in rl.items():
        cfg.rl[k] = v
    run = run_config.from_config_dict(cfg)
    policy = types.SimpleNamespace(config=QWEN_15B, quant="nvfp4", backend="xla")
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: device_bytes)
    return train._check_memory(run, policy), run


def test_the_run_resolves_auto_to_the_plan_and_prints_it(monkeypatch, capsys):
    cpu, run = _check_memory(monkeypatch, None)
    assert cpu == memory.Resolved(micro_batch_size=8, logprob_chunk=256, remat="full", max_batch=0)
    assert "micro-batch=8" in capsys.readouterr().out
    # The config keeps what was written (0 and "auto"); the resolved sizes are a separate object.
    assert (run.rl.micro_batch_size, run.rl.logprob_chunk, run.rl.remat) == (0, 0, "auto")
    big, _ = _check_memory(monkeypatch, 141 * GIB)
    out = capsys.readouterr().out
    assert big.micro_batch_size > 8 and big.logprob_chunk > 256 and big.remat == "proj" and big.max_batch == 0
    assert f"auto rl.micro_batch_size = {big.micro_batch_size}, rl.logprob_chunk = {big.logprob_chunk}" in out
    assert f"micro-batch={big.micro_batch_size}" in out  # the table is the fitted plan's
    explicit, _ = _check_memory(monkeypatch, 141 * GIB, micro_batch_size=4, logprob_chunk=64, remat="full")
    assert (explicit.micro_batch_size, explicit.logprob_chunk, explicit.remat) == (4, 64, "full")


def test_the_run_lowers_rollout_rows_that_do_not_fit_and_keeps_the_config(monkeypatch, capsys):
    small, run = _check_memory(monkeypatch, 5 * GIB, max_batch=128)
    assert 0 < small.max_batch < 128 and 128 % small.max_batch == 0 and run.rollout.max_batch == 128
    assert f"rollout.max_batch 128 -> {small.max_batch}" in capsys.readouterr().out
    assert _check_memory(monkeypatch, 141 * GIB, max_batch=128)[0].max_batch == 128
    assert _check_memory(monkeypatch, None, max_batch=128)[0].max_batch == 128  # nothing to fit to


def test_plan_inputs_derive_and_cap_their_sizes():
    i = memory.PlanInputs(rollout_batch=16, max_batch=64, prompt_len=100, max_new_tokens=28, logprob_chunk=None)
    assert (i.max_batch, i.train_seq_len, i.logprob_chunk, i.remat) == (16, 128, 128, "full")
    assert memory.PlanInputs(remat=False).remat == "none" and memory.PlanInputs(lora_rank=0).lora_targets == ()
    assert memory.PlanInputs(logprob_chunk=4096, train_seq_len=512).logprob_chunk == 512
    assert memory.PlanInputs(quant_skip=["down_proj"]).quant_skip == ("down_proj",)
    # Re-planned sizes are checked again, as `fit` makes them.
    with pytest.raises(ValueError, match=r"rl\.micro_batch_size must be a positive int; got 0"):
        dataclasses.replace(i, micro_batch_size=0)
    assert dataclasses.replace(i, max_batch=8).max_batch == 8


# ----------------------------------------------------------------------------- frozen numbers
# Plans and fits of Qwen2.5 0.5B / 1.5B / 7B (and 72B) shapes as `memory` computed them on the
# day its functions were split up (issue 46): a refactor must give the same bytes, choices and
# messages. Plans: (total, train_peak, rollout_peak, digest of as_dict() and table()).
GOLDEN_MODELS = {"0.5B": QWEN_05B, "1.5B": qwen(1536, 8960, 28, 12, 2, vocab=151936, tied=True), "7B": QWEN_7B}
GOLDEN_MODELS["72B"] = QWEN_72B
GOLDEN_PLAN_INPUTS = {
    "0.5B bf16": ("0.5B", None, dict(quant="bf16", rollout_batch=64, group_size=8, prompt_len=256, max_new_tokens=768, micro_batch_size=8, logprob_chunk=128)),
    "1.5B nvfp4 proj flash": ("1.5B", None, dict(quant="nvfp4", lora_rank=16, rollout_batch=128, group_size=8, prompt_len=256, max_new_tokens=768, attention="flash", remat="proj", train_norms=True)),
    "7B nf4 no remat": ("7B", None, dict(quant="nf4", quant_skip=("embed", "lm_head", "down_proj"), lora_rank=8, lora_targets=("q_proj", "v_proj"), rollout_batch=32, max_batch=16, remat=False, logprob_chunk=None, backend="pallas")),
    "7B mxfp4 defaults": ("7B", 80 * GIB, dict(quant="mxfp4", train_seq_len=1000)),
    "7B bf16 mb16": ("7B", None, dict(quant="bf16", rollout_batch=64, group_size=8, micro_batch_size=16)),
    "72B proj": ("72B", None, dict(rollout_batch=64, group_size=8, micro_batch_size=8, max_new_tokens=512, prompt_len=256, remat="proj")),
    "1.5B long": ("1.5B", None, dict(quant="nvfp4", lora_rank=16, rollout_batch=128, group_size=8, prompt_len=256, max_new_tokens=8192 - 256, attention="flash", remat="full")),
}  # fmt: skip
GOLDEN_PLANS = {
    "0.5B bf16": (4633571072, 4633571072, 3006621440, "3df23fcc535c38a0"),
    "1.5B nvfp4 proj flash": (17339723536, 17339723536, 7233044240, "106a321176ff84e1"),
    "7B nf4 no remat": (182506237600, 182506237600, 15035908768, "7b93bd21d3dff3b2"),
    "7B mxfp4 defaults": (15814168336, 15814168336, 15442300688, "802335480be49229"),
    "7B bf16 mb16": (39888497664, 39888497664, 36621406208, "f0355b6ba1adb253"),
    "72B proj": (154504218816, 154504218816, 73111395520, "01e78c83a9e1fad5"),
    "1.5B long": (46702690064, 16340676368, 46702690064, "17946ca0c504786d"),
}
# Fits: (plan, device bytes, fit's options) -> (micro_batch_size, max_batch, remat, logprob_chunk,
# changed, plan.total, digest of the plan's as_dict() and table() and the message), or the error.
AUTO = dict(remat_fallback=True, auto_micro_batch=True, auto_logprob_chunk=True)
GOLDEN_FITS = {
    "1.5B auto 16GiB": (("1.5B nvfp4 proj flash", 16 * GIB, AUTO), (4, 128, "proj", 512, (), 11374309136, "f539af2865a495b1")),
    "1.5B auto 141GiB x2": (("1.5B nvfp4 proj flash", 141 * GIB, dict(AUTO, micro_batch_multiple=2)), (32, 128, "proj", 512, (), 79270063888, "a453f6a61ad3fc23")),
    "0.5B lowered 3GiB": (("0.5B bf16", 3 * GIB, {}), (4, 64, "full", 128, ("rl.micro_batch_size",), 3006621440, "00fb2bebabc3b8fc")),
    "7B nf4 20GiB": (("7B nf4 no remat", 20 * GIB, dict(auto_logprob_chunk=True)), "does not fit on a 20.0 GiB device (19.0 GiB usable with a 5% margin): training on even 1 sequence needs 28.3 GiB: set rl.remat=True"),
    "7B mxfp4 kept": (("7B mxfp4 defaults", None, dict(adjust=False)), (8, 64, "full", 256, (), 15814168336, "40f8dfefb0572250")),
    "7B bf16 lowered 30GiB": (("7B bf16 mb16", 30 * GIB, {}), (8, 8, "full", 256, ("rl.micro_batch_size", "rollout.max_batch"), 30597123584, "e21a8f6f05f21365")),
    "7B bf16 copies 26GiB": (("7B bf16 mb16", 26 * GIB, {}), "does not fit on a 26.0 GiB device (24.7 GiB usable with a 5% margin): the rollout needs 27.5 GiB before any KV cache (the weights plus their per-layer copies for the decode): set model.quant='nvfp4' (packed weights are read in place), or shard the model over more GPUs"),
    "7B bf16 validate 30GiB": (("7B bf16 mb16", 30 * GIB, dict(adjust=False)), "does not fit on a 30.0 GiB device (28.5 GiB usable with a 5% margin): the rollout phase needs 34.1 GiB: lower rollout.max_batch from 64 to 8; the training phase needs 37.1 GiB: lower rl.micro_batch_size from 16 to 8"),
    "72B proj fallback 80GiB": (("72B proj", 80 * GIB, dict(remat_fallback=True)), (8, 64, "full", 256, ("rl.remat",), 73111395520, "62c56a80485ff876")),
    "1.5B long smaller chunk": (("1.5B long", 3_608_880_000, dict(auto_micro_batch=True, auto_logprob_chunk=True)), (1, 4, "full", 128, ("rollout.max_batch",), 3311791888, "c270956099622118")),
    "1.5B long no chunk": (("1.5B long", 3_608_880_000, dict(auto_micro_batch=True)), "does not fit on a 3.4 GiB device (3.2 GiB usable with a 5% margin): training on even 1 sequence needs 3.3 GiB: lower rollout.max_new_tokens (now 7936; training sequences are 8192 tokens)"),
}  # fmt: skip


def _digest(*parts) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _golden_plan(name: str):
    model, device_bytes, kwargs = GOLDEN_PLAN_INPUTS[name]
    return _plan(GOLDEN_MODELS[model], **kwargs, device_bytes=device_bytes)


@pytest.mark.parametrize("name", sorted(GOLDEN_PLANS))
def test_plans_give_the_frozen_numbers(name):
    plan = _golden_plan(name)
    assert (plan.total, plan.train_peak, plan.rollout_peak, _digest(plan.as_dict(), plan.table())) == GOLDEN_PLANS[name]


@pytest.mark.parametrize("name", sorted(GOLDEN_FITS))
def test_fits_give_the_frozen_choices_and_messages(name):
    (plan_name, device_bytes, options), expected = GOLDEN_FITS[name]
    if isinstance(expected, str):
        with pytest.raises(memory.DoesNotFitError) as e:
            memory.fit(_golden_plan(plan_name), device_bytes, **options)
        assert str(e.value) == expected
        return
    r = memory.fit(_golden_plan(plan_name), device_bytes, **options)
    got = (r.micro_batch_size, r.max_batch, r.remat, r.logprob_chunk, r.changed, r.plan.total)
    assert (*got, _digest(r.plan.as_dict(), r.plan.table(), r.message)) == expected
