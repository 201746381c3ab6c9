"""The packed train step's two programs at a workload's shapes: XLA's memory analysis and largest buffers.

    python -m benchmarks.devtools.step_memory --model 7B --sequences 256 --row-len 2304 --rows 96

Lowers and compiles (nothing runs) the micro-step ([micro_batch, row_len] packed rows) and the
update ([sequences, row_len] per-sequence arrays) of `rl.step.make_train_step` for LoRA on a
Qwen2.5-shaped model, and prints each program's argument / output / temp bytes and the five largest
array shapes in its optimized HLO: where a program's memory goes, on whatever device runs it.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import rollout as rollout_bench
from qerl_jax import lora, optim  # noqa: E402
from qerl_jax.models.qwen2 import ModelConfig  # noqa: E402
from qerl_jax.rl import losses  # noqa: E402
from qerl_jax.rl.step import init_train_state, make_train_step  # noqa: E402

SHAPE = re.compile(r"\b(f32|bf16|s32|pred|u8|f16)\[([0-9,]+)\]")
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "u8": 1, "f16": 2}


def largest_shapes(hlo: str, n: int = 5) -> list[str]:
    seen = {(t, dims) for t, dims in SHAPE.findall(hlo)}
    size = lambda td: BYTES[td[0]] * int(np.prod([int(x) for x in td[1].split(",")]))  # noqa: E731
    return [f"{t}[{d}] {size((t, d)) / 2**30:.3f} GiB" for t, d in sorted(seen, key=size, reverse=True)[:n]]


def report(name: str, compiled) -> None:
    m = compiled.memory_analysis()
    gib = lambda x: f"{x / 2**30:.3f} GiB"  # noqa: E731
    print(f"{name}: arguments {gib(m.argument_size_in_bytes)}, outputs {gib(m.output_size_in_bytes)}, "
          f"temp {gib(m.temp_size_in_bytes)}")  # fmt: skip
    for line in largest_shapes(compiled.as_text()):
        print(f"    {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="7B", choices=("7B", "tiny"))
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--row-len", type=int, default=2304)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--quant", default="bf16")
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--remat", default="full")
    p.add_argument("--attention", default="flash")
    args = p.parse_args()
    config = ModelConfig(**(rollout_bench.QWEN25_7B if args.model == "7B" else rollout_bench.TINY))
    opt = optim.make_optimizer(1e-5, warmup_steps=0, total_steps=100)
    lcfg = lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    state = jax.eval_shape(lambda: init_train_state(lora.init_lora(jax.random.key(1), config, lcfg), opt))
    step = make_train_step(config, losses.LossConfig(kind="dapo"), opt, lora_scale=1.0, remat=args.remat,
                           attention=args.attention, micro_batch_size=args.micro_batch_size,
                           logprob_chunk=args.logprob_chunk)  # fmt: skip
    b, length = args.sequences, args.row_len
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    per_seq = {"token_index": i32(b, length), "response_mask": f32(b, length), "old_logp": f32(b, length),
               "advantages": f32(b)}  # fmt: skip
    trainable = (state.lora, state.norms)
    acc = (jax.tree.map(lambda x: f32(*x.shape), trainable), f32(b, length - 1), f32(b, length - 1), None)
    report("update", step.update.lower(state, per_seq, None, acc).compile())
    from benchmarks import common

    frozen = jax.eval_shape(lambda: common.random_params(config, quant=args.quant, seed=0))
    mb = args.micro_batch_size
    micro = step.micro.lower(trainable, frozen, i32(mb, length), i32(mb, length), jnp.int32(0), per_seq, None, acc)
    report("micro", micro.compile())


if __name__ == "__main__":
    main()
