"""A tiny random Qwen2 on GSM8K prompts: the whole QeRL loop on a CPU in a few minutes, offline.

The checkpoint (random weights + a small BPE tokenizer trained on GSM8K text) is built in the
workdir on first use. A random model solves no GSM8K problem, so the demo trains on a task it can
learn in a few steps: the `digits` reward (the share of digit characters, up to 8, in a completion).
Its log shows the reward rising from ~0.1 and a non-zero gradient at every step.
"""

from qerl_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/tiny"
    c.model.tiny = True
    c.model.dtype = "float32"
    c.model.quant = "nvfp4"
    c.data.max_prompt_len = 384  # the tiny 512-token BPE needs ~2x Qwen's tokens per prompt
    c.rollout.prompts_per_step = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 32
    c.rl.micro_batch_size = 8
    c.rl.logprob_chunk = 64
    c.rl.dynamic_sampling = False
    c.rl.mask_truncated = False  # random weights rarely emit EOS within 32 tokens
    c.lora.rank = 8
    c.lora.alpha = 16.0
    c.aqn.num_stages = 2  # every noise stage needs a step; the tests run as few as 2
    c.rl.reward = "digits"
    c.rollout.temperature = 0.3  # LoRA moves the tiny lm_head's (std 0.02) logits a little: sample sharply
    c.optim.lr = 1e-2
    c.optim.schedule = "constant"
    c.optim.warmup_frac = 0.0
    c.optim.weight_decay = 0.0
    c.train.total_steps = 12
    c.train.sample_every = 2
    c.train.checkpoint_every = 3
    c.eval.num_examples = 8
    c.eval.batch_size = 8
    c.eval.max_new_tokens = 32
    return c
