"""The experiment config: each field declared once, in the sections below; files in configs/ start
from `default_config()` and override.

A section is a frozen dataclass (`qerl_jax.schema`) whose fields carry their default, `--help` line,
check and whether a resumed run must keep them (`recipe`). From them come `default_config()` (the
ml_collections ConfigDict that config files and `--config.<section>.<field>=` overrides set; a misspelt
override such as `--config.rl.grup_size=8` fails at start-up), the checks of `validate`, `--help`
(`field_docs`), `recipe_fields()` (which `checkpoint` compares on resume) and the typed tree the run
reads (`run_config.RunConfig`, these sections with the library's LoRA and AQN configs).
"""

from __future__ import annotations

import functools
import os

import ml_collections

from qerl_jax import aqn, fp8, linear, optim, schema
from qerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_TEMPLATE
from qerl_jax.models.qwen2 import ATTENTION_MODES, REMAT_MODES
from qerl_jax.projections import PROJECTIONS
from qerl_jax.quant.formats import CONFIG_FORMATS
from qerl_jax.rl.losses import IS_CORRECTIONS, LOSS_KINDS, OLD_LOGP_SOURCES, REWARD_SCALES
from qerl_jax.rollout.scheduler import DEFAULT_SMALLER_ROWS
from qerl_jax.schema import (
    boolean,
    choice,
    integer,
    mesh_axis,
    names,
    number,
    numbers,
    paths,
    positive_ints,
    section,
    setting,
    subsection,
    text,
)

# Where the shared datasets live; override with the QERL_DATA_DIR environment variable.
DATA_DIR = os.environ.get("QERL_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))

BACKENDS = ("auto", *linear.BACKENDS)  # auto: pallas on a GPU, xla elsewhere
DTYPES = ("bfloat16", "float32", "float16")  # what loader.load_model reads dense tensors as
_AUTO = " (0: auto, the largest that fits)"


def data_path(relative: str) -> str:
    """A file of the shared data directory (e.g. 'gsm8k/train.jsonl')."""
    return os.path.normpath(os.path.join(DATA_DIR, relative))


@section
class ModelSection:
    path: str = setting(
        "", "a local HF checkpoint directory, a .gguf file, or a hub id (Qwen/Qwen2.5-7B-Instruct)", text()
    )
    tiny: bool = setting(False, "build a tiny random checkpoint in workdir on first use (offline demo)", boolean())
    dtype: str = setting("bfloat16", "dense weights as: {choices}", choice(DTYPES))
    quant: str = setting(
        "nvfp4",
        "the frozen base's weight format: {choices} (bf16 = not quantized)",
        choice(CONFIG_FORMATS),
        recipe=True,
    )
    quant_skip: tuple[str, ...] = setting(
        (), "projections kept bf16 (embeddings, lm_head and norms always are)", names(PROJECTIONS, nonempty=False)
    )
    backend: str = setting("auto", "linear backend: {choices} (auto: pallas on GPU, xla on CPU)", choice(BACKENDS))
    fp8_matmul: str = setting(
        "off",
        "base matmuls of >= 256 rows (prefill, the largest decode bucket, the train step) on FP8 tensor "
        "cores over E4M3 copies of the base (+1 byte/weight in the rollout, +2 in training): {choices} "
        "(auto: a 4-bit base on a GPU with FP8 tensor cores)",
        choice(fp8.MODES),
    )
    cache_dir: str = setting(
        "", 'converted GGUF models (qerl_jax.model_io.load_cache); "" = $XDG_CACHE_HOME/qerl_jax/models', text()
    )


@section
class DataSection:
    train: str = setting(
        data_path("gsm8k/train.jsonl"),
        'a file, a known dataset name, or "arithmetic:train" (generated)',
        text(nonempty=True),
    )
    eval: str = setting(
        data_path("gsm8k/test.jsonl"), "not read by the commands: eval.datasets is what eval scores", text()
    )
    system_prompt: str | None = setting(
        DEFAULT_SYSTEM_PROMPT, "the chat's system message; None = the template's default", text(optional=True)
    )
    template: str = setting(
        DEFAULT_USER_TEMPLATE, 'user message; "{prompt}" is replaced by the problem', text(nonempty=True)
    )
    max_prompt_len: int = setting(256, "longer prompts are dropped; also every rollout's prompt slots", integer(1))
    max_bad_fraction: float = setting(
        0.01, "the share of malformed dataset rows skipped before the dataset is refused", number(0.0, 1.0)
    )


@section
class RolloutSection:
    prompts_per_step: int = setting(32, "prompts (groups) trained on per step", integer(1), recipe=True)
    group_size: int = setting(
        8,
        "completions sampled per prompt (GRPO's group; >= 2)",
        integer(2, " (GRPO scores each completion against the others of its prompt's group)"),
        recipe=True,
    )
    max_new_tokens: int = setting(2048, "the longest completion; longer ones are truncated", integer(1))
    temperature: float = setting(1.0, "sampling temperature of the rollouts", number(0.0, lo_open=True))
    top_p: float = setting(
        1.0,
        "nucleus sampling: the smallest set of tokens of this total probability",
        number(0.0, 1.0, lo_open=True),
    )
    top_k: int = setting(0, "sample among the k most likely tokens; 0 = all", integer(0))
    max_batch: int = setting(
        0, "sequences decoded at once (refilled as they stop); 0 = sized to the free device memory", integer(0)
    )
    compaction_rows: tuple[int, ...] = setting(
        DEFAULT_SMALLER_ROWS,
        "the smaller row buckets a rollout's tail moves into once no sequence is queued and its live rows fit "
        "(a decode step costs its bucket's rows, live or not; each bucket compiles its own programs)",
        positive_ints(),
    )
    max_staleness: int = setting(
        0,
        "Partial rollouts (APRIL): K >= 1 keeps more groups in flight than the step needs (about 1.5x, carried ones "
        "included, at most 2x), ends the rollout once enough are complete and carries the rest, paused with their "
        "tokens and sampler log-probs, into the next step's rollout (resumed first, under the updated adapter); a "
        "group carried K steps finishes and is trained in the next one. 0 = on-policy.",
        integer(0),
    )
    norm_parts: bool = setting(
        True,
        "a one-row decode step takes each RMSNorm in two parts around its fused projections (x * scale into the "
        "matmul, 1/rms onto its output: 2 kernel launches a layer fewer, one bf16 rounding apart); False: whole",
        boolean(),
    )


@section
class RLSection:
    loss: str = setting(
        "dapo",
        "{choices}; bnpo is the QeRL reference's, dr_grpo needs scale_rewards=none; gspo: one clipped ratio per "
        "sequence (TRL importance_sampling_level=sequence, clip rl.gspo_eps_*); cispo: the stop-gradient IS weight "
        "capped at rl.cispo_eps_max times the log-prob, every token keeps its gradient (TRL's cispo)",
        choice(LOSS_KINDS),
        recipe=True,
    )
    eps_low: float = setting(
        0.2, "PPO clip: the ratio is kept >= 1 - eps_low", number(0.0, 1.0, hi_open=True), recipe=True
    )
    eps_high: float = setting(
        0.28, "PPO clip: the ratio is kept <= 1 + eps_high (DAPO's clip-higher)", number(0.0), recipe=True
    )
    beta: float = setting(0.0, "KL weight to the LoRA-free reference (GRPO uses 0.04)", number(0.0), recipe=True)
    old_logp_source: str = setting(
        "rollout",
        "The ratio's denominator ({choices}): \"rollout\" = the sampler's log-probs (quantized, AQN noise in "
        'the norms); "current" = the train forward\'s own (ratio 1 with one update per rollout, as TRL); '
        '"proximal" = decoupled PPO (AReaL): the ratio against the train forward\'s own, each token weighted by '
        "the stop-gradient proximal / sampler ratio, 0 above rl.behav_weight_cap (needs rl.ppo_epochs=1).",
        choice(OLD_LOGP_SOURCES),
    )
    is_correction: str = setting(
        "none",
        "With old_logp_source=current: weight each token's loss by the truncated importance ratio of the train "
        "forward and the sampler ({choices}), cap is_cap.",
        choice(IS_CORRECTIONS),
    )
    is_cap: float = setting(3.0, "the cap C of rl.is_correction's importance weights (TRL's 3)", number(1.0))
    gspo_eps_low: float = setting(
        3e-4,
        "rl.loss=gspo: its sequence ratio is kept >= 1 - this (GSPO paper, TRL: 3e-4)",
        number(0.0, 1.0, hi_open=True),
    )
    gspo_eps_high: float = setting(
        4e-4, "rl.loss=gspo: its sequence ratio is kept <= 1 + this (GSPO paper, TRL: 4e-4)", number(0.0)
    )
    cispo_eps_max: float = setting(
        5.0,
        "rl.loss=cispo: the cap of its IS weight (TRL's epsilon_high under cispo; 5 as TRL and ScaleRL recommend)",
        number(0.0, lo_open=True),
    )
    behav_weight_cap: float = setting(
        5.0,
        "rl.old_logp_source=proximal: tokens whose proximal / sampler weight exceeds it get weight 0 "
        "(AReaL's behav_imp_weight_cap)",
        number(1.0),
    )
    scale_rewards: str = setting(
        "group",
        "advantages (r - group mean) / std of the: {choices} (none: no division)",
        choice(REWARD_SCALES),
        recipe=True,
    )
    reward: str = setting(
        "accuracy",
        'A registered reward (accuracy | format | accuracy_format) or "module:function", or several of them '
        'comma-separated ("accuracy,format"), summed with rl.reward_weights (() = 1 each).',
        text(nonempty=True),
        recipe=True,
    )
    reward_weights: tuple[float, ...] = setting(
        (), "one weight per reward of rl.reward; () = 1 each", numbers(), recipe=True
    )
    reward_timeout_s: float = setting(
        10.0,
        "per completion; a reward worker past it is restarted and the item scores 0",
        number(0.0, lo_open=True),
    )
    reward_failure_fraction: float = setting(
        0.5,
        "Stop the run when a reward fails (raises, times out, kills its worker) on more than this share of the "
        "completions of the last 5 steps; failing on every completion of one step always stops it.",
        number(0.0, 1.0, lo_open=True),
    )
    dynamic_sampling: bool = setting(True, "DAPO: drop groups with equal rewards, refill", boolean())
    max_refill_rounds: int = setting(
        2, "dynamic sampling's extra rollout rounds per step to refill dropped groups", integer(0)
    )
    mask_truncated: bool = setting(True, "truncated completions do not count in the loss", boolean())
    overlong_cache: int = setting(0, "DAPO soft overlong penalty window (tokens); 0 = off", integer(0))
    overlong_penalty: float = setting(
        1.0, "the reward's soft overlong penalty reaches -this at rollout.max_new_tokens", number(0.0)
    )
    micro_batch_size: int = setting(
        0,
        "Packed rows per forward/backward of the train step; 0 = auto: the largest that fits the device's free "
        "memory (`memory.fit`; 8 on a device of unknown size). A positive value is lowered only if it does not fit.",
        integer(0, _AUTO),
    )
    ppo_epochs: int = setting(1, "train steps on each step's rollouts", integer(1))
    logprob_chunk: int = setting(
        0,
        "Positions per chunk of the LM-head log-probs; 0 = auto: the largest that fits beside the micro-batch "
        "(256 on a device of unknown size).",
        integer(0, _AUTO),
    )
    remat: str = setting(
        "auto",
        'per-layer checkpointing: {choices}. auto: "proj" (projection outputs kept, no matmul recompute) where '
        'the memory plan fits it, else "full"; "full" on a device of unknown size.',
        choice(("auto", *REMAT_MODES)),
    )
    attention: str = setting(
        "flash", "the train forward's attention: {choices} (flash: cuDNN's on GPU)", choice(ATTENTION_MODES)
    )
    reward_workers: int = setting(0, "reward-scoring worker processes; 0 = min(8, cpus / 2)", integer(0))


@section
class LoraSection:
    """The ConfigDict's lora.*; the run holds them as a `lora.LoraConfig` (`run_config.from_config_dict`)."""

    rank: int = setting(16, "LoRA rank r of every adapted projection", integer(1))
    alpha: float = setting(16.0, "LoRA scale alpha / r (alpha / sqrt(r) with rslora)", number(0.0, lo_open=True))
    targets: tuple[str, ...] = setting(PROJECTIONS, "the adapted projections", names(PROJECTIONS, nonempty=True))
    rslora: bool = setting(False, "rank-stabilized LoRA: scale alpha / sqrt(r)", boolean())
    train_norms: bool = setting(
        False,
        "Train the per-layer input/post-attention RMSNorm scales beside LoRA (QeRL's --ln True; no weight decay; "
        "the rollout adds AQN's noise to the trained scales; exported as PEFT modules_to_save).",
        boolean(),
    )


@section
class AQNSection:
    """The ConfigDict's aqn.*; the run holds them as an `aqn.AQNConfig`, `enabled` resolved."""

    enabled: bool | None = setting(
        None,
        "Adaptive quantization noise in the rollout's norms; None: on iff the policy is quantized.",
        boolean(optional=True),
        recipe=True,
        field_type=bool,
    )
    sigma_start: float = setting(
        1e-2, "the noise std of the first noisy stage (stage 0 is noise-free)", number(0.0), recipe=True
    )
    sigma_end: float = setting(1e-4, "the noise std of the last stage", number(0.0), recipe=True)
    num_stages: int = setting(
        10, "stages of constant noise over train.total_steps", integer(2, " (stage 0 is noise-free)"), recipe=True
    )
    decay: str = setting("exponential", "sigma from stage to stage: {choices}", choice(aqn.DECAYS), recipe=True)
    first_stage_noise: bool = setting(False, "True: stage 0 adds noise too (sigma_start from step 0)", boolean())


@section
class TrainSection:
    total_steps: int = setting(500, "the run's steps (the LR and AQN schedules span them)", integer(1), recipe=True)
    log_every: int = setting(1, "TensorBoard scalars every N steps", integer(1))
    sample_every: int = setting(10, "text samples of completions to TensorBoard", integer(0))
    checkpoint_every: int = setting(50, "a checkpoint every N steps (and at the end)", integer(1))
    eval_every: int = setting(0, "0 = only at the end (when eval.num_examples > 0)", integer(0))
    max_nonfinite: int = setting(5, "stop after this many non-finite updates in a row", integer(1))
    stop_after_steps: int = setting(
        0, "end this invocation after N steps (checkpointed); resume later. 0 = off", integer(0)
    )
    stop_after_minutes: float = setting(
        0.0, "end it after the first step that ends past N minutes (checkpointed). 0 = off", number(0.0)
    )


@section
class OptimSection:
    lr: float = setting(1e-5, "AdamW's peak learning rate", number(0.0, lo_open=True), recipe=True)
    warmup_frac: float = setting(0.1, "the share of train.total_steps of linear warm-up", number(0.0, 1.0), recipe=True)
    schedule: str = setting(
        "cosine", "the learning rate after warm-up: {choices} (cosine: to 0)", choice(optim.SCHEDULES), recipe=True
    )
    b1: float = setting(0.9, "AdamW beta1", number(0.0, 1.0, hi_open=True))
    b2: float = setting(0.99, "AdamW beta2", number(0.0, 1.0, hi_open=True))
    weight_decay: float = setting(0.1, "AdamW weight decay (not on trained norm scales)", number(0.0))
    clip_norm: float = setting(0.2, "global gradient-norm clip; 0 = none", number(0.0))


@section
class EvalSection:
    checkpoint: str = setting("", 'a run\'s workdir/checkpoint dir, or a PEFT adapter dir; "" = base model', text())
    datasets: tuple[str, ...] = setting(
        (data_path("gsm8k/test.jsonl"),),
        "the datasets scored (files, known names, arithmetic:test)",
        paths(nonempty=False),
    )
    num_examples: int = setting(0, "0 = all", integer(0))
    batch_size: int = setting(64, "prompts generated for at once", integer(1))
    max_new_tokens: int = setting(2048, "the longest completion", integer(1))
    num_samples: int = setting(0, "k for mean@k with sampling; 0 = greedy pass@1 only", integer(0))
    temperature: float = setting(0.6, "mean@k's sampling temperature", number(0.0))
    top_p: float = setting(0.95, "mean@k's nucleus sampling", number(0.0, 1.0, lo_open=True))
    output_dir: str = setting("", "default: <workdir>/eval", text())


@section
class MeshSection:
    data: int = setting(1, "devices the rollouts and train batches are split over; -1 = all remaining", mesh_axis())
    model: int = setting(
        1, "devices the base weights are split over (tensor parallel); -1 = all remaining", mesh_axis()
    )


@section
class Settings:
    """The whole config, each section as `--config.<section>.<field>`."""

    seed: int = setting(
        0, "every random draw derives from it (LoRA init, rollouts, AQN noise, the data order)", integer()
    )
    workdir: str = setting(
        "runs/default",
        "the run's directory: checkpoints, TensorBoard logs, eval outputs, adapter",
        text(nonempty=True),
    )
    resume: bool = setting(False, "continue from the latest checkpoint in workdir", boolean())
    resume_changes: str = setting(
        "",
        "Recipe fields a resumed run may change from its checkpoint's (comma-separated paths, e.g. "
        '"train.total_steps,optim.lr"); any other difference in them is refused (config.recipe_fields()).',
        text(),
    )
    compile_cache: bool = setting(True, "JAX's persistent compilation cache (qerl_jax.compile_cache)", boolean())
    compile_cache_dir: str = setting(
        "", 'its directory; "" = shared by every run: $XDG_CACHE_HOME/qerl_jax/jax_cache (~/.cache)', text()
    )
    model: ModelSection = subsection(ModelSection)
    data: DataSection = subsection(DataSection)
    rollout: RolloutSection = subsection(RolloutSection)
    rl: RLSection = subsection(RLSection)
    lora: LoraSection = subsection(LoraSection)
    aqn: AQNSection = subsection(AQNSection)
    train: TrainSection = subsection(TrainSection)  # before optim, whose schedules span train.total_steps
    optim: OptimSection = subsection(OptimSection)
    eval: EvalSection = subsection(EvalSection)
    mesh: MeshSection = subsection(MeshSection)


def default_config() -> ml_collections.ConfigDict:
    """The ConfigDict of every field's default; config files start from it and override."""
    return schema.config_dict(Settings)


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's help, by path ("rollout.group_size" -> "...")."""
    return {leaf.path: leaf.help for leaf in schema.leaves(Settings)}


def field_checks() -> dict[str, schema.Check]:
    """Each field's check, by path."""
    return {leaf.path: leaf.check for leaf in schema.leaves(Settings)}


def recipe_fields() -> tuple[str, ...]:
    """The fields that change what a run means (its batch, length, schedules, loss, rewards, noise,
    policy): a resumed run whose config differs from its checkpoint's in one of them is refused unless
    `resume_changes` names it (`checkpoint.resume_problems`)."""
    return tuple(leaf.path for leaf in schema.leaves(Settings) if leaf.recipe)
