"""Packed (segment) attention on GPU: cuDNN's ragged flash path vs the masked XLA reference.

    python -m benchmarks.devtools.packed_attention_check

Prints the max abs error of the forward and of the q/k/v gradients (bf16, causal within segments).
"""

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.models.qwen2 import attention, packed_flash_attention


def main() -> None:
    rng = np.random.default_rng(0)
    b, t, h, kvh, d = 2, 256, 8, 2, 128
    lengths = [[100, 3, 60, 93], [256]]  # segments cover each row (the tail is a segment of its own)
    seg = np.concatenate([np.repeat(np.arange(1, len(r) + 1), r)[None] for r in lengths]).astype(np.int32)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16) for n in (h, kvh, kvh))
    seg = jnp.asarray(seg)

    def ref(q, k, v):
        mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tri(t, dtype=bool)[None]
        return attention(q, k, v, mask)

    def flash(q, k, v):
        return packed_flash_attention(q, k, v, seg)

    out_r, out_f = jax.jit(ref)(q, k, v), jax.jit(flash)(q, k, v)
    print("forward max abs error:", float(jnp.abs(out_r.astype(jnp.float32) - out_f.astype(jnp.float32)).max()))
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
    g_r = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    g_f = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    for name, a, c in zip("qkv", g_r, g_f):
        err = float(jnp.abs(a.astype(jnp.float32) - c.astype(jnp.float32)).max())
        print(f"d{name} max abs error: {err} (ref max {float(jnp.abs(a.astype(jnp.float32)).max())})")


if __name__ == "__main__":
    main()
