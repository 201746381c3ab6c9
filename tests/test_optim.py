"""optim.py: the warm-up + cosine / constant schedule against transformers', clipping + AdamW
against torch's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from qerl_jax.optim import make_optimizer, make_schedule


def test_schedule_matches_transformers():
    import transformers

    def hf_lrs(fn, n, **kw):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=3e-4)
        sched = fn(opt, **kw)
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return np.array(out)

    cos = make_schedule(3e-4, warmup_steps=5, total_steps=20, schedule="cosine")
    const = make_schedule(3e-4, warmup_steps=5, total_steps=20, schedule="constant")
    ours_cos = np.array([float(cos(i)) for i in range(21)])
    ours_const = np.array([float(const(i)) for i in range(25)])
    assert float(cos(30)) == 0.0  # past total_steps ours stays at 0 (transformers' cosine rises again)
    np.testing.assert_allclose(
        ours_cos,
        hf_lrs(transformers.get_cosine_schedule_with_warmup, 21, num_warmup_steps=5, num_training_steps=20),
        rtol=1e-5,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        ours_const, hf_lrs(transformers.get_constant_schedule_with_warmup, 25, num_warmup_steps=5), rtol=1e-6
    )
    with pytest.raises(ValueError, match="schedule"):
        make_schedule(1e-3, warmup_steps=0, total_steps=10, schedule="linear")


def test_optimizer_matches_torch_adamw_with_clipping():
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) * s for k, v in params.items()} for s in (1.0, 0.05, 3.0)]
    tx = make_optimizer(
        1e-2, warmup_steps=0, total_steps=10, schedule="constant", b1=0.9, b2=0.99, weight_decay=0.1, clip_norm=0.2
    )
    ours = jax.tree.map(jnp.asarray, params)
    state = tx.init(ours)
    for g in grads:
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, ours)
        ours = optax.apply_updates(ours, updates)

    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    topt = torch.optim.AdamW(list(tp.values()), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for g in grads:
        for k, p in tp.items():
            p.grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 0.2)
        topt.step()
    for k in params:
        np.testing.assert_allclose(np.asarray(ours[k]), tp[k].detach().numpy(), atol=1e-6, rtol=1e-5)
