"""Every package the library imports is one `pyproject.toml` declares.

A package that arrives only as another's dependency can vanish with that package's next release
(transformers 5 stopped requiring jinja2, which its chat templates still import): the main job then
dies on a fresh install. `.ci/run` also runs the README's first command on what `pip install -e .`
alone installs; this test names the culprit without an install.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("qerl_jax", "pallas_kernels")
# Imported by a library we call, not by our code, on the main job's path: distribution -> why.
RUNTIME_NEEDS = {"jinja2": "transformers' apply_chat_template renders every prompt (qerl_jax/data/prompts.py)"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {extra: {_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()}
    return {_name(r) for r in project["dependencies"]}, extras


def _third_party_imports() -> dict[str, list[tuple[str, bool]]]:
    """top-level module -> [(file, imported inside a `try ... except ImportError`)]."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            guarded = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
                    guarded.update(id(n) for stmt in node.body for n in ast.walk(stmt))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, []).append((str(path.relative_to(ROOT)), id(node) in guarded))
    return found


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError") for k in kinds)


def _distributions(module: str) -> list[str]:
    return [d.lower().replace("_", "-") for d in md.packages_distributions().get(module, [module])]


def test_every_import_is_declared():
    base, extras = _declared()
    problems = []
    for module, places in sorted(_third_party_imports().items()):
        dists = _distributions(module)
        if any(d in base for d in dists):
            continue
        in_extra = sorted(extra for extra, names in extras.items() if any(d in names for d in dists))
        unguarded = [file for file, guarded in places if not guarded]
        if not in_extra:
            problems.append(f"{module} ({', '.join(dists)}), imported by {places[0][0]}: not in [project].dependencies")
        elif unguarded:
            problems.append(
                f"{module}: only in the extra {in_extra[0]!r}, but {unguarded[0]} imports it without catching "
                "ImportError (a user without the extra gets a traceback, not one line)"
            )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dist", sorted(RUNTIME_NEEDS))
def test_runtime_needs_are_declared(dist):
    base, _ = _declared()
    assert dist in base, f"{dist} is not in [project].dependencies, yet {RUNTIME_NEEDS[dist]}"


def test_the_check_sees_an_undeclared_import(tmp_path, monkeypatch):
    """The scan itself: an import of a package pyproject does not name is reported."""
    fake = tmp_path / "qerl_jax"
    fake.mkdir()
    (fake / "m.py").write_text("import os\ntry:\n    import gguf\nexcept ImportError:\n    gguf = None\nimport yaml\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("qerl_jax",))
    found = _third_party_imports()
    assert found == {"gguf": [("qerl_jax/m.py", True)], "yaml": [("qerl_jax/m.py", False)]}
    with pytest.raises(AssertionError, match=r"yaml .*not in \[project\]\.dependencies"):
        test_every_import_is_declared()
