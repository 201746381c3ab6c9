"""Evaluation (the library behind `python -m qerl_jax.eval`).

pass@1 (`pass_at_1`) with greedy decoding and, with eval.num_samples = k > 0, mean@k (`mean_at_k`)
with sampling, on each
dataset of eval.datasets, using the rollout engine. The policy is the config's base model in the
config's quantization (`--config.model.quant=bf16|nf4|mxfp4|nvfp4`), plus the LoRA adapter (and
trained norm scales, if the run trained them) of eval.checkpoint: a training run's directory
(latest orbax checkpoint) or a PEFT adapter directory; "" evaluates the base model. Writes `<dataset>.jsonl` (prompt, completion, extracted
answer, correct, length), `<dataset>.problems.jsonl.gz` (metric, problem id, correct, length: the
small per-problem record that paired tests between evaluations need) and `summary.json` to
eval.output_dir and logs to TensorBoard.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from qerl_jax import compile_cache, lora, reward_pool, rewards, run_config, validate
from qerl_jax.checkpoint import Checkpointer, CheckpointMismatchError, mismatch_message
from qerl_jax.data import load_math_dataset, tokenize_prompts
from qerl_jax.errors import UserFacingError
from qerl_jax.metrics import MetricWriter
from qerl_jax.model_io.loader import CheckpointError
from qerl_jax.model_io.peft_adapter import ADAPTER_CONFIG, load_peft_adapter, load_peft_norms
from qerl_jax.policy import Policy, load_policy
from qerl_jax.rl.step import init_train_state
from qerl_jax.rollout.sampler import generate
from qerl_jax.rollout.sampling import SamplingConfig
from qerl_jax.run_config import RunConfig, optimizer_from_config, rollout_options


def load_adapter(cfg: RunConfig, policy: Policy) -> tuple[dict[str, Any] | None, dict[str, Any] | None, float]:
    """(LoRA pytree or None, trained norms or None, lora_scale) from eval.checkpoint (run dir, orbax dir
    or PEFT dir). Whether norms were trained is the checkpoint's own: its run config, or the
    adapter's modules_to_save."""
    path = cfg.eval.checkpoint
    if not path:
        print("adapter: none (eval.checkpoint is empty): the base model")
        return None, None, 1.0
    if not os.path.isdir(path):
        raise UserFacingError(f"eval.checkpoint {path!r} does not exist (expected a run directory or a PEFT adapter)")
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        try:
            adapter, adapter_cfg = load_peft_adapter(path, policy.config.num_hidden_layers)
            norms = load_peft_norms(path, policy.config.num_hidden_layers)
        except CheckpointError as e:
            raise validate.ConfigError([f"eval.checkpoint = {path!r}: {e}"]) from None
        rank, alpha = adapter_cfg["r"], adapter_cfg["lora_alpha"]
        scale = alpha / (rank**0.5 if adapter_cfg.get("use_rslora") else rank)
        described = f"PEFT: LoRA rank {rank}, alpha {alpha:g}, trained norms: {_yes(norms)}"
        print(f"adapter: {os.path.abspath(path)} ({described})")
        return jax.device_put(adapter), jax.device_put(norms), float(scale)
    ckpt_dir = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    ckpt = Checkpointer(ckpt_dir)
    if ckpt.latest_step() is None:
        raise UserFacingError(f"eval.checkpoint {path!r} holds no orbax checkpoint and no {ADAPTER_CONFIG}")
    lcfg = cfg.lora
    optimizer, _ = optimizer_from_config(cfg)
    run_lora = ckpt.read_meta(ckpt.latest_step()).get("config", {}).get("lora", {})
    norms = lora.init_trained_norms(policy.frozen["norms"]) if run_lora.get("train_norms") else None
    like = init_train_state(lora.init_lora(jax.random.key(0), policy.config, lcfg), optimizer, norms)
    try:
        state, meta = ckpt.restore(None, like=like)
    except CheckpointMismatchError as e:
        message = mismatch_message(e, run_config.to_dict(cfg))
        raise validate.ConfigError([f"eval.checkpoint = {path!r}: {message}"]) from None
    finally:
        ckpt.close()
    print(
        f"checkpoint: {os.path.join(os.path.abspath(ckpt_dir), str(meta.get('step')))} (step {meta.get('step')}: LoRA "
        f"rank {lcfg.rank}, alpha {lcfg.alpha:g}, trained norms: {_yes(state.norms)})"
    )
    return state.lora, state.norms, lora.lora_scale(lcfg)


def _yes(tree: Any) -> str:
    return "no" if tree is None else "yes"


def evaluate_params(
    cfg: RunConfig,
    policy: Policy,
    params: dict[str, Any],
    *,
    lora_scale: float,
    output_dir: str,
    writer: MetricWriter | None = None,
    step: int = 0,
    max_batch: int | None,
) -> dict[str, Any]:
    """Scores `params` on every eval dataset; writes the per-example JSONL and summary JSON.
    max_batch: rollout rows at once (None: sized to the free memory)."""
    os.makedirs(output_dir, exist_ok=True)
    summary: dict[str, Any] = {"metrics": {}, "datasets": {}}
    with reward_pool.RewardPool(timeout_s=cfg.rl.reward_timeout_s) as pool:
        for path in cfg.eval.datasets:
            name = os.path.splitext(os.path.basename(os.path.dirname(path) or path))[0] or "eval"
            name = (
                f"{name}_{os.path.splitext(os.path.basename(path))[0]}"
                if os.path.exists(path)
                else path.replace("/", "_").replace(":", "_")
            )
            result = _evaluate_dataset(
                cfg, policy, params, lora_scale, path, pool, os.path.join(output_dir, f"{name}.jsonl"), max_batch
            )
            summary["datasets"][name] = result
            for k, v in result.items():
                if isinstance(v, float):
                    summary["metrics"][f"{name}/{k}"] = v
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if writer is not None:
        writer.scalars(step, {f"eval/{k}": v for k, v in summary["metrics"].items()})
    return summary


def _eval_prompts(cfg: RunConfig, policy: Policy, path: str):
    """(dataset, tokenized prompts) of one eval dataset; a ConfigError when every prompt is too long."""
    dataset = load_math_dataset(path, max_bad_fraction=cfg.data.max_bad_fraction)
    if cfg.eval.num_examples:
        dataset = dataset.select(range(min(cfg.eval.num_examples, len(dataset))))
    tok = tokenize_prompts(
        policy.tokenizer,
        list(dataset["prompt"]),
        cfg.data.max_prompt_len,
        cfg.data.template,
        system_prompt=cfg.data.system_prompt,
    )
    if len(dataset) and not len(tok.kept_indices):
        raise validate.ConfigError(
            [
                f"data.max_prompt_len = {cfg.data.max_prompt_len}: every one of the {len(dataset)} prompts of "
                f"eval dataset {path!r} is longer, so nothing would be evaluated; raise data.max_prompt_len"
            ]
        )
    return dataset, tok


def _evaluate_dataset(
    cfg: RunConfig, policy: Policy, params, lora_scale: float, path: str, pool, out_file: str, max_batch: int | None
) -> dict[str, Any]:
    """One eval dataset's metrics (pass@1, mean@k), its per-example JSONL and problems file written."""
    dataset, tok = _eval_prompts(cfg, policy, path)
    if tok.num_dropped:
        logging.warning(
            "%s: %d prompts longer than data.max_prompt_len=%d are skipped",
            path,
            tok.num_dropped,
            cfg.data.max_prompt_len,
        )
    result: dict[str, Any] = {"num_examples": int(len(tok.kept_indices)), "skipped_too_long": int(tok.num_dropped)}
    records = []
    for metric, sampling, k in _eval_runs(cfg, policy):
        t0 = time.perf_counter()
        completions, lengths = _completions(cfg, policy, params, lora_scale, tok, sampling, k, max_batch)
        rows = np.repeat(tok.kept_indices, k)
        answers = [dataset[int(i)]["answer"] for i in rows]
        correct = pool.score(completions, answers, "accuracy")
        result[metric] = float(correct.mean()) if len(correct) else 0.0
        result[f"{metric}_response_length"] = float(np.mean(lengths)) if lengths else 0.0
        result[f"{metric}_seconds"] = time.perf_counter() - t0
        for i, (row, completion) in enumerate(zip(rows, completions)):
            records.append(
                {
                    "metric": metric,
                    "source_id": dataset[int(row)]["source_id"],
                    "prompt": dataset[int(row)]["prompt"],
                    "completion": completion,
                    "extracted_answer": rewards.extract_answer(completion, answers[i]),
                    "answer": answers[i],
                    "correct": bool(correct[i] >= 1.0),
                    "length": int(lengths[i]),
                }
            )
    with open(out_file, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    _write_problems(os.path.splitext(out_file)[0] + PROBLEMS_SUFFIX, records)
    return result


def _eval_runs(cfg: RunConfig, policy: Policy) -> list[tuple[str, SamplingConfig, int]]:
    """(metric, sampling, samples per prompt) of each pass over a dataset: greedy pass@1, and
    mean@k of k sampled completions when eval.num_samples is set."""
    greedy = SamplingConfig(
        temperature=0.0, max_new_tokens=cfg.eval.max_new_tokens, eos_ids=policy.stop_ids, pad_id=policy.pad_id
    )
    runs = [("pass_at_1", greedy, 1)]
    if cfg.eval.num_samples:
        sampled = SamplingConfig(
            temperature=cfg.eval.temperature,
            top_p=cfg.eval.top_p,
            max_new_tokens=cfg.eval.max_new_tokens,
            eos_ids=policy.stop_ids,
            pad_id=policy.pad_id,
        )
        runs.append((f"mean_at_{cfg.eval.num_samples}", sampled, cfg.eval.num_samples))
    return runs


def _completions(
    cfg: RunConfig, policy: Policy, params, lora_scale: float, tok, sampling: SamplingConfig, k: int, max_batch
) -> tuple[list[str], list[int]]:
    """k decoded completions per kept prompt (prompt-major) and their lengths in tokens, eval.batch_size
    prompts a call, each call's key folded from the seed by its first prompt."""
    completions, lengths = [], []
    for start in range(0, len(tok.kept_indices), cfg.eval.batch_size):
        sl = slice(start, start + cfg.eval.batch_size)
        batch = generate(
            policy.config,
            params,
            tok.input_ids[sl],
            tok.attention_mask[sl],
            jax.random.fold_in(jax.random.key(cfg.seed), start),
            sampling,
            group_size=k,
            lora_scale=lora_scale,
            max_batch=max_batch,
            options=rollout_options(cfg, policy),
        )
        tokens, lens = np.asarray(batch.tokens), np.asarray(batch.lengths)
        completions += policy.tokenizer.batch_decode([r[:n] for r, n in zip(tokens, lens)], skip_special_tokens=True)
        lengths += lens.tolist()
    return completions, lengths


PROBLEMS_SUFFIX = ".problems.jsonl.gz"


def _write_problems(path: str, records: list[dict[str, Any]]) -> None:
    """Per problem (and sample): metric, id, correct, length in tokens; compressed, kept with the summary."""
    with gzip.open(path, "wt") as f:
        for r in records:
            row = {"metric": r["metric"], "id": r["source_id"], "correct": r["correct"], "length": r["length"]}
            f.write(json.dumps(row) + "\n")


def evaluate(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """The eval command: base model (+ adapter) in the config's quantization, on eval.datasets.

    The config is checked and made the typed tree first (`run_config.build`), before anything is loaded.
    """
    run = run_config.build(cfg, "eval")
    if run.compile_cache:
        compile_cache.enable_compilation_cache(compile_cache.cache_dir(run.compile_cache_dir))
    policy = load_policy(run)
    adapter, norms, scale = load_adapter(run, policy)
    for path in run.eval.datasets:  # refused before anything is generated or written
        _, tok = _eval_prompts(run, policy, path)
        skipped = f" ({tok.num_dropped} longer than data.max_prompt_len skipped)" if tok.num_dropped else ""
        print(f"dataset {path}: {len(tok.kept_indices)} examples{skipped}")
    params = lora.with_lora(policy.frozen, adapter, norms)
    output_dir = os.path.abspath(run.eval.output_dir or os.path.join(run.workdir, "eval"))
    print(f"model: {policy.model_dir} ({policy.quant}); writing to {output_dir} (files of the same names are replaced)")
    writer = MetricWriter(os.path.join(output_dir, "tensorboard"))
    try:
        summary = evaluate_params(
            run,
            policy,
            params,
            lora_scale=scale,
            output_dir=output_dir,
            writer=writer,
            max_batch=run.rollout.max_batch or None,
        )
    finally:
        writer.close()
    summary["model"] = {"path": policy.model_dir, "quant": policy.quant, "adapter": run.eval.checkpoint or None}
    summary["output_dir"] = output_dir
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
