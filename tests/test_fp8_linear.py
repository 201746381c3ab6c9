"""benchmarks/devtools/fp8_linear.py's accuracy check on a real model (--gguf): the text it scores is the
jsonl's problems in order, and the FP8 path moves the log-probs by a little, not by nothing or by a lot."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.devtools import fp8_linear


def test_real_model_accuracy_scores_the_texts_tokens(tmp_path, tiny_model_dir):
    text = tmp_path / "problems.jsonl"
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}, {"question": "And 4 * 6?", "answer": "#### 24"}]
    text.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config, _, ids = fp8_linear.real_model(tiny_model_dir, str(text), 2, 8)
    from qerl_jax import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    expected = [t for r in rows for t in tokenizer.encode(f"{r['question']}\n{r['answer']}\n\n")]
    assert len(expected) >= 16 and np.asarray(ids).reshape(-1).tolist() == expected[:16]
    result = fp8_linear.logprob_error("", 0, 2, 8, gguf=tiny_model_dir, text=str(text))
    assert result["tokens"] == 16 and result["layers"] == config.num_hidden_layers
    assert 0.0 < result["mean_abs_logp_diff"] < 1.0 and 0.0 < result["mean_kl_bf16_fp8"] < 0.5, result
