"""Launch the wgmma NVFP4 kernel a few times on one shape, for Nsight Compute.

    ncu --set full -k regex:wgmma_nvfp4 --launch-skip 2 --launch-count 2 -o X \
        python -m benchmarks.devtools.wgmma_ncu --n 18944 --k 3584 --m 16
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import kernels as kb
from pallas_kernels import wgmma_nvfp4 as wn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=18944)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    p = kb.rand_packed(jax.random.PRNGKey(0), a.n, a.k, "nvfp4")
    x = kb.rand_x(jax.random.PRNGKey(1), a.m, a.k)
    w, s = wn.repack(p.codes, p.scales)
    cfg = wn.kernel_config(a.m, a.n, a.k)
    for _ in range(a.reps):
        jax.block_until_ready(wn.wgmma_matmul(x, w, s, p.global_scale, **cfg))
    print("done", a, cfg)


if __name__ == "__main__":
    main()
