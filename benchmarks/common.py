"""What the benchmarks share: random Qwen2.5-shaped models, the transformers + PEFT peer of our
train step with the FLOP count both are measured against, and the timing of a rollout's phases.

Random models (`model_config`, `random_params`, `random_rl_batch`):

    config = model_config("7B")                              # Qwen2.5-7B shapes
    params = random_params(config, quant="nvfp4", seed=0)    # {"base", "norms"}, layer-stacked
    batch = random_rl_batch(config, batch=8, seq_len=1024)   # a train-step batch (numpy)

Each projection's [L, N, K] stack is produced by one jitted `lax.map` over layers: a layer's
weight is drawn (N(0, 0.02^2), bfloat16) and, for a 4-bit format, quantized with
`qerl_jax.quant.quantize` inside the same iteration, so only one layer's dense matrix exists at a
time and a quantized model never holds all its bf16 weights. Embeddings / lm_head stay bf16
(the model reads them dense), norms are ones, q/k/v biases small random values.
With `mesh=` every piece is made in its tensor-parallel sharding (one jit per piece with
`out_shardings`), so a model that does not fit one device never lands on one; the values are the
same (JAX's threefry is partitionable).

The peer (`peer_model`, `peer_train_step`, `train_flops`):

    model = peer_model(config)                              # torch bf16 Qwen2 + PEFT LoRA, random weights
    stats = peer_train_step(model, optimizer, batch, ...)   # one GRPO/DAPO update, TRL-style

The peer is the stack TRL trains LoRA with: `transformers.Qwen2ForCausalLM` in bf16 (SDPA
attention), a PEFT LoRA adapter on the same projections, gradient checkpointing (non-reentrant),
AdamW, and the loss computed from float32 log-softmax of the logits at the response positions;
micro-batches accumulate gradients. The loss is the same token-level DAPO loss (clip-higher) as
`qerl_jax.rl.losses`, written in torch here.

`train_flops` counts one train step's matrix FLOPs by formula (stated in every benchmark's output):
2 * N * K per token for each projection and the LM head, the causal attention products
(QK^T and PV over half the square), LoRA's two products; a frozen-base LoRA step with per-layer
checkpointing does three forward passes' worth (forward, recompute, input gradients) plus LoRA's
weight gradients. Without recomputation (remat "proj"/"none") the work is smaller, but the
formula stays the same, so TFLOP/s compare the same useful work.

Train steps (`timed_train`, `time_packed_train`): a warm step's seconds, as the GRPO and DAPO
benchmarks time it.

Where a first call's time goes (`CompileTimeline`): JAX's tracing, lowering and backend-compile
spans (a persistent-cache load counts as a backend compile), summed and as wall time covered.

Rollout phases (`timed_generate`): the rollout engine keeps no timing hooks; a rollout's prefill
is timed as the same call with every sequence limited to one token (the same programs: token limits are runtime arguments, so
nothing new is compiled), and its decode as the rest of the full call's wall time.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qerl_jax.models.qwen2 import PROJECTIONS, ModelConfig, projection_shapes
from qerl_jax.rollout import (
    RolloutOptions,
    SamplingConfig,
    generate,
    new_tokens_bucket,
    plan_rollout,
    prompt_bucket,
    weights,
)
from qerl_jax.sharding import param_shardings

# (vocab, hidden, intermediate, layers, heads, kv_heads, tied) from the public Qwen2.5 config.json files.
QWEN25_SHAPES = {
    "0.5B": (151936, 896, 4864, 24, 14, 2, True),
    "1.5B": (151936, 1536, 8960, 28, 12, 2, True),
    "3B": (151936, 2048, 11008, 36, 16, 2, True),
    "7B": (152064, 3584, 18944, 28, 28, 4, False),
    "14B": (152064, 5120, 13824, 48, 40, 8, False),
    "32B": (152064, 5120, 27648, 64, 40, 8, False),
    "72B": (152064, 8192, 29568, 80, 64, 8, False),
}
# A tiny stand-in with the same structure (CPU smoke tests); K is a multiple of every format's block.
TINY_SHAPE = (512, 128, 256, 2, 4, 2, False)
DENSE = (None, "bf16")


def model_config(name: str) -> ModelConfig:
    """ModelConfig of a Qwen2.5 size ("0.5B" ... "72B", case-insensitive) or "tiny"."""
    key = {k.lower(): k for k in QWEN25_SHAPES}.get(name.lower())
    if key is None and name.lower() != "tiny":
        raise ValueError(f"unknown model size {name!r}; expected 'tiny' or one of {list(QWEN25_SHAPES)}")
    v, d, i, layers, heads, kv, tied = TINY_SHAPE if key is None else QWEN25_SHAPES[key]
    return ModelConfig(
        vocab_size=v,
        hidden_size=d,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d // heads,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tied,
        attention_bias=True,
        max_position_embeddings=32768,
    )


@functools.partial(jax.jit, static_argnames=("shape", "num_layers", "fmt", "std"))
def _random_stack(key: jax.Array, *, shape: tuple[int, int], num_layers: int, fmt: str | None, std: float):
    """[L, N, K] bf16 (fmt None) or a PackedWeight with leading L, one layer at a time."""

    def one_layer(k):
        w = jax.random.normal(k, shape, jnp.bfloat16) * jnp.bfloat16(std)
        if fmt is None:
            return w
        from qerl_jax.quant import quantize  # noqa: PLC0415 (only needed for 4-bit bases)

        return quantize(w, fmt)

    return jax.lax.map(one_layer, jax.random.split(key, num_layers))


@functools.partial(jax.jit, static_argnames=("shape", "std"))
def _random_dense(key: jax.Array, *, shape: tuple[int, ...], std: float):
    return jax.random.normal(key, shape, jnp.bfloat16) * jnp.bfloat16(std)


def _build(mesh, where: tuple[str, ...], fn, *args):
    """fn(*args) (a jitted generator): on the default device (mesh None), or computed straight into
    its tensor-parallel sharding on `mesh`, the one `param_shardings` gives a params-shaped tree
    holding only this piece at `where` (it reads shapes only), so no device holds all of it."""
    if mesh is None:
        return fn(*args)
    piece = jax.eval_shape(fn, *args)
    tree = functools.reduce(lambda sub, name: {name: sub}, reversed(where), piece)
    shardings = functools.reduce(lambda sub, name: sub[name], where, param_shardings(tree, mesh, "tp"))
    return jax.jit(fn, out_shardings=shardings)(*args)


def random_params(
    config: ModelConfig, *, quant: str | None = "bf16", seed: int = 0, std: float = 0.02, mesh: Mesh | None = None
) -> dict[str, Any]:
    """{"base", "norms"} of random weights (bf16 dense or `quant` 4-bit linears): on the default
    device, or with `mesh` (a ("data", "model") mesh) each piece made in its "tp" sharding
    (`qerl_jax.sharding.param_shardings`), the same values (JAX's threefry is partitionable)."""
    fmt = None if quant in DENSE else quant
    key = jax.random.key(seed)
    shapes = projection_shapes(config)
    n_layers, d = config.num_hidden_layers, config.hidden_size
    dense = lambda where, k, shape: _build(mesh, where, functools.partial(_random_dense, shape=shape, std=std), k)  # noqa: E731
    layers = {}
    for i, proj in enumerate(PROJECTIONS):
        stack = functools.partial(_random_stack, shape=shapes[proj], num_layers=n_layers, fmt=fmt, std=std)
        w = _build(mesh, ("base", "layers", proj, "w"), stack, jax.random.fold_in(key, i))
        layers[proj] = {"w": jax.block_until_ready(w)}  # one projection's temporaries at a time
        if config.attention_bias and proj in ("q_proj", "k_proj", "v_proj"):
            where, bias_key = ("base", "layers", proj, "b"), jax.random.fold_in(key, 100 + i)
            layers[proj]["b"] = dense(where, bias_key, (n_layers, shapes[proj][0]))
    base = {"embed": dense(("base", "embed"), jax.random.fold_in(key, 200), (config.vocab_size, d)), "layers": layers}
    if not config.tie_word_embeddings:
        base["lm_head"] = dense(("base", "lm_head"), jax.random.fold_in(key, 201), (config.vocab_size, d))
    ones = lambda where, shape: _build(mesh, ("norms", *where), lambda: jnp.ones(shape, jnp.bfloat16))  # noqa: E731
    norms = {
        "final_norm": ones(("final_norm",), (d,)),
        "layers": {
            name: ones(("layers", name), (n_layers, d)) for name in ("input_layernorm", "post_attention_layernorm")
        },
    }
    return jax.block_until_ready({"base": base, "norms": norms})


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in a pytree (PackedWeight fields included)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def random_rl_batch(
    config: ModelConfig, *, batch: int, seq_len: int, prompt_len: int | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """A train-step batch (numpy): prompts of ~prompt_len tokens (left-padded by a few tokens on
    odd rows), responses up to seq_len (right-padded by a few on every third row), random
    old_logp on response tokens and random advantages."""
    prompt_len = prompt_len or seq_len // 4
    if not 1 <= prompt_len < seq_len:
        raise ValueError(f"need 1 <= prompt_len < seq_len; got prompt_len={prompt_len}, seq_len={seq_len}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int32)
    attn = np.ones((batch, seq_len), np.int32)
    resp = np.zeros((batch, seq_len), np.float32)
    resp[:, prompt_len:] = 1
    pad = min(8, prompt_len - 1)
    attn[1::2, :pad] = 0
    tail = min(8, seq_len - prompt_len - 1)
    if tail > 0:
        attn[::3, seq_len - tail :] = 0
    resp *= attn
    ids *= attn
    old = np.where(resp > 0, rng.uniform(-4.0, -0.1, (batch, seq_len)), 0.0).astype(np.float32)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "response_mask": resp,
        "old_logp": old,
        "advantages": rng.standard_normal(batch).astype(np.float32),
    }


# ----------------------------------------------------------------------------- the transformers peer

# LoRA targets of both stacks: every projection.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def train_flops(config: ModelConfig, *, tokens: int, seq_len: int, lora_rank: int) -> dict[str, float]:
    """FLOPs of one train step over `tokens` tokens in sequences of `seq_len` (see the module docstring).

    Returns {"forward": one forward pass, "step": the step (3 forward passes + LoRA weight gradients),
    "attention_share": the attention products' share of a forward pass}."""
    shapes = projection_shapes(config)
    layers, heads, hd = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    proj = sum(2 * n * k for n, k in shapes.values())  # per token per layer
    lora = sum(2 * lora_rank * (n + k) for n, k in shapes.values())
    attention = 2 * 2 * heads * hd * seq_len / 2  # QK^T and PV, causal: half the square on average
    head = 2 * config.hidden_size * config.vocab_size
    forward = tokens * (layers * (proj + lora + attention) + head)
    return {
        "forward": forward,
        "step": 3 * forward + 2 * tokens * layers * lora,
        "attention_share": tokens * layers * attention / forward,
    }


def hf_model(config: ModelConfig, *, device: str, seed: int = 0, **hf_config: Any):
    """A `transformers.Qwen2ForCausalLM` of `config`'s shapes with random bf16 weights, built on
    `device` (the peer of our random-weight benchmarks); `hf_config` overrides Qwen2Config fields."""
    import torch
    import transformers

    fields = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**fields, **hf_config}))
    finally:
        torch.set_default_dtype(torch.float32)


def peer_model(config: ModelConfig, *, lora_rank: int, device: str, seed: int = 0):
    """A random bf16 `Qwen2ForCausalLM` of `config`'s shapes with a PEFT LoRA (alpha 2r) on TARGETS,
    gradient checkpointing on (as TRL's `gradient_checkpointing=True`)."""
    import peft

    model = hf_model(config, device=device, seed=seed, use_cache=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=list(TARGETS), lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    for p in model.parameters():  # adapters in float32, as ours (PEFT keeps the base's dtype otherwise)
        if p.requires_grad:
            p.data = p.data.float()
    model.train()
    return model


def peer_train_step(
    model,
    optimizer,
    batch: dict[str, np.ndarray],
    *,
    micro_batch_size: int,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    temperature: float = 1.0,
) -> dict[str, float]:
    """One DAPO update of `model` on a token-aligned batch (`random_rl_batch`'s format): micro-batches
    accumulate the gradient of the token-level loss normalized by the whole batch's response tokens."""
    import torch

    device = next(model.parameters()).device
    t = lambda x, dtype: torch.as_tensor(np.asarray(x), dtype=dtype, device=device)  # noqa: E731
    ids, attn = t(batch["input_ids"], torch.long), t(batch["attention_mask"], torch.long)
    resp, old = t(batch["response_mask"], torch.float32)[:, 1:], t(batch["old_logp"], torch.float32)[:, 1:]
    adv = t(batch["advantages"], torch.float32)
    tokens = resp.sum().clamp(min=1.0)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for s in range(0, ids.shape[0], micro_batch_size):
        sl = slice(s, s + micro_batch_size)
        logits = model(input_ids=ids[sl], attention_mask=attn[sl]).logits[:, :-1].float() / temperature
        logp = torch.gather(logits.log_softmax(-1), -1, ids[sl, 1:, None])[..., 0]
        ratio = torch.exp(logp - old[sl])
        a = adv[sl, None]
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
        loss = (per_token * resp[sl]).sum() / tokens
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return {"loss": total}


def time_peer_train(
    model, batch: dict[str, np.ndarray], *, micro_batch_size: int, steps: int, lr: float = 1e-5
) -> dict[str, Any]:
    """Times `peer_train_step` (one warm-up step, then the median of `steps`); peak device bytes."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.99))
    cuda = torch.cuda.is_available()
    times, stats = [], {}
    for i in range(steps + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = peer_train_step(model, optimizer, batch, micro_batch_size=micro_batch_size)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return {
        "step_s": float(np.median(times)),
        "step_times_s": [round(x, 4) for x in times],
        "loss": stats["loss"],
        "peak_bytes_in_use": torch.cuda.max_memory_allocated() if cuda else None,
    }


# ----------------------------------------------------------------------------- train steps


def backend_for(fmt: str) -> str:
    """The linear backend a benchmark times `fmt` with: the Pallas kernels for a 4-bit base on a GPU, else XLA."""
    return "pallas" if fmt != "bf16" and jax.default_backend() == "gpu" else "xla"


def timed_train(step, state, frozen, train_batch):
    """(state, metrics, seconds) of a warm train step: compiled by a first call, then timed once."""
    state, m = step(state, frozen, train_batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    state, m = step(state, frozen, train_batch)
    jax.block_until_ready(m)
    return state, m, time.perf_counter() - t0


def time_packed_train(args, config, frozen, state, optimizer, batch, rows, lcfg, backend) -> float:
    """Seconds of one warm packed train step (`rl.packing`, as the loop) on the given rows of a rollout
    (args: a benchmark's micro_batch_size, remat, attention, logprob_chunk)."""
    from qerl_jax import lora  # noqa: PLC0415
    from qerl_jax.rl import losses, packing  # noqa: PLC0415
    from qerl_jax.rl.step import TrainStep  # noqa: PLC0415
    from qerl_jax.rollout.batch import select_rows  # noqa: PLC0415
    from qerl_jax.rollout.sampler import to_train_batch  # noqa: PLC0415

    kept = select_rows(batch, rows)
    padded = {k: np.asarray(v) for k, v in to_train_batch(kept).items()}
    scores = np.random.default_rng(0).uniform(0, 1, len(rows)).astype(np.float32)
    padded["advantages"] = np.asarray(losses.group_advantages(jnp.asarray(scores), batch.group_size))
    mb = args.micro_batch_size
    train_batch = packing.pack_batch(padded, padded["input_ids"].shape[1], rows_multiple=mb)
    step = TrainStep(
        config, losses.LossConfig(kind="dapo"), optimizer, lora_scale=lora.lora_scale(lcfg), backend=backend,
        remat=args.remat if args.remat != "auto" else "full", attention=args.attention,
        micro_batch_size=mb, logprob_chunk=args.logprob_chunk,
    )  # fmt: skip
    return timed_train(step, state, {"base": frozen["base"], "norms": frozen["norms"]}, train_batch)[2]


# ----------------------------------------------------------------------------- rollout phases


def decode_step_seconds(short: list[dict[str, float]], long: list[dict[str, float]]) -> float:
    """Seconds per decode step from warm `timed_generate` timings of calls that run a few steps
    (`short`) and many more (`long`) on the same program: (fastest long call - fastest short call)
    / (the long call's steps - the short call's).

    Each call's host work (per-layer weight copies, admissions, the programs' cache lookups) is
    the same in both and cancels. It varies by 60-190 ms from call to call on an H100 at 1.5B, so
    the one-token call's wall time, subtracted from a 32-step call's, put 1.7-2.9 ms on the same
    2.4 ms step in different processes (H100, 2026-11-27, `dd2236e`).
    """
    steps = min(tm["steps"] for tm in long) - max(tm["steps"] for tm in short)
    if steps < 1:
        raise ValueError(f"the long calls must run more steps than the short ones; got {steps} more")
    wall_s = min(tm["wall_s"] for tm in long) - min(tm["wall_s"] for tm in short)
    return max(wall_s, 1e-9) / steps


def timed_generate(
    config,
    params: dict[str, Any],
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    key: jax.Array,
    sampling: SamplingConfig,
    *,
    group_size: int = 1,
    lora_scale: float = 1.0,
    max_batch: int | None = None,
    max_new_tokens_per_seq: np.ndarray | int | None = None,
    options: RolloutOptions = RolloutOptions(),
):
    """`generate` twice (one token per sequence, then the full call) -> (batch, timings).

    max_new_tokens_per_seq: as `generate`'s, or an int for every sequence (e.g. a few steps timed
    at the cache size of sampling.max_new_tokens). Timings: "prefill_s" (the one-token call:
    weight copies, admissions, first tokens), "decode_s" (the full call's wall time less that),
    "wall_s", "steps" (1 + the decode steps of every segment), "decode_steps", "rows" (the first
    row bucket), "estimated_bytes" (the engine's memory estimate), "wgmma_copy_bytes", and the
    call's plan: "dense_names", "wgmma_names", "buckets" (rows, then the smaller buckets) and
    "segment_steps" (`RolloutBatch.steps`).
    """
    total = np.asarray(prompt_ids).shape[0] * group_size
    limits = max_new_tokens_per_seq
    if isinstance(limits, int):
        limits = np.full((total,), limits, np.int32)
    kw = dict(group_size=group_size, lora_scale=lora_scale, max_batch=max_batch, options=options)
    t = time.perf_counter()
    one = generate(config, params, prompt_ids, prompt_mask, key, sampling, max_new_tokens_per_seq=np.ones((total,), np.int32), **kw)  # fmt: skip
    jax.block_until_ready(one.tokens)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    batch = generate(config, params, prompt_ids, prompt_mask, key, sampling, max_new_tokens_per_seq=limits, **kw)
    jax.block_until_ready(batch.tokens)
    wall_s = time.perf_counter() - t
    plan = plan_rollout(
        config,
        params,
        total,
        prompt_bucket(int(np.asarray(prompt_mask).sum(axis=1).max())),
        new_tokens_bucket(sampling.max_new_tokens),
        group_size=group_size,
        max_batch=max_batch,
        options=options,
    )
    segments = np.asarray(batch.steps)
    return batch, {
        "prefill_s": prefill_s,
        # a difference of two wall times: on a tiny CPU run it can come out <= 0 (noise)
        "decode_s": max(wall_s - prefill_s, 1e-6),
        "wall_s": wall_s,
        "steps": int(segments.sum()),
        "decode_steps": int(segments.sum() - len(segments)),
        "rows": plan.rows,
        "estimated_bytes": plan.memory.total,
        "wgmma_copy_bytes": weights.wgmma_copy_bytes(params, plan.wgmma_names),
        # the plan the call ran: which projections decode from bf16 copies, which on the wgmma
        # kernel (at most its rows), and each segment's steps with the buckets they ran at
        "dense_names": list(plan.dense_names),
        "wgmma_names": list(plan.wgmma_names),
        "buckets": [plan.rows, *plan.smaller],
        "segment_steps": segments.tolist(),
    }


COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds of wall time inside the union of [start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class CompileTimeline:
    """Records JAX's trace / lower / backend-compile spans (every thread) while it is registered.

        timeline = CompileTimeline()
        t0 = time.time(); f(); t1 = time.time()
        timeline.summary(t0, t1)   # {"trace_s", "lower_s", "compile_s", "compile_wall_s", ...}
    """

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []  # (kind, program, start, end), time.time()
        jax.monitoring.register_event_time_span_listener(self._record)

    def _record(self, event: str, start: float, end: float, **kw: Any) -> None:
        kind = COMPILE_EVENTS.get(event)
        if kind is not None:
            self.spans.append((kind, self.label(kw), start, end))

    def label(self, event_kw: dict[str, Any]) -> str:
        """A span's program name (its event's `fun_name`)."""
        return str(event_kw.get("fun_name", "?"))

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        """The spans that ended in [t0, t1]: per kind the summed seconds, the backend compiles' wall
        time covered ("compile_wall_s", less than their sum when they overlap), every kind's
        together ("compiling_wall_s"), the rest of the window ("other_s": running, copying,
        loading kernels) and the five longest backend compiles."""
        inside = [s for s in self.spans if t0 <= s[3] <= t1]
        out: dict[str, Any] = {
            f"{kind}_s": round(sum(e - b for k, _, b, e in inside if k == kind), 3) for kind in ("trace", "lower", "compile")
        }
        compiles = [(b, e) for k, _, b, e in inside if k == "compile"]
        out["compiles"] = len(compiles)
        out["compile_wall_s"] = round(_covered(compiles), 2)
        busy = _covered([(max(b, t0), e) for _, _, b, e in inside])
        out["compiling_wall_s"] = round(busy, 2)
        out["other_s"] = round(t1 - t0 - busy, 2)
        longest = sorted((e - b, name) for k, name, b, e in inside if k == "compile")[-5:][::-1]
        out["longest_compiles"] = [[name, round(secs, 2)] for secs, name in longest]
        return out
