"""The documentation: docs/configuration.md is what `qerl_jax.config_doc` generates from the schema and
covers every field `--help` lists; every relative link in README.md and docs/*.md names a file that exists."""

import glob
import os
import re

from qerl_jax import cli, config, config_doc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_configuration_page_is_generated_from_the_schema():
    page = _read(os.path.join(REPO, "docs", "configuration.md"))
    assert page == config_doc.page(), "stale: run python -m qerl_jax.config_doc > docs/configuration.md"


def test_configuration_page_covers_every_field_help_lists():
    help_text = cli.config_help(config.default_config())
    help_fields = re.findall(r"^  --config\.(\S+?)=", help_text, flags=re.M)
    assert len(help_fields) == len(config.field_docs()) > 50
    page_fields = set(re.findall(r"^\| `([^`]+)` \|", config_doc.page(), flags=re.M))
    assert sorted(set(help_fields) - page_fields) == []


def test_default_text_names_the_data_directory_not_this_machine():
    inside = os.path.join(os.path.normpath(config.DATA_DIR), "gsm8k", "train.jsonl")
    assert config_doc._default_text(inside) == "$QERL_DATA_DIR/gsm8k/train.jsonl"
    assert config_doc._default_text("a b") == "'a b'"
    assert config_doc._default_text(("q_proj",)) == "('q_proj',)"
    assert config_doc._default_text((inside,)) == "('$QERL_DATA_DIR/gsm8k/train.jsonl',)"


def test_configuration_page_is_the_same_in_any_checkout():
    assert os.path.normpath(config.DATA_DIR) not in config_doc.page()


def _relative_links(path: str) -> list[str]:
    targets = [t for t in LINK.findall(_read(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    return [t.split("#", 1)[0] for t in targets if t.split("#", 1)[0]]  # a bare #anchor names this file


def test_every_relative_link_resolves():
    pages = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
    assert len(pages) >= 8  # README and the seven topic pages
    broken = [
        f"{os.path.relpath(page, REPO)} -> {target}"
        for page in pages
        for target in _relative_links(page)
        if not os.path.exists(os.path.join(os.path.dirname(page), target))
    ]
    assert broken == []


def test_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[ok](p.md) [web](https://x.org/a) [anchor](#top) [bad](missing.md#x)\n")
    assert _relative_links(str(page)) == ["p.md", "missing.md"]
