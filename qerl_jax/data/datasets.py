"""Math datasets (GSM8K, MATH, BigMath, AIME, AMC, generated arithmetic) mapped to one schema.

Every loader returns a `datasets.Dataset` with three string columns:
  prompt:    the problem text,
  answer:    the ground-truth final answer (GSM8K: the number after "####",
             thousands commas removed; MATH: `answer`, else the last
             `\\boxed{}` of `solution`),
  source_id: a stable id (the row's `unique_id`/`id` when present, else
             "<dataset>/<split>/<row index>", e.g. "gsm8k/train/17").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
from typing import Any, Iterable

from qerl_jax import rewards
from qerl_jax.data import arithmetic

log = logging.getLogger(__name__)

SCHEMA = ("prompt", "answer", "source_id")


@dataclasses.dataclass(frozen=True)
class HubSpec:
    """A known Hugging Face hub dataset."""

    repo: str
    config: str | None
    default_split: str
    tag: str  # Prefix of generated source ids.


KNOWN_DATASETS: dict[str, HubSpec] = {
    "openai/gsm8k": HubSpec("openai/gsm8k", "main", "train", "gsm8k"),
    "HuggingFaceH4/MATH-500": HubSpec("HuggingFaceH4/MATH-500", None, "test", "math500"),
    "SynthLabsAI/Big-Math-RL-Verified": HubSpec("SynthLabsAI/Big-Math-RL-Verified", None, "train", "bigmath"),
    "AI-MO/aimo-validation-aime": HubSpec("AI-MO/aimo-validation-aime", None, "train", "aime"),
    "AI-MO/aimo-validation-amc": HubSpec("AI-MO/aimo-validation-amc", None, "train", "amc"),
}
ALIASES = {
    "gsm8k": "openai/gsm8k",
    "math500": "HuggingFaceH4/MATH-500",
    "math-500": "HuggingFaceH4/MATH-500",
    "bigmath": "SynthLabsAI/Big-Math-RL-Verified",
    "aime": "AI-MO/aimo-validation-aime",
    "amc": "AI-MO/aimo-validation-amc",
}
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")

_GSM8K_SEP = "####"


class BadRow(ValueError):
    """A row that cannot be mapped to the schema."""


def _nonempty_str(row: dict[str, Any], key: str) -> str | None:
    v = row.get(key)
    if v is None or isinstance(v, (dict, list)):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    s = str(v).strip()
    return s or None


def _gsm8k_final(answer: str) -> str:
    final = answer.rsplit(_GSM8K_SEP, 1)[1].strip()
    if not final:
        raise BadRow("GSM8K answer has nothing after '####'")
    if rewards.parse_number(final) is None:
        raise BadRow(f"GSM8K final answer {final!r} is not a number")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", final):
        final = final.replace(",", "")
    return final


def convert_row(row: dict[str, Any]) -> tuple[str, str]:
    """(prompt, answer) for one raw row, auto-detecting its format.

    GSM8K rows: `question` + `answer` ending in "#### <number>". MATH-like rows:
    `problem` (or `question`/`prompt`) + `answer` (or the last box of `solution`).
    Raises BadRow naming what is missing or unparsable.
    """
    if not isinstance(row, dict):
        raise BadRow(f"row is a {type(row).__name__}, expected a JSON object")
    prompt = next((p for k in ("problem", "question", "prompt") if (p := _nonempty_str(row, k)) is not None), None)
    if prompt is None:
        raise BadRow(f"no non-empty 'problem'/'question'/'prompt' field (keys: {sorted(row)})")
    answer = _nonempty_str(row, "answer")
    if answer is not None and _GSM8K_SEP in answer:
        return prompt, _gsm8k_final(answer)
    if answer is not None:
        if "question" in row and "problem" not in row and re.search(r"\n", answer):
            # A multi-line GSM8K-style rationale without its "#### <number>" line.
            raise BadRow("GSM8K-style answer lacks a '#### <number>' final line")
        return prompt, answer
    solution = _nonempty_str(row, "solution")
    if solution is not None:
        boxed = rewards.extract_last_boxed(solution)
        if boxed is None or not boxed.strip():
            raise BadRow("no 'answer' and the 'solution' has no \\boxed{} answer")
        return prompt, boxed.strip()
    raise BadRow(f"no non-empty 'answer' or 'solution' field (keys: {sorted(row)})")


def _row_id(row: dict[str, Any], tag: str, split: str, index: int) -> str:
    for key in ("unique_id", "id"):
        v = _nonempty_str(row, key) if isinstance(row, dict) else None
        if v is not None:
            return v
    return f"{tag}/{split}/{index}"


def rows_to_dataset(
    rows: Iterable[Any], *, tag: str, split: str, origin: str, max_bad_fraction: float = 0.01
) -> datasets.Dataset:
    """Maps raw rows to the schema; bad rows are skipped (logged) or raise.

    Raises ValueError when there are no rows, or more than `max_bad_fraction` of
    the rows are bad (the message names `origin` and the first bad rows).
    """
    out = {k: [] for k in SCHEMA}
    bad: list[tuple[int, str]] = []
    total = 0
    for i, row in enumerate(rows):
        total += 1
        if isinstance(row, BadRow):  # A line that failed to parse as JSON.
            bad.append((i, str(row)))
            continue
        try:
            prompt, answer = convert_row(row)
        except BadRow as e:
            bad.append((i, str(e)))
            continue
        out["prompt"].append(prompt)
        out["answer"].append(answer)
        out["source_id"].append(_row_id(row, tag, split, i))
    if total == 0:
        raise ValueError(f"{origin}: contains no rows.")
    if bad:
        examples = "; ".join(f"row {i}: {msg}" for i, msg in bad[:3])
        if len(bad) == total or len(bad) > max_bad_fraction * total:
            raise ValueError(
                f"{origin}: {len(bad)} of {total} rows are bad (more than "
                f"max_bad_fraction={max_bad_fraction}); e.g. {examples}."
            )
        log.warning("%s: skipped %d of %d bad rows; e.g. %s.", origin, len(bad), total, examples)
    import datasets  # noqa: PLC0415 (HF datasets and pandas: ~0.6 s an import, not for a config's checks)

    features = datasets.Features({k: datasets.Value("string") for k in SCHEMA})
    return datasets.Dataset.from_dict(out, features=features)


def _read_jsonl(path: pathlib.Path) -> list[Any]:
    rows: list[Any] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(BadRow(f"line {lineno} is not valid JSON ({e.msg})"))
    return rows


def _read_rows(path: pathlib.Path) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            return []
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return _read_jsonl(path)  # JSON lines under a .json name.
        if isinstance(obj, dict) and isinstance(obj.get("data"), list):
            obj = obj["data"]
        if not isinstance(obj, list):
            raise ValueError(f"{path}: expected a JSON list of rows, got {type(obj).__name__}.")
        return obj
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {suffix!r}; expected one of {_FILE_SUFFIXES}.")


def _resolve_local(path: pathlib.Path, split: str | None) -> tuple[pathlib.Path, str, str]:
    """(file, tag, split) for a local file or a directory holding split files."""
    if path.is_file():
        return path, path.parent.name or "local", split or path.stem
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in _FILE_SUFFIXES)
    if split is None:
        if len(files) != 1:
            raise ValueError(
                f"{path}: a folder of {len(files)} dataset files ({[p.name for p in files]}); name one file "
                f"(expected one of {_FILE_SUFFIXES})."
            )
        return files[0], path.name, files[0].stem
    for p in files:
        if p.stem == split:
            return p, path.name, split
    raise ValueError(f"{path}: no file for split {split!r}; found {[p.name for p in files]}.")


def _looks_like_path(name: str) -> bool:
    return (
        (os.sep in name and name not in KNOWN_DATASETS)
        or name.startswith(".")
        or name.lower().endswith(_FILE_SUFFIXES)
        or name.startswith("~")
    )


def load_math_dataset(
    name_or_path: str | os.PathLike, split: str | None = None, *, max_bad_fraction: float = 0.01
) -> datasets.Dataset:
    """Loads a math dataset as a `datasets.Dataset` with columns prompt/answer/source_id.

    Args:
      name_or_path: a local .jsonl/.json/.parquet file, a folder holding
        `<split>.<ext>` files, "arithmetic:train" / "arithmetic:test" (generated,
        `qerl_jax.data.arithmetic`), or a known hub name (see KNOWN_DATASETS and
        ALIASES; needs network access).
      split: split name (default: the file stem / the hub dataset's default split).
      max_bad_fraction: rows missing fields or with unparsable answers are skipped
        and counted; above this fraction a ValueError is raised instead.
    """
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}.")
    arithmetic_split = arithmetic.parse_name(str(name_or_path))
    if arithmetic_split is not None:
        if split not in (None, arithmetic_split):
            raise ValueError(f"dataset {name_or_path!r} is the {arithmetic_split} split; got split={split!r}.")
        rows = arithmetic.arithmetic_rows(arithmetic_split)
        return rows_to_dataset(rows, tag="arithmetic", split=arithmetic_split, origin=str(name_or_path))
    path = pathlib.Path(os.path.expanduser(str(name_or_path)))
    name = str(name_or_path)
    if path.exists():
        file, tag, split_name = _resolve_local(path, split)
        rows = _read_rows(file)
        return rows_to_dataset(rows, tag=tag, split=split_name, origin=str(file), max_bad_fraction=max_bad_fraction)
    key = ALIASES.get(name.lower(), name)
    if key in KNOWN_DATASETS:
        spec = KNOWN_DATASETS[key]
        split_name = split or spec.default_split
        import datasets  # noqa: PLC0415

        try:
            hub = datasets.load_dataset(spec.repo, spec.config, split=split_name)
        except Exception as e:
            raise RuntimeError(
                f"could not load hub dataset {spec.repo!r} (config={spec.config!r}, "
                f"split={split_name!r}): {type(e).__name__}: {e}. Offline? Pass a local "
                "file path instead."
            ) from e
        return rows_to_dataset(
            iter(hub), tag=spec.tag, split=split_name, origin=spec.repo, max_bad_fraction=max_bad_fraction
        )
    known = sorted(KNOWN_DATASETS) + sorted(ALIASES)
    if _looks_like_path(name):
        raise FileNotFoundError(f"dataset path does not exist: {path} (nor is it a known name: {', '.join(known)}).")
    raise ValueError(
        f"unknown dataset {name!r}: not an existing path and not a known name; known names: {', '.join(known)}."
    )
