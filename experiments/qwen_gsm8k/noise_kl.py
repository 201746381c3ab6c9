"""How much policy noise NVFP4 and AQN add on the real model: next-token KL on GSM8K text.

  python -m experiments.qwen_gsm8k.noise_kl --gguf qwen1.5b.gguf --out noise_kl.json

Loads the GGUF once as the bf16 reference (the Q4_K_M file dequantized to bf16) and once
quantized to NVFP4 while loading (as training does), then over the first --num-texts GSM8K test
problems (question + reference answer, plain text) reports, per predicted token:
  KL(bf16 || nvfp4)                    the quantization's own noise;
  KL(nvfp4 || nvfp4 + AQN(sigma))      what AQN adds on top, for each --sigmas (mean of --draws
                                       noise draws, each from its own key): the dose of a sigma;
  KL(bf16 || nvfp4 + AQN(sigma))       both together;
and the mean next-token entropy of each policy. AQN is `qerl_jax.aqn.apply_aqn` on the norms the
rollout perturbs: the float32 masters of the trained per-layer scales (`lora.init_trained_norms`,
merged as `train.rollout_norms` does) and the final norm (the loader keeps every norm in float32).
The default sigmas cover every stage of the dose-response arms (configs/aqn_dose.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import qerl_jax
from qerl_jax import aqn, lora
from qerl_jax.config import data_path

DOSE_SIGMAS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4)


def text_batches(tokenizer, num_texts: int, max_len: int, batch: int):
    """Right-padded int32 [B, max_len] ids and masks of GSM8K test question + answer texts (one shape,
    so the forward compiles once rather than once per batch)."""
    rows = [json.loads(line) for line in open(data_path("gsm8k/test.jsonl"))][:num_texts]
    ids = [tokenizer(r["question"] + "\n" + r["answer"], add_special_tokens=False)["input_ids"][:max_len] for r in rows]
    for i in range(0, len(ids), batch):
        chunk = ids[i : i + batch]
        x, m = np.zeros((len(chunk), max_len), np.int32), np.zeros((len(chunk), max_len), np.int32)
        for r, seq in enumerate(chunk):
            x[r, : len(seq)], m[r, : len(seq)] = seq, 1
        yield x, m


def noised(params, sigma: float, key) -> dict:
    """params with the rollout's AQN noise at `sigma` in every RMSNorm scale, added as the rollout
    adds it: to the trained per-layer scales' float32 masters merged into the frozen norms."""
    cfg = aqn.AQNConfig(
        enabled=True, sigma_start=sigma, sigma_end=sigma, num_stages=2, total_steps=2, first_stage_noise=True
    )
    norms = lora.merge_norms(params["norms"], lora.init_trained_norms(params["norms"]))
    return {**params, "norms": aqn.apply_aqn(cfg, norms, key, 0)}


@functools.cache
def _log_softmax_fn(config):
    """The jitted next-token log-softmax of `config`'s model, one per config for every call
    (a jit made per call would compile again each time)."""
    return jax.jit(
        lambda p, x, m: jax.nn.log_softmax(qerl_jax.forward(config, p, x, m)[:, :-1].astype(jnp.float32), -1)
    )


def mean_kl(config, p_params, q_params_list, batches) -> dict[str, float]:
    """Over predicted tokens (and over q_params_list): the mean KL(p || q) per next token and the
    mean next-token entropy of q."""
    fwd = _log_softmax_fn(config)
    kl_total, ent_total, n = 0.0, 0.0, 0
    for x, m in batches:
        lp = fwd(p_params, x, m)
        valid = jnp.asarray(m[:, 1:], bool)
        for q_params in q_params_list:
            lq = fwd(q_params, x, m)
            kl = jnp.sum(jnp.exp(lp) * (lp - lq), -1)
            ent = -jnp.sum(jnp.exp(lq) * lq, -1)
            kl_total += float(jnp.sum(jnp.where(valid, kl, 0.0))) / len(q_params_list)
            ent_total += float(jnp.sum(jnp.where(valid, ent, 0.0))) / len(q_params_list)
        n += int(valid.sum())
    return {"kl": kl_total / n, "entropy": ent_total / n}


def measure(config, ref, q, batches, sigmas, draws: int) -> dict:
    """The result dict: NVFP4's KL to bf16, each policy's entropy, and per sigma what AQN adds."""
    base = mean_kl(config, ref, [q], batches)
    result = {
        "tokens": int(sum(m[:, 1:].sum() for _, m in batches)),
        "kl_bf16_nvfp4": base["kl"],
        "entropy": {"bf16": mean_kl(config, q, [ref], batches)["entropy"], "nvfp4": base["entropy"]},
        "aqn": {},
    }
    for sigma in sigmas:
        keys = jax.random.split(jax.random.key(0), draws)
        noisy = [noised(q, sigma, k) for k in keys]
        added = mean_kl(config, q, noisy, batches)
        result["aqn"][str(sigma)] = {
            "kl_nvfp4_to_noised": added["kl"],
            "kl_bf16_to_noised": mean_kl(config, ref, noisy, batches)["kl"],
            "entropy": added["entropy"],
            "relative_to_nvfp4": added["kl"] / result["kl_bf16_nvfp4"],
        }
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--num-texts", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sigmas", type=float, nargs="+", default=list(DOSE_SIGMAS))
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.gguf):
        parser.exit(2, f"error: --gguf {args.gguf}: no such file\n")
    if min(args.sigmas) <= 0:
        parser.exit(2, f"error: --sigmas {' '.join(map(str, args.sigmas))}: every sigma must be > 0 (sigma 0 is NVFP4 itself)\n")

    tokenizer = qerl_jax.load_tokenizer(args.gguf)
    config, ref = qerl_jax.load_model(args.gguf, dtype="bfloat16")
    _, q = qerl_jax.load_model(args.gguf, dtype="bfloat16", quant="nvfp4")
    batches = list(text_batches(tokenizer, args.num_texts, args.max_len, args.batch))
    result = {"model": os.path.basename(args.gguf), **measure(config, ref, q, batches, args.sigmas, args.draws)}
    print(f"{result['model']}: {result['tokens']} tokens of GSM8K test text")
    print("| policy | KL to bf16 / token | KL to NVFP4 / token (the dose) | x NVFP4's own | next-token entropy |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| NVFP4 | {result['kl_bf16_nvfp4']:.4f} | 0 | 0 | {result['entropy']['nvfp4']:.4f} |")
    for sigma, r in result["aqn"].items():
        print(
            f"| NVFP4 + AQN {float(sigma):g} | {r['kl_bf16_to_noised']:.4f} | {r['kl_nvfp4_to_noised']:.2e} "
            f"| {r['relative_to_nvfp4']:.3f} | {r['entropy']:.4f} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
