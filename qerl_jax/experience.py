"""One step's experience: rollouts of the step's prompts, scored, and the groups it trains on.

    exp, stats = collect_experience(cfg, policy, rollout_params, loader, pool, key, mesh, keep_rate)

With DAPO's dynamic sampling (`rl.dynamic_sampling`), the loader batches a step may need (1 +
`rl.max_refill_rounds`) are sampled in ONE continuous-batching rollout, in loader order:
sequences are scored as they stop, while the rest decode, and once enough groups with varied
rewards are certain the rest are dropped (`rl.dynamic_sampling.GroupTracker`). The kept groups
are those refill rounds (one rollout per batch, until enough groups vary) would keep from the
same samples: sample g of prompt i of peeked batch b draws from PRNG stream (b * B + i) * G + g
whichever call samples it. The loader ends after the last batch a kept group came from, as the
rounds would leave it: the batches peeked but not needed are given back.

With a mesh, each data shard samples its block of every batch and keeps its share of the groups
(the first ones with varied rewards in its own order); its process scores its sequences.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import threading
import time
from typing import Any

import jax
import numpy as np

from qerl_jax import lora, rewards
from qerl_jax.data import PromptLoader, tokenize_prompts
from qerl_jax.policy import Policy
from qerl_jax.reward_pool import RewardPool
from qerl_jax.rl import dynamic_sampling, losses
from qerl_jax.rollout import batch as rollout_batch
from qerl_jax.rollout import data_parallel
from qerl_jax.rollout.sampler import RolloutBatch, RolloutPart, generate
from qerl_jax.run_config import RunConfig, rollout_options, sampling_config


@dataclasses.dataclass
class Experience:
    """Scored rollouts of the groups kept for training."""

    rollout: RolloutBatch
    answers: list[str]
    completions: list[str]
    prompts: list[str]
    rewards: np.ndarray  # float32 [N], after shaping
    accuracy: np.ndarray  # float32 [N], 1 where the answer was right
    groups_sampled: int
    groups_kept: int


@dataclasses.dataclass
class StepPrompts:
    """The prompts of the loader batches a step may sample, in loader order (B of them)."""

    ids: np.ndarray  # int32 [B, P], left-padded
    mask: np.ndarray  # int32 [B, P]
    prompts: list[str]
    answers: list[str]
    fields: list[dict[str, Any]]  # per prompt, the keyword fields a reward may take
    batch_of: np.ndarray  # int [B]: the peeked batch each prompt came from
    position: np.ndarray  # int [B]: its row in that batch


def peek_prompts(cfg: RunConfig, policy: Policy, loader: PromptLoader, batches: int) -> StepPrompts:
    """The next `batches` loader batches, tokenized (prompts over data.max_prompt_len dropped)."""
    parts = []
    for b in range(batches):
        rows = next(loader)
        tok = tokenize_prompts(
            policy.tokenizer, rows["prompt"], cfg.data.max_prompt_len, cfg.data.template,
            system_prompt=cfg.data.system_prompt,
        )  # fmt: skip
        kept = np.asarray(tok.kept_indices, np.int64)
        fields = _reward_fields(rows, kept)
        parts.append((tok, kept, [rows["prompt"][i] for i in kept], [rows["answer"][i] for i in kept], fields, b))
    return StepPrompts(
        ids=np.concatenate([p[0].input_ids for p in parts]).astype(np.int32),
        mask=np.concatenate([p[0].attention_mask for p in parts]).astype(np.int32),
        prompts=[x for p in parts for x in p[2]],
        answers=[x for p in parts for x in p[3]],
        fields=[x for p in parts for x in p[4]],
        batch_of=np.concatenate([np.full(len(p[1]), p[5]) for p in parts]).astype(np.int64),
        position=np.concatenate([p[1] for p in parts]),
    )


def _reward_fields(rows: dict[str, Any], indices: np.ndarray) -> list[dict[str, Any]]:
    """Per prompt, the keyword fields a reward may take: its text and its dataset row's other columns."""
    columns = [k for k in rows if k != "answer"]
    value = lambda x: x.item() if isinstance(x, np.generic) else x  # noqa: E731 (plain Python for the workers)
    return [{k: value(rows[k][i]) for k in columns} for i in indices]


def shard_order(batch_of: np.ndarray, shards: int) -> list[np.ndarray]:
    """Per data shard, its prompts in the order it samples them: its block of each batch in turn."""
    order = [[] for _ in range(shards)]
    for b in np.unique(batch_of):
        members = np.flatnonzero(batch_of == b)
        for d, block in enumerate(data_parallel.prompt_blocks(len(members), shards)):
            order[d].append(members[block])
    return [np.concatenate(o) if o else np.zeros((0,), np.int64) for o in order]


class Scorer:
    """Decodes stopped sequences and submits them to the reward pool; keeps their texts. A step's rows
    are prompt-major over `step`'s prompts (row r: prompt r // group_size); one per step, shared by its
    shards' monitors (`for_rows`)."""

    def __init__(self, cfg: RunConfig, policy: Policy, pool: RewardPool, step: StepPrompts, group_size: int):
        self.cfg, self.tokenizer, self.pool, self.step, self.g = cfg, policy.tokenizer, pool, step, group_size
        self.spec = rewards.parse_reward_spec(cfg.rl.reward, cfg.rl.reward_weights)
        self.weights = np.asarray([w for _, w in self.spec], np.float32)
        self.texts: dict[int, str] = {}
        self._lock = threading.Lock()  # shard threads decode through one tokenizer

    def for_rows(self, rows_N: np.ndarray):
        """A `GroupTracker` submit function over a call whose row k is global row rows_N[k]."""
        return lambda seqs, tokens, lengths: self.submit(rows_N[seqs], tokens, lengths)

    def submit(self, rows_K: np.ndarray, tokens_KxM: np.ndarray, lengths_K: np.ndarray) -> concurrent.futures.Future:
        with self._lock:
            texts = self.tokenizer.batch_decode(
                [t[:n] for t, n in zip(tokens_KxM, lengths_K)], skip_special_tokens=True
            )
        self.texts.update(zip(rows_K.tolist(), texts))
        prompts = rows_K // self.g
        future = self.pool.submit_each(
            texts, [self.step.answers[p] for p in prompts], [name for name, _ in self.spec],
            fields=[self.step.fields[p] for p in prompts],
        )  # fmt: skip
        return map_future(future, lambda each_RxK: (self.shape(each_RxK, lengths_K), each_RxK))

    def completions(self, rows_K: np.ndarray, tokens_KxM: np.ndarray, lengths_K: np.ndarray) -> list[str]:
        """The texts of rows; those another process scored are decoded here."""
        missing = [k for k, r in enumerate(rows_K) if int(r) not in self.texts]
        if missing:
            texts = self.tokenizer.batch_decode(
                [tokens_KxM[k][: lengths_K[k]] for k in missing], skip_special_tokens=True
            )
            self.texts.update(zip(rows_K[missing].tolist(), texts))
        return [self.texts[int(r)] for r in rows_K]

    def shape(self, each_RxK: np.ndarray, lengths_K: np.ndarray) -> np.ndarray:
        """The shaped rewards: the weighted sum of the rewards, DAPO's overlong penalty added."""
        shaped = self.weights @ each_RxK
        if self.cfg.rl.overlong_cache:
            shaped = shaped + np.asarray(
                losses.overlong_penalty(
                    lengths_K, self.cfg.rollout.max_new_tokens, self.cfg.rl.overlong_cache, self.cfg.rl.overlong_penalty
                )
            )
        return shaped.astype(np.float32)


def map_future(future: concurrent.futures.Future, fn) -> concurrent.futures.Future:
    """A future of fn(future's result), or of its exception."""
    out = concurrent.futures.Future()

    def done(f):
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 (handed to whoever waits on it)
            out.set_exception(e)

    future.add_done_callback(done)
    return out


def collect_experience(
    cfg: RunConfig,
    policy: Policy,
    rollout_params,
    loader: PromptLoader,
    pool: RewardPool,
    key,
    mesh: jax.sharding.Mesh | None = None,
    keep_rate: float = 1.0,
    *,
    max_batch: int | None,
) -> tuple[Experience | None, dict[str, float]]:
    """Rollouts + rewards for `prompts_per_step` groups (module doc). keep_rate: the expected
    share of groups with varied rewards (the last step's `rollout/keep_rate`): it paces how many
    prompts are admitted before their groups' rewards are known, not what is kept. max_batch:
    rollout rows at once (`memory.Resolved.max_batch`; None: sized to the free memory). Returns
    (None, stats) when no group is kept."""
    g, want, dynamic = cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.rl.dynamic_sampling
    before = loader.state()
    step = peek_prompts(cfg, policy, loader, 1 + (cfg.rl.max_refill_rounds if dynamic else 0))
    shards = data_parallel.shard_count(mesh)
    order = shard_order(step.batch_of, shards)
    wants = [b.stop - b.start for b in data_parallel.prompt_blocks(want, shards)]
    scorer = Scorer(cfg, policy, pool, step, g)
    local = [d for d, _ in data_parallel.local_shards(mesh)] if mesh is not None else [0]
    rows_of = [(o[:, None] * g + np.arange(g)).reshape(-1) for o in order]
    trackers = {
        d: dynamic_sampling.GroupTracker(
            len(order[d]), g, wants[d], scorer.for_rows(rows_of[d]), dynamic=dynamic, keep_rate=keep_rate
        )
        for d in local
    }
    t0 = time.perf_counter()
    planned = [dynamic_sampling.groups_to_plan(w, keep_rate) if dynamic else w for w in wants]
    batch = _rollout(cfg, policy, rollout_params, step, key, mesh, order, trackers, planned, max_batch)
    t_rollout = time.perf_counter() - t0
    t0 = time.perf_counter()
    shaped_N, each_RxN = shared_scores(trackers, rows_of, len(step.answers) * g, len(scorer.spec))
    t_reward = time.perf_counter() - t0
    kept, sampled, used = select_groups(shaped_N, order, wants, g, dynamic, step.batch_of)
    loader.restore(before)
    for _ in range(used):
        next(loader)
    stats = rollout_stats(cfg, scorer, batch, shaped_N, each_RxN, sampled, len(kept), used, t_rollout, t_reward)
    if not len(kept):
        return None, stats
    return kept_experience(batch, scorer, step, shaped_N, each_RxN, kept, g, len(sampled)), stats


def select_groups(
    shaped_N: np.ndarray, order: list[np.ndarray], wants: list[int], g: int, dynamic: bool, batch_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """(kept prompts, sampled prompts, loader batches used) of a step: each shard keeps the first
    wants[d] groups with varied rewards in its own order (`order[d]`; all its first wants[d]
    without dynamic sampling) and samples up to the last of them; the loader gives up every batch
    up to the last one a shard needed. shaped_N: the step's shaped rewards, NaN where not scored."""
    kept, sampled, used = [], [], 1
    for prompts, want in zip(order, wants):
        rows = (prompts[:, None] * g + np.arange(g)).reshape(-1)
        needed = dynamic_sampling.needed_groups(shaped_N[rows], g, want) if dynamic else min(want, len(prompts))
        kept.append(prompts[dynamic_sampling.kept_groups(shaped_N[rows[: needed * g]], g, want, dynamic)])
        sampled.append(prompts[:needed])
        if needed:
            used = max(used, int(batch_of[prompts[needed - 1]]) + 1)
    return np.sort(np.concatenate(kept)), np.concatenate(sampled), used


def _rollout(cfg, policy, rollout_params, step: StepPrompts, key, mesh, order, trackers, planned, max_batch):
    """One rollout call over every peeked prompt (each sample on its stream, module doc), each
    shard's rows planned for `planned` groups (those it expects to admit; more as rows free up)."""
    g = cfg.rollout.group_size
    streams = ((step.batch_of * cfg.rollout.prompts_per_step + step.position)[:, None] * g + np.arange(g)).reshape(-1)
    parts = {d: RolloutPart(monitor=t, expected_seqs=planned[d] * g) for d, t in trackers.items()}
    key = jax.random.fold_in(key, 0)  # the first batch draws what a call per batch drew for it
    return rollout_call(cfg, policy, rollout_params, step, key, mesh, order, parts, streams=streams,
                        max_batch=max_batch)  # fmt: skip


def rollout_call(
    cfg: RunConfig, policy: Policy, rollout_params, step: StepPrompts, key, mesh: jax.sharding.Mesh | None,
    order: list[np.ndarray], parts: dict[int, RolloutPart], *, streams: np.ndarray | None = None,
    max_batch: int | None,
):  # fmt: skip
    """A step's rollout over `step`'s prompts, finished on the device: `generate` with one shard (its
    order the prompts'), else `generate_data_parallel` with each shard's prompts in `order`. parts: each
    local shard's monitor, expected_seqs and partial (their streams: `streams`, default row r on stream
    r). Returns what the engine returns: the batch, and the paused sequences where the parts carry
    partials."""
    common = dict(
        group_size=cfg.rollout.group_size,
        lora_scale=lora.lora_scale(cfg.lora),
        max_batch=max_batch,
        options=rollout_options(cfg, policy),
    )
    sampling = sampling_config(cfg, policy)
    if mesh is None:
        part = dataclasses.replace(parts[0], streams=streams)
        out = generate(policy.config, rollout_params, step.ids, step.mask, key, sampling, part=part, **common)
    else:
        plan = data_parallel.ShardPlan(prompts=order, streams=streams, parts=parts)
        out = data_parallel.generate_data_parallel(
            policy.config, rollout_params, step.ids, step.mask, key, sampling, mesh=mesh, plan=plan, **common
        )
    jax.block_until_ready(out[0].tokens if isinstance(out, tuple) else out.tokens)
    return out


def shared_scores(trackers, rows_of, num_rows: int, num_rewards: int) -> tuple[np.ndarray, np.ndarray]:
    """(shaped_N, each_RxN) over the step's rows (NaN / 0 where not scored), on every process."""
    shaped_N = np.zeros((num_rows,), np.float32)
    known_N = np.zeros((num_rows,), bool)
    each_RxN = np.zeros((num_rewards, num_rows), np.float32)
    mine_N = np.zeros((num_rows,), bool)
    for d, tracker in trackers.items():
        shaped, each = tracker.results()
        rows = rows_of[d]
        mine_N[rows] = True
        known_N[rows] = ~np.isnan(shaped)
        shaped_N[rows] = np.nan_to_num(shaped)
        if each.shape[0]:
            each_RxN[:, rows] = each
    shaped_N, each_RxN = data_parallel.share_rows(shaped_N, mine_N), data_parallel.share_rows(each_RxN, mine_N)
    known_N = data_parallel.share_rows(known_N, mine_N)
    return np.where(known_N, shaped_N, np.nan).astype(np.float32), each_RxN


def rollout_stats(cfg, scorer, batch, shaped_N, each_RxN, sampled, kept, used, t_rollout, t_reward) -> dict[str, float]:
    """The step's rollout metrics; reward statistics over the groups `sampled` (prompt indices: those up
    to each shard's last needed one, every reward known); kept: the groups trained on, used: the loader
    batches the step took."""
    g = cfg.rollout.group_size
    lengths, decoded = np.asarray(batch.lengths), np.asarray(batch.decoded)
    rows = (np.sort(sampled)[:, None] * g + np.arange(g)).reshape(-1)
    stats = {
        "time/rollout_s": t_rollout,
        "time/reward_s": t_reward,
        "rollout/tokens_per_s": float(lengths.sum()) / max(t_rollout, 1e-9),
        "rollout/decoded_tokens": float(decoded.sum()),
        # Decode-loop steps (each one token for every live row): the tail of few rows costs steps, not
        # tokens. On a mesh: summed over the data shards' calls.
        "rollout/decode_steps": float(np.sum(np.asarray(batch.steps) - 1)),
        # Its segments: each hands control back to the host (refills, compactions, the monitor's checks).
        "rollout/decode_segments": float(np.asarray(batch.steps).shape[0]),
        **loop_stats(batch),
        # Decoded for groups past the last one needed: admitted on the keep rate's estimate, then
        # dropped (or finished unneeded). The cost of deciding dynamic sampling in one call.
        "rollout/unused_tokens_frac": 1.0 - float(decoded[rows].sum()) / max(float(decoded.sum()), 1.0),
        "rollout/groups_sampled": float(len(sampled)),
        "rollout/groups_kept": float(kept),
        "rollout/prompt_batches": float(used),
        "rollout/keep_rate": float(dynamic_sampling.varied_groups(shaped_N[rows], g).mean()) if len(rows) else 1.0,
    }
    if not len(rows):
        return stats
    raw = scorer.weights @ each_RxN[:, rows]
    stats["reward/mean_sampled"] = float(shaped_N[rows].mean())
    stats["reward/accuracy_sampled"] = float((raw >= 1.0).mean())
    for (name, _), scores in zip(scorer.spec, each_RxN[:, rows]):  # unweighted, per reward
        # TensorBoard keeps [A-Za-z0-9_./-] in tags: "module:function" would be logged under another name.
        stats[f"reward/{re.sub(r'[^A-Za-z0-9_./-]', '_', name)}_mean_sampled"] = float(scores.mean())
    # -log p of the sampled tokens under the sampler (quantized, AQN noise in its norms): a Monte
    # Carlo estimate of the sampling policy's entropy per token
    mask = np.asarray(batch.response_mask, bool)[rows]
    logp = np.asarray(batch.logprobs, np.float64)[rows]
    stats["rollout/entropy_mc"] = -float(logp[mask].sum()) / max(int(mask.sum()), 1)
    return stats


def loop_stats(batch) -> dict[str, float]:
    """Where the decode loop's time went (`RolloutBatch.segment_s`; on a mesh summed over the data
    shards' calls): the host's work between segments (scheduling, admission inputs, harvests) and
    the segments themselves (the device's admissions, compactions and decoding). time/rollout_s
    less both is the call's set-up (weights, programs) and assembly. And the rows a decode step ran
    on average (its bucket's, `segment_rows`)."""
    out = {}
    if batch.segment_s is not None:
        host_s, device_s = np.asarray(batch.segment_s, np.float64).reshape(-1, 2).sum(axis=0)
        out |= {"time/rollout_loop_host_s": float(host_s), "time/rollout_loop_device_s": float(device_s)}
    if batch.segment_rows is not None:  # a loop step's cost follows its bucket's rows, live or not
        steps = np.asarray(batch.steps, np.float64) - 1
        rows = np.asarray(batch.segment_rows, np.float64)
        out["rollout/rows_per_decode_step"] = float((steps * rows).sum() / max(steps.sum(), 1.0))
    return out


def kept_experience(batch, scorer, step, shaped_N, each_RxN, kept, g: int, sampled: int) -> Experience:
    """The `Experience` of the groups `kept` (prompt indices of `step`, in the order trained) out of the
    step's rollout `batch` and its scores; sampled: how many groups the step sampled."""
    rows = (kept[:, None] * g + np.arange(g)).reshape(-1)
    raw = scorer.weights @ each_RxN[:, rows]
    # Selected on the host: a gather on the device compiles for each new row count of the call.
    selected = jax.device_put(rollout_batch.select_rows(jax.device_get(batch), rows))
    return Experience(
        rollout=selected,
        answers=[step.answers[r // g] for r in rows],
        completions=scorer.completions(rows, np.asarray(selected.tokens), np.asarray(selected.lengths)),
        prompts=[step.prompts[r // g] for r in rows],
        rewards=shaped_N[rows].astype(np.float32),
        accuracy=(raw >= 1.0).astype(np.float32),
        groups_sampled=sampled,
        groups_kept=len(kept),
    )
