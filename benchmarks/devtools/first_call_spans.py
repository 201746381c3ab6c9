"""Where a rollout's first call spends its time: every trace / lower / backend-compile span, with its
thread and its start and end relative to the call, for the gsm8k workload's rollout (random weights
of a Qwen2.5 size, as `benchmarks.rollout --workload gsm8k` builds them).

    python -m benchmarks.devtools.first_call_spans --model 7B --format nvfp4 --out spans.json
    python -m benchmarks.devtools.first_call_spans --model 7B --format nvfp4 --kernels-only

--kernels-only compiles the call's wgmma kernels alone, each in a small program of its own, one
after another, and reports each one's spans: what a kernel costs in Python (trace, lower) and in
jaxlib (the backend compile, where the Mosaic GPU kernel compiles when the program loads).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from benchmarks import common
from benchmarks import rollout as bench


class ThreadTimeline(common.CompileTimeline):
    """`CompileTimeline` with each span's thread name."""

    def label(self, event_kw: dict) -> str:
        return f"{super().label(event_kw)} @{threading.current_thread().name}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7B")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--kernels-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.tiny, args.prompts, args.group, args.max_new = False, None, None, None

    import jax
    import numpy as np

    import qerl_jax.rollout as rollout
    from qerl_jax.lora import LoraConfig, init_lora, lora_scale, with_lora
    from qerl_jax.models.qwen2 import ModelConfig
    from qerl_jax.rollout import sampler

    run, ids, lengths = bench.gsm8k_inputs(args)
    config = ModelConfig(**bench.model_dict(args))
    params = bench.build_random_params(config, args.format, jax.random.key(0))
    lcfg = LoraConfig(rank=run["lora_rank"], alpha=2.0 * run["lora_rank"])
    params = jax.block_until_ready(with_lora(params, init_lora(jax.random.key(1), config, lcfg)))
    sampling = rollout.SamplingConfig(temperature=1.0, max_new_tokens=run["max_new"], ignore_eos=True)
    options = rollout.RolloutOptions(backend=args.backend, decode_attention=rollout.decode_attention_backend(None))
    kw = dict(group_size=run["group"], lora_scale=lora_scale(lcfg), options=options)

    timeline = ThreadTimeline()
    out: dict = {"model": args.model, "format": args.format}
    if args.kernels_only:
        from pallas_kernels import wgmma_nvfp4
        from qerl_jax.rollout import scheduler, weights

        p_b = scheduler.prompt_bucket(ids.shape[1])
        total = ids.shape[0] * run["group"]
        new_slots = scheduler.new_tokens_bucket(run["max_new"])
        plan = sampler.plan_rollout(config, params, total, p_b, new_slots, group_size=run["group"], options=options)
        packed = {n: w for n, w in weights._packed_and_copied(params)[0].items() if n in plan.wgmma_names}
        layer = jax.eval_shape(weights._wgmma_layer, packed, jax.numpy.int32(0)) if packed else {}
        kernel_weights = [getattr(w, "w", w) for _, w in sorted(layer.items())]  # a fused group as one
        out["kernels"] = []
        for m in sorted({*plan.buckets, plan.admit_prompts * p_b}):
            for w in kernel_weights if m <= wgmma_nvfp4.MAX_ROWS else ():
                x = jax.ShapeDtypeStruct((m, w.shape[1]), jax.numpy.bfloat16)
                t0 = time.time()
                jax.jit(wgmma_nvfp4.wgmma_linear).trace(x, w).lower().compile()
                t1 = time.time()
                out["kernels"].append(
                    {"m": m, "shape": list(w.shape), "s": round(t1 - t0, 3), **timeline.summary(t0, t1)}
                )
                print(json.dumps(out["kernels"][-1]), flush=True)
    else:
        t0 = time.time()
        batch = rollout.generate(config, params, ids, np.ones_like(ids), jax.random.key(2), sampling,
                                 max_new_tokens_per_seq=lengths, **kw)  # fmt: skip
        jax.block_until_ready(batch.tokens)
        t1 = time.time()
        out["first_call_s"] = round(t1 - t0, 2)
        out["summary"] = timeline.summary(t0, t1)
        out["spans"] = [
            (kind, name, round(b - t0, 3), round(e - t0, 3))
            for kind, name, b, e in sorted(timeline.spans, key=lambda s: s[2])
        ]
        print(json.dumps({k: v for k, v in out.items() if k != "spans"}), flush=True)
        for span in out["spans"]:
            if span[3] - span[2] >= 0.05:
                print(*span, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
