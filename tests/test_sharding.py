"""Sharding rules, mesh construction, multi-process start-up, and 4-device parity.

The parity test runs this file as a script in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flag must be set before jax is
imported), so the rest of the suite keeps one CPU device.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest

if __name__ != "__main__":  # the 4-device worker must set XLA_FLAGS before jax is imported
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from qerl_jax import sharding
    from qerl_jax.quant import quantize

HERE = os.path.dirname(os.path.abspath(__file__))


def _spec_params(n_layers=2, d=64, q=64, kv=32, inter=128, vocab=128, packed_fmt=None, rank=4):
    """Abstract params (ShapeDtypeStructs) of a small model, optionally with packed linears."""
    sds = jax.ShapeDtypeStruct
    shapes = {
        "q_proj": (q, d),
        "k_proj": (kv, d),
        "v_proj": (kv, d),
        "o_proj": (d, q),
        "gate_proj": (inter, d),
        "up_proj": (inter, d),
        "down_proj": (d, inter),
    }
    layers, lora = {}, {}
    for proj, (n, k) in shapes.items():
        if packed_fmt:
            w = jax.eval_shape(lambda n=n, k=k: quantize(jnp.zeros((n_layers, n, k), jnp.float32), packed_fmt))
        else:
            w = sds((n_layers, n, k), jnp.bfloat16)
        layers[proj] = {"w": w}
        if proj in ("q_proj", "k_proj", "v_proj"):
            layers[proj]["b"] = sds((n_layers, n), jnp.bfloat16)
        lora[proj] = {"a": sds((n_layers, rank, k), jnp.float32), "b": sds((n_layers, n, rank), jnp.float32)}
    return {
        "base": {"embed": sds((vocab, d), jnp.bfloat16), "lm_head": sds((vocab, d), jnp.bfloat16), "layers": layers},
        "norms": {
            "final_norm": sds((d,), jnp.bfloat16),
            "layers": {"input_layernorm": sds((n_layers, d), jnp.bfloat16)},
        },
        "lora": {"layers": lora},
    }


def test_tp_rules_dense():
    specs = sharding.param_specs(_spec_params(), AbstractMesh((2, 2), ("data", "model")), "tp")
    layers = specs["base"]["layers"]
    for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert layers[proj]["w"] == P(None, "model", None), proj  # column-parallel: N
    for proj in ("o_proj", "down_proj"):
        assert layers[proj]["w"] == P(None, None, "model"), proj  # row-parallel: K
    assert layers["q_proj"]["b"] == P(None, "model")
    assert specs["base"]["embed"] == P("model", None) and specs["base"]["lm_head"] == P("model", None)
    assert specs["norms"]["final_norm"] == P(None)
    lora = specs["lora"]["layers"]
    assert lora["q_proj"]["b"] == P(None, "model", None) and lora["q_proj"]["a"] == P(None, None, None)
    assert lora["down_proj"]["a"] == P(None, None, "model") and lora["down_proj"]["b"] == P(None, None, None)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_tp_rules_packed_shard_codes_and_scales_together(fmt):
    specs = sharding.param_specs(
        _spec_params(packed_fmt=fmt, d=128, q=128), AbstractMesh((1, 2), ("data", "model")), "tp"
    )
    q, o = specs["base"]["layers"]["q_proj"]["w"], specs["base"]["layers"]["o_proj"]["w"]
    assert q.fmt == fmt and q.codes == q.scales == P(None, "model", None) and q.global_scale == P(None)
    assert o.codes == o.scales == P(None, None, "model") and o.global_scale == P(None)


def test_packed_k_sharding_needs_whole_blocks(caplog):
    # o_proj K = 64 -> 4 nvfp4 blocks (divisible by 4), down_proj K = 96 -> 6 blocks (not by 4).
    params = _spec_params(packed_fmt="nvfp4", inter=96)
    with caplog.at_level(logging.INFO, logger="qerl_jax.sharding"):
        specs = sharding.param_specs(params, AbstractMesh((1, 4), ("data", "model")), "tp")
    layers = specs["base"]["layers"]
    assert layers["o_proj"]["w"].codes == P(None, None, "model")
    assert layers["down_proj"]["w"].codes == layers["down_proj"]["w"].scales == P(None, None, None)
    assert any("down_proj" in r.getMessage() and "6 blocks" in r.getMessage() for r in caplog.records)
    # A dense K = 96 splits fine into 4 x 24.
    dense = sharding.param_specs(_spec_params(inter=96), AbstractMesh((1, 4), ("data", "model")), "tp")
    assert dense["base"]["layers"]["down_proj"]["w"] == P(None, None, "model")


def test_indivisible_dims_fall_back_to_replication(caplog):
    params = _spec_params(vocab=131, kv=18)
    with caplog.at_level(logging.INFO, logger="qerl_jax.sharding"):
        specs = sharding.param_specs(params, AbstractMesh((1, 4), ("data", "model")), "tp")
    assert specs["base"]["embed"] == P(None, None)
    assert specs["base"]["layers"]["k_proj"]["w"] == P(None, None, None)
    assert specs["base"]["layers"]["q_proj"]["w"] == P(None, "model", None)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "base/embed" in messages and "131" in messages and "k_proj" in messages


def test_fsdp_rules():
    specs = sharding.param_specs(_spec_params(packed_fmt="nvfp4"), AbstractMesh((4, 1), ("data", "model")), "fsdp")
    for proj, leaves in specs["base"]["layers"].items():
        assert leaves["w"].codes == leaves["w"].scales == P(None, "data", None), proj
    assert specs["base"]["embed"] == P("data", None)
    assert all(s == P(None, None, None) for s in jax.tree.leaves(specs["lora"], is_leaf=lambda x: isinstance(x, P)))


def test_lora_specs_apply_to_optimizer_state():
    import optax

    lora = {"layers": {"o_proj": {"a": jnp.zeros((2, 4, 64)), "b": jnp.zeros((2, 64, 4))}}}
    state = jax.eval_shape(optax.adamw(1e-3).init, lora)
    specs = sharding.lora_specs(state, AbstractMesh((1, 2), ("data", "model")), "tp")
    mu = specs[0].mu["layers"]["o_proj"]
    assert mu["a"] == P(None, None, "model") and mu["b"] == P(None, None, None)
    assert specs[0].count == P()


def test_bad_strategy_and_mesh():
    with pytest.raises(ValueError, match="strategy 'zero'"):
        sharding.param_specs(_spec_params(), AbstractMesh((1, 1), ("data", "model")), "zero")
    with pytest.raises(ValueError, match="lack"):
        sharding.param_specs(_spec_params(), AbstractMesh((1,), ("batch",)), "tp")
    with pytest.raises(ValueError, match="unexpected top-level"):
        sharding.param_specs({"weights": {}}, AbstractMesh((1, 1), ("data", "model")), "tp")


def test_make_mesh_sizes():
    mesh = sharding.make_mesh(-1, 1)
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 1, "model": 1}
    assert dict(sharding.make_mesh(1, -1).shape) == {"data": 1, "model": 1}
    with pytest.raises(ValueError, match="mesh.data=2 x mesh.model=2 = 4 devices, but 1"):
        sharding.make_mesh(2, 2)
    with pytest.raises(ValueError, match="only one of"):
        sharding.make_mesh(-1, -1)
    with pytest.raises(ValueError, match="mesh.model must be"):
        sharding.make_mesh(1, 0)


def test_shard_batch_checks_divisibility():
    mesh = sharding.make_mesh(1, 1)
    placed = sharding.shard_batch({"ids": np.zeros((3, 5), np.int32), "t": np.float32(2.0)}, mesh)
    assert placed["ids"].sharding.spec == P("data", None) and placed["t"].sharding.spec == P()
    fake = type("M", (), {"shape": {"data": 2, "model": 1}})()
    with pytest.raises(ValueError, match="batch size 3 does not divide"):
        sharding.shard_batch({"ids": np.zeros((3, 5))}, fake)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "QERL_NUM_PROCESSES",
        "QERL_PROCESS_ID",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS",
        "SLURM_NTASKS",
        "SLURM_JOB_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    return monkeypatch, calls


def test_distributed_init_only_when_the_environment_says_so(clean_env):
    env, calls = clean_env
    assert sharding.maybe_initialize_distributed() is False and calls == []
    env.setenv("SLURM_NTASKS", "1")
    env.setenv("SLURM_JOB_ID", "7")
    assert sharding.maybe_initialize_distributed() is False and calls == []
    env.setenv("SLURM_NTASKS", "4")
    assert sharding.maybe_initialize_distributed() is True and calls == [{}]
    env.delenv("SLURM_NTASKS")
    env.setenv("QERL_NUM_PROCESSES", "2")
    env.setenv("QERL_PROCESS_ID", "1")
    env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert sharding.maybe_initialize_distributed() is True
    assert calls[-1] == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}
    env.setenv("QERL_NUM_PROCESSES", "1")
    n = len(calls)
    assert sharding.maybe_initialize_distributed() is False and len(calls) == n


def test_distributed_init_rejects_incomplete_environment(clean_env):
    env, calls = clean_env
    env.setenv("QERL_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="QERL_PROCESS_ID"):
        sharding.maybe_initialize_distributed()
    env.setenv("QERL_PROCESS_ID", "2")
    env.setenv("JAX_COORDINATOR_ADDRESS", "h:1")
    with pytest.raises(ValueError, match=r"QERL_PROCESS_ID=2 must be in \[0, 2\)"):
        sharding.maybe_initialize_distributed()
    env.setenv("QERL_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="QERL_NUM_PROCESSES='two'"):
        sharding.maybe_initialize_distributed()
    assert calls == []


@pytest.fixture(scope="module")
def four_device_results():
    from conftest import once_per_test_run

    return once_per_test_run("four_device_results", _four_device_results)


def _four_device_results(_directory: str) -> dict:
    from conftest import COMPILE_ONLY_XLA_FLAGS

    # The worker compiles ~100 small programs; their speed does not matter (`COMPILE_ONLY_XLA_FLAGS`).
    flags = f"--xla_force_host_platform_device_count=4 {COMPILE_ONLY_XLA_FLAGS}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "test_sharding.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"4-device worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_worker_saw_four_devices(four_device_results):
    assert four_device_results["devices"] == 4
    assert four_device_results["mesh"] == {"data": 2, "model": 2}


@pytest.mark.parametrize("case", ["tp_f32", "tp_nvfp4"])
def test_sharded_logits_equal_one_device(four_device_results, case):
    r = four_device_results["logits"][case]
    assert r["actually_sharded"], r
    assert r["max_abs_diff"] <= 1e-5 * r["scale"], r


def test_rollout_rows_are_rounded_to_the_data_shard_count(four_device_results):
    assert four_device_results["row_shards"] == {"2x2": 2, "3x1": 3}


def test_data_parallel_micro_batches_are_split_over_devices(four_device_results):
    # Batch 4, micro-batch 2, "data" axis 2: each device runs 1 row of every micro-batch (not
    # every micro-batch in full).
    assert four_device_results["train_step"]["micro_rows_per_device"] == [1]


def test_a_train_step_on_a_mesh_compiles_each_program_once(four_device_results):
    # The micro-step and the update take the accumulators and the state as they return them: two steps
    # of two micro-batches each ran one program of each (before: 4 micro-steps and 2 updates).
    assert four_device_results["train_step"]["tp_fast"]["programs_after_two_steps"] == [1, 1]


@pytest.mark.parametrize("strategy", ["tp", "fsdp", "tp_fast"])
def test_sharded_grpo_loss_and_lora_grads_equal_one_device(four_device_results, strategy):
    """tp_fast: tensor-parallel with the flash attention and the "proj" remat."""
    r = four_device_results["train_step"][strategy]
    assert r["kl_ref"] > 0, r  # the GRPO loss includes a live KL term (B != 0)
    assert abs(r["loss"] - r["loss_ref"]) <= 1e-5 * max(1.0, abs(r["loss_ref"])), r
    assert abs(r["grad_norm"] - r["grad_norm_ref"]) <= 1e-5 * r["grad_norm_ref"] and r["grad_norm_ref"] > 0, r
    assert r["grad_rel_err"] <= 1e-4, r
    if strategy.startswith("tp"):  # the adapter stays sharded like its row-parallel base weight
        assert r["lora_a_spec"] == str(P(None, None, "model")), r


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_sharded_rollout_tokens_equal_one_device(four_device_results, mode):
    r = four_device_results["rollout"][mode]
    assert r["tokens_equal"], r
    assert r["logp_max_abs_diff"] <= 1e-4, r
    assert r["distinct_tokens"] > 3, r  # the comparison is not between constant outputs


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_data_parallel_rollout_tokens_equal_one_device(four_device_results, mode):
    r = four_device_results["rollout"][mode]
    assert r["dp_tokens_equal"], r


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("mesh_shape", ["2x2", "4x1"])
def test_per_shard_rollouts_equal_one_call(four_device_results, mode, mesh_shape):
    """generate_data_parallel (a generate call per data shard, in threads) draws the tokens one call
    over the whole batch draws, with tensor-parallel shards (2 x 2) and one device per shard (4 x 1)."""
    r = four_device_results["rollout"][mode][f"shards_{mesh_shape}"]
    assert r["tokens_equal"] and r["prompt_index_equal"] and r["prompts_equal"], r
    assert r["logp_max_abs_diff"] < 1e-4, r


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("mesh_shape", ["2x2", "4x1"])
def test_per_shard_rollouts_compile_nothing_in_their_decode_loops(four_device_results, mode, mesh_shape):
    """Each shard's programs are compiled ahead with the placement its loop passes (a one-device
    shard's committed arrays; a tensor-parallel shard's cache with its kv heads over "model"):
    none compiles again inside the loop (before: each did, one after another)."""
    assert four_device_results["rollout"][mode][f"shards_{mesh_shape}"]["in_loop_compiles"] == []


def test_pallas_decode_attention_runs_on_each_model_device_s_own_heads(four_device_results):
    """With the tensor-parallel mesh set (as a rollout sets it), the kernel runs per "model" device
    on its kv heads: no all-gather of the cache (XLA, left to split the custom call itself,
    gathers the whole cache to every device, every layer and decode step)."""
    r = four_device_results["decode_attention_tp"]
    assert r["largest_gather_without_mesh"] >= r["cache_elements"] // 2, r  # the cost it avoids
    assert r["largest_gather_with_mesh"] == 0, r
    assert r["max_abs_diff"] < 1e-5, r


def test_tensor_parallel_rollout_with_the_pallas_kernels_equals_one_device(four_device_results):
    """The NVFP4 matmul (weights read in place) and the decode attention, each run per "model"
    device, sample what one device samples with the same kernels. The log-probs agree to 5e-3,
    not 1e-4: each device's kernels run other shapes (here N down to 16, K down to 32) than the
    whole weights, with other float32 sums (interpreted, the same kernels on one device differ
    by up to 7e-3 between two row layouts of the same prompts); the per-device matmul alone
    agrees to 1e-5 (`test_pallas_matmul_runs_on_each_model_device_s_own_part_of_the_weight`)."""
    r = four_device_results["rollout_tp_kernels"]
    assert r["tokens_equal"] and r["distinct_tokens"] > 3, r
    assert r["logp_max_abs_diff"] < 5e-3, r


def test_tensor_parallel_train_step_with_the_pallas_matmul_equals_one_device(four_device_results):
    """The NVFP4 kernel's forward and backward run per "model" device in the train step: the loss
    and LoRA gradients equal one device's, and no device gathers the packed weights (it did, every
    micro-batch, with no mesh set)."""
    r = four_device_results["train_step"]["tp_pallas"]
    assert abs(r["loss"] - r["loss_ref"]) <= 1e-5 * max(1.0, abs(r["loss_ref"])), r
    # The kernel's bf16 cotangents: tensor parallel sums the devices' parts in another order. Its
    # gradients stay closer to one device's than one device's kernel is to the XLA path.
    assert r["grad_rel_err"] <= r["kernel_vs_xla_rel_err"], r
    assert r["u8_gathers_without_mesh"] > 0, r
    assert r["u8_gathers_with_mesh"] == 0, r


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_pallas_matmul_runs_on_each_model_device_s_own_part_of_the_weight(four_device_results, parallel):
    """With the tensor-parallel mesh set, the NVFP4 kernel multiplies each device's own output
    (column) or input (row, then summed) features: no all-gather. Left to XLA, the compiled
    (Triton) kernel gathers the whole weight to every device first, every decode step."""
    r = four_device_results["quant_matmul_tp"]
    assert r[parallel]["largest_gather_without_mesh"] > 0, r  # interpreted, XLA splits the kernel's loops its own way
    assert r[parallel]["largest_gather_with_mesh"] == 0, r
    assert r[parallel]["max_abs_diff"] <= 1e-5 * r[parallel]["scale"], r


# ----------------------------------------------------------------------------- worker


def _shard_thread_compiles(sink: list):
    """A compile-event listener that appends the rollout programs a data shard's own thread compiles
    (its decode loop; the programs compiled ahead compile on other threads)."""
    import threading

    def record(event, duration, **kw):
        name = str(kw.get("fun_name"))
        on_shard = threading.current_thread().name.startswith("rollout-shard")
        if event == "/jax/core/compile/backend_compile_duration" and on_shard:
            if any(p in name for p in ("_admit", "_decode", "_compact")):
                sink.append(name)

    return record


def _largest_gather(jitted, *args) -> int:
    """Elements of the largest all-gather in the compiled program of `jitted` on args."""
    import numpy as np

    text = jitted.lower(*args).compile().as_text()
    shapes = re.findall(r"= [a-z0-9]+\[([\d,]*)\][^ ]* all-gather", text)
    return max((int(np.prod([int(n) for n in dims.split(",")])) for dims in shapes), default=0)


def _quant_matmul_over_model_devices() -> dict:
    """The Pallas NVFP4 matmul (interpreted) of a column- and a row-parallel weight split over a
    1 x 2 mesh's "model" axis as `sharding` splits them: the largest all-gather with and without
    the mesh set, and the output against one device's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from qerl_jax import sharding
    from qerl_jax.linear import base_matmul
    from qerl_jax.quant import quantize
    from qerl_jax.quant.packed import PackedWeight

    mesh = sharding.make_mesh(1, 2, devices=jax.devices()[:2])
    keys = jax.random.split(jax.random.key(11), 2)
    w = quantize(jax.random.normal(keys[0], (64, 128), jnp.float32), "nvfp4")
    x = jax.random.normal(keys[1], (5, 128), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(base_matmul(x, w, "pallas"))
    out = {}
    for parallel, dim in (("column", 0), ("row", 1)):
        split = P(*[("model" if i == dim else None) for i in range(2)])
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        w_split = PackedWeight(put(w.codes, split), put(w.scales, split), put(w.global_scale, P()), w.fmt)
        x_split = jax.device_put(x, NamedSharding(mesh, P(None, "model") if parallel == "row" else P()))
        matmul = jax.jit(lambda x, w, parallel=parallel: base_matmul(x, w, "pallas", parallel))
        without_mesh = _largest_gather(matmul, x_split, w_split)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            with_mesh = _largest_gather(matmul, x_split, w_split)
            got = np.asarray(matmul(x_split, w_split))
        out[parallel] = {
            "largest_gather_with_mesh": with_mesh,
            "largest_gather_without_mesh": without_mesh,
            "max_abs_diff": float(np.abs(got - ref).max()),
            "scale": float(np.abs(ref).max()),
        }
    return out


def _pallas_train_step_over_model_devices(
    config, loss_cfg, lora_scale, packed, lora, train_batch, mesh, xla_lora
) -> dict:
    """The train step with the NVFP4 Pallas matmul (interpreted) on tensor-parallel weights over the
    2 x 2 mesh against one device's with the same kernel: loss and LoRA gradients (the backward
    kernel per device, the input features' cotangent summed over "model"), beside the spread of
    one device's kernel against the XLA path (xla_lora: the XLA step's updated adapter, same
    SGD step), and the u8 (packed weight) all-gathers of its compiled micro-step with and without
    the mesh set as the step sets it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from qerl_jax import linear, sharding
    from qerl_jax.rl.step import TrainStep, init_train_state

    lr = 0.5
    # The whole batch in one micro-step (each device 2 rows): on a mesh, a second micro-batch compiles
    # the micro-step again (its accumulators then carry the first one's shardings), 8 s more here.
    step = TrainStep(
        config, loss_cfg, optax.sgd(lr), lora_scale=lora_scale, micro_batch_size=None, logprob_chunk=4, backend="pallas"
    )
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])  # noqa: E731
    ref_state, ref_metrics = step(init_train_state(jax.tree.map(jnp.copy, lora), optax.sgd(lr)), packed, train_batch)
    frozen = sharding.shard_params(packed, mesh, "tp")
    lora_tp = sharding.shard_like_lora(lora, mesh, "tp")
    batch = sharding.shard_batch(train_batch, mesh)
    state, metrics = step(init_train_state(lora_tp, optax.sgd(lr)), frozen, batch)
    g, g_ref, g_xla = (flat(lora) - flat(t) for t in (state.lora, ref_state.lora, xla_lora))
    micro_args, _ = step.lower_args(init_train_state(lora_tp, optax.sgd(lr)), frozen, batch)

    def u8_gathers() -> int:
        text = step.micro.lower(*micro_args).compile().as_text()
        return len(re.findall(r"= u8\[[\d,]*\][^ ]* all-gather", text))

    without_mesh = u8_gathers()
    with linear.kernels_per_model_device(frozen):
        with_mesh = u8_gathers()
    return {
        "loss": float(metrics["loss"]),
        "loss_ref": float(ref_metrics["loss"]),
        "grad_rel_err": float(np.abs(g - g_ref).max() / np.abs(g_ref).max()),
        "kernel_vs_xla_rel_err": float(np.abs(g_ref - g_xla).max() / np.abs(g_xla).max()),
        "u8_gathers_with_mesh": with_mesh,
        "u8_gathers_without_mesh": without_mesh,
    }


def _decode_attention_over_model_devices() -> dict:
    """The Pallas decode attention (interpreted) on a 1 x 2 mesh, heads and caches split over
    "model": its largest all-gather with and without the mesh set as the rollout sets it, and its
    output against one device's reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from qerl_jax import sharding
    from qerl_jax.models.qwen2 import attend_decode_slots, decode_attention_reference

    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (3, 4, 16), jnp.float32)  # 4 query heads over 2 kv heads
    k, v = (jax.random.normal(key, (3, 40, 2, 16), jnp.float32) for key in keys[1:])
    start, end = jnp.array([0, 5, 12], jnp.int32), jnp.array([40, 30, 13], jnp.int32)
    mesh = sharding.make_mesh(1, 2, devices=jax.devices()[:2])
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (put(q, None, "model"), put(k, None, None, "model"), put(v, None, None, "model"), put(start), put(end))
    attend = jax.jit(lambda *a: attend_decode_slots(*a, backend="pallas"))

    without_mesh = _largest_gather(attend, *args)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        with_mesh = _largest_gather(attend, *args)
        got = np.asarray(attend(*args))
    return {
        "largest_gather_with_mesh": with_mesh,
        "largest_gather_without_mesh": without_mesh,
        "cache_elements": int(k.size),
        "max_abs_diff": float(np.abs(got - np.asarray(decode_attention_reference(q, k, v, start, end))).max()),
    }


def _worker() -> dict:
    """Runs in a fresh process with 4 CPU devices; returns the comparisons as a dict."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    from qerl_jax import linear, sharding
    from qerl_jax.lora import LoraConfig, init_lora, with_lora
    from qerl_jax.models.qwen2 import ModelConfig, forward, projection_shapes
    from qerl_jax.quant import quantize_params
    from qerl_jax.rl.losses import LossConfig
    from qerl_jax.rl.packing import pack_batch
    from qerl_jax.rl.step import TrainStep, init_train_state
    from qerl_jax.rollout import RolloutOptions, SamplingConfig, generate
    from qerl_jax.rollout.data_parallel import generate_data_parallel

    start = [time.perf_counter()]

    def _tick(what):
        now = time.perf_counter()
        print(f"{what}: {now - start[0]:.1f}s", file=sys.stderr)
        start[0] = now

    out: dict = {"devices": len(jax.devices())}
    config = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=256,
        attention_bias=True,
    )
    L, d = config.num_hidden_layers, config.hidden_size
    shapes = projection_shapes(config)  # q/o 64x64, k/v 32x64, gate/up 128x64, down 64x128
    keys = iter(jax.random.split(jax.random.key(0), 64))
    normal = lambda shape, s: s * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    layers = {}
    for proj, (n, k) in shapes.items():
        layers[proj] = {"w": normal((L, n, k), k**-0.5)}
        if proj in ("q_proj", "k_proj", "v_proj"):
            layers[proj]["b"] = normal((L, n), 0.1)
    params = {
        "base": {"embed": normal((128, d), 1.0), "lm_head": normal((128, d), d**-0.5), "layers": layers},
        "norms": {
            "final_norm": 1.0 + normal((d,), 0.1),
            "layers": {
                "input_layernorm": 1.0 + normal((L, d), 0.1),
                "post_attention_layernorm": 1.0 + normal((L, d), 0.1),
            },
        },
    }
    lora_cfg = LoraConfig(rank=4, alpha=8.0)
    lora = init_lora(next(keys), config, lora_cfg)
    lora = jax.tree.map(lambda x: x if x.any() else normal(x.shape, 0.05), lora)  # B != 0: the adapter matters
    lora_scale = 2.0

    rng = np.random.default_rng(0)
    b, t = 4, 12
    ids = rng.integers(0, 128, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    for row, pad in enumerate([0, 2, 5, 1]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0

    mesh = sharding.make_mesh(2, 2)
    out["mesh"] = dict(mesh.shape)
    fwd = jax.jit(lambda p, i, m: forward(config, p, i, m, lora_scale=lora_scale))

    def logits_case(name, base_params, strategy, probe):
        full = with_lora(base_params, lora)
        ref = np.asarray(fwd(full, ids, mask))
        sp = sharding.shard_params(full, mesh, strategy)
        batch = sharding.shard_batch({"ids": ids, "mask": mask}, mesh)
        got = np.asarray(fwd(sp, batch["ids"], batch["mask"]))
        leaf = probe(sp)
        real = mask.astype(bool)
        out.setdefault("logits", {})[name] = {
            "max_abs_diff": float(np.abs(got[real] - ref[real]).max()),
            "scale": float(np.abs(ref[real]).max()),
            "actually_sharded": not leaf.sharding.is_fully_replicated and batch["ids"].sharding.spec == P("data", None),
        }

    packed = quantize_params(params, "nvfp4")
    logits_case("tp_f32", params, "tp", lambda sp: sp["base"]["layers"]["down_proj"]["w"])
    logits_case("tp_nvfp4", packed, "tp", lambda sp: sp["base"]["layers"]["o_proj"]["w"].codes)
    _tick("logits")
    tp_codes = sharding.shard_params(packed, mesh, "tp")["base"]["layers"]["o_proj"]["w"].codes
    assert tp_codes.sharding.spec == P(None, None, "model"), tp_codes.sharding

    # A GRPO batch: prompt (left-padded) then response tokens.
    response = np.zeros((b, t), np.float32)
    response[:, 7:] = 1.0
    train_batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": response,
        "old_logp": np.where(response > 0, -4.0 + 0.1 * rng.standard_normal((b, t)), 0.0).astype(np.float32),
        "advantages": np.array([1.0, -0.5, 0.25, -0.75], np.float32),
    }
    train_batch = pack_batch(train_batch, t, rows_multiple=2)  # every sequence longer than t / 2: one per row
    loss_cfg = LossConfig(kind="grpo", beta=0.04, eps_low=0.2, eps_high=0.28)
    # Plain SGD: the LoRA update is -lr * gradient, so the new adapter compares the gradients.
    lr = 0.5
    step = TrainStep(config, loss_cfg, optax.sgd(lr), lora_scale=lora_scale, micro_batch_size=2, logprob_chunk=4)
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])  # noqa: E731
    lora_before = flat(lora)
    ref_state, ref_metrics = step(init_train_state(jax.tree.map(jnp.copy, lora), optax.sgd(lr)), packed, train_batch)
    g_ref = (lora_before - flat(ref_state.lora)) / lr
    # "tp_fast": the flash attention and the "proj" remat on the mesh, against the same one-device reference.
    fast = TrainStep(
        config, loss_cfg, optax.sgd(lr), lora_scale=lora_scale, micro_batch_size=2, logprob_chunk=4,
        remat="proj", attention="flash",
    )  # fmt: skip
    for name, strategy, case_step in (("tp_fast", "tp", fast), ("tp", "tp", step), ("fsdp", "fsdp", step)):
        frozen = sharding.shard_params(packed, mesh, strategy)
        lora_s = sharding.shard_like_lora(lora, mesh, strategy)
        state, metrics = case_step(
            init_train_state(lora_s, optax.sgd(lr)), frozen, sharding.shard_batch(train_batch, mesh)
        )
        g = (lora_before - flat(state.lora)) / lr
        out.setdefault("train_step", {})[name] = {
            "loss": float(metrics["loss"]),
            "loss_ref": float(ref_metrics["loss"]),
            "kl_ref": float(metrics["kl_ref"]),
            "grad_norm": float(metrics["grad_norm"]),
            "grad_norm_ref": float(ref_metrics["grad_norm"]),
            "grad_rel_err": float(np.abs(g - g_ref).max() / np.abs(g_ref).max()),
            "lora_a_spec": str(state.lora["layers"]["down_proj"]["a"].sharding.spec),
        }
        if name == "tp_fast":  # a second step takes what the first returned: no program of its own
            case_step(state, frozen, sharding.shard_batch(train_batch, mesh))
            out["train_step"][name]["programs_after_two_steps"] = [fast.micro._cache_size(), fast.update._cache_size()]
    out["train_step"]["tp_pallas"] = _pallas_train_step_over_model_devices(
        config, loss_cfg, lora_scale, packed, lora, train_batch, mesh, xla_lora=ref_state.lora
    )
    # Rows of a micro-batch each device runs (the partitioned micro-step's packed input_ids).
    sharded_batch = sharding.shard_batch(train_batch, mesh)
    micro_args, _ = step.lower_args(init_train_state(lora_s, optax.sgd(lr)), frozen, sharded_batch)
    with linear.kernels_per_model_device(frozen):  # as the step lowers it: its traced program again, not a new one
        compiled = step.micro.lower(*micro_args).compile()
    ids_sharding = compiled.input_shardings[0][2]
    out["train_step"]["micro_rows_per_device"] = [int(ids_sharding.shard_shape(micro_args[2].shape)[0])]
    _tick("train step")

    # Rollouts: tensor-parallel weights (the rollout engine builds its batches on the host).
    prompt_ids, prompt_mask = ids[:2, :6], mask[:2, :6]
    full = with_lora(packed, lora)
    sharded_full = sharding.shard_params(full, mesh, "tp")
    for mode, sampling in (
        ("greedy", SamplingConfig(greedy=True, max_new_tokens=10, eos_ids=())),
        ("sampled", SamplingConfig(temperature=1.0, max_new_tokens=10, eos_ids=())),
    ):
        kw = dict(group_size=2, lora_scale=lora_scale)
        f32 = RolloutOptions(cache_dtype=jnp.float32)
        ref = generate(config, full, prompt_ids, prompt_mask, jax.random.key(3), sampling, **kw, options=f32)
        got = generate(config, sharded_full, prompt_ids, prompt_mask, jax.random.key(3), sampling, **kw, options=f32)
        out.setdefault("rollout", {})[mode] = {
            "tokens_equal": bool(np.array_equal(np.asarray(ref.tokens), np.asarray(got.tokens))),
            "logp_max_abs_diff": float(np.abs(np.asarray(ref.logprobs) - np.asarray(got.logprobs)).max()),
            "distinct_tokens": int(len(np.unique(np.asarray(ref.tokens)))),
        }
        dp = generate(  # data-parallel: rows over "data" as well
            config,
            sharded_full,
            prompt_ids,
            prompt_mask,
            jax.random.key(3),
            sampling,
            **kw,
            options=RolloutOptions(cache_dtype=jnp.float32, batch_sharding=sharding.data_sharding(mesh)),
        )
        out["rollout"][mode]["dp_tokens_equal"] = bool(np.array_equal(np.asarray(ref.tokens), np.asarray(dp.tokens)))
        # Each data shard its own generate call (threads), over a 2 x 2 (tensor parallel shards) and a 4 x 1 mesh.
        # The tensor-parallel shards run the Pallas decode attention (interpreted), as on a GPU.
        pallas = dict(decode_attention="pallas")
        for name, shape, kernels in (("shards_2x2", (2, 2), pallas), ("shards_4x1", (4, 1), {})):
            m = sharding.make_mesh(*shape)
            four_ids, four_mask = (
                np.concatenate([prompt_ids, ids[2:4, :6]]),
                np.concatenate([prompt_mask, mask[2:4, :6]]),
            )
            f32 = RolloutOptions(cache_dtype=jnp.float32, **kernels)
            ref4 = generate(config, full, four_ids, four_mask, jax.random.key(3), sampling, **kw, options=f32)
            in_loop = []  # programs compiled by a shard's own thread (its decode loop), not ahead
            listener = _shard_thread_compiles(in_loop)
            jax.monitoring.register_event_duration_secs_listener(listener)
            got4 = generate_data_parallel(
                config, sharding.shard_params(full, m, "tp"), four_ids, four_mask, jax.random.key(3), sampling,
                mesh=m, **kw, options=f32,
            )  # fmt: skip
            jax.monitoring.unregister_event_duration_listener(listener)
            out["rollout"][mode][name] = {
                "in_loop_compiles": in_loop,
                "tokens_equal": bool(np.array_equal(np.asarray(ref4.tokens), np.asarray(got4.tokens))),
                "logp_max_abs_diff": float(np.abs(np.asarray(ref4.logprobs) - np.asarray(got4.logprobs)).max()),
                "prompt_index_equal": bool(
                    np.array_equal(np.asarray(ref4.prompt_index), np.asarray(got4.prompt_index))
                ),
                "prompts_equal": bool(np.array_equal(np.asarray(ref4.prompt_ids), np.asarray(got4.prompt_ids))),
            }
        _tick(f"rollout {mode}")
    # Tensor parallel (1 x 2) with the GPU's Pallas kernels, interpreted: the NVFP4 matmul reading
    # the packed weights in place and the decode attention, against one device with the same kernels.
    kernels = RolloutOptions(cache_dtype=jnp.float32, backend="pallas", dense_weights=False, decode_attention="pallas")
    tp = sharding.make_mesh(1, 2, devices=jax.devices()[:2])
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=10, eos_ids=())
    kw = dict(group_size=2, lora_scale=lora_scale, options=kernels)
    ref = generate(config, full, prompt_ids, prompt_mask, jax.random.key(5), sampled, **kw)
    got = generate_data_parallel(
        config,
        sharding.shard_params(full, tp, "tp"),
        prompt_ids,
        prompt_mask,
        jax.random.key(5),
        sampled,
        mesh=tp,
        **kw,
    )
    out["rollout_tp_kernels"] = {
        "tokens_equal": bool(np.array_equal(np.asarray(ref.tokens), np.asarray(got.tokens))),
        "logp_max_abs_diff": float(np.abs(np.asarray(ref.logprobs) - np.asarray(got.logprobs)).max()),
        "distinct_tokens": int(len(np.unique(np.asarray(ref.tokens)))),
    }
    _tick("tensor-parallel rollout, Pallas kernels")
    out["decode_attention_tp"] = _decode_attention_over_model_devices()
    out["quant_matmul_tp"] = _quant_matmul_over_model_devices()
    _tick("decode attention")
    # Row shards of a data sharding, also for a data axis that is not a power of two.
    from qerl_jax.rollout.sampler import _row_shards

    out["row_shards"] = {
        "2x2": _row_shards(sharding.data_sharding(mesh)),
        "3x1": _row_shards(sharding.data_sharding(sharding.make_mesh(3, 1, devices=jax.devices()[:3]))),
    }
    return out


if __name__ == "__main__":
    print(json.dumps(_worker()))
