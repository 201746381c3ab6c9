"""Tiny offline Qwen2-style tokenizer and random checkpoint builder (for tests).

Nothing here touches the network or torch: the tokenizer is a byte-level BPE
trained with the `tokenizers` library on a small text sample, and the checkpoint
is a Hugging Face Qwen2 directory (`config.json`, `model.safetensors`,
`generation_config.json`, tokenizer files) written with `safetensors.numpy`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Sequence

import ml_dtypes
import numpy as np

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Same split regex as the Qwen2 tokenizer: words, single digits, punctuation runs.
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# ChatML template in the style of Qwen2.5 (without tool calling): a default
# system turn is inserted when the conversation does not start with one.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_BUILTIN_TEXT = """\
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? She sold 48 / 2 = 24 clips in May,
so 48 + 24 = 72 clips in total. The answer is \\boxed{72}.
Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes of babysitting.
12 / 60 = 0.2 dollars per minute, and 0.2 * 50 = 10 dollars. The answer is \\boxed{10}.
Let x be a real number such that x^2 - 5x + 6 = 0. Then (x - 2)(x - 3) = 0, so x = 2 or x = 3.
The sum of the roots is \\frac{5}{1} = 5 and the product is 6. Therefore the answer is \\boxed{5}.
Compute \\sqrt{16} + \\sqrt{9}. We have \\sqrt{16} = 4 and \\sqrt{9} = 3, so the total is 7.
Find the interval where f(x) = \\frac{1}{x - 1} is defined: (-\\infty, 1) \\cup (1, \\infty).
A triangle has angles of 30, 60 and 90 degrees. The hypotenuse is 10, so the short side is 5.
Please reason step by step, and put your final answer within \\boxed{}.
The quick brown fox jumps over the lazy dog. A train travels 120 miles in 2 hours.
Its average speed is 120 / 2 = 60 miles per hour. John has 3 apples and buys 4 more.
"""


def default_data_dir() -> pathlib.Path | None:
    """The shared math data folder (`qerl_jax.config.DATA_DIR`, env QERL_DATA_DIR), if it exists."""
    from qerl_jax.config import DATA_DIR  # noqa: PLC0415

    path = pathlib.Path(DATA_DIR)
    return path if path.is_dir() else None


def _default_texts(max_rows: int = 300) -> list[str]:
    """A few hundred GSM8K question+answer texts, or the built-in sample."""
    texts = [_BUILTIN_TEXT]
    data_dir = default_data_dir()
    path = data_dir / "gsm8k" / "train.jsonl" if data_dir else None
    if path is not None and path.is_file():
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= max_rows:
                    break
                row = json.loads(line)
                texts.append(row.get("question", "") + "\n" + row.get("answer", ""))
    return texts


def build_tiny_tokenizer(
    out_dir: str | os.PathLike | None = None,
    vocab_size: int = 512,
    texts: Iterable[str] | None = None,
):
    """Trains a small Qwen2-style byte-level BPE tokenizer offline.

    Args:
      out_dir: if given, the tokenizer is saved there with `save_pretrained`.
      vocab_size: total vocabulary size, the 3 special tokens and the 256 byte
        symbols included (must be >= 260); when the texts run out of merges the
        rest is filled with `<|reserved_i|>` special tokens.
      texts: training texts; default: up to 300 GSM8K train rows from the shared
        data folder (if present) plus a small built-in math/English sample.

    Returns:
      A `transformers.PreTrainedTokenizerFast` with `<|endoftext|>` as pad and
      eos token, `<|im_start|>`/`<|im_end|>` and a ChatML chat template.
    """
    import transformers

    min_size = len(SPECIAL_TOKENS) + 256 + 1
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small; expected >= {min_size}.")
    texts = list(texts) if texts is not None else _default_texts()
    if not texts:
        raise ValueError("texts is empty; expected at least one training text.")

    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(vocab_size, texts),
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf_tok.save_pretrained(str(out_dir))
        # Real Qwen checkpoints name Qwen2Tokenizer; it loads the same tokenizer.json.
        cfg_path = pathlib.Path(out_dir) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "Qwen2Tokenizer"
        _write_json(cfg_path, cfg)
    return hf_tok


def _train_bpe(vocab_size: int, texts: list[str]):
    """A Qwen2-style byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` ids trained on `texts`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Small corpora run out of merges: fill up with reserved special tokens (like
    # Qwen's unused ids) so that the vocabulary size is always as asked.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)])
    return tok


def _supports_bf16_numpy() -> bool:
    import tempfile

    import safetensors.numpy

    try:
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "probe.safetensors")
            safetensors.numpy.save_file({"x": np.zeros((1,), ml_dtypes.bfloat16)}, p)
            return safetensors.numpy.load_file(p)["x"].dtype == ml_dtypes.bfloat16
    except Exception:  # older safetensors: no bf16 in the numpy backend.
        return False


def make_tiny_weights(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    random_norms: bool = False,
) -> dict[str, np.ndarray]:
    """Random float32 Qwen2 weights under their HF names (std 0.02 normal).

    Norm scales are ones unless `random_norms`, then 1 + N(0, 0.1) so that a
    swapped norm would be noticed. Shapes follow HF: linear W is [out, in].
    """
    rng = np.random.default_rng(seed)
    head_dim = hidden_size // num_heads
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(d):
        if random_norms:
            return (1.0 + rng.standard_normal(d) * 0.1).astype(np.float32)
        return np.ones((d,), np.float32)

    w = {"model.embed_tokens.weight": normal(vocab_size, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(q_out, hidden_size)
        w[p + "self_attn.q_proj.bias"] = normal(q_out)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden_size)
        w[p + "self_attn.k_proj.bias"] = normal(kv_out)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden_size)
        w[p + "self_attn.v_proj.bias"] = normal(kv_out)
        w[p + "self_attn.o_proj.weight"] = normal(hidden_size, q_out)
        w[p + "mlp.gate_proj.weight"] = normal(intermediate_size, hidden_size)
        w[p + "mlp.up_proj.weight"] = normal(intermediate_size, hidden_size)
        w[p + "mlp.down_proj.weight"] = normal(hidden_size, intermediate_size)
        w[p + "input_layernorm.weight"] = norm(hidden_size)
        w[p + "post_attention_layernorm.weight"] = norm(hidden_size)
    w["model.norm.weight"] = norm(hidden_size)
    if not tie_word_embeddings:
        w["lm_head.weight"] = normal(vocab_size, hidden_size)
    return w


_CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_BUILD_ARGS_FILE = "tiny_build_args.json"


def _write_json(path: pathlib.Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def hf_config(
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    eos_id: int = SPECIAL_TOKENS.index(ENDOFTEXT),
) -> dict:
    """The config.json that `build_tiny_checkpoint` writes with these arguments (its defaults: the
    model that `model.tiny=True` builds), known without building it."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": eos_id,  # Qwen2.5 uses <|endoftext|> as bos id too.
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def build_tiny_checkpoint(
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    vocab_size: int = 512,
    random_norms: bool = False,
    texts: Sequence[str] | None = None,
) -> str:
    """Writes a complete random HF Qwen2 checkpoint directory without torch.

    Skips the work when `out_dir` already holds a checkpoint built with the same
    arguments (recorded in `tiny_build_args.json`, written last).

    Args:
      out_dir: target directory (created if needed).
      hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: model
        shape; hidden_size must divide by num_heads and num_heads by num_kv_heads.
      seed: weight RNG seed.
      tie_word_embeddings: if True, no `lm_head.weight` is written.
      vocab_size: tokenizer vocabulary size (also the model's vocab_size).
      random_norms: RMSNorm scales 1 + N(0, 0.1) instead of ones.
      texts: tokenizer training texts (default: see `build_tiny_tokenizer`).

    Returns:
      `out_dir` as a string.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}.")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}.")
    out = pathlib.Path(out_dir)
    texts = list(texts) if texts is not None else _default_texts()
    shape = dict(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip
    build_args = dict(
        **shape, seed=seed, vocab_size=vocab_size, random_norms=random_norms, texts_hash=_hash_texts(texts),
        format_version=1,
    )  # fmt: skip
    if _built_with(out, build_args):
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / _BUILD_ARGS_FILE).unlink(missing_ok=True)  # written again last, once the checkpoint is complete
    tokenizer = build_tiny_tokenizer(out, vocab_size=vocab_size, texts=texts)
    real_vocab = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = hf_config(vocab_size=real_vocab, eos_id=eos_id, **shape)
    weights = make_tiny_weights(vocab_size=real_vocab, seed=seed, random_norms=random_norms, **shape)
    gen_config = _generation_config(eos_id, tokenizer.convert_tokens_to_ids(IM_END))
    _write_weights_and_configs(out, weights, config, gen_config)
    _write_json(out / _BUILD_ARGS_FILE, build_args)
    return str(out)


def _built_with(out: pathlib.Path, build_args: dict) -> bool:
    """Whether `out` holds a complete checkpoint built with `build_args` (its marker written last)."""
    marker = out / _BUILD_ARGS_FILE
    if marker.is_file() and all((out / f).is_file() for f in _CHECKPOINT_FILES):
        try:
            return json.loads(marker.read_text()) == build_args
        except json.JSONDecodeError:
            pass
    return False


def _generation_config(eos_id: int, im_end_id: int) -> dict:
    return {
        "bos_token_id": eos_id,
        "eos_token_id": [im_end_id, eos_id],
        "pad_token_id": eos_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def _write_weights_and_configs(out: pathlib.Path, weights: dict[str, np.ndarray], config: dict, gen_config: dict):
    """model.safetensors (bf16 where safetensors' numpy backend has it, else float32: config.json
    then says so), config.json and generation_config.json."""
    import safetensors.numpy

    if _supports_bf16_numpy():
        weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}
    else:
        config["torch_dtype"] = "float32"
    tmp = out / f"model.safetensors.tmp{os.getpid()}"
    safetensors.numpy.save_file(weights, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / "model.safetensors")
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", gen_config)


def _hash_texts(texts: Sequence[str]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()
