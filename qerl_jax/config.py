"""The default experiment config (ml_collections); files in configs/ start from it and override.

Every field a run reads is declared here, so a misspelt override (`--config.rl.grup_size=8`)
fails at start-up instead of being silently ignored. Each field's comment (on its line, after the
comment lines right above it) is its documentation: `field_docs()` reads them for `--help`.
"""

from __future__ import annotations

import ast
import functools
import io
import os
import tokenize

import ml_collections

from qerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_TEMPLATE

# Where the shared datasets live; override with the QERL_DATA_DIR environment variable.
DATA_DIR = os.environ.get("QERL_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def data_path(relative: str) -> str:
    """A file of the shared data directory (e.g. 'gsm8k/train.jsonl')."""
    return os.path.normpath(os.path.join(DATA_DIR, relative))


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # every random draw derives from it (LoRA init, rollouts, AQN noise, the data order)
    c.workdir = "runs/default"  # the run's directory: checkpoints, TensorBoard logs, eval outputs, adapter
    c.resume = False  # continue from the latest checkpoint in workdir
    # Recipe fields a resumed run may change from its checkpoint's (comma-separated paths, e.g.
    # "train.total_steps,optim.lr"); any other difference in them is refused (checkpoint.RECIPE_FIELDS).
    c.resume_changes = ""
    c.compile_cache = True  # JAX's persistent compilation cache (qerl_jax.compile_cache)
    c.compile_cache_dir = ""  # its directory; "" = shared by every run: $XDG_CACHE_HOME/qerl_jax/jax_cache (~/.cache)

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # a local HF checkpoint directory, a .gguf file, or a hub id (Qwen/Qwen2.5-7B-Instruct)
    c.model.tiny = False  # build a tiny random checkpoint in workdir on first use (offline demo)
    c.model.dtype = "bfloat16"  # dense weights as: bfloat16 | float32 | float16
    c.model.quant = "nvfp4"  # bf16 | nvfp4 | mxfp4 | nf4
    c.model.quant_skip = ()  # projections kept bf16 (embeddings, lm_head and norms always are)
    c.model.backend = "auto"  # linear backend: auto (pallas on GPU, xla on CPU) | pallas | xla
    c.model.cache_dir = ""  # converted GGUF models (qerl_jax.model_io.load_cache); "" = $XDG_CACHE_HOME/qerl_jax/models

    c.data = ml_collections.ConfigDict()
    c.data.train = data_path("gsm8k/train.jsonl")  # a file, a known dataset name, or "arithmetic:train" (generated)
    c.data.eval = data_path("gsm8k/test.jsonl")  # not read by the commands: eval.datasets is what eval scores
    c.data.system_prompt = DEFAULT_SYSTEM_PROMPT  # the chat's system message; None = the template's default
    c.data.template = DEFAULT_USER_TEMPLATE  # user message; "{prompt}" is replaced by the problem
    c.data.max_prompt_len = 256  # longer prompts are dropped; also every rollout's prompt slots
    c.data.max_bad_fraction = 0.01  # the share of malformed dataset rows skipped before the dataset is refused

    c.rollout = ml_collections.ConfigDict()
    c.rollout.prompts_per_step = 32  # prompts (groups) trained on per step
    c.rollout.group_size = 8  # completions sampled per prompt (GRPO's group; >= 2)
    c.rollout.max_new_tokens = 2048  # the longest completion; longer ones are truncated
    c.rollout.temperature = 1.0  # sampling temperature of the rollouts
    c.rollout.top_p = 1.0  # nucleus sampling: the smallest set of tokens of this total probability
    c.rollout.top_k = 0  # sample among the k most likely tokens; 0 = all
    c.rollout.max_batch = 0  # sequences decoded at once (refilled as they stop); 0 = sized to the free device memory

    c.rl = ml_collections.ConfigDict()
    c.rl.loss = "dapo"  # dapo | grpo | bnpo (the QeRL reference's) | dr_grpo (needs scale_rewards=none)
    c.rl.eps_low = 0.2  # PPO clip: the ratio is kept >= 1 - eps_low
    c.rl.eps_high = 0.28  # PPO clip: the ratio is kept <= 1 + eps_high (DAPO's clip-higher)
    c.rl.beta = 0.0  # KL weight to the LoRA-free reference (GRPO uses 0.04)
    # The ratio's denominator: "rollout" = the sampler's log-probs (quantized, AQN noise in the norms);
    # "current" = the train forward's own (ratio 1 with one update per rollout, as TRL).
    c.rl.old_logp_source = "rollout"
    # With old_logp_source=current: weight each token's loss by the truncated importance ratio of the
    # train forward and the sampler (none | token_truncate | sequence_truncate | sequence_mask), cap is_cap.
    c.rl.is_correction = "none"
    c.rl.is_cap = 3.0  # the cap C of rl.is_correction's importance weights (TRL's 3)
    c.rl.scale_rewards = "group"  # advantages (r - group mean) / std of the group | batch | none (no division)
    # A registered reward (accuracy | format | accuracy_format) or "module:function", or several of them
    # comma-separated ("accuracy,format"), summed with rl.reward_weights (() = 1 each).
    c.rl.reward = "accuracy"
    c.rl.reward_weights = ()  # one weight per reward of rl.reward; () = 1 each
    c.rl.reward_timeout_s = 10.0  # per completion; a reward worker past it is restarted and the item scores 0
    # Stop the run when a reward fails (raises, times out, kills its worker) on more than this share of
    # the completions of the last 5 steps; failing on every completion of one step always stops it.
    c.rl.reward_failure_fraction = 0.5
    c.rl.dynamic_sampling = True  # DAPO: drop groups with equal rewards, refill
    c.rl.max_refill_rounds = 2  # dynamic sampling's extra rollout rounds per step to refill dropped groups
    c.rl.mask_truncated = True  # truncated completions do not count in the loss
    c.rl.overlong_cache = 0  # DAPO soft overlong penalty window (tokens); 0 = off
    c.rl.overlong_penalty = 1.0  # the reward's soft overlong penalty reaches -this at rollout.max_new_tokens
    # Packed rows per forward/backward of the train step; 0 = auto: the largest that fits the device's
    # free memory (`memory.fit`; 8 on a device of unknown size). A positive value is lowered only if
    # it does not fit.
    c.rl.micro_batch_size = 0
    c.rl.ppo_epochs = 1  # train steps on each step's rollouts
    # Positions per chunk of the LM-head log-probs; 0 = auto: the largest that fits beside the
    # micro-batch (256 on a device of unknown size).
    c.rl.logprob_chunk = 0
    # per-layer checkpointing: auto | full | proj | none. auto: "proj" (projection outputs kept, no
    # matmul recompute) where the memory plan fits it, else "full"; "full" on a device of unknown size.
    c.rl.remat = "auto"
    c.rl.attention = "flash"  # the train forward's attention: flash (cuDNN's on GPU) | xla
    c.rl.reward_workers = 0  # reward-scoring worker processes; 0 = min(8, cpus / 2)

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # LoRA rank r of every adapted projection
    c.lora.alpha = 16.0  # LoRA scale alpha / r (alpha / sqrt(r) with rslora)
    c.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # adapted
    c.lora.rslora = False  # rank-stabilized LoRA: scale alpha / sqrt(r)
    # Train the per-layer input/post-attention RMSNorm scales beside LoRA (QeRL's --ln True; no weight
    # decay; the rollout adds AQN's noise to the trained scales; exported as PEFT modules_to_save).
    c.lora.train_norms = False

    c.aqn = ml_collections.ConfigDict()
    # Adaptive quantization noise in the rollout's norms; None: on iff the policy is quantized.
    c.aqn.enabled = ml_collections.FieldReference(None, field_type=bool)
    c.aqn.sigma_start = 1e-2  # the noise std of the first noisy stage (stage 0 is noise-free)
    c.aqn.sigma_end = 1e-4  # the noise std of the last stage
    c.aqn.num_stages = 10  # stages of constant noise over train.total_steps
    c.aqn.decay = "exponential"  # sigma from stage to stage: exponential | linear | cosine | logarithmic
    c.aqn.first_stage_noise = False  # True: stage 0 adds noise too (sigma_start from step 0)

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-5  # AdamW's peak learning rate
    c.optim.warmup_frac = 0.1  # the share of train.total_steps of linear warm-up
    c.optim.schedule = "cosine"  # the learning rate after warm-up: cosine (to 0) | constant
    c.optim.b1 = 0.9  # AdamW beta1
    c.optim.b2 = 0.99  # AdamW beta2
    c.optim.weight_decay = 0.1  # AdamW weight decay (not on trained norm scales)
    c.optim.clip_norm = 0.2  # global gradient-norm clip; 0 = none

    c.train = ml_collections.ConfigDict()
    c.train.total_steps = 500  # the run's steps (the LR and AQN schedules span them)
    c.train.log_every = 1  # TensorBoard scalars every N steps
    c.train.sample_every = 10  # text samples of completions to TensorBoard
    c.train.checkpoint_every = 50  # a checkpoint every N steps (and at the end)
    c.train.eval_every = 0  # 0 = only at the end (when eval.num_examples > 0)
    c.train.max_nonfinite = 5  # stop after this many non-finite updates in a row
    c.train.stop_after_steps = 0  # end this invocation after N steps (checkpointed); resume later. 0 = off
    c.train.stop_after_minutes = 0.0  # end it after the first step that ends past N minutes (checkpointed). 0 = off

    c.eval = ml_collections.ConfigDict()
    c.eval.checkpoint = ""  # a run's workdir/checkpoint dir, or a PEFT adapter dir; "" = base model
    c.eval.datasets = (data_path("gsm8k/test.jsonl"),)  # the datasets scored (files, known names, arithmetic:test)
    c.eval.num_examples = 0  # 0 = all
    c.eval.batch_size = 64  # prompts generated for at once
    c.eval.max_new_tokens = 2048  # the longest completion
    c.eval.num_samples = 0  # k for mean@k with sampling; 0 = greedy pass@1 only
    c.eval.temperature = 0.6  # mean@k's sampling temperature
    c.eval.top_p = 0.95  # mean@k's nucleus sampling
    c.eval.output_dir = ""  # default: <workdir>/eval

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # devices the rollouts and train batches are split over; -1 = all remaining
    c.mesh.model = 1  # devices the base weights are split over (tensor parallel); -1 = all remaining
    return c

@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's help, by path ("rollout.group_size" -> "..."): the comment lines right above its
    assignment in `default_config` and the comment on the assignment's own lines, joined."""
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    (function,) = [n for n in ast.parse(source).body if getattr(n, "name", None) == "default_config"]
    docs = {}
    for node in ast.walk(function):
        path = _assigned_field(node)
        if path is None:
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        own = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        docs[path] = " ".join(above + own)
    return docs


def _assigned_field(node: ast.AST) -> str | None:
    """"rl.loss" for `c.rl.loss = ...` (not for a section's `c.rl = ConfigDict()`), else None."""
    if not isinstance(node, ast.Assign) or len(node.targets) != 1:
        return None
    value = node.value
    if isinstance(value, ast.Call) and getattr(value.func, "attr", None) == "ConfigDict":
        return None
    parts, target = [], node.targets[0]
    while isinstance(target, ast.Attribute):
        parts.insert(0, target.attr)
        target = target.value
    return ".".join(parts) if parts and isinstance(target, ast.Name) and target.id == "c" else None
