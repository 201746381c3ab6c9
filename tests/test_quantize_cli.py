"""The qerl-quantize CLI on a tiny random transformers Qwen2 checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from qerl_jax import quant
from qerl_jax.quant import compressed_tensors as qct
from qerl_jax.quantize import main
from qerl_jax.quantize_checkpoint import QUANTIZABLE, QuantizeError, quantize_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from conftest import make_hf_model, save_hf_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TOKENIZER_FILES = {
    "tokenizer.json": '{"fake": true}\n',
    "tokenizer_config.json": '{"model_max_length": 64}\n',
    "merges.txt": "a b\n",
}


def _model():
    return make_hf_model(**TINY).to(torch.bfloat16)


def _src(path) -> str:
    save_hf_model(_model(), path)
    for name, text in TOKENIZER_FILES.items():
        (path / name).write_text(text)
    (path / "notes.txt").write_text("not a tokenizer file\n")
    return str(path)


def _read_dir(path: str) -> dict[str, np.ndarray]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(qct.read_safetensors(os.path.join(path, name)))
    return out


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def _ct_reference_checkpoint(path) -> str:
    """The same model quantized by compressed-tensors itself (what llm-compressor does with
    NVFP4A16 and its memoryless min-max observer, q/k/v and gate/up fused), then saved."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    model = _model()
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for group in ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]):
            lo = torch.stack([mod.weight.min() for mod in group]).min()
            hi = torch.stack([mod.weight.max() for mod in group]).max()
            gs = generate_gparam(lo, hi)
            for mod in group:
                blocks = mod.weight.data.unflatten(-1, (-1, 16))
                scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
                mod.weight_global_scale.data.copy_(gs)
                mod.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize_cli")
    src = _src(root / "src")
    out = {}
    for fmt, extra in (("nvfp4", []), ("nvfp4_unfused", ["--no-fuse-global-scale"]), ("mxfp4", [])):
        out[fmt] = str(root / fmt)
        assert main(["--model", src, "--out", out[fmt], "--format", fmt.split("_")[0], "--quiet", *extra]) == 0
    return {"src": src, "root": root, **out}


def test_nvfp4_output_equals_compressed_tensors_bit_for_bit(dirs):
    ref_dir = _ct_reference_checkpoint(dirs["root"] / "ct_reference")
    ours, ref = _read_dir(dirs["nvfp4"]), _read_dir(ref_dir)
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype and ours[name].shape == ref[name].shape, name
        np.testing.assert_array_equal(_bits(ours[name]), _bits(ref[name]), err_msg=name)
    with open(os.path.join(ref_dir, "config.json")) as f:
        ref_config = json.load(f)
    with open(os.path.join(dirs["nvfp4"], "config.json")) as f:
        our_config = json.load(f)
    ours_q, ref_q = our_config["quantization_config"], ref_config["quantization_config"]
    assert ours_q.pop("version") == qct.CT_VERSION  # provenance, not the installed release (CT_VERSION's note)
    ref_q.pop("version")
    assert ours_q == ref_q  # every format field, as the installed compressed-tensors writes it
    with open(os.path.join(dirs["src"], "config.json")) as f:
        src_config = json.load(f)
    assert {k: v for k, v in our_config.items() if k != "quantization_config"} == src_config


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_unfused", "mxfp4"])
def test_output_structure_and_dequantization(dirs, fmt):
    base_fmt = fmt.split("_")[0]
    src, out = _read_dir(dirs["src"]), _read_dir(dirs[fmt])
    quantized = [n for n in src if QUANTIZABLE.match(n)]
    assert len(quantized) == 14
    suffixes = qct.TENSOR_SUFFIXES[base_fmt]
    expected_names = {n for n in src if n not in quantized} | {
        n[: -len("weight")] + s for n in quantized for s in suffixes
    }
    assert set(out) == expected_names
    for name in src:
        if name not in quantized:  # copied unchanged
            assert out[name].dtype == src[name].dtype
            np.testing.assert_array_equal(_bits(out[name]), _bits(src[name]))
    # Fused amax per layer group, as the CLI computes it.
    amax = {}
    for name in quantized:
        key = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        amax[key] = max(amax.get(key, 0.0), float(np.abs(src[name].astype(np.float32)).max()))
    for name in quantized:
        module = name[: -len(".weight")]
        packed = qct.packed_from_tensors({s: out[f"{module}.{s}"] for s in suffixes}, base_fmt)
        w = jnp.asarray(src[name])
        assert w.dtype == jnp.bfloat16
        kw = {}
        if fmt == "nvfp4":
            key = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            kw["amax"] = jnp.float32(amax[key])
        expected = quant.quantize(w, base_fmt, **kw)
        np.testing.assert_array_equal(
            np.asarray(quant.dequantize(packed)), np.asarray(quant.dequantize(expected)), err_msg=name
        )
        assert packed.codes.shape == (w.shape[0], w.shape[1] // 2)
    if fmt == "nvfp4":  # vLLM keeps the max of the fused global scales: they must be equal
        for i in range(2):
            gs = {
                p: float(out[f"model.layers.{i}.{m}.{p}.weight_global_scale"][0])
                for m, p in [
                    ("self_attn", "q_proj"),
                    ("self_attn", "k_proj"),
                    ("self_attn", "v_proj"),
                    ("mlp", "gate_proj"),
                    ("mlp", "up_proj"),
                ]
            }
            assert gs["q_proj"] == gs["k_proj"] == gs["v_proj"] and gs["gate_proj"] == gs["up_proj"]
    with open(os.path.join(dirs[fmt], "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"] == qct.quantization_config(base_fmt, ignore=["lm_head"])
    assert qct.detect_format(config) == base_fmt
    files = set(os.listdir(dirs[fmt]))
    assert files == {"config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES}
    for name, text in TOKENIZER_FILES.items():
        with open(os.path.join(dirs[fmt], name)) as f:
            assert f.read() == text


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_transformers_loads_output_with_our_dequantized_weights(dirs, fmt):
    """transformers + compressed-tensors decompress our checkpoint to our dequantized weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs[fmt])
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2]])).logits  # the first forward decompresses
    assert torch.isfinite(logits).all()
    out = _read_dir(dirs[fmt])
    suffixes = qct.TENSOR_SUFFIXES[fmt]
    for i, proj in [(0, "self_attn.q_proj"), (1, "mlp.down_proj"), (1, "self_attn.v_proj")]:
        module = f"model.layers.{i}.{proj}"
        packed = qct.packed_from_tensors({s: out[f"{module}.{s}"] for s in suffixes}, fmt)
        ours = np.asarray(quant.dequantize(packed, jnp.float32).astype(jnp.bfloat16))
        theirs = model.get_submodule(module).weight.detach()
        np.testing.assert_array_equal(ours.view(np.uint16), theirs.view(torch.uint16).numpy())


def test_sharded_checkpoint(tmp_path):
    src = tmp_path / "src"
    save_hf_model(_model(), src, shard_size="40KB")
    with open(src / "model.safetensors.index.json") as f:
        src_index = json.load(f)
    shards = sorted(set(src_index["weight_map"].values()))
    assert len(shards) > 1
    out = tmp_path / "out"
    quantize_checkpoint(str(src), str(out), "nvfp4", progress=False)
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == shards
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    tensors = {}
    for shard in shards:
        for name, array in qct.read_safetensors(str(out / shard)):
            assert index["weight_map"][name] == shard
            tensors[name] = array
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    # Same tensors as quantizing the unsharded checkpoint.
    single = tmp_path / "single"
    save_hf_model(_model(), single)
    single_out = _read_dir(quantize_checkpoint(str(single), str(tmp_path / "single_out"), "nvfp4", progress=False))
    assert set(single_out) == set(tensors)
    for name in tensors:
        np.testing.assert_array_equal(_bits(tensors[name]), _bits(single_out[name]), err_msg=name)


def _write_checkpoint(path, tensors: dict[str, np.ndarray], config: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config or {"model_type": "qwen2"}, f)
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


def test_errors(dirs, tmp_path):
    src = dirs["src"]
    cases = [
        (dict(model_dir=str(tmp_path / "missing")), "does not exist"),
        (dict(fmt="nf4"), "'nf4' cannot be written as a compressed-tensors checkpoint"),
        (dict(fmt="bf16"), "'bf16' cannot be written"),
        (dict(fmt="int8"), "unknown --format 'int8'"),
        (dict(model_dir=dirs["nvfp4"]), "already has a quantization_config"),
        (dict(out_dir=dirs["nvfp4"]), "is not empty"),
        (dict(out_dir=src), "--out must differ from --model"),
    ]
    for kw, match in cases:
        args = dict(model_dir=src, out_dir=str(tmp_path / "o"), fmt="nvfp4") | kw
        with pytest.raises(QuantizeError, match=match):
            quantize_checkpoint(args["model_dir"], args["out_dir"], args["fmt"], progress=False)

    no_config = tmp_path / "no_config"
    no_config.mkdir()
    with pytest.raises(QuantizeError, match="config.json is missing"):
        quantize_checkpoint(str(no_config), str(tmp_path / "o"), "nvfp4", progress=False)
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text("{}")
    (pickles / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(QuantizeError, match=r"only PyTorch pickle weights \(\*\.bin\).*safe_serialization=True"):
        quantize_checkpoint(str(pickles), str(tmp_path / "o"), "nvfp4", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(QuantizeError, match="no model.safetensors"):
        quantize_checkpoint(str(empty), str(tmp_path / "o"), "nvfp4", progress=False)

    name = "model.layers.0.mlp.down_proj.weight"
    bad_k = _write_checkpoint(tmp_path / "bad_k", {name: np.ones((64, 120), np.float32)})
    with pytest.raises(QuantizeError, match=f"'{name}' has shape \\(64, 120\\): mxfp4 needs K .* multiple of 32"):
        quantize_checkpoint(bad_k, str(tmp_path / "o1"), "mxfp4", progress=False)
    nan = np.ones((64, 128), np.float32)
    nan[3, 4] = np.nan
    bad_nan = _write_checkpoint(tmp_path / "bad_nan", {name: nan, "model.norm.weight": np.ones(64, np.float32)})
    for fmt in ("nvfp4", "mxfp4"):
        with pytest.raises(QuantizeError, match=f"'{name}' has non-finite values"):
            quantize_checkpoint(bad_nan, str(tmp_path / f"o_{fmt}"), fmt, progress=False)
    # main() turns these into exit status 2 with the message on stderr.
    assert main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o3"), "--quiet"]) == 2


def test_flags_are_spelt_as_the_other_commands_and_the_old_spellings_still_work(dirs, tmp_path, capsys):
    """absl flags (`--flag=value`, `--noflag`) as qerl_jax.main and qerl_jax.eval; argparse's spellings kept."""
    out = str(tmp_path / "unfused")
    args = [f"--model={dirs['src']}", f"--out={out}", "--format=nvfp4", "--quiet", "--nofuse_global_scale"]
    assert main(args) == 0
    for name, array in _read_dir(dirs["nvfp4_unfused"]).items():  # written with --no-fuse-global-scale
        np.testing.assert_array_equal(_bits(_read_dir(out)[name]), _bits(array))
    fused = _read_dir(dirs["nvfp4"])
    assert any(not np.array_equal(_bits(fused[n]), _bits(a)) for n, a in _read_dir(out).items())  # the flag took
    capsys.readouterr()
    for argv, line in (
        ([f"--out={tmp_path / 'x'}"], "qerl-quantize: error: --model is required, e.g. --model=DIR --out=DIR"),
        (
            ["--model", dirs["src"], "--out", str(tmp_path / "x"), "--fmt=mxfp4"],
            "error: Unknown command line flag 'fmt'",
        ),
        (["--model", dirs["src"], "--out", str(tmp_path / "x"), "mxfp4"], "error: unexpected arguments: mxfp4"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].endswith(line), err
    assert not os.path.exists(tmp_path / "x")


def test_command_line_entry_point(dirs, tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "cli_out"
    ok = subprocess.run(
        [sys.executable, "-m", "qerl_jax.quantize", "--model", dirs["src"], "--out", str(out), "--format", "mxfp4"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert "quantizing to mxfp4" in ok.stderr  # the tqdm bar
    for name, array in _read_dir(dirs["mxfp4"]).items():
        np.testing.assert_array_equal(_bits(_read_dir(str(out))[name]), _bits(array))
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "qerl_jax.quantize",
            "--model",
            dirs["src"],
            "--out",
            str(tmp_path / "x"),
            "--format",
            "nf4",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert bad.returncode == 2 and "error: --format 'nf4' cannot be written" in bad.stderr


def _forward(config, params, ids):
    import qerl_jax

    return np.asarray(qerl_jax.forward(config, params, ids))


def test_loading_cli_output_gives_the_same_logits(dirs):
    """load_model(CLI output) == load_model(original, quant=fmt) == quantize_params(dense, fmt):
    all three share the fused q/k/v and gate/up global scales that vLLM expects."""
    import qerl_jax

    ids = jnp.asarray([[3, 17, 42, 99, 7]], jnp.int32)
    cfg_d, dense = qerl_jax.load_model(dirs["src"])
    for fmt in ("nvfp4", "mxfp4"):
        cfg_q, params_q = qerl_jax.load_model(dirs[fmt])
        assert params_q["base"]["layers"]["q_proj"]["w"].fmt == fmt
        cfg, params = qerl_jax.load_model(dirs["src"], quant=fmt)
        from_ckpt = _forward(cfg_q, params_q, ids)
        np.testing.assert_array_equal(from_ckpt, _forward(cfg, params, ids))
        np.testing.assert_array_equal(from_ckpt, _forward(cfg_d, quant.quantize_params(dense, fmt), ids))


def test_an_unwritable_out_is_one_line_before_any_work(dirs, tmp_path):
    """--out a file, under a file, or (not as root) in a read-only folder: exit 2, one line, nothing written."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [(str(a_file), "is a file, not a directory"), (str(a_file / "out"), f"{a_file} is a file, not a directory")]
    if os.geteuid() != 0:  # root writes regardless of the mode
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((str(locked / "out"), f"{locked} is not writable"))
    from experiments.models import smollm2_gguf_path

    for model in (dirs["src"], smollm2_gguf_path()):  # a GGUF file is refused before its export
        for out, needle in cases:
            bad = subprocess.run(
                [sys.executable, "-m", "qerl_jax.quantize", "--model", model, "--out", out, "--quiet"],
                capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
            )
            assert bad.returncode == 2, bad.stderr
            assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
            assert f"error: --out {out!r}: {needle}" in bad.stderr, bad.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["file"] + (["locked"] if len(cases) == 3 else []))
