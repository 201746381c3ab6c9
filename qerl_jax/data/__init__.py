"""Math datasets, prompt rendering/tokenization and the prompt batch loader."""

from qerl_jax.data.datasets import ALIASES
from qerl_jax.data.datasets import KNOWN_DATASETS
from qerl_jax.data.datasets import SCHEMA
from qerl_jax.data.datasets import convert_row
from qerl_jax.data.datasets import load_math_dataset
from qerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT
from qerl_jax.data.prompts import DEFAULT_USER_TEMPLATE
from qerl_jax.data.prompts import PromptLoader
from qerl_jax.data.prompts import TokenizedPrompts
from qerl_jax.data.prompts import filter_overlong
from qerl_jax.data.prompts import render_prompt
from qerl_jax.data.prompts import tokenize_prompts

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
    "load_math_dataset",
    "render_prompt",
    "tokenize_prompts",
]
