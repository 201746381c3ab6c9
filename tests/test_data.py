"""Tests for qerl_jax.data: dataset loading, prompt tokenization, the batch loader."""

import json
import logging
import pathlib

import datasets
import numpy as np
import pytest

from qerl_jax.data import datasets as ds_mod
from qerl_jax.data import load_math_dataset
from qerl_jax.data import prompts as pr
from qerl_jax.model_io import tiny

DATA = tiny.default_data_dir()
needs_data = pytest.mark.skipif(
    DATA is None or not (DATA / "gsm8k" / "train.jsonl").is_file(), reason="shared math data not present"
)


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tiny_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _raw(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


# ---------------------------------------------------------------- shared files


@needs_data
@pytest.mark.parametrize("split,count", [("train", 7473), ("test", 1319)])
def test_gsm8k_files(split, count):
    path = DATA / "gsm8k" / f"{split}.jsonl"
    d = load_math_dataset(path)
    assert isinstance(d, datasets.Dataset)
    assert d.column_names == ["prompt", "answer", "source_id"] and len(d) == count
    assert all(v.dtype == "string" for v in d.features.values())
    raw = _raw(path)
    # Reference: the text after "####" with thousands commas dropped.
    assert d["answer"] == [r["answer"].split("####")[-1].strip().replace(",", "") for r in raw]
    assert d["prompt"] == [r["question"] for r in raw]
    assert d["source_id"][17] == f"gsm8k/{split}/17"
    assert len(set(d["source_id"])) == count
    if split == "train":
        assert d[0]["answer"] == "72" and d[1]["answer"] == "10"
        assert d[0]["prompt"].startswith("Natalia sold clips to 48 of her friends")


@needs_data
def test_math500_file_and_folder():
    d = load_math_dataset(DATA / "math500", "test")
    assert len(d) == 500 and d.column_names == ["prompt", "answer", "source_id"]
    raw = _raw(DATA / "math500" / "test.jsonl")
    assert d["answer"] == [r["answer"] for r in raw]
    assert d["source_id"] == [r["unique_id"] for r in raw]
    assert d[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert d[0]["source_id"] == "test/precalculus/807.json"
    # Split defaults to the only file of the folder.
    assert load_math_dataset(DATA / "math500")["answer"] == d["answer"]


# ---------------------------------------------------------------- formats


def test_math_rows_from_solution_box_and_parquet(tmp_path):
    rows = [
        {"problem": "P0", "solution": "so $\\boxed{\\frac{1}{2}}$ and done", "unique_id": "u0"},
        {"problem": "P1", "solution": "first \\boxed{1} then \\boxed{\\{3, 4\\}}."},
        {"problem": "P2", "answer": 720, "id": 9},  # AIME-style integer answer.
        {"question": "Q3", "answer": "Compute.\n#### -1,250"},
        {"prompt": "P4", "answer": "x+1"},
    ]
    d = load_math_dataset(_write_jsonl(tmp_path / "mix.jsonl", rows))
    assert d["prompt"] == ["P0", "P1", "P2", "Q3", "P4"]
    assert d["answer"] == ["\\frac{1}{2}", "\\{3, 4\\}", "720", "-1250", "x+1"]
    assert d["source_id"] == ["u0", f"{tmp_path.name}/mix/1", "9", f"{tmp_path.name}/mix/3", f"{tmp_path.name}/mix/4"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"problem": "A", "answer": "1"}, {"problem": "B", "answer": "2"}]),
        tmp_path / "train.parquet",
    )
    d = load_math_dataset(tmp_path / "train.parquet")
    assert d["answer"] == ["1", "2"] and d["source_id"][1] == f"{tmp_path.name}/train/1"
    (tmp_path / "list.json").write_text(json.dumps([{"problem": "J", "answer": "3"}]))
    assert load_math_dataset(tmp_path / "list.json")["answer"] == ["3"]


@pytest.mark.parametrize(
    "row,reason",
    [
        ({"answer": "5"}, "problem"),
        ({"problem": "", "answer": "5"}, "problem"),
        ({"problem": "P"}, "answer"),
        ({"problem": "P", "answer": "  "}, "answer"),
        ({"problem": "P", "solution": "no box here"}, "boxed"),
        ({"question": "Q", "answer": "steps\n#### "}, "nothing after"),
        ({"question": "Q", "answer": "steps\n#### twelve"}, "not a number"),
        ({"question": "Q", "answer": "steps\nno final line"}, "####"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_convert_row_rejects(row, reason):
    with pytest.raises(ds_mod.BadRow, match=reason):
        ds_mod.convert_row(row)


def test_bad_rows_skipped_counted_or_raise(tmp_path, caplog):
    good = [{"question": f"Q{i}", "answer": f"s\n#### {i}"} for i in range(199)]
    path = _write_jsonl(tmp_path / "train.jsonl", good[:100] + [{"question": "Q"}] + good[100:])
    with caplog.at_level(logging.WARNING):
        d = load_math_dataset(path)
    assert len(d) == 199 and d["answer"][100] == "100"
    assert d["source_id"][100] == f"{tmp_path.name}/train/101"  # Ids keep file rows.
    assert "skipped 1 of 200 bad rows" in caplog.text and "row 100" in caplog.text
    with pytest.raises(ValueError, match=r"1 of 200 rows are bad.*row 100"):
        load_math_dataset(path, max_bad_fraction=0.0)
    bad_json = _write_jsonl(tmp_path / "b.jsonl", good[:3] + ["{not json"])
    with pytest.raises(ValueError, match=r"line 4 is not valid JSON"):
        load_math_dataset(bad_json)
    assert len(load_math_dataset(bad_json, max_bad_fraction=0.5)) == 3
    with pytest.raises(ValueError, match="max_bad_fraction"):
        load_math_dataset(path, max_bad_fraction=2.0)


def test_empty_and_missing_and_unknown(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl: contains no rows"):
        load_math_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="contains no rows"):
        load_math_dataset(tmp_path / "blank.jsonl")
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_math_dataset(missing)
    with pytest.raises(ValueError, match=r"unknown dataset 'gsm9k'.*MATH-500.*openai/gsm8k"):
        load_math_dataset("gsm9k")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_math_dataset(tmp_path / "x.csv")
    _write_jsonl(tmp_path / "train.jsonl", [{"problem": "p", "answer": "1"}])
    with pytest.raises(ValueError, match="empty.jsonl.*name one file"):
        load_math_dataset(tmp_path)
    with pytest.raises(ValueError, match="no file for split 'dev'"):
        load_math_dataset(tmp_path, "dev")
    assert load_math_dataset(tmp_path, "train")["answer"] == ["1"]


def test_hub_names_map_to_schema(monkeypatch):
    calls = []

    def fake_load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        if repo == "openai/gsm8k":
            return datasets.Dataset.from_list([{"question": "Q", "answer": "x\n#### 1,000"}])
        return datasets.Dataset.from_list(
            [{"problem": "P", "answer": "\\frac{1}{2}", "unique_id": "test/algebra/1.json"}]
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    d = load_math_dataset("gsm8k", "test")
    assert calls[-1] == ("openai/gsm8k", "main", "test")
    assert d[0] == {"prompt": "Q", "answer": "1000", "source_id": "gsm8k/test/0"}
    d = load_math_dataset("HuggingFaceH4/MATH-500")
    assert calls[-1] == ("HuggingFaceH4/MATH-500", None, "test")
    assert d[0]["source_id"] == "test/algebra/1.json"
    load_math_dataset("bigmath")
    assert calls[-1] == ("SynthLabsAI/Big-Math-RL-Verified", None, "train")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="AI-MO/aimo-validation-aime.*Offline"):
        load_math_dataset("aime")


# ---------------------------------------------------------------- prompts


def test_render_prompt(tok):
    text = pr.render_prompt(tok, "What is {x}?")
    assert text == (
        f"<|im_start|>system\n{pr.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is {x}?\nPlease reason step by step, and put your "
        "final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert pr.render_prompt(tok, "Q", template="Solve: {prompt}", system_prompt=None) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nSolve: Q<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="exactly once"):
        pr.render_prompt(tok, "Q", template="no placeholder")


def test_prompts_rendered_around_a_probe_equal_each_rendered_alone(tok):
    problems = ["What is {x}?", "  padded  ", "line one\nline two", "<b>&amp;</b> 'quoted' \"x\"", ""]
    for template, system in ((pr.DEFAULT_USER_TEMPLATE, pr.DEFAULT_SYSTEM_PROMPT), (None, None)):
        alone = [pr.render_prompt(tok, p, template=template, system_prompt=system) for p in problems]
        assert pr._render(tok, problems, template, system) == alone


def test_a_template_that_changes_the_problem_renders_each_one():
    class Trimming:  # a chat template that strips the user's content: the probe is not kept verbatim
        chat_template = "strip"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>" for m in messages) + "<assistant>"

    problems = ["  a  ", "b\n"]
    assert pr._render(Trimming(), problems, None, None) == ["<user>a</user><assistant>", "<user>b</user><assistant>"]


def test_tokenize_prompts_left_pads_and_drops(tok):
    prompts = ["Short one.", "A much longer problem statement " * 8, "Mid length question?"]
    ref = [
        tok.apply_chat_template(
            [
                {"role": "system", "content": pr.DEFAULT_SYSTEM_PROMPT},
                {"role": "user", "content": pr.DEFAULT_USER_TEMPLATE.replace("{prompt}", p)},
            ],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        for p in prompts
    ]
    lens = [len(r) for r in ref]
    max_len = max(lens[0], lens[2]) + 3
    assert lens[1] > max_len
    out = pr.tokenize_prompts(tok, prompts, max_len)
    ids, mask, kept, dropped = out
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    assert ids.shape == mask.shape == (2, max_len)
    assert kept.tolist() == [0, 2] and dropped == 1
    for row, i in enumerate(kept):
        n = lens[i]
        assert mask[row].tolist() == [0] * (max_len - n) + [1] * n
        assert ids[row, max_len - n :].tolist() == ref[i]
        assert (ids[row, : max_len - n] == tok.pad_token_id).all()
        text = tok.decode(ids[row, max_len - n :])
        assert pr.DEFAULT_SYSTEM_PROMPT in text and text.endswith("<|im_start|>assistant\n")
        assert prompts[i] in text
    short = pr.tokenize_prompts(tok, prompts, max_len, pad_to_max=False)
    assert short.input_ids.shape == (2, max(lens[0], lens[2]))
    np.testing.assert_array_equal(short.input_ids, ids[:, max_len - short.input_ids.shape[1] :])
    none = pr.tokenize_prompts(tok, prompts[1:2], 10)
    assert none.input_ids.shape == (0, 10) and none.num_dropped == 1
    with pytest.raises(ValueError, match="max_prompt_len"):
        pr.tokenize_prompts(tok, prompts, 0)


def test_filter_overlong(tok):
    d = datasets.Dataset.from_dict(
        {"prompt": ["a", "b " * 300, "c"], "answer": ["1", "2", "3"], "source_id": ["x/0", "x/1", "x/2"]}
    )
    kept, n = pr.filter_overlong(d, tok, 200)
    assert n == 1 and kept["source_id"] == ["x/0", "x/2"]


# ---------------------------------------------------------------- loader


def _toy(n):
    return datasets.Dataset.from_dict(
        {
            "prompt": [f"p{i}" for i in range(n)],
            "answer": [str(i) for i in range(n)],
            "source_id": [f"t/{i}" for i in range(n)],
        }
    )


def test_loader_epochs_cover_all_rows():
    d = _toy(10)
    loader = pr.PromptLoader(d, 4, seed=1, drop_last=False, num_epochs=2)
    batches = list(loader)
    assert [len(b["index"]) for b in batches] == [4, 4, 2, 4, 4, 2]
    e0 = np.concatenate([b["index"] for b in batches[:3]])
    e1 = np.concatenate([b["index"] for b in batches[3:]])
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0.tolist() != e1.tolist()  # Reshuffled per epoch.
    for b in batches:
        assert b["prompt"] == [f"p{i}" for i in b["index"]]
        assert b["answer"] == [str(i) for i in b["index"]]
    again = list(pr.PromptLoader(d, 4, seed=1, drop_last=False, num_epochs=2))
    assert all((a["index"] == b["index"]).all() for a, b in zip(batches, again))
    other = list(pr.PromptLoader(d, 4, seed=2, drop_last=False, num_epochs=1))
    assert np.concatenate([b["index"] for b in other]).tolist() != e0.tolist()
    plain = list(pr.PromptLoader(d, 5, shuffle=False, num_epochs=1))
    assert [b["index"].tolist() for b in plain] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_loader_drop_last_and_resume():
    d = _toy(11)
    ref = pr.PromptLoader(d, 3, seed=7)
    seq = [next(ref)["index"].tolist() for _ in range(10)]
    assert all(len(s) == 3 for s in seq)
    assert len(set(sum(seq[:3], []))) == 9  # 3 full batches per epoch, row 10th/11th skipped.
    loader = pr.PromptLoader(d, 3, seed=7)
    for _ in range(4):
        next(loader)
    state = json.loads(json.dumps(loader.state()))
    assert state["epoch"] == 1 and state["step"] == 1
    resumed = pr.PromptLoader(d, 3, seed=7)
    resumed.restore(state)
    assert [next(resumed)["index"].tolist() for _ in range(6)] == seq[4:10]
    with pytest.raises(ValueError, match="batch_size=3 but this loader has batch_size=4"):
        pr.PromptLoader(d, 4, seed=7).restore(state)
    with pytest.raises(ValueError, match="exceeds"):
        pr.PromptLoader(d, 12)
    with pytest.raises(ValueError, match="empty"):
        pr.PromptLoader(_toy(0), 1)
