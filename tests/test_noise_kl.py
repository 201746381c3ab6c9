"""experiments/qwen_gsm8k/noise_kl: the dose each AQN sigma adds, measured on the rollout's norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qerl_jax
from experiments.qwen_gsm8k import noise_kl


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    config, ref = qerl_jax.load_model(tiny_model_dir, dtype="bfloat16")
    _, q = qerl_jax.load_model(tiny_model_dir, dtype="bfloat16", quant="nvfp4")
    x = np.random.default_rng(0).integers(0, config.vocab_size, (4, 24)).astype(np.int32)
    return config, ref, q, [(x, np.ones_like(x))]


def test_noise_goes_on_the_rollouts_float32_norms(tiny):
    _, _, q, _ = tiny
    noisy = noise_kl.noised(q, 1e-4, jax.random.key(0))
    for name, w in {**noisy["norms"]["layers"], "final_norm": noisy["norms"]["final_norm"]}.items():
        clean = q["norms"]["final_norm"] if name == "final_norm" else q["norms"]["layers"][name]
        assert w.dtype == jnp.float32, name
        z = np.asarray(w) - np.asarray(clean)
        assert 0.5e-4 < z.std() < 2e-4, name  # the sigma asked for, not rounded to a bf16 grid


def test_the_dose_grows_with_sigma(tiny):
    config, ref, q, batches = tiny
    r = noise_kl.measure(config, ref, q, batches, [1e-1, 1e-2, 1e-4], draws=2)
    assert r["kl_bf16_nvfp4"] > 0 and r["tokens"] == 4 * 23
    kls = [r["aqn"][str(s)]["kl_nvfp4_to_noised"] for s in (1e-1, 1e-2, 1e-4)]
    assert kls[0] > 10 * kls[1] > 0 and kls[1] > kls[2] > 0  # about sigma squared
    assert r["aqn"]["0.1"]["relative_to_nvfp4"] == pytest.approx(kls[0] / r["kl_bf16_nvfp4"])
    assert set(r["entropy"]) == {"bf16", "nvfp4"} and r["aqn"]["0.1"]["entropy"] > 0
    assert r["aqn"]["0.0001"]["kl_bf16_to_noised"] == pytest.approx(r["kl_bf16_nvfp4"], rel=0.05)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        noise_kl.main(["--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o.json")])
    assert e.value.code == 2 and "--gguf" in capsys.readouterr().err
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    with pytest.raises(SystemExit) as e:
        noise_kl.main(["--gguf", str(gguf), "--sigmas", "0.01", "0", "--out", str(tmp_path / "o.json")])
    assert e.value.code == 2 and "every sigma must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
