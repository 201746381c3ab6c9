"""A tiny random Qwen2 on GSM8K prompts: the whole QeRL loop on a CPU in a few minutes, offline.

The checkpoint (random weights + a small BPE tokenizer trained on GSM8K text) is built in the
workdir on first use. Rewards stay ~0 with random weights: this run checks the machinery.
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
    c.optim.lr = 1e-3
    c.train.total_steps = 6
    c.train.sample_every = 2
    c.train.checkpoint_every = 3
    c.eval.num_examples = 8
    c.eval.batch_size = 8
    c.eval.max_new_tokens = 32
    return c
