"""docs/configuration.md, generated from the config's one schema (`qerl_jax.config.Settings`).

`python -m qerl_jax.config_doc > docs/configuration.md` rewrites the page; tests/test_docs.py fails when
the page in the repository differs from what this prints, or misses a field that `--help` lists.
"""

from __future__ import annotations

import os
from typing import Any

from qerl_jax import config, schema

HEADER = """# Configuration

Every config field, with its default and its help line. Set any of them on the command line as
`--config.<section>.<field>=value` (e.g. `--config.rollout.group_size=16`); a config file in `configs/`
starts from these defaults and overrides some. `python -m qerl_jax.main --help` (or `qerl_jax.eval`)
prints the same list with the values of the `--config` file given.

A field marked **recipe** changes what a run means: a resumed run whose value differs from its
checkpoint's is refused unless `--config.resume_changes=<path>,...` names it.
`$QERL_DATA_DIR` is the datasets' directory (`../shared/data` beside the repository unless the
environment variable says otherwise).

This page is generated: `python -m qerl_jax.config_doc > docs/configuration.md` (from
`qerl_jax/config.py`, declared with `qerl_jax/schema.py`); `tests/test_docs.py` fails when it is stale.
"""


def _portable(value: Any) -> Any:
    """Paths under the data directory as $QERL_DATA_DIR/..., inside tuples too, so the page is the same in any checkout."""
    if isinstance(value, tuple):
        return tuple(_portable(item) for item in value)
    if isinstance(value, str):
        data_dir = os.path.normpath(config.DATA_DIR)
        if value.startswith(data_dir + os.sep):
            return "$QERL_DATA_DIR/" + os.path.relpath(value, data_dir).replace(os.sep, "/")
    return value


def _default_text(value: Any) -> str:
    """A default as written on the command line, its data paths portable."""
    return schema.flag_value(_portable(value))


def _cell(text: str) -> str:
    """Text safe inside one Markdown table cell (a pipe escaped, a line break as a space)."""
    return text.replace("|", "\\|").replace("\n", " ")


def page() -> str:
    """The whole Markdown page: the top-level fields, then one table per section, in declaration order."""
    groups: dict[str, list[schema.Leaf]] = {}
    for leaf in schema.leaves(config.Settings):
        head, _, _ = leaf.path.rpartition(".")
        groups.setdefault(head, []).append(leaf)
    out = [HEADER]
    for head, group in groups.items():
        out += ["", f"## `{head}`" if head else "## Top level", "", "| field | default | help |", "| --- | --- | --- |"]
        for leaf in group:
            default = _cell(_default_text(leaf.default))
            recipe = " **recipe**" if leaf.recipe else ""
            out.append(f"| `{leaf.path}` | `{default}` | {_cell(leaf.help)}{recipe} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(page(), end="")
