"""QeRL on GSM8K: Qwen2.5-7B-Instruct, NVFP4 base, LoRA r16, AQN, DAPO-style loss (the reference recipe).

  python -m qerl_jax.main --config=configs/gsm8k.py  (model.path: the hub id; or a local directory,
  --config.model.path=/models/Qwen2.5-7B-Instruct)
GRPO with a KL term instead:  --config.rl.loss=grpo --config.rl.beta=0.04
"""

from qerl_jax.config import data_path, default_config


def get_config():
    c = default_config()
    c.workdir = "runs/gsm8k"
    c.model.path = "Qwen/Qwen2.5-7B-Instruct"
    c.model.quant = "nvfp4"
    c.data.train = data_path("gsm8k/train.jsonl")
    c.data.eval = data_path("gsm8k/test.jsonl")
    c.data.max_prompt_len = 256
    c.rollout.prompts_per_step = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 2048
    c.rl.loss = "dapo"
    c.rl.beta = 0.0
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.28
    c.rl.mask_truncated = True
    c.lora.rank = 16
    c.lora.alpha = 16.0
    c.lora.train_norms = True  # the reference's --ln True: RMSNorm scales train beside LoRA
    c.optim.lr = 1e-5  # NVFP4 + LoRA; bf16 LoRA is stable only up to ~5e-6 (paper)
    c.optim.b1, c.optim.b2 = 0.9, 0.99
    c.optim.weight_decay = 0.1
    c.optim.warmup_frac = 0.1
    c.optim.schedule = "cosine"
    c.optim.clip_norm = 0.2
    c.aqn.sigma_start, c.aqn.sigma_end, c.aqn.num_stages = 1e-2, 1e-4, 10
    c.train.total_steps = 234  # ~one epoch of GSM8K train at 32 prompts per step
    c.eval.datasets = (data_path("gsm8k/test.jsonl"),)
    return c
