"""Quantization error of NVFP4 / MXFP4 / NF4 (CPU is fine).

  python -m benchmarks.quant_error [--out benchmarks/quant_error.json]

1. Weight reconstruction: relative Frobenius error ||dequant(quant(W)) - W|| / ||W|| on
   Gaussian, heavy-tailed (Student t, 3 dof) and outlier (Gaussian + 0.1% entries x50)
   matrices, and the storage cost in bits per weight (codes + scales + global scale).
2. Model: mean KL(p_bf16 || p_quant) of next-token distributions of a tiny random Qwen2
   checkpoint (qerl_jax.model_io.tiny) whose linear projections are quantized with quantize_params.
Prints a table and writes everything as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import quant

DISTRIBUTIONS = ("gaussian", "student_t3", "outliers")


def make_weights(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "student_t3":
        return rng.standard_t(3, (rows, cols)).astype(np.float32)
    if kind == "outliers":
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        mask = rng.random((rows, cols)) < 1e-3
        w[mask] *= 50.0
        return w
    raise ValueError(f"unknown distribution {kind!r}; expected one of {DISTRIBUTIONS}")


def weight_errors(rows: int, cols: int, seed: int) -> dict:
    dequant = jax.jit(quant.dequantize, static_argnums=1)
    out = {}
    for kind in DISTRIBUTIONS:
        w = jnp.asarray(make_weights(kind, rows, cols, seed)).astype(jnp.bfloat16).astype(jnp.float32)
        out[kind] = {}
        for fmt in quant.FORMATS:
            packed = quant.quantize(w, fmt)
            err = jnp.linalg.norm(dequant(packed, jnp.float32) - w) / jnp.linalg.norm(w)
            out[kind][fmt] = {"rel_frobenius": float(err), "bits_per_weight": 8 * packed.nbytes / w.size}
    return out


def _kl(logits_p: jax.Array, logits_q: jax.Array) -> float:
    logp, logq = jax.nn.log_softmax(logits_p, -1), jax.nn.log_softmax(logits_q, -1)
    return float(jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), -1)))


def model_kl(seed: int) -> dict | None:
    try:
        import qerl_jax
        from qerl_jax.model_io.tiny import build_tiny_checkpoint

        load_model, forward = qerl_jax.load_model, qerl_jax.forward
    except (ImportError, AttributeError):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(
            os.path.join(tmp, "tiny"),
            hidden_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=256,
            seed=seed,
            random_norms=True,
        )
        config, params = load_model(path, dtype="bfloat16")
    ids = jax.random.randint(jax.random.PRNGKey(seed), (4, 32), 0, config.vocab_size, jnp.int32)
    ref = forward(config, params, ids)
    result = {
        "model": {"hidden": 128, "layers": 2, "intermediate": 256, "vocab": config.vocab_size, "tokens": int(ids.size)}
    }
    for fmt in quant.FORMATS:
        logits = forward(config, quant.quantize_params(params, fmt), ids)
        result[fmt] = {
            "kl_to_bf16": _kl(ref, logits),
            "top1_agreement": float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(logits, -1))),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "quant_error.json"))
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    weights = weight_errors(args.rows, args.cols, args.seed)
    print(f"relative Frobenius error, {args.rows}x{args.cols} bf16 weights (bits/weight in parentheses)")
    print(f"{'distribution':<12}" + "".join(f"{fmt:>18}" for fmt in quant.FORMATS))
    for kind, row in weights.items():
        cells = "".join(f"{row[f]['rel_frobenius']:>11.5f} ({row[f]['bits_per_weight']:.2f})" for f in quant.FORMATS)
        print(f"{kind:<12}{cells}")
    kl = model_kl(args.seed)
    if kl is None:
        print("qerl_jax.forward / load_model not available: model KL skipped")
    else:
        print(f"\ntiny random Qwen2 ({kl['model']}): KL(bf16 || quantized) per token, top-1 agreement")
        for fmt in quant.FORMATS:
            print(f"{fmt:<12}{kl[fmt]['kl_to_bf16']:>12.3e}{kl[fmt]['top1_agreement']:>8.3f}")
    result = {
        "device": jax.devices()[0].platform,
        "rows": args.rows,
        "cols": args.cols,
        "seed": args.seed,
        "weight_error": weights,
        "model_kl": kl,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
