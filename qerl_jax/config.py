"""The default experiment config (ml_collections); files in configs/ start from it and override.

Every field a run reads is declared here, so a misspelt override (`--config.rl.grup_size=8`)
fails at start-up instead of being silently ignored.
"""

from __future__ import annotations

import os

import ml_collections

from qerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_TEMPLATE

# Where the shared datasets live; override with the QERL_DATA_DIR environment variable.
DATA_DIR = os.environ.get("QERL_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def data_path(relative: str) -> str:
    """A file of the shared data directory (e.g. 'gsm8k/train.jsonl')."""
    return os.path.normpath(os.path.join(DATA_DIR, relative))


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "runs/default"
    c.resume = False  # continue from the latest checkpoint in workdir
    c.compile_cache = True  # JAX's persistent compilation cache (qerl_jax.compile_cache)
    c.compile_cache_dir = ""  # its directory; "" = shared by every run: $XDG_CACHE_HOME/qerl_jax/jax_cache (~/.cache)

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # local HF checkpoint directory
    c.model.tiny = False  # build a tiny random checkpoint in workdir on first use (offline demo)
    c.model.dtype = "bfloat16"
    c.model.quant = "nvfp4"  # bf16 | nvfp4 | mxfp4 | nf4
    c.model.quant_skip = ()  # projections kept bf16 (embeddings, lm_head and norms always are)
    c.model.backend = "auto"  # linear backend: auto (pallas on GPU, xla on CPU) | pallas | xla
    c.model.cache_dir = ""  # converted GGUF models (qerl_jax.model_io.load_cache); "" = $XDG_CACHE_HOME/qerl_jax/models

    c.data = ml_collections.ConfigDict()
    c.data.train = data_path("gsm8k/train.jsonl")  # a file, a known dataset name, or "arithmetic:train" (generated)
    c.data.eval = data_path("gsm8k/test.jsonl")
    c.data.system_prompt = DEFAULT_SYSTEM_PROMPT
    c.data.template = DEFAULT_USER_TEMPLATE  # user message; "{prompt}" is replaced by the problem
    c.data.max_prompt_len = 256  # longer prompts are dropped; also every rollout's prompt slots
    c.data.max_bad_fraction = 0.01

    c.rollout = ml_collections.ConfigDict()
    c.rollout.prompts_per_step = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 2048
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.max_batch = 0  # sequences decoded at once (refilled as they stop); 0 = sized to the free device memory

    c.rl = ml_collections.ConfigDict()
    c.rl.loss = "dapo"  # dapo | grpo | bnpo (the QeRL reference's) | dr_grpo (needs scale_rewards=none)
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.28
    c.rl.beta = 0.0  # KL weight to the LoRA-free reference (GRPO uses 0.04)
    # The ratio's denominator: "rollout" = the sampler's log-probs (quantized, AQN noise in the norms);
    # "current" = the train forward's own (ratio 1 with one update per rollout, as TRL).
    c.rl.old_logp_source = "rollout"
    # With old_logp_source=current: weight each token's loss by the truncated importance ratio of the
    # train forward and the sampler (none | token_truncate | sequence_truncate | sequence_mask), cap is_cap.
    c.rl.is_correction = "none"
    c.rl.is_cap = 3.0
    c.rl.scale_rewards = "group"  # advantages (r - group mean) / std of the group | batch | none (no division)
    # A registered reward (accuracy | format | accuracy_format) or "module:function", or several of them
    # comma-separated ("accuracy,format"), summed with rl.reward_weights (() = 1 each).
    c.rl.reward = "accuracy"
    c.rl.reward_weights = ()
    c.rl.reward_timeout_s = 10.0  # per completion; a reward worker past it is restarted and the item scores 0
    c.rl.dynamic_sampling = True  # DAPO: drop groups with equal rewards, refill
    c.rl.max_refill_rounds = 2
    c.rl.mask_truncated = True  # truncated completions do not count in the loss
    c.rl.overlong_cache = 0  # DAPO soft overlong penalty window (tokens); 0 = off
    c.rl.overlong_penalty = 1.0
    # Packed rows per forward/backward of the train step; 0 = auto: the largest that fits the device's
    # free memory (`memory.fit`; 8 on a device of unknown size). A positive value is lowered only if
    # it does not fit.
    c.rl.micro_batch_size = 0
    c.rl.ppo_epochs = 1
    # Positions per chunk of the LM-head log-probs; 0 = auto: the largest that fits beside the
    # micro-batch (256 on a device of unknown size).
    c.rl.logprob_chunk = 0
    # per-layer checkpointing: auto | full | proj | none. auto: "proj" (projection outputs kept, no
    # matmul recompute) where the memory plan fits it, else "full"; "full" on a device of unknown size.
    c.rl.remat = "auto"
    c.rl.attention = "flash"  # the train forward's attention: flash (cuDNN's on GPU) | xla
    c.rl.reward_workers = 0  # reward-scoring worker processes; 0 = min(8, cpus / 2)

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16
    c.lora.alpha = 16.0
    c.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    c.lora.rslora = False
    # Train the per-layer input/post-attention RMSNorm scales beside LoRA (QeRL's --ln True; no weight
    # decay; the rollout adds AQN's noise to the trained scales; exported as PEFT modules_to_save).
    c.lora.train_norms = False

    c.aqn = ml_collections.ConfigDict()
    c.aqn.enabled = ml_collections.FieldReference(None, field_type=bool)  # None: on iff quantized
    c.aqn.sigma_start = 1e-2
    c.aqn.sigma_end = 1e-4
    c.aqn.num_stages = 10
    c.aqn.decay = "exponential"  # exponential | linear | cosine | logarithmic
    c.aqn.first_stage_noise = False  # True: stage 0 adds noise too (sigma_start from step 0)

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-5
    c.optim.warmup_frac = 0.1
    c.optim.schedule = "cosine"
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.1
    c.optim.clip_norm = 0.2

    c.train = ml_collections.ConfigDict()
    c.train.total_steps = 500
    c.train.log_every = 1
    c.train.sample_every = 10  # text samples of completions to TensorBoard
    c.train.checkpoint_every = 50
    c.train.eval_every = 0  # 0 = only at the end (when eval.num_examples > 0)
    c.train.max_nonfinite = 5  # stop after this many non-finite updates in a row
    c.train.stop_after_steps = 0  # end this invocation after N steps (checkpointed); resume later. 0 = off
    c.train.stop_after_minutes = 0.0  # end it after the first step that ends past N minutes (checkpointed). 0 = off

    c.eval = ml_collections.ConfigDict()
    c.eval.checkpoint = ""  # a run's workdir/checkpoint dir, or a PEFT adapter dir; "" = base model
    c.eval.datasets = (data_path("gsm8k/test.jsonl"),)
    c.eval.num_examples = 0  # 0 = all
    c.eval.batch_size = 64
    c.eval.max_new_tokens = 2048
    c.eval.num_samples = 0  # k for mean@k with sampling; 0 = greedy pass@1 only
    c.eval.temperature = 0.6
    c.eval.top_p = 0.95
    c.eval.output_dir = ""  # default: <workdir>/eval

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.model = 1
    return c
