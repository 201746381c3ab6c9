"""QeRL with DAPO on BigMath-style competition math; 7B / 14B / 32B variants.

  python -m qerl_jax.main --config=configs/bigmath.py:32b --config.model.path=/models/Qwen2.5-32B-Instruct
The data path accepts a local jsonl/parquet file or, online, a hub dataset name.
"""

from qerl_jax.config import data_path, default_config

VARIANTS = {
    "7b": dict(path="Qwen/Qwen2.5-7B-Instruct", lr=1e-5, micro_batch_size=8),
    "14b": dict(path="Qwen/Qwen2.5-14B-Instruct", lr=5e-6, micro_batch_size=4),
    "32b": dict(path="Qwen/Qwen2.5-32B-Instruct", lr=5e-6, micro_batch_size=2),
}


def get_config(variant: str = "7b"):
    if variant not in VARIANTS:
        raise ValueError(f"unknown bigmath variant {variant!r}; expected one of {sorted(VARIANTS)}")
    v = VARIANTS[variant]
    c = default_config()
    c.workdir = f"runs/bigmath_{variant}"
    c.model.path = v["path"]
    c.model.quant = "nvfp4"
    c.data.train = "SynthLabsAI/Big-Math-RL-Verified"
    c.data.eval = data_path("math500/test.jsonl")
    c.data.max_prompt_len = 512
    c.rollout.prompts_per_step = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 4096
    c.rl.loss = "dapo"
    c.rl.eps_high = 0.28
    c.rl.dynamic_sampling = True
    c.rl.overlong_cache = 512
    c.rl.micro_batch_size = v["micro_batch_size"]
    c.lora.train_norms = True  # the reference's --ln True: RMSNorm scales train beside LoRA
    c.optim.lr = v["lr"]
    c.train.total_steps = 500
    c.eval.datasets = (data_path("math500/test.jsonl"),)
    return c
