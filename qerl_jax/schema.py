"""How a config field is declared: once, as a field of a frozen dataclass section.

`setting(default, help, check)` is a dataclass field that carries its default, its `--help` line, the
check of its value and whether a resumed run may change it silently (`recipe`); `subsection(cls)` nests
a section. From the root section, `qerl_jax.config` derives the ConfigDict of `default_config()`,
`validate` the per-field checks, `cli` the `--help` lines and `checkpoint` the recipe fields.
A check is a function value -> what is wrong with it (one phrase), or None; the check builders below
are the ones the config uses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import ml_collections

Check = Callable[[Any], "str | None"]  # value -> what is wrong with it, or None

section = dataclasses.dataclass(frozen=True)


def setting(default: Any, help: str, check: Check, *, recipe: bool = False, field_type: type | None = None) -> Any:
    """A config field. help may hold "{choices}", filled with the options of a `choice` check;
    recipe: a resumed run must keep the checkpoint's value unless `resume_changes` names it;
    field_type: the ConfigDict type of a field whose default is None (an override is parsed as it)."""
    metadata = {"help": help, "check": check, "recipe": recipe, "field_type": field_type}
    return dataclasses.field(default=default, metadata=metadata)


def subsection(cls: type) -> Any:
    """A section of the config (`--config.<name>.<field>`), declared by the frozen dataclass `cls`."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One field of the config, by its path ("rl.eps_low")."""

    path: str
    default: Any
    check: Check
    recipe: bool
    field_type: type | None
    raw_help: str

    @property
    def help(self) -> str:
        options = getattr(self.check, "options", None)
        return self.raw_help.format(choices=" | ".join(map(str, options))) if options else self.raw_help


@functools.cache
def leaves(root: type) -> tuple[Leaf, ...]:
    """Every field under the section `root`, in declaration order."""
    out = []
    for f in dataclasses.fields(root):
        if "section" in f.metadata:
            out += [dataclasses.replace(leaf, path=f"{f.name}.{leaf.path}") for leaf in leaves(f.metadata["section"])]
        else:
            m = f.metadata
            out.append(Leaf(f.name, f.default, m["check"], m["recipe"], m["field_type"], m["help"]))
    return tuple(out)


def flag_value(value: Any) -> str:
    """A field's value as it is written on the command line (`--config.<path>=<this>`)."""
    if isinstance(value, str):
        return value if value and not any(c.isspace() for c in value) else repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def config_dict(root: type) -> ml_collections.ConfigDict:
    """The ConfigDict of the section `root`'s defaults (sections nested; a None default typed by field_type)."""
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(root):
        if "section" in f.metadata:
            c[f.name] = config_dict(f.metadata["section"])
        elif f.metadata["field_type"] is not None:
            c[f.name] = ml_collections.FieldReference(f.default, field_type=f.metadata["field_type"])
        else:
            c[f.name] = f.default
    return c


# ----------------------------------------------------------------------------- checks


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(lo: int | None = None, why: str = "") -> Check:
    def check(v):
        if not _is_int(v):
            return f"expected an integer, got {type(v).__name__}"
        if lo is not None and v < lo:
            return f"must be >= {lo}{why}"
        return None

    return check


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    def check(v):
        if not _is_number(v):
            return f"expected a finite number, got {v!r}"
        too_low = lo is not None and (v <= lo if lo_open else v < lo)
        too_high = hi is not None and (v >= hi if hi_open else v > hi)
        if too_low or too_high:
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            return f"must be in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
        return None

    return check


def boolean(optional: bool = False) -> Check:
    def check(v):
        if isinstance(v, bool) or (optional and v is None):
            return None
        return f"expected True or False{' or None' if optional else ''}, got {v!r}"

    return check


def text(nonempty: bool = False, optional: bool = False) -> Check:
    def check(v):
        if optional and v is None:
            return None
        if not isinstance(v, str):
            return f"expected a string, got {type(v).__name__}"
        if nonempty and not v:
            return "must not be empty"
        return None

    return check


def choice(options: Sequence[str]) -> Check:
    """One of `options` (which `--help` lists where the field's help says "{choices}")."""

    def check(v):
        return None if v in options else f"expected one of {', '.join(map(str, options))}"

    check.options = tuple(options)
    return check


def names(options: Sequence[str], nonempty: bool) -> Check:
    def check(v):
        if isinstance(v, str) or not isinstance(v, (tuple, list)):
            return f"expected a tuple of names, got {v!r}"
        unknown = [x for x in v if x not in options]
        if unknown:
            return f"unknown name(s) {unknown}; expected names from {', '.join(options)}"
        if len(set(v)) != len(v):
            return "has duplicates"
        if nonempty and not v:
            return f"must not be empty; expected names from {', '.join(options)}"
        return None

    return check


def paths(nonempty: bool) -> Check:
    def check(v):
        if isinstance(v, str) or not isinstance(v, (tuple, list)) or not all(isinstance(x, str) for x in v):
            return f"expected a tuple of file paths, got {v!r}"
        return "must not be empty" if nonempty and not v else None

    return check


def numbers() -> Check:
    def check(v):
        if isinstance(v, str) or not isinstance(v, (tuple, list)) or not all(_is_number(x) for x in v):
            return f"expected a tuple of finite numbers, got {v!r}"
        return None

    return check


def positive_ints(nonempty: bool = False) -> Check:
    def check(v):
        if isinstance(v, str) or not isinstance(v, (tuple, list)) or not all(_is_int(x) and x >= 1 for x in v):
            return f"expected a tuple of positive integers, got {v!r}"
        return "must not be empty" if nonempty and not v else None

    return check


def mesh_axis() -> Check:
    def check(v):
        if not _is_int(v) or (v < 1 and v != -1):
            return f"expected a positive integer or -1 (all remaining devices), got {v!r}"
        return None

    return check
