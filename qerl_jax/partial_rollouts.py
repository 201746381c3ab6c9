"""Partial rollouts (`rollout.max_staleness` = K >= 1, as APRIL): the tail of a step's rollout carried over.

    exp, stats, carry = collect_partial(cfg, policy, rollout_params, loader, pool, key, carry, step, keep_rate,
                                        max_batch=...)

A step's rollout call keeps more groups in flight than the step needs, one group at a time in queue
order: the groups carried from the last step that have tokens first (their finished samples as they
are, the others resumed where they were paused; the oldest first), then the carried groups that
never started, then the prompts of new loader batches. At most T groups are in flight, the carried
ones included (T: about OVERSAMPLE times the groups the step expects to need, at most twice those it
needs; with DAPO's dynamic sampling more are admitted while too few groups vary, never more than
twice the need plus the groups dropped for equal rewards). The call ends as soon as
`prompts_per_step` groups are complete (with dynamic sampling: complete and with varied rewards) and
every group carried K steps already is complete too: those are counted, never dropped (dropping the
long ones would bias training toward short answers). The step trains on the first complete groups in
queue order (carried first, the oldest first); the other started groups are carried to the next step
with their tokens and the sampler log-probs they were drawn with, so every trained token keeps its
own behaviour log-prob (`rl.old_logp_source`). The call's key is the step's and each sequence draws
from the stream of its row in the call: a resumed sequence draws fresh tokens under the new adapter,
as sampling it anew would.

The cap on the groups in flight bounds what is carried: at most T minus the step's need started
groups (never more than the next step trains), so every group carried K steps that completes is
among the next step's kept groups (they come first in its queue) and no trained token is more than
K steps old. Prompts are taken from the loader a whole batch at a time; a prompt of a batch taken
whose group did not start in the call is carried too, unstarted (no tokens, no staleness: its
`since` is set when its first token is drawn, and it is never forced), so no prompt is lost. The
loader moves past the batches up to the last one a group started from; the others are given back.

The decision to end the call waits for the scores of the complete groups (dynamic sampling), so the
kept set is the same whatever the reward workers' timing: deterministic per seed and row layout.
The carried groups, unstarted ones included, are JSON in the checkpoint's metadata (`to_meta`,
`from_meta`): resume is exact.

With a mesh (`mesh.data` = D > 1) each data shard does all of the above for itself, in its own call
(`data_parallel.generate_data_parallel`, one thread per shard, nothing shared while decoding): its
carried groups (those it paused or took: `CarriedGroup.shard`) first, then its block of each loader
batch (`shard_calls`), its own tracker capping its groups in flight and ending its call once its
share of the groups (`data_parallel.prompt_blocks(prompts_per_step, D)`) is complete and its own
forced groups are. A shard that is done pauses its rows and returns at once, whatever the others
decode; what waits is the end of the step's rollout: the shards' threads are joined and their rows
gathered (across processes, one `process_allgather`), so the step goes on when the last shard has its
share, the done shards' devices idle until then. The kept set is each shard's first complete groups
in its order, sorted; the same for a seed and layout. A checkpoint written on D shards and resumed
on another number deals its groups round-robin (`deal`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np

from qerl_jax import experience
from qerl_jax.data import PromptLoader
from qerl_jax.policy import Policy
from qerl_jax.reward_pool import RewardPool
from qerl_jax.rl import dynamic_sampling
from qerl_jax.rollout import data_parallel
from qerl_jax.rollout.sampler import Partial, RolloutPart
from qerl_jax.run_config import RunConfig

# Groups a call keeps in flight per group the step needs (carried ones included): the surplus is
# what lets the call end before its slowest groups do.
OVERSAMPLE = 1.5
# The most groups in flight per group the step needs (dynamic sampling's dropped groups aside): what a
# call carries then never exceeds what the next step trains, so its forced groups are all kept.
MOST_IN_FLIGHT = 2


@dataclasses.dataclass
class CarriedGroup:
    """A group paused at the end of a step's rollout: its prompt, the step that drew its first token
    (None: unstarted, a prompt taken from the loader that no call has sampled yet), per sample its
    tokens so far (none: never admitted), their sampler log-probs and whether it finished, and its
    data shard."""

    prompt: str
    answer: str
    fields: dict[str, Any]
    prompt_ids: list[int]  # the prompt's real tokens
    since: int | None
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    stopped: list[bool]
    shard: int = 0  # the data shard that paused it, and resumes it (`deal`)


def to_meta(carry: list[CarriedGroup]) -> list[dict[str, Any]]:
    """The carried groups as JSON (float32 log-probs round-trip exactly through JSON's doubles)."""
    return [dataclasses.asdict(c) for c in carry]


def from_meta(meta: list[dict[str, Any]] | None) -> list[CarriedGroup]:
    return [CarriedGroup(**c) for c in meta or []]


def queued(carry: list[CarriedGroup]) -> list[CarriedGroup]:
    """The carry in the order its shards' calls take it: by shard, the started groups first (the
    oldest first: those forced come first), then the unstarted ones; otherwise as it was."""
    return sorted(carry, key=lambda c: (c.shard, c.since is None, c.since or 0))


class PartialTracker:
    """The call's `RolloutMonitor` (with `done`): scores stopped sequences, paces admissions, says when
    the step has its groups. Groups are the call's prompts in order, the `started` carried groups
    first (always admitted); must_G: those that must complete. At first `in_flight` groups may be
    admitted; with dynamic sampling more while the admitted ones are not expected to give `want`
    with varied rewards, never past MOST_IN_FLIGHT * want plus the groups dropped (equal rewards)."""

    def __init__(self, num_groups: int, group_size: int, want: int, submit, *, dynamic: bool, keep_rate: float,
                 in_flight: int, started: int, must_G: np.ndarray):  # fmt: skip
        self.g, self.want, self.dynamic, self.keep_rate = group_size, want, dynamic, keep_rate
        self.num_groups, self.must_G, self._submit, self.started = num_groups, must_G, submit, started
        self.limit = min(num_groups, max(started, in_flight))
        self.finished_N = np.zeros((num_groups * group_size,), bool)
        self.shaped_N = np.full((num_groups * group_size,), np.nan, np.float32)
        self.each_RxN: np.ndarray | None = None
        self._pending: list = []

    def planned_seqs(self) -> int:
        """The sequences the call's rows are planned for: those of the groups in flight, rounded as the
        on-policy step plans them (`dynamic_sampling.round_to_plan`). The groups in flight move with the
        keep rate by one or two (59, 62, 63, 64 for 32 wanted), and each new row count compiled the
        call's programs again inside a step."""
        return dynamic_sampling.round_to_plan(self.limit, self.want) * self.g

    def finished(self, seqs_K: np.ndarray, tokens_KxM: np.ndarray, lengths_K: np.ndarray) -> None:
        self.finished_N[seqs_K] = True
        self._pending.append((np.asarray(seqs_K), self._submit(seqs_K, tokens_KxM, lengths_K)))

    def complete(self) -> np.ndarray:
        """bool [groups]: every sample finished."""
        return self.finished_N.reshape(-1, self.g).all(axis=1)

    def usable(self) -> np.ndarray:
        """bool [groups]: complete (and, with dynamic sampling, with varied rewards)."""
        varied = dynamic_sampling.varied_groups(self.shaped_N, self.g) if self.dynamic else True
        return self.complete() & varied

    def bounds(self, wait: bool) -> tuple[int, int]:
        """With dynamic sampling: every pending score collected first (so `done` does not depend on the
        workers' timing), and more groups admitted while those admitted are not expected to be enough."""
        self._collect(block=self.dynamic)
        if self.dynamic:
            complete, usable = self.complete()[: self.limit], self.usable()[: self.limit]
            more = dynamic_sampling.groups_to_add(self.want, usable, complete, self.keep_rate)
            most = max(self.started, MOST_IN_FLIGHT * self.want + int((complete & ~usable).sum()))
            self.limit = min(self.num_groups, max(self.limit, min(self.limit + more, most)))
        total = self.num_groups * self.g
        return self.limit * self.g, total

    def _collect(self, block: bool) -> None:
        """Stores the scores that have arrived (with `block`, every pending one)."""
        still = []
        for seqs, future in self._pending:
            if not block and not future.done():
                still.append((seqs, future))
                continue
            shaped_K, each_RxK = future.result()
            if self.each_RxN is None:
                self.each_RxN = np.zeros((each_RxK.shape[0], len(self.shaped_N)), np.float32)
            self.shaped_N[seqs], self.each_RxN[:, seqs] = shaped_K, each_RxK
        self._pending = still

    def done(self) -> bool:
        return int(self.usable().sum()) >= self.want and not (self.must_G & ~self.complete()).any()

    def results(self) -> tuple[np.ndarray, np.ndarray]:
        """(shaped_N, each_RxN) once every score is in: NaN / 0 where not scored."""
        self._collect(block=True)
        each = self.each_RxN if self.each_RxN is not None else np.zeros((0, len(self.shaped_N)), np.float32)
        return self.shaped_N, each


def collect_partial(
    cfg: RunConfig, policy: Policy, rollout_params, loader: PromptLoader, pool: RewardPool, key,
    carry: list[CarriedGroup], step: int, keep_rate: float = 1.0, mesh: jax.sharding.Mesh | None = None, *,
    max_batch: int | None,
) -> tuple[experience.Experience | None, dict[str, float], list[CarriedGroup]]:  # fmt: skip
    """Rollouts + rewards of step `step` with the groups `carry` brought (module doc): (the experience of
    the kept groups, None if none; the step's metrics; the groups carried to the next step). With a mesh,
    each data shard runs its own call over its carried groups and its block of each loader batch
    (`shard_calls`); a carried group's `shard` must be one of the mesh's (`deal`)."""
    g, want, dynamic = cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.rl.dynamic_sampling
    shards = data_parallel.shard_count(mesh)
    wants = [b.stop - b.start for b in data_parallel.prompt_blocks(want, shards)]
    if any(not 0 <= c.shard < shards for c in carry):
        raise ValueError(f"carried groups of data shards {sorted({c.shard for c in carry})} on a mesh of {shards}: "
                         "deal them first (`deal`)")  # fmt: skip
    carry = queued(carry)
    mine = [[i for i, c in enumerate(carry) if c.shard == d] for d in range(shards)]
    started = [sum(carry[i].since is not None for i in m) for m in mine]
    flights = [in_flight(w, keep_rate, dynamic) for w in wants]
    new_batches = [-(-max(f - len(m), 0) // w) if w else 0 for w, f, m in zip(wants, flights, mine)]
    before = loader.state()
    refills = cfg.rl.max_refill_rounds if dynamic else 0
    fresh = experience.peek_prompts(cfg, policy, loader, max(*new_batches, 1) + refills)
    prompts = _joined(carry, fresh)
    order = shard_calls(mine, fresh.batch_of, len(carry))
    rows_of = [(o[:, None] * g + np.arange(g)).reshape(-1) for o in order]
    scorer = experience.Scorer(cfg, policy, pool, prompts, g)
    num_groups = len(prompts.answers)
    must_G = np.zeros((num_groups,), bool)
    must_G[: len(carry)] = [c.since is not None and step - c.since >= cfg.rollout.max_staleness for c in carry]
    local = [d for d, _ in data_parallel.local_shards(mesh)] if mesh is not None else [0]
    trackers = {
        d: PartialTracker(len(order[d]), g, wants[d], scorer.for_rows(rows_of[d]), dynamic=dynamic, keep_rate=keep_rate,
                          in_flight=flights[d], started=started[d], must_G=must_G[order[d]])
        for d in local
    }  # fmt: skip
    t0 = time.perf_counter()
    carried_in = {d: _partial_of([carry[i] for i in mine[d]], g, cfg.rollout.max_new_tokens) for d in local}
    parts = {d: RolloutPart(monitor=t, expected_seqs=t.planned_seqs(), partial=carried_in[d]) for d, t in trackers.items()}
    batch, paused = experience.rollout_call(cfg, policy, rollout_params, prompts, key, mesh, order, parts,
                                            max_batch=max_batch)  # fmt: skip
    t_rollout, t0 = time.perf_counter() - t0, time.perf_counter()
    shaped_N, each_RxN = experience.shared_scores(trackers, rows_of, num_groups * g, len(scorer.spec))
    t_reward = time.perf_counter() - t0
    kept, complete_G, carried_G, used = _selection(batch, paused, shaped_N, order, wants, prompts.batch_of, g, dynamic)
    loader.restore(before)
    for _ in range(used):
        next(loader)
    complete = np.flatnonzero(complete_G)
    stats = experience.rollout_stats(
        cfg, scorer, batch, shaped_N, each_RxN, complete, len(kept), used, t_rollout, t_reward
    )
    new_carry = queued([
        _carried(prompts, batch, paused, carry, i, g, step, d) for d, o in enumerate(order) for i in o if carried_G[i]
    ])  # fmt: skip
    stats.update(_partial_stats(carry, batch, kept, g, step, must_G, new_carry, t_rollout))
    if not len(kept):
        return None, stats, new_carry
    exp = experience.kept_experience(batch, scorer, prompts, shaped_N, each_RxN, kept, g, len(complete))
    return exp, stats, new_carry


def _selection(batch, paused: Partial, shaped_N, order, wants, batch_of, g: int, dynamic: bool):
    """(kept: each shard's first wants[d] usable groups in its order, sorted; complete_G; carried_G: the
    groups started, neither kept nor dropped (dynamic sampling: complete, equal rewards), and those
    not started of the carry and of the loader batches used; the loader batches used: up to the last
    one a group started from). Usable: complete (every sample finished; paused ones are empty in the
    batch), and with dynamic sampling with varied rewards."""
    lengths_G = np.asarray(batch.lengths).reshape(-1, g)
    complete_G = (lengths_G > 0).all(axis=1)
    usable_G = complete_G & (dynamic_sampling.varied_groups(shaped_N, g) if dynamic else True)
    kept = np.sort(np.concatenate([o[usable_G[o]][:w] for o, w in zip(order, wants)])).astype(np.int64)
    started_G = (lengths_G > 0).any(axis=1)
    started_G[paused.seqs_K // g] = True
    fresh = batch_of[started_G & (batch_of >= 0)]
    used = int(fresh.max()) + 1 if fresh.size else 0
    carried_G = started_G & ~np.isin(np.arange(len(complete_G)), kept) & ~(complete_G & ~usable_G)
    return kept, complete_G, carried_G | (~started_G & (batch_of < used)), used


def in_flight(want: int, keep_rate: float, dynamic: bool) -> int:
    """T: the groups a shard wanting `want` keeps in flight at first, its carried ones included: about
    OVERSAMPLE times those it expects to need (dynamic sampling: at this keep rate), at most
    MOST_IN_FLIGHT * want. It carries at most T - want started groups: no more than the next step trains."""
    expected = dynamic_sampling.groups_to_admit(want, keep_rate) if dynamic else want
    return min(math.ceil(expected * OVERSAMPLE), MOST_IN_FLIGHT * want)


def shard_calls(mine: list[list[int]], batch_of: np.ndarray, carried: int) -> list[np.ndarray]:
    """Per data shard, the call's groups in the order it samples them: its carried groups (mine[d], indices
    into the carry, the call's first `carried` groups) first, then its block of each fresh loader batch
    (`experience.shard_order`; batch_of: the fresh prompts' batches)."""
    fresh = experience.shard_order(batch_of, len(mine))
    return [np.concatenate([np.asarray(m, np.int64), carried + f]).astype(np.int64) for m, f in zip(mine, fresh)]


def deal(carry: list[CarriedGroup], saved_shards: int, shards: int) -> list[CarriedGroup]:
    """The carry of a checkpoint written on `saved_shards` data shards, for a run on `shards`: as it is on
    the same layout (each group resumes on its shard); on another, dealt round-robin in carry order
    (group i to shard i % shards), the same on every process."""
    if saved_shards == shards:
        return carry
    return [dataclasses.replace(c, shard=i % shards) for i, c in enumerate(carry)]


def _joined(carry: list[CarriedGroup], fresh: experience.StepPrompts) -> experience.StepPrompts:
    """The call's prompts: the carried groups' (batch -1), then the fresh ones, left-padded alike."""
    width = fresh.ids.shape[1]
    ids = np.zeros((len(carry), width), np.int32)
    mask = np.zeros((len(carry), width), np.int32)
    for i, c in enumerate(carry):
        n = len(c.prompt_ids)
        ids[i, width - n :], mask[i, width - n :] = c.prompt_ids, 1
    return experience.StepPrompts(
        ids=np.concatenate([ids, fresh.ids]),
        mask=np.concatenate([mask, fresh.mask]),
        prompts=[c.prompt for c in carry] + fresh.prompts,
        answers=[c.answer for c in carry] + fresh.answers,
        fields=[c.fields for c in carry] + fresh.fields,
        batch_of=np.concatenate([np.full((len(carry),), -1), fresh.batch_of]),
        position=np.concatenate([np.full((len(carry),), -1), fresh.position]),
    )


def _partial_of(carry: list[CarriedGroup], g: int, max_new: int) -> Partial:
    """The carried samples that have tokens, as the call's `Partial` (the carried groups are its first rows)."""
    seqs, tokens, logp, lengths, finished, stopped = [], [], [], [], [], []
    for i, c in enumerate(carry):
        for j in range(g):
            if c.tokens[j]:
                n = len(c.tokens[j])
                seqs.append(i * g + j)
                tokens.append(np.pad(np.asarray(c.tokens[j], np.int32), (0, max_new - n)))
                logp.append(np.pad(np.asarray(c.logprobs[j], np.float32), (0, max_new - n)))
                lengths.append(n)
                finished.append(c.finished[j])
                stopped.append(c.stopped[j])
    k = len(seqs)
    return Partial(
        seqs_K=np.asarray(seqs, np.int64),
        tokens_KxM=np.asarray(tokens, np.int32).reshape(k, max_new),
        logprobs_KxM=np.asarray(logp, np.float32).reshape(k, max_new),
        lengths_K=np.asarray(lengths, np.int32),
        finished_K=np.asarray(finished, bool),
        stopped_K=np.asarray(stopped, bool),
    )


def _carried(prompts: experience.StepPrompts, batch, paused: Partial, carry, group: int, g: int, step: int, shard: int):
    """Group `group` of the call as it stands, to carry (by `shard`): finished samples from the batch, paused
    ones as paused; unstarted (since None) while none has a token."""
    lengths, tokens, logp = np.asarray(batch.lengths), np.asarray(batch.tokens), np.asarray(batch.logprobs)
    truncated = np.asarray(batch.truncated)
    at = {int(s): i for i, s in enumerate(paused.seqs_K)}
    out = CarriedGroup(
        prompt=prompts.prompts[group], answer=prompts.answers[group], fields=prompts.fields[group],
        prompt_ids=prompts.ids[group][prompts.mask[group] == 1].tolist(),
        since=None, tokens=[], logprobs=[], finished=[], stopped=[], shard=shard,
    )  # fmt: skip
    for r in range(group * g, group * g + g):
        if r in at:
            n = int(paused.lengths_K[at[r]])
            sample = (paused.tokens_KxM[at[r], :n], paused.logprobs_KxM[at[r], :n], False, False)
        else:
            n = int(lengths[r])  # 0: never admitted
            sample = (tokens[r, :n], logp[r, :n], n > 0, n > 0 and not truncated[r])
        out.tokens.append(sample[0].tolist())
        out.logprobs.append(sample[1].tolist())
        out.finished.append(bool(sample[2]))
        out.stopped.append(bool(sample[3]))
    if any(out.tokens):  # started: in an earlier call (its step kept), else in this one
        since = carry[group].since if group < len(carry) else None
        out.since = step if since is None else since
    return out


def _partial_stats(
    carry, batch, kept, g: int, step: int, must_G, new_carry, t_rollout: float
) -> dict[str, float]:
    """The off-policy share of the trained tokens (drawn under an earlier step's adapter), the largest
    staleness among the kept groups, the groups forced to finish and those carried on (started, and
    unstarted), the carried tokens re-prefilled; the tokens this call decoded (the carried ones' earlier
    tokens not counted again) and their rate."""
    rows = (kept[:, None] * g + np.arange(g)).reshape(-1)
    before_N = np.zeros((len(np.asarray(batch.lengths)),), np.int64)  # tokens each row had when the call began
    before_N[: len(carry) * g] = [len(t) for c in carry for t in c.tokens]
    trained = float(np.asarray(batch.lengths)[rows].sum())
    ages = [step - carry[i].since for i in kept if i < len(carry) and carry[i].since is not None]
    decoded = float(np.asarray(batch.decoded).sum() - before_N.sum())
    resumed = sum(len(t) for c in carry for t, done in zip(c.tokens, c.finished) if not done)
    return {
        "rollout/decoded_tokens": decoded,
        "rollout/tokens_per_s": decoded / max(t_rollout, 1e-9),
        "rollout/offpolicy_tokens_frac": float(before_N[rows].sum()) / max(trained, 1.0),
        "rollout/staleness_max": float(max(ages, default=0)),
        "rollout/carried_groups": float(sum(c.since is not None for c in new_carry)),
        "rollout/unstarted_groups": float(sum(c.since is None for c in new_carry)),
        "rollout/forced_groups": float(must_G.sum()),
        # Re-prefilled (with their prompts) as their sequences resumed: the cost of carrying, in tokens.
        "rollout/resumed_tokens": float(resumed),
    }
