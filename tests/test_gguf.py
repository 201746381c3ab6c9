"""GGUF import: small GGUF files written here with gguf.GGUFWriter (several tensor types, llama
and qwen2), checked against the transformers model they were written from and against
transformers' own GGUF loading; the bad-input errors; and SmolLM2-135M-Instruct's logits
against transformers' GGUF loading of the same file."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_logits, left_padded_batch, make_hf_model, save_hf_model

import qerl_jax
from experiments.models import smollm2_gguf_path
from qerl_jax import quant
from qerl_jax.model_io import gguf as qgguf
from qerl_jax.model_io.loader import CheckpointError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# K-quants need K (the row length) to be a multiple of 256.
TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)
# Block byte offsets of the float16 scales of the K-quants (the rest of a block may be random bits).
_K_SCALE_BYTES = {Q.Q2_K: (80, 84), Q.Q3_K: (108, 110), Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (208, 210)}
_GGUF_NAMES = {v: k for k, v in qgguf._TOP_NAMES.items()}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.<i>.<module...>.<weight|bias>
    module = ".".join(parts[3:-1])
    short = next(k for k, v in qgguf._BLOCK_NAMES.items() if v == module)
    return f"blk.{parts[2]}.{short}.{parts[-1]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (written independently of the loader's inverse)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    lo, hi = _K_SCALE_BYTES[qtype]
    scales = (rng.uniform(0.002, 0.02, size=(rows, cols // block, (hi - lo) // 2))).astype(np.float16)
    raw[..., lo:hi] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path, model, arch: str = "llama", types=None, *, drop=(), extra=None, metadata=None, seed=0) -> str:
    """Writes a transformers model as a GGUF file the way llama.cpp's converter lays it out.

    types: {hf tensor name suffix (e.g. "q_proj.weight") -> GGMLQuantizationType} for 2-D weights
    (default F32); K-quants get random valid blocks instead of the model's values.
    """
    cfg = model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in (metadata or {}).items():
        w.add_key_value(key, value[0], value[1])
    for name, p in model.state_dict().items():
        if name in drop or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        array = p.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = _permute(array, heads)
        qtype = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), Q.F32)
        if array.ndim == 1 or qtype == Q.F32:
            w.add_tensor(_gguf_name(name), array)
        elif qtype == Q.F16:
            w.add_tensor(_gguf_name(name), array.astype(np.float16))
        elif qtype in _K_SCALE_BYTES:
            w.add_tensor(_gguf_name(name), _random_k_blocks(qtype, *array.shape, rng), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def tokenizer_metadata(tokenizer) -> dict:
    """A byte-level BPE fast tokenizer (the tiny model's, Qwen2's) as llama.cpp writes it into a GGUF
    file's metadata, for write_gguf(metadata=...): tokens by id, merges, special ids, chat template."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = {**state["model"]["vocab"], **{t["content"]: t["id"] for t in state["added_tokens"]}}
    control = {t["id"] for t in state["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    V = gguf.GGUFValueType
    return {
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("qwen2", V.STRING),
        "tokenizer.ggml.tokens": (sorted(vocab, key=vocab.get), V.ARRAY),
        "tokenizer.ggml.token_type": ([3 if i in control else 1 for i in range(len(vocab))], V.ARRAY),
        "tokenizer.ggml.merges": (merges, V.ARRAY),
        "tokenizer.ggml.eos_token_id": (tokenizer.eos_token_id, V.UINT32),
        "tokenizer.ggml.padding_token_id": (tokenizer.pad_token_id, V.UINT32),
        "tokenizer.chat_template": (tokenizer.chat_template, V.STRING),
    }


def write_gguf_with_tokenizer(path, tokenizer) -> str:
    """A tiny random qwen2 GGUF file (2 layers, 2048 positions) whose metadata holds `tokenizer`."""
    model = make_hf_model("qwen2", **{**TINY_LLAMA, "vocab_size": len(tokenizer), "max_position_embeddings": 2048})
    return write_gguf(path, model, "qwen2", metadata=tokenizer_metadata(tokenizer))


def _assert_logits_match(config, params, torch_model, vocab):
    ids, mask = left_padded_batch(vocab, t=9, pads=(0, 2, 5))
    ours = np.asarray(qerl_jax.forward(config, params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(torch_model, ids, mask)
    real = mask.astype(bool)
    scale = np.abs(ref[real]).max()
    assert np.abs(ours[real] - ref[real]).max() < 1e-4 * scale  # tests/test_model.py's float32 tolerance


def _transformers_gguf(file):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(file), gguf_file=os.path.basename(file), dtype=torch.float32
    ).eval()


def _dense(params, proj):
    return np.asarray(params["base"]["layers"][proj]["w"])


@pytest.fixture(scope="module")
def llama_model():
    return make_hf_model("llama", **TINY_LLAMA)


# ----------------------------------------------------------------------------- values


def test_f32_llama_equals_the_model_it_was_written_from(tmp_path, llama_model):
    """Unpermuted q/k, names and config: the loaded weights are the original ones, bit for bit."""
    file = write_gguf(tmp_path / "m.gguf", llama_model)
    config, params = qerl_jax.load_model(file, dtype="float32")
    assert (config.model_type, config.num_key_value_heads, config.head_dim) == ("llama", 2, 64)
    assert not config.attention_bias and not config.tie_word_embeddings
    state = llama_model.state_dict()
    for proj in ("q_proj", "k_proj", "v_proj", "down_proj"):
        module = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
        for layer in range(2):
            np.testing.assert_array_equal(
                _dense(params, proj)[layer], state[f"model.layers.{layer}.{module}.{proj}.weight"].numpy()
            )
    np.testing.assert_array_equal(
        np.asarray(params["norms"]["layers"]["input_layernorm"][1]), state["model.layers.1.input_layernorm.weight"]
    )
    _assert_logits_match(config, params, llama_model, config.vocab_size)


@pytest.mark.parametrize(
    "types",
    [
        {"q_proj.weight": Q.F16, "k_proj.weight": Q.Q8_0, "v_proj.weight": Q.Q4_0, "o_proj.weight": Q.Q4_1},
        {"q_proj.weight": Q.Q4_K, "k_proj.weight": Q.Q5_K, "v_proj.weight": Q.Q6_K, "gate_proj.weight": Q.Q2_K},
        {"q_proj.weight": Q.Q3_K, "up_proj.weight": Q.Q5_0, "down_proj.weight": Q.Q5_1, "embed_tokens.weight": Q.Q8_0},
    ],
    ids=["f16_q8_q4", "k_quants", "q3k_q5_embed_q8"],
)
def test_quantized_types_match_transformers_gguf_loading(tmp_path, llama_model, types):
    file = write_gguf(tmp_path / "m.gguf", llama_model, types=types)
    config, params = qerl_jax.load_model(file, dtype="float32")
    ref = _transformers_gguf(file)
    ref_state = ref.state_dict()
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        module = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        np.testing.assert_array_equal(
            _dense(params, proj)[0], ref_state[f"model.layers.0.{module}.{proj}.weight"].numpy(), err_msg=proj
        )
    _assert_logits_match(config, params, ref, config.vocab_size)
    if types.get("k_proj.weight") == Q.Q8_0:  # an independent bound: Q8_0 is within half a step (+ its f16 rounding)
        orig = llama_model.state_dict()["model.layers.0.self_attn.k_proj.weight"].numpy()
        step = np.abs(orig).reshape(orig.shape[0], -1, 32).max(-1, keepdims=True) / 127
        err = np.abs(_dense(params, "k_proj")[0] - orig).reshape(orig.shape[0], -1, 32)
        assert (err <= 0.5 * step + 127 * 2.0**-11 * step).all() and err.max() > 0


def test_bf16_tensors(tmp_path, llama_model):
    file = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(file), "llama")
    write_gguf(tmp_path / "f32.gguf", llama_model)  # reference file
    reader = gguf.GGUFReader(str(tmp_path / "f32.gguf"))
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            w.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2:
            w.add_tensor(t.name, gguf.quants.quantize(data, Q.BF16), raw_dtype=Q.BF16)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, params = qerl_jax.load_model(str(file), dtype="float32")
    orig = llama_model.state_dict()["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_array_equal(_dense(params, "up_proj")[1], orig.to(torch.bfloat16).float().numpy())


def test_qwen2_with_biases_and_tied_embeddings(tmp_path):
    model = make_hf_model("qwen2", tie_word_embeddings=True)
    file = write_gguf(tmp_path / "q.gguf", model, arch="qwen2")
    config, params = qerl_jax.load_model(file, dtype="float32")
    assert config.model_type == "qwen2" and config.attention_bias and config.tie_word_embeddings
    assert "lm_head" not in params["base"]
    state = model.state_dict()
    np.testing.assert_array_equal(  # qwen2 q/k are stored unpermuted
        _dense(params, "q_proj")[1], state["model.layers.1.self_attn.q_proj.weight"].numpy()
    )
    np.testing.assert_array_equal(
        np.asarray(params["base"]["layers"]["k_proj"]["b"])[0], state["model.layers.0.self_attn.k_proj.bias"].numpy()
    )
    _assert_logits_match(config, params, model, config.vocab_size)


def test_quantize_while_loading_equals_the_safetensors_path(tmp_path, llama_model):
    """An F32 GGUF quantized while loading packs exactly like the same weights from safetensors."""
    file = write_gguf(tmp_path / "m.gguf", llama_model)
    hf_dir = save_hf_model(llama_model, tmp_path / "hf")
    _, from_gguf = qerl_jax.load_model(file, dtype="float32", quant="nvfp4")
    _, from_hf = qerl_jax.load_model(hf_dir, dtype="float32", quant="nvfp4")
    for proj in ("q_proj", "k_proj", "down_proj"):
        a, b = from_gguf["base"]["layers"][proj]["w"], from_hf["base"]["layers"][proj]["w"]
        assert quant.is_packed(a) and a.fmt == "nvfp4"
        np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
        np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))


def test_quantize_cli_on_a_gguf_file(tmp_path, llama_model):
    from qerl_jax.quantize import main

    file = write_gguf(tmp_path / "m.gguf", llama_model, types={"gate_proj.weight": Q.Q4_1})
    out = tmp_path / "out"
    assert main(["--model", file, "--format", "nvfp4", "--out", str(out), "--quiet"]) == 0
    _, from_ckpt = qerl_jax.load_model(str(out), dtype="float32")
    _, from_gguf = qerl_jax.load_model(file, dtype="float32", quant="nvfp4")
    for proj in ("q_proj", "gate_proj"):
        a, b = from_ckpt["base"]["layers"][proj]["w"], from_gguf["base"]["layers"][proj]["w"]
        np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
        np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
        np.testing.assert_array_equal(np.asarray(a.global_scale), np.asarray(b.global_scale))
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tmp")]  # the float32 export is removed


def test_directory_with_one_gguf_file(tmp_path, llama_model):
    write_gguf(tmp_path / "m.gguf", llama_model)
    config, _ = qerl_jax.load_model(str(tmp_path), dtype="float32")
    assert config.num_hidden_layers == 2


def test_a_file_is_parsed_once_per_process_until_it_changes(tmp_path, llama_model, monkeypatch):
    file = write_gguf(tmp_path / "m.gguf", llama_model)
    parses = []
    reader_cls = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or reader_cls(*a, **k))
    first = qgguf.open_gguf(file)
    assert qgguf.open_gguf(file) is first and qgguf.open_gguf(str(tmp_path)) is first
    assert len(parses) == 1
    st = os.stat(file)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the file changed
    assert qgguf.open_gguf(file) is not first and len(parses) == 2


# ----------------------------------------------------------------------------- bad input


def test_unsupported_architecture(tmp_path, llama_model):
    file = write_gguf(tmp_path / "m.gguf", llama_model, arch="gemma")
    with pytest.raises(CheckpointError, match=r"m\.gguf.*architecture 'gemma' is not supported"):
        qerl_jax.load_model(file)


def test_unsupported_tensor_type_fails_before_any_dequantization(tmp_path, llama_model, monkeypatch):
    file = write_gguf(tmp_path / "m.gguf", llama_model, extra={"blk.1.attn_extra.weight": np.zeros((4, 4), np.int32)})
    calls = []
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(a))
    with pytest.raises(CheckpointError, match=r"m\.gguf.*tensor type\(s\) \['I32'\].*blk\.1\.attn_extra\.weight"):
        qerl_jax.load_model(file)
    assert not calls


def test_unknown_tensor_name(tmp_path, llama_model):
    file = write_gguf(tmp_path / "m.gguf", llama_model, extra={"rope_freqs.weight": np.ones(32, np.float32)})
    with pytest.raises(CheckpointError, match=r"rope_freqs\.weight.*llama3 RoPE"):
        qerl_jax.load_model(file)


def test_missing_tensor(tmp_path, llama_model):
    file = write_gguf(tmp_path / "m.gguf", llama_model, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(CheckpointError, match=r"m\.gguf: 1 tensor\(s\) are missing.*layers\.1\.mlp\.up_proj"):
        qerl_jax.load_model(file)


@pytest.mark.parametrize("keep", [0.5, 0.02], ids=["in_tensor_data", "in_header"])
def test_truncated_file(tmp_path, llama_model, keep):
    file = write_gguf(tmp_path / "m.gguf", llama_model)
    data = open(file, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*(truncated|cannot read)"):
        qerl_jax.load_model(str(cut))


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match=r"x\.gguf is not a GGUF file"):
        qerl_jax.load_model(str(tmp_path / "x.gguf"))


def test_directory_with_two_gguf_files(tmp_path, llama_model):
    write_gguf(tmp_path / "a.gguf", llama_model)
    write_gguf(tmp_path / "b.gguf", llama_model)
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\)"):
        qerl_jax.load_model(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files"):
        qerl_jax.load_tokenizer(str(tmp_path))


def test_gguf_without_tokenizer_metadata(tmp_path, llama_model):
    file = write_gguf(tmp_path / "m.gguf", llama_model)
    with pytest.raises(CheckpointError, match=r"m\.gguf: the GGUF metadata has no tokenizer"):
        qerl_jax.load_tokenizer(file)


def test_a_tokenizer_in_the_metadata_renders_and_tokenizes_as_the_one_written(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from qerl_jax.data import prompt_lengths

    source = AutoTokenizer.from_pretrained(tiny_model_dir)
    loaded = qerl_jax.load_tokenizer(write_gguf_with_tokenizer(tmp_path / "m.gguf", source))
    prompts = ["What is 12 plus 30?", "Natalia sold clips to 48 of her friends in April."]
    assert prompt_lengths(loaded, prompts, "{prompt}") == prompt_lengths(source, prompts, "{prompt}")
    text = "<|im_start|>user\nHow many clips?<|im_end|>"
    assert loaded(text)["input_ids"] == source(text)["input_ids"]
    assert (loaded.eos_token, loaded.pad_token) == (source.eos_token, source.pad_token)


def test_a_tokenizer_is_built_once_per_process_and_each_caller_gets_its_own(tmp_path, tiny_model_dir, monkeypatch):
    """The config check and the model load each ask for it; transformers parses the metadata once."""
    from transformers import AutoTokenizer

    file = write_gguf_with_tokenizer(tmp_path / "m.gguf", AutoTokenizer.from_pretrained(tiny_model_dir))
    builds = []
    build = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: builds.append(a) or build(*a, **k))
    first = qerl_jax.load_tokenizer(file)
    first.pad_token = None  # a caller's change stays its own
    second = qerl_jax.load_tokenizer(str(tmp_path))
    assert len(builds) == 1 and second is not first and second.pad_token == "<|endoftext|>"
    st = os.stat(file)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the file changed
    qerl_jax.load_tokenizer(file)
    assert len(builds) == 2


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer):
    return smollm2_gguf_path(), smollm2_tokenizer


def test_smollm2_logits_match_transformers_gguf_loading(smollm2):
    path, tokenizer = smollm2
    config, params = qerl_jax.load_model(path, dtype="float32")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert config.num_key_value_heads == 3 and config.tie_word_embeddings and config.model_type == "llama"
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is 6 times 7?", "Name a prime number.", "2+2=")
    ]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    t = max(map(len, ids))
    batch = np.full((len(ids), t), tokenizer.pad_token_id, np.int32)
    mask = np.zeros_like(batch)
    for row, x in enumerate(ids):
        batch[row, t - len(x) :], mask[row, t - len(x) :] = x, 1
    ours = np.asarray(qerl_jax.forward(config, params, jnp.asarray(batch), jnp.asarray(mask)))
    ref = hf_logits(_transformers_gguf(path), batch, mask)
    real = mask.astype(bool)
    assert np.abs(ours[real] - ref[real]).max() < 1e-4 * np.abs(ref[real]).max()


def test_smollm2_tokenizer_chat_template_and_stop_ids(smollm2):
    from qerl_jax.data import render_prompt
    from qerl_jax.policy import stop_token_ids

    path, tokenizer = smollm2
    text = render_prompt(tokenizer, "What is 2 + 3?", template="{prompt}", system_prompt="Be brief.")
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2 and tokenizer.pad_token_id is not None
    config = qgguf.open_gguf(path).config
    assert im_end in stop_token_ids(path, config, tokenizer)


def test_special_tokens_missing_after_conversion_come_from_the_metadata(smollm2):
    """transformers 5.17's GGUF conversion leaves pad_token unset (5.23 sets it): the metadata's
    padding_token_id fills it; tokens the tokenizer already has are kept."""
    import copy

    path, tokenizer = smollm2
    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    assert bare.pad_token_id is None
    metadata = qgguf.open_gguf(path).metadata
    filled = qgguf.fill_special_tokens(bare, {**metadata, "tokenizer.ggml.eos_token_id": 0})
    assert filled.pad_token_id == metadata["tokenizer.ggml.padding_token_id"] == 2
    assert filled.eos_token_id == 2  # already set: the metadata does not override it
