"""The transformers + PEFT peer of our train step, and the FLOP count both are measured against.

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
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from qerl_jax.models.qwen2 import ModelConfig, projection_shapes

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
