"""qerl_jax.model_io.load_cache: a converted GGUF model read back from the cache is bit-identical to a
direct load (params, config, tokenizer, stop ids) without converting; a changed file or option
misses; a damaged entry is replaced; an unusable root leaves the cache off; the root is bounded
(least recently used entries go)."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest
from conftest import make_hf_model
from test_gguf import TINY_LLAMA, write_gguf

from experiments.models import smollm2_gguf_path
from qerl_jax import compile_cache
from qerl_jax.model_io import load_cache, loader
from qerl_jax.policy import stop_token_ids

SAMPLE = "Natalia sold 48 clips in April, and half as many in May. <|im_end|> ünïcode 3.14"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


def _assert_same_params(a, b):
    leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)  # incl. PackedWeight's fmt
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), path
        assert x.tobytes() == y.tobytes(), path


def _assert_same_tokenizer(a, b):
    assert a(SAMPLE)["input_ids"] == b(SAMPLE)["input_ids"]
    chat = dict(tokenize=False, add_generation_prompt=True)
    assert a.apply_chat_template(MESSAGES, **chat) == b.apply_chat_template(MESSAGES, **chat)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(a, attr) == getattr(b, attr), attr


def _no_conversion(*args, **kwargs):
    raise AssertionError("converted although the entry is cached")


def _entries(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


@pytest.fixture(scope="module")
def llama_model():
    return make_hf_model("llama", **TINY_LLAMA)


@pytest.fixture
def tiny_gguf(tmp_path, llama_model, smollm2_tokenizer, monkeypatch):
    """A tiny llama GGUF file (no tokenizer metadata: the converter gets SmolLM2's tokenizer)."""
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: smollm2_tokenizer)
    return write_gguf(tmp_path / "m.gguf", llama_model)


def _load(file, root, quant="nvfp4", dtype="bfloat16", **kw):
    return load_cache.load_or_convert(file, dtype=dtype, quant=quant, root=str(root), **kw)


# ----------------------------------------------------------------------------- hits


@pytest.mark.parametrize("quant", [None, "nvfp4", "mxfp4", "nf4"])
def test_a_hit_equals_a_direct_load_without_converting(tmp_path, tiny_gguf, smollm2_tokenizer, quant, monkeypatch):
    root = tmp_path / "cache"
    _load(tiny_gguf, root, quant=quant)
    assert len(_entries(root)) == 1
    monkeypatch.setattr(load_cache, "convert", _no_conversion)
    config, params, tokenizer = _load(tiny_gguf, root, quant=quant)
    ref_config, ref_params = loader.load_model(tiny_gguf, dtype="bfloat16", quant=quant)
    assert config == ref_config
    _assert_same_params(params, ref_params)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(params))  # on the device, as load_model
    _assert_same_tokenizer(tokenizer, smollm2_tokenizer)


def test_smollm2_nvfp4_hit_equals_the_conversion(tmp_path, monkeypatch, capsys):
    """The real GGUF model: params, config, tokenizer (chat template, special tokens) and stop ids."""
    file, root = smollm2_gguf_path(), tmp_path / "cache"
    config, params, tokenizer = _load(file, root)
    out = capsys.readouterr().out
    assert f"model: stored the converted {os.path.basename(file)} in the cache {root}" in out
    monkeypatch.setattr(load_cache, "convert", _no_conversion)
    hit_config, hit_params, hit_tokenizer = _load(file, root)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"model: loaded the converted {os.path.basename(file)} from the cache ")
    assert hit_config == config
    _assert_same_params(hit_params, params)
    assert type(hit_tokenizer) is type(tokenizer) and len(hit_tokenizer) == len(tokenizer)
    _assert_same_tokenizer(hit_tokenizer, tokenizer)
    assert stop_token_ids(file, hit_config, hit_tokenizer) == stop_token_ids(file, config, tokenizer)


def test_a_checkpoint_directory_is_not_cached(tmp_path, tiny_qwen2_dir, smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: smollm2_tokenizer)  # the directory has none
    root = tmp_path / "cache"
    _, params, _ = _load(tiny_qwen2_dir[0], root, quant=None, dtype="float32")
    assert not root.exists()
    _assert_same_params(params, loader.load_model(tiny_qwen2_dir[0], dtype="float32")[1])


# ----------------------------------------------------------------------------- keys


def test_the_key_follows_the_file_and_the_options(tiny_gguf):
    key = load_cache.cache_key(tiny_gguf, "bfloat16", "nvfp4", ("up_proj", "down_proj"))
    assert key == load_cache.cache_key(tiny_gguf, "bfloat16", "nvfp4", ("down_proj", "up_proj"))
    assert load_cache.cache_key(tiny_gguf, "bfloat16", None, ()) == load_cache.cache_key(
        tiny_gguf, "bfloat16", "bf16", ()
    )
    for other in (("float32", "nvfp4", ("up_proj", "down_proj")), ("bfloat16", "mxfp4", ("up_proj", "down_proj"))):
        assert load_cache.cache_key(tiny_gguf, *other) != key
    assert load_cache.cache_key(tiny_gguf, "bfloat16", "nvfp4", ("down_proj",)) != key
    st = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: converted again
    assert load_cache.cache_key(tiny_gguf, "bfloat16", "nvfp4", ("up_proj", "down_proj")) != key


def test_a_touched_file_or_another_quant_misses(tmp_path, tiny_gguf, monkeypatch):
    root = tmp_path / "cache"
    calls = []
    convert = load_cache.convert
    monkeypatch.setattr(load_cache, "convert", lambda *a, **kw: calls.append(kw["quant"]) or convert(*a, **kw))
    _load(tiny_gguf, root)
    _load(tiny_gguf, root)
    assert calls == ["nvfp4"]
    _load(tiny_gguf, root, quant="mxfp4")
    st = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _load(tiny_gguf, root)
    assert calls == ["nvfp4", "mxfp4", "nvfp4"] and len(_entries(root)) == 3


# ----------------------------------------------------------------------------- problems


@pytest.mark.parametrize("damage", ["truncate weights", "no config", "no tokenizer", "foreign tensor"])
def test_a_damaged_entry_is_replaced_with_one_line(tmp_path, tiny_gguf, damage, capsys):
    root = tmp_path / "cache"
    _, ref_params, _ = _load(tiny_gguf, root)
    (key,) = _entries(root)
    entry = root / key
    weights = entry / load_cache.WEIGHTS_FILE
    if damage == "truncate weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "no config":
        (entry / load_cache.CONFIG_FILE).unlink()
    elif damage == "no tokenizer":
        (entry / "tokenizer.json").unlink()
        (entry / "tokenizer_config.json").unlink()
    else:  # the manifest no longer matches the file's tensors
        from safetensors import safe_open
        from safetensors.numpy import load_file, save_file

        with safe_open(str(weights), framework="numpy") as f:
            metadata = f.metadata()
        save_file({**load_file(str(weights)), "extra": np.zeros(3, np.float32)}, str(weights), metadata=metadata)
    capsys.readouterr()
    _, params, _ = _load(tiny_gguf, root)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"model cache: removing the damaged entry {entry}")
    _assert_same_params(params, ref_params)
    assert _entries(root) == [key]  # stored again
    _, params, _ = load_cache._read(str(entry))
    _assert_same_params(params, ref_params)


def test_an_unusable_root_leaves_the_cache_off_with_one_line(tmp_path, tiny_gguf, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config, params, _ = _load(tiny_gguf, blocker / "cache")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"model cache off: cannot use {blocker / 'cache'}")
    ref_config, ref_params = loader.load_model(tiny_gguf, quant="nvfp4")
    assert config == ref_config
    _assert_same_params(params, ref_params)


def test_the_least_recently_used_entry_is_evicted(tmp_path, tiny_gguf, capsys):
    files = [shutil.copy(tiny_gguf, str(tmp_path / f"m{i}.gguf")) for i in range(3)]
    root = tmp_path / "cache"
    _load(files[0], root)
    (first,) = _entries(root)
    size = load_cache._size(str(root / first))
    bound = int(2.5 * size)  # two entries fit
    _load(files[1], root, max_bytes=bound)
    second = (set(_entries(root)) - {first}).pop()
    _load(files[0], root, max_bytes=bound)  # a hit: the first is now the more recently used
    capsys.readouterr()
    _load(files[2], root, max_bytes=bound)
    assert second not in _entries(root) and first in _entries(root) and len(_entries(root)) == 2
    assert f"model cache: evicted {root / second}" in capsys.readouterr().out


def test_an_entry_larger_than_the_bound_is_not_stored(tmp_path, tiny_gguf, capsys):
    root = tmp_path / "cache"
    _, params, _ = _load(tiny_gguf, root, max_bytes=1000)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "is larger than the cache's bound" in out[0] and "not stored" in out[0]
    assert _entries(root) == []
    _assert_same_params(params, loader.load_model(tiny_gguf, quant="nvfp4")[1])


def test_runs_share_the_user_cache_unless_the_config_names_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = compile_cache.cache_dir("", load_cache.CACHE_NAME)
    assert root == str(tmp_path / "xdg" / "qerl_jax" / "models")
    assert os.path.dirname(root) == os.path.dirname(compile_cache.cache_dir(""))  # next to JAX's cache
    assert compile_cache.cache_dir(str(tmp_path / "mine"), load_cache.CACHE_NAME) == str(tmp_path / "mine")


def test_load_policy_reads_a_gguf_model_through_the_cache_of_model_cache_dir(tmp_path, tiny_gguf, monkeypatch, capsys):
    from conftest import tiny_config

    from qerl_jax import policy, run_config

    root = tmp_path / "models"
    run = run_config.from_config_dict(tiny_config(tmp_path, tiny_gguf, **{"model.cache_dir": str(root)}))
    first = policy.load_policy(run)
    (key,) = _entries(root)
    monkeypatch.setattr(load_cache, "convert", _no_conversion)
    capsys.readouterr()
    second = policy.load_policy(run)
    assert f"from the cache {root / key} (" in capsys.readouterr().out
    _assert_same_params(second.frozen, first.frozen)
    assert (second.config, second.stop_ids, second.pad_id) == (first.config, first.stop_ids, first.pad_id)
