"""Math datasets, prompt rendering/tokenization and the prompt batch loader."""

from qerl_jax.data.datasets import ALIASES, KNOWN_DATASETS, SCHEMA, convert_row, load_math_dataset
from qerl_jax.data.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_TEMPLATE,
    PromptLoader,
    TokenizedPrompts,
    filter_overlong,
    prompt_lengths,
    render_prompt,
    tokenize_prompts,
)

__all__ = [
    "ALIASES",
    "KNOWN_DATASETS",
    "SCHEMA",
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_USER_TEMPLATE",
    "PromptLoader",
    "TokenizedPrompts",
    "convert_row",
    "filter_overlong",
    "prompt_lengths",
    "load_math_dataset",
    "render_prompt",
    "tokenize_prompts",
]
