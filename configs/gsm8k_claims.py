"""The paper's claims on a real Qwen2.5: Qwen2.5-Coder-1.5B-Instruct on GSM8K (experiments/qwen_gsm8k/).

  python -m qerl_jax.main --config=configs/gsm8k_claims.py:nvfp4_aqn --config.model.path=qwen1.5b.gguf
(the GGUF file: `python -m experiments.models qwen2.5-coder-1.5b --out qwen1.5b.gguf`, see experiments/models.py)

Arms, identical in everything but what the name says:

| arm | base | lr | AQN |
| --- | --- | --- | --- |
| bf16_lr5e-6 | bf16 | 5e-6 (the reference's bf16 setting) | no |
| bf16 | bf16 | 1e-5 (separates the learning rate from quantization) | no |
| nvfp4 | NVFP4 | 1e-5 | no |
| nvfp4_aqn (QeRL) | NVFP4 | 1e-5 | 1e-2 -> 1e-4, 10 stages, first stage none |
| bf16_aqn | bf16 | 1e-5 | same (noise without quantization) |

Everything else follows the reference (NVlabs/QeRL's GSM8K scripts): AdamW b 0.9 / 0.99, weight decay
0.1, warm-up 0.1, cosine, grad clip 0.2, LoRA r 16 / alpha 16 on all 7 projections, DAPO's
token-level loss with clip 0.2 / 0.28, beta 0, one update per rollout, the input and
post-attention RMSNorm scales trained beside LoRA (its --ln True).
"""

from qerl_jax.config import data_path, default_config

ARMS = {
    "bf16_lr5e-6": dict(quant="bf16", lr=5e-6, aqn=False),
    "bf16": dict(quant="bf16", lr=1e-5, aqn=False),
    "nvfp4": dict(quant="nvfp4", lr=1e-5, aqn=False),
    "nvfp4_aqn": dict(quant="nvfp4", lr=1e-5, aqn=True),
    "bf16_aqn": dict(quant="bf16", lr=1e-5, aqn=True),
}


def get_config(arm: str = "nvfp4_aqn"):
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; expected one of {sorted(ARMS)}")
    spec = ARMS[arm]
    c = default_config()
    c.workdir = f"runs/gsm8k_claims_{arm}"
    c.model.path = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    c.model.quant = spec["quant"]
    c.aqn.enabled = spec["aqn"]
    c.aqn.sigma_start, c.aqn.sigma_end, c.aqn.num_stages = 1e-2, 1e-4, 10

    c.data.train = data_path("gsm8k/train.jsonl")
    c.data.eval = data_path("gsm8k/test.jsonl")
    c.data.max_prompt_len = 256
    # Greedy answers of the untrained model average 323 tokens (GSM8K test); 768 leaves room for
    # sampling's longer tail (the truncated fraction is logged as rollout/truncated_frac).
    c.rollout.prompts_per_step = 16
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 768
    c.rollout.temperature = 1.0

    c.rl.loss = "dapo"
    c.rl.eps_low, c.rl.eps_high = 0.2, 0.28
    c.rl.beta = 0.0
    # No refills: they would multiply the rollouts of easy steps by up to 3 and make arms' costs
    # differ; all-equal groups get zero advantage (no gradient) either way, and the logged reward
    # stays an unbiased sample of the policy.
    c.rl.dynamic_sampling = False
    c.rl.mask_truncated = True
    c.rl.ppo_epochs = 1

    c.lora.rank = 16
    c.lora.alpha = 16.0
    c.lora.train_norms = True  # the reference's --ln True: RMSNorm scales trained beside LoRA
    c.optim.lr = spec["lr"]
    c.optim.b1, c.optim.b2 = 0.9, 0.99
    c.optim.weight_decay = 0.1
    c.optim.warmup_frac = 0.1
    c.optim.schedule = "cosine"
    c.optim.clip_norm = 0.2

    c.train.total_steps = 150
    c.train.sample_every = 25
    c.train.checkpoint_every = 25

    c.eval.datasets = (data_path("gsm8k/test.jsonl"),)
    c.eval.num_examples = 0  # the whole test set (1319)
    c.eval.batch_size = 1319  # one generate call: the engine refills rows as answers end
    c.eval.max_new_tokens = 1024
    c.eval.temperature = 0.6
    return c
