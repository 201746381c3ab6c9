"""The FP8 (E4M3) base matmul (`qerl_jax.fp8`) against the bf16 one, at Qwen2.5-7B layer shapes, and
the log-prob error of the FP8 path against the bf16-activation path on a random NVFP4 model.

    python -m benchmarks.devtools.fp8_linear --out $OUT/fp8_linear.json   # GPU (Hopper)
    python -m benchmarks.devtools.fp8_linear --tiny                      # CPU smoke run
    python -m benchmarks.devtools.fp8_linear --gguf q15.gguf --text gsm8k/train.jsonl --rows ''   # a real model, accuracy only

Matmuls: for each row count M and each 7B projection group (q/k/v fused, o, gate/up fused, down),
  bf16:   `linear.matmul_nt` on the NVFP4 weight's bf16 copy (the rollout's and, dequantized in
          the step, the train step's path today), forward and input gradient;
  fp8:    `fp8.fp8_matmul` on its `Fp8Weight` (W and W.T copies), forward and input gradient;
  fp8/bf16out: the same FP8 dot with a bf16 product (rescaled after), forward only.
Times: median of --reps calls after a warm-up, each call one jitted matmul, synchronized.
The compiled program of the first fp8 matmul is searched for cuBLASLt's FP8 GEMM custom call.

Accuracy: `qwen2.forward` of a random NVFP4 model (--model shapes, --layers layers) on random
tokens, its base matmuls through the bf16 path and through `linear.fp8_train_base(min_rows=1)`: the mean
and largest |log p| difference at the tokens, and the mean KL(bf16 || fp8) per position. With --gguf,
the same on that real model (NVFP4, as a run loads it) over GSM8K text (--text: question and answer of
its first problems, packed into --batch rows of --seq tokens): the train forward's log-prob error at
the text's tokens and the sampler's next-token KL, teacher-forced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import fp8, linear
from qerl_jax.linear import matmul_nt


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fp8_bf16_out(x, w):
    x_q, s = fp8.quantize_rows(x)
    y = jax.lax.dot_general(x_q, w.w_NxK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return y.astype(jnp.float32) * s[:, None] * w.scale_N[None, :]


def matmuls(shapes: dict[str, tuple[int, int]], rows: list[int], reps: int) -> list[dict]:
    out = []
    fwd_bf16 = jax.jit(lambda x, w: matmul_nt(x, w).astype(jnp.bfloat16))
    fwd_fp8 = jax.jit(lambda x, w: fp8.fp8_matmul(x, w).astype(jnp.bfloat16))
    fwd_fp8_b = jax.jit(lambda x, w: _fp8_bf16_out(x, w).astype(jnp.bfloat16))
    # the input gradient alone (W frozen): the backward's work per projection
    bwd_bf16 = jax.jit(lambda x, w, g: jax.vjp(lambda x_: matmul_nt(x_, w), x)[1](g)[0])
    bwd_fp8 = jax.jit(lambda x, w, g: jax.vjp(lambda x_: fp8.fp8_matmul(x_, w), x)[1](g)[0])
    checked = False
    for name, (n, k) in shapes.items():
        key = jax.random.key(hash(name) % 2**31)
        w_bf16 = (0.02 * jax.random.normal(key, (n, k), jnp.float32)).astype(jnp.bfloat16)
        w_fp8 = jax.block_until_ready(fp8.from_dense(w_bf16, transposed=True))
        for m in rows:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
            g = jax.random.normal(jax.random.fold_in(key, m + 1), (m, n), jnp.float32)
            if not checked:
                hlo = fwd_fp8.lower(x, w_fp8).compile().as_text()
                checked = True
                out.append({"fp8_gemm_in_hlo": "f8" in hlo and "cublas" in hlo, "custom_calls": sorted(
                    {line.split('custom_call_target="')[1].split('"')[0] for line in hlo.splitlines()
                     if 'custom_call_target="' in line})})  # fmt: skip
            row = {"proj": name, "N": n, "K": k, "M": m}
            row["fwd_bf16_ms"] = 1e3 * _time(fwd_bf16, x, w_bf16, reps=reps)
            row["fwd_fp8_ms"] = 1e3 * _time(fwd_fp8, x, w_fp8, reps=reps)
            row["fwd_fp8_bf16out_ms"] = 1e3 * _time(fwd_fp8_b, x, w_fp8, reps=reps)
            row["bwd_bf16_ms"] = 1e3 * _time(bwd_bf16, x, w_bf16, g, reps=reps)
            row["bwd_fp8_ms"] = 1e3 * _time(bwd_fp8, x, w_fp8, g, reps=reps)
            y_ref = np.asarray(matmul_nt(x, w_bf16))
            y_fp8 = np.asarray(fp8.fp8_matmul(x, w_fp8))
            row["fwd_rel_err"] = float(np.linalg.norm(y_fp8 - y_ref) / np.linalg.norm(y_ref))
            row["flops"] = 2 * m * n * k
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def real_model(gguf: str, text: str, batch: int, seq: int):
    """(config, NVFP4 params, ids [batch, seq]) of a real model, as `qerl_jax.main` loads it, and the
    tokens of the jsonl file `text`'s problems (question, answer) one after another."""
    from qerl_jax import run_config
    from qerl_jax.config import default_config
    from qerl_jax.policy import load_policy

    c = default_config()
    c.model.path, c.model.quant = gguf, "nvfp4"
    policy = load_policy(run_config.from_config_dict(c))
    ids: list[int] = []
    with open(text) as f:
        for line in f:
            row = json.loads(line)
            ids += policy.tokenizer.encode(f"{row['question']}\n{row['answer']}\n\n")
            if len(ids) >= batch * seq:
                break
    return policy.config, policy.frozen, jnp.asarray(np.array(ids[: batch * seq], np.int32).reshape(batch, seq))


def logprob_error(model: str, layers: int, batch: int, seq: int, gguf: str = "", text: str = "") -> dict:
    from benchmarks import common
    from qerl_jax.models.qwen2 import forward

    if gguf:
        config, params, ids = real_model(gguf, text, batch, seq)
        model = os.path.basename(gguf)
    else:
        config = common.model_config(model)
        config = dataclasses.replace(config, num_hidden_layers=min(layers, config.num_hidden_layers))
        params = common.random_params(config, quant="nvfp4", seed=0)
        ids = jax.random.randint(jax.random.key(5), (batch, seq), 0, config.vocab_size)
    run = jax.jit(lambda p, i: jax.nn.log_softmax(forward(config, p, i), axis=-1))
    logp_bf16 = run(params, ids)
    logp_fp8 = run(linear.fp8_train_base(params, min_rows=1), ids)
    at_bf16 = jnp.take_along_axis(logp_bf16[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    at_fp8 = jnp.take_along_axis(logp_fp8[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    diff = jnp.abs(at_fp8 - at_bf16)
    kl = jnp.sum(jnp.exp(logp_bf16) * (logp_bf16 - logp_fp8), axis=-1)
    entropy = -jnp.sum(jnp.exp(logp_bf16) * logp_bf16, axis=-1)
    return {
        "model": model, "layers": config.num_hidden_layers, "tokens": batch * seq,
        "mean_abs_logp_diff": float(diff.mean()), "max_abs_logp_diff": float(diff.max()),
        "mean_kl_bf16_fp8": float(kl.mean()), "mean_entropy_bf16": float(entropy.mean()),
    }  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rows", default="256,1024,4096")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--model", default="1.5B", help="the accuracy check's random model shapes")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--gguf", default="", help="the accuracy check on this real model instead (a GGUF file or checkpoint directory; NVFP4)")
    p.add_argument("--text", default="", help="with --gguf: a GSM8K-style jsonl whose text is scored")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.tiny:
        shapes, rows, reps = {"qkv": (96, 64), "down": (64, 160)}, [16, 40], 2
    else:
        d, i, kv = 3584, 18944, 512
        shapes = {"q+k+v": (d + 2 * kv, d), "o": (d, d), "gate+up": (2 * i, d), "down": (d, i)}
        rows, reps = [int(r) for r in args.rows.split(",") if r], args.reps
    result = {"device": str(jax.devices()[0]), "matmuls": matmuls(shapes, rows, reps) if rows else []}
    result["logprob_error"] = logprob_error(
        "tiny" if args.tiny else args.model, 2 if args.tiny else args.layers, args.batch,
        32 if args.tiny else args.seq, gguf=args.gguf, text=args.text,
    )  # fmt: skip
    print(json.dumps(result["logprob_error"]))
    print(
        f"\n{'proj':8}{'M':>6}{'fwd bf16':>10}{'fwd fp8':>9}{'x':>6}{'fp8 bf16out':>12}{'bwd bf16':>10}"
        f"{'bwd fp8':>9}{'x':>6}{'rel err':>9}"
    )
    total = {}
    for r in result["matmuls"][1:]:
        print(
            f"{r['proj']:8}{r['M']:>6}{r['fwd_bf16_ms']:>10.3f}{r['fwd_fp8_ms']:>9.3f}"
            f"{r['fwd_bf16_ms'] / r['fwd_fp8_ms']:>6.2f}{r['fwd_fp8_bf16out_ms']:>12.3f}"
            f"{r['bwd_bf16_ms']:>10.3f}{r['bwd_fp8_ms']:>9.3f}{r['bwd_bf16_ms'] / r['bwd_fp8_ms']:>6.2f}"
            f"{r['fwd_rel_err']:>9.4f}"
        )
        t = total.setdefault(r["M"], [0.0] * 5)
        for j, f in enumerate(("fwd_bf16_ms", "fwd_fp8_ms", "fwd_fp8_bf16out_ms", "bwd_bf16_ms", "bwd_fp8_ms")):
            t[j] += r[f]
    for m, t in total.items():
        print(
            f"{'layer':8}{m:>6}{t[0]:>10.3f}{t[1]:>9.3f}{t[0] / t[1]:>6.2f}{t[2]:>12.3f}{t[3]:>10.3f}{t[4]:>9.3f}"
            f"{t[3] / t[4]:>6.2f}"
        )
    if result["matmuls"]:
        print(result["matmuls"][0])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
