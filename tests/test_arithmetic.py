"""The generated arithmetic data source: seeded, a fixed disjoint split, correct answers that the
reward checks, selectable from a config; and configs/arithmetic_smollm2.py."""

import collections
import re

import pytest
from conftest import load_config

from qerl_jax import rewards
from qerl_jax.data import arithmetic, load_math_dataset

_PROBLEM_RE = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def _parse(prompt: str) -> tuple[int, str, int]:
    m = _PROBLEM_RE.fullmatch(prompt)
    assert m, prompt
    return int(m.group(1)), m.group(2), int(m.group(3))


def test_answers_are_the_python_integer_results():
    ds = load_math_dataset("arithmetic:test")
    python = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for prompt, answer in zip(ds["prompt"], ds["answer"]):
        a, op, b = _parse(prompt)
        assert int(answer) == python[op](a, b) and answer == str(int(answer))


def test_seeded_and_fixed():
    spec = arithmetic.ArithmeticSpec(num_train=300, num_test=50)
    assert arithmetic.problems(spec) == arithmetic.problems(spec)
    assert arithmetic.problems(spec) != arithmetic.problems(arithmetic.ArithmeticSpec(300, 50, seed=1))
    # The default split is what "arithmetic:test" loads, row for row, every time.
    rows = arithmetic.arithmetic_rows("test")
    ds = load_math_dataset("arithmetic:test")
    assert list(ds["prompt"]) == [r["question"] for r in rows] and ds["source_id"][0] == "arithmetic/test/0"
    assert ds["prompt"][:3] == [
        "What is 56 * 3?",
        "What is 0 + 8?",
        "What is 553 - 97?",
    ]  # pinned: the split never moves


def test_train_and_test_do_not_overlap_even_up_to_commutativity():
    train = load_math_dataset("arithmetic:train")
    test = load_math_dataset("arithmetic:test")
    assert (len(train), len(test)) == (arithmetic.ArithmeticSpec.num_train, arithmetic.ArithmeticSpec.num_test)

    def key(prompt):
        a, op, b = _parse(prompt)
        return (min(a, b), op, max(a, b)) if op in "+*" else (a, op, b)

    train_keys = [key(p) for p in train["prompt"]]
    assert len(set(train_keys)) == len(train_keys)  # no duplicates within a split either
    assert not set(train_keys) & {key(p) for p in test["prompt"]}


def test_mixed_difficulty():
    ds = load_math_dataset("arithmetic:train")
    problems = [_parse(p) for p in ds["prompt"]]
    ops = collections.Counter(op for _, op, _ in problems)
    assert set(ops) == {"+", "-", "*"} and min(ops.values()) > 0.25 * len(problems)
    digits = collections.Counter(len(str(x)) for a, _, b in problems for x in (a, b))
    assert set(digits) == {1, 2, 3} and min(digits.values()) > 0.2 * 2 * len(problems)
    assert all(a >= b for a, op, b in problems if op == "-")  # answers are never negative


def test_reward_scores_a_correct_completion_1_and_a_wrong_one_0():
    ds = load_math_dataset("arithmetic:test").select(range(30))
    for prompt, answer in zip(ds["prompt"], ds["answer"]):
        a, op, b = _parse(prompt)
        right = f"To find {a} {op} {b}, compute: {a} {op} {b} = {answer}."
        wrong = f"{a} {op} {b} = {int(answer) + 1}"
        assert rewards.accuracy_reward(right, answer) == 1.0
        assert rewards.accuracy_reward(f"The answer is \\boxed{{{answer}}}.", answer) == 1.0
        assert rewards.accuracy_reward(wrong, answer) == 0.0


def test_bad_names_and_splits():
    with pytest.raises(ValueError, match="unknown arithmetic split 'val'"):
        load_math_dataset("arithmetic:val")
    with pytest.raises(ValueError, match="is the train split; got split='test'"):
        load_math_dataset("arithmetic:train", split="test")
    with pytest.raises(ValueError, match="operations"):
        arithmetic.problems(arithmetic.ArithmeticSpec(operations=("/",)))
    with pytest.raises(ValueError, match="distinct problems"):
        arithmetic.problems(arithmetic.ArithmeticSpec(num_train=200, num_test=0, max_digits=1, operations=("+",)))


def test_config_arms_differ_only_in_precision_aqn_and_ratio_source():
    flat = {}
    for arm in ("bf16", "nvfp4", "nvfp4_aqn", "nvfp4_aqn_current"):
        cfg = load_config("arithmetic_smollm2", arm)
        assert cfg.data.train == "arithmetic:train" and cfg.eval.datasets == ("arithmetic:test",)
        d = cfg.to_dict()
        d.pop("workdir")
        d["model"].pop("quant")
        d["aqn"].pop("enabled")
        d["rl"].pop("old_logp_source")
        flat[arm] = d
    assert flat["bf16"] == flat["nvfp4"] == flat["nvfp4_aqn"] == flat["nvfp4_aqn_current"]
    assert load_config("arithmetic_smollm2", "nvfp4_aqn_current").rl.old_logp_source == "current"
    with pytest.raises(ValueError, match="unknown arm"):
        load_config("arithmetic_smollm2", "fp8")


def test_smollm2_prompts_fit_and_render_with_its_chat_template(smollm2_tokenizer):
    from qerl_jax.data import filter_overlong, render_prompt

    cfg = load_config("arithmetic_smollm2", "nvfp4")
    assert cfg.model.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    text = render_prompt(smollm2_tokenizer, "What is 17 + 25?", template=cfg.data.template, system_prompt=None)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
    )
    test = load_math_dataset("arithmetic:test")
    kept, dropped = filter_overlong(
        test, smollm2_tokenizer, cfg.data.max_prompt_len, cfg.data.template, system_prompt=cfg.data.system_prompt
    )
    assert dropped == 0 and len(kept) == len(test)
