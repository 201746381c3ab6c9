"""The rollout's programs compiled for an H100 on a machine without a GPU, and their memory: XLA's
buffer assignment (`compiled.memory_analysis()`) against the engine's estimate
(`qerl_jax.rollout.budget.rollout_memory`, what `generate` sizes its rows with).

    pip install "jax-cuda12-plugin==$JAXV" "jax-cuda12-pjrt==$JAXV"   # XLA's GPU compiler; no GPU needed
    JAX_PLATFORMS=cpu python -m benchmarks.devtools.rollout_memory --formats bf16,nvfp4 --rows 256

For each format, the admission program of the first row bucket, the decode program of every
bucket and the compaction into the next are compiled for the H100 (deviceless, as
`hlo_census.py`) with shape-only Qwen2.5 weights and the weight copies `generate` makes on
Hopper. Per program: its temporaries (XLA's temp buffer), the bytes of its donated inputs it
updates in place (aliased), and the estimate's term for it. A decode program must alias its
whole cache (no second copy: once, a loop-carried layout change made XLA transpose the 7B
cache into a 30 GiB temporary) and the temporaries must stay within the estimate.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.devtools import hlo_census

GIB = 2**30


def measure(fmt: str, args) -> list[dict]:
    from qerl_jax.rollout import cache_bytes  # noqa: PLC0415

    device = hlo_census.h100_device()
    setup = hlo_census.rollout_setup(
        args.size,
        fmt,
        args.rows,
        prompt_len=args.prompt_len,
        new_slots=args.new_slots,
        lora_rank=args.lora_rank,
        device=device,
        group_size=args.group_size,
    )
    plan, static = setup["plan"], setup["static"]
    mem = plan.memory
    slots = args.prompt_len + args.new_slots
    print(
        f"{fmt}: rows {plan.buckets}, admission {plan.admit_rows} rows / {plan.admit_prompts} prompts; "
        f"bf16 copies {list(plan.dense_names)}, wgmma copies {list(plan.wgmma_names)}"
    )
    print(
        f"  estimate: KV cache {mem.kv_cache / GIB:.2f}, row state {mem.row_state / GIB:.3f}, admission "
        f"{mem.admission / GIB:.2f}, decode {mem.decode / GIB:.2f}, compaction {mem.compaction / GIB:.2f}, "
        f"weight copies {mem.weight_copies / GIB:.2f} = {mem.total / GIB:.2f} GiB"
    )
    estimates = {"admit": mem.admission, "decode": mem.decode, "compact": mem.compaction}
    jobs = [(*job, estimates[job[0]]) for job in hlo_census.rollout_programs(setup, device)]
    rows = []
    for name, bucket, fn, fn_args, estimate in jobs:
        t0 = time.perf_counter()
        with hlo_census.as_if_hopper():
            compiled = fn.trace(static, *fn_args).lower().compile()
        m = compiled.memory_analysis()
        cache_b = cache_bytes(setup["config"], bucket, slots)
        work = m.temp_size_in_bytes + (m.output_size_in_bytes if name == "compact" else 0)
        row = dict(
            format=fmt,
            program=name,
            rows=bucket,
            cache_bytes=cache_b,
            temp_bytes=m.temp_size_in_bytes,
            alias_bytes=m.alias_size_in_bytes,
            output_bytes=m.output_size_in_bytes,
            work_bytes=work,
            estimate_bytes=estimate,
            within_estimate=work <= estimate,
            in_place=name == "compact" or m.alias_size_in_bytes >= cache_b,
            compile_s=round(time.perf_counter() - t0, 1),
        )
        rows.append(row)
        print(
            f"  {name:>8} {bucket:>4} rows: temp {m.temp_size_in_bytes / GIB:7.3f} GiB"
            f"{' + new bucket ' + format(m.output_size_in_bytes / GIB, '.3f') if name == 'compact' else ''}"
            f" | aliased {m.alias_size_in_bytes / GIB:6.2f} of cache {cache_b / GIB:6.2f} GiB"
            f" | estimate {estimate / GIB:6.3f} GiB | {'ok' if row['within_estimate'] and row['in_place'] else 'OVER'}"
            f" ({row['compile_s']} s)",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hlo_census.add_rollout_args(parser, size="7B", rows=256, new_slots=2048)
    args = parser.parse_args(argv)
    rows = [r for fmt in args.formats.split(",") for r in measure(fmt, args)]
    bad = [r for r in rows if not (r["within_estimate"] and r["in_place"])]
    print("all programs within the estimate, caches updated in place" if not bad else f"{len(bad)} program(s) OVER")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
