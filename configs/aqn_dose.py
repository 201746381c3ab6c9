"""The AQN dose-response on Qwen2.5-Coder-1.5B-Instruct / GSM8K (experiments/aqn_dose/, pre-registered
in experiments/qwen_gsm8k/PROTOCOL.md, section 3).

  python -m qerl_jax.main --config=configs/aqn_dose.py:sigma3e-2 --config.model.path=qwen1.5b.gguf

Every arm is `configs/gsm8k_claims.py`'s NVFP4 arm (NVFP4 re-quantized from the Q4_K_M GGUF, lr 1e-5,
the reference's optimizer and DAPO settings) over 180 steps. The arms differ only in AQN:

| arm | AQN | sigma per 60-step stage |
| --- | --- | --- |
| sigma0 (control) | off | 0, 0, 0 |
| sigma1e-2 | on | 1e-2, 1e-3, 1e-4 |
| sigma3e-2 | on | 3e-2, 3e-3, 3e-4 |
| sigma1e-1 | on | 1e-1, 1e-2, 1e-3 |

Three stages, noise from step 0 (`aqn.first_stage_noise`), exponential decay from sigma_start to
sigma_start / 100. A seed samples the same prompts with the same rollout keys in every arm (the
loader and the rollout key follow the seed only), so arms pair step by step.
"""

from configs import gsm8k_claims

SIGMAS = {"sigma0": 0.0, "sigma1e-2": 1e-2, "sigma3e-2": 3e-2, "sigma1e-1": 1e-1}
ARMS = {name: dict(quant="nvfp4", lr=1e-5, aqn=sigma > 0, sigma_start=sigma) for name, sigma in SIGMAS.items()}
STEPS, STAGES, DECAY_RATIO = 180, 3, 100.0


def get_config(arm: str = "sigma1e-2"):
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; expected one of {sorted(ARMS)}")
    c = gsm8k_claims.get_config("nvfp4")
    c.workdir = f"runs/aqn_dose_{arm}"
    sigma = SIGMAS[arm]
    c.aqn.enabled = sigma > 0
    if sigma > 0:
        c.aqn.sigma_start, c.aqn.sigma_end = sigma, sigma / DECAY_RATIO
    c.aqn.num_stages = STAGES
    c.aqn.first_stage_noise = True
    c.aqn.decay = "exponential"
    c.train.total_steps = STEPS
    c.train.sample_every = 30
    c.train.checkpoint_every = 30
    return c
