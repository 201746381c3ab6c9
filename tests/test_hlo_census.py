"""benchmarks/devtools/hlo_census.py: the walk over an optimized HLO module that counts a loop step's launches.

Compiling for an H100 needs jax's CUDA plugin (not installed in CI); the parser is tested on a
small module in the optimized-HLO text format (a while loop whose body has a GEMM fusion, a
Mosaic GPU custom call, a copy, buffer plumbing and a `call` into a computation with two more
fusions). With the plugin, the rollout's decode program compiled for an H100 keeps one KV cache.
"""

from __future__ import annotations

import pytest

from benchmarks.devtools import hlo_census
from qerl_jax.models.qwen2 import ModelConfig
from qerl_jax.rollout import cache_bytes, programs

MODULE = """HloModule jit_f, is_scheduled=true

%gemm_fusion_dot.1_computation (parameter_0: f32[64,64], parameter_1: f32[64,64]) -> f32[64,64] {
  %parameter_0 = f32[64,64]{1,0} parameter(0)
  %parameter_1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot.0 = f32[64,64]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (param_0: s32[]) -> s32[] {
  %param_0 = s32[] parameter(0)
  %constant_4_1 = s32[] constant(1)
  ROOT %add.2.1 = s32[] add(%param_0, %constant_4_1)
}

%fused_tanh (param_0.2: f32[64,64]) -> f32[64,64] {
  %param_0.2 = f32[64,64]{1,0} parameter(0)
  ROOT %tanh.1 = f32[64,64]{1,0} tanh(%param_0.2)
}

%inner (p.0: f32[64,64]) -> f32[64,64] {
  %p.0 = f32[64,64]{1,0} parameter(0)
  %loop_tanh_fusion = f32[64,64]{1,0} fusion(%p.0), kind=kLoop, calls=%fused_tanh
  ROOT %loop_tanh_fusion.1 = f32[64,64]{1,0} fusion(%loop_tanh_fusion), kind=kLoop, calls=%fused_tanh
}

%body (arg_tuple.1: (s32[], f32[64,64], s32[])) -> (s32[], f32[64,64], s32[]) {
  %arg_tuple.1 = (s32[], f32[64,64]{1,0}, s32[]) parameter(0)
  %get-tuple-element.6 = s32[] get-tuple-element(%arg_tuple.1), index=0
  %loop_add_fusion = s32[] fusion(%get-tuple-element.6), kind=kLoop, calls=%fused_add
  %get-tuple-element.14 = s32[] get-tuple-element(%arg_tuple.1), index=2
  %get-tuple-element.7 = f32[64,64]{1,0} get-tuple-element(%arg_tuple.1), index=1
  %gemm_fusion_dot.1 = f32[64,64]{1,0} fusion(%get-tuple-element.7, %get-tuple-element.7), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %mpmd_map.3 = f32[132,2,8,128]{3,2,1,0} custom-call(%gemm_fusion_dot.1), custom_call_target="mosaic_gpu_v2"
  %call.1 = f32[64,64]{1,0} call(%gemm_fusion_dot.1), to_apply=%inner
  %bitcast.1 = f32[64,64]{1,0} bitcast(%call.1)
  %copy.5 = f32[64,64]{1,0} copy(%bitcast.1)
  ROOT %tuple.3 = (s32[], f32[64,64]{1,0}, s32[]) tuple(%loop_add_fusion, %copy.5, %get-tuple-element.14)
}

%cond (arg_tuple.3: (s32[], f32[64,64], s32[])) -> pred[] {
  %arg_tuple.3 = (s32[], f32[64,64]{1,0}, s32[]) parameter(0)
  %get-tuple-element.9.0 = s32[] get-tuple-element(%arg_tuple.3), index=0
  %get-tuple-element.11.0 = s32[] get-tuple-element(%arg_tuple.3), index=2
  ROOT %lt = pred[] compare(%get-tuple-element.9.0, %get-tuple-element.11.0), direction=LT
}

ENTRY %main.3 (x.1: f32[64,64], n.1: s32[]) -> f32[64,64] {
  %constant_5_0 = s32[] constant(0)
  %copy.9 = s32[] copy(%constant_5_0)
  %n.1 = s32[] parameter(1), sharding={replicated}
  %x.1 = f32[64,64]{1,0} parameter(0), sharding={replicated}
  %copy.8 = f32[64,64]{1,0} copy(%x.1)
  %tuple = (s32[], f32[64,64]{1,0}, s32[]) tuple(%copy.9, %copy.8, %n.1)
  %while.5 = (s32[], f32[64,64]{1,0}, s32[]) while(%tuple), condition=%cond, body=%body
  ROOT %while.7.0 = f32[64,64]{1,0} get-tuple-element(%while.5), index=1
}
"""


def test_parse_finds_every_computation_and_the_entry():
    computations, entry = hlo_census.parse_hlo(MODULE)
    assert entry == "main.3"
    assert set(computations) == {
        "gemm_fusion_dot.1_computation",
        "fused_add",
        "fused_tanh",
        "inner",
        "body",
        "cond",
        "main.3",
    }
    assert [i["op"] for i in computations["inner"]] == ["parameter", "fusion", "fusion"]
    assert computations["body"][6]["shape"] == "f32[132,2,8,128]{3,2,1,0}"


def test_loop_body_launches_follow_calls_and_skip_plumbing():
    steps = hlo_census.loop_body_launches(MODULE)
    assert [(s.kind, s.name) for s in steps] == [
        ("fusion", "loop_add_fusion"),
        ("gemm", "gemm_fusion_dot.1"),
        ("wgmma", "mpmd_map.3"),
        ("fusion", "loop_tanh_fusion"),  # inside the called computation
        ("fusion", "loop_tanh_fusion.1"),
        ("copy", "copy.5"),
    ]
    counts = hlo_census.census(steps, num_layers=2)
    assert counts == dict(launches=6, per_layer=3.0, by_kind=dict(copy=1, fusion=3, gemm=1, wgmma=1))


def test_launch_kinds_of_custom_calls():
    kind = lambda target: hlo_census.launch_kind(
        dict(op="custom-call", name="x", rest=f'custom_call_target="{target}"')
    )  # noqa: E731
    assert kind("mosaic_gpu_v2") == "wgmma"
    assert kind("__gpu$xla.gpu.triton") == "triton"
    assert kind("__cublas$gemm") == "gemm"
    assert kind("something_else") == "custom-call:something_else"


def test_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="one while loop"):
        hlo_census.loop_body_launches(
            MODULE.replace("while(%tuple)", "call(%tuple)").replace("condition=%cond, body=%body", "to_apply=%body")
        )
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo_census.parse_hlo(MODULE.replace("ENTRY ", ""))


def test_decode_program_compiled_for_an_h100_keeps_one_cache(monkeypatch):
    """The decode loop compiled for an H100 (deviceless: XLA's GPU compiler through jax's CUDA
    plugin, skipped where it is not installed) updates its donated cache in place and keeps no
    second one: with `attention`'s einsums instead of `decode_attention_reference`, XLA carried
    the cache in another layout and copied all of it on entry (the old OOM at 256 x 2304)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip("jax's CUDA plugin (jax-cuda12-plugin / -pjrt) is not installed")
    from benchmarks import common

    config = ModelConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
    )
    monkeypatch.setattr(common, "model_config", lambda name: config)
    device = hlo_census.h100_device()
    setup = hlo_census.rollout_setup("test", "bf16", 64, prompt_len=64, new_slots=448, lora_rank=4, device=device)
    cache, state = setup["bucket_args"](64)
    args = (setup["run_params"], cache, state, setup["key"], setup["stop"], setup["scalar"], setup["scalar"])
    m = programs.decode.trace(setup["static"], *args).lower().compile().memory_analysis()
    cache_b = cache_bytes(config, 64, 512)
    assert m.alias_size_in_bytes >= cache_b
    assert m.temp_size_in_bytes < cache_b / 4, (m.temp_size_in_bytes, cache_b)
