"""qerl_jax.schema: a config field declared once (default, help, check, recipe) and all else read from it."""

import dataclasses

import ml_collections
import pytest

from qerl_jax import config, schema
from qerl_jax.schema import choice, integer, number, positive_ints, section, setting, subsection


@section
class _Inner:
    size: int = setting(4, "rows per step", integer(1), recipe=True)
    kind: str = setting("a", "one of {choices}", choice(("a", "b")))
    on: bool | None = setting(None, "None: decided later", lambda v: None, field_type=bool)


@section
class _Root:
    seed: int = setting(0, "the seed", integer())
    inner: _Inner = subsection(_Inner)


def test_the_configdict_help_checks_and_recipe_come_from_the_declaration():
    c = schema.config_dict(_Root)
    assert c.to_dict() == {"seed": 0, "inner": {"size": 4, "kind": "a", "on": None}}
    c.inner.on = True  # typed by field_type although its default is None
    with pytest.raises(TypeError):
        c.inner.on = "yes"
    with pytest.raises(TypeError):
        c.inner.size = "4"  # typed by its default
    leaves = {leaf.path: leaf for leaf in schema.leaves(_Root)}
    assert list(leaves) == ["seed", "inner.size", "inner.kind", "inner.on"]
    assert leaves["inner.kind"].help == "one of a | b"
    assert leaves["inner.size"].check(0) == "must be >= 1" and leaves["inner.size"].check(3) is None
    assert [p for p, leaf in leaves.items() if leaf.recipe] == ["inner.size"]
    assert _Root().inner.size == 4  # the dataclass's own default is the same declaration


def test_every_field_of_the_config_is_declared_with_help_and_a_check():
    leaves = schema.leaves(config.Settings)
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, ml_collections.ConfigDict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(config.default_config(), "")
    assert sorted(leaf.path for leaf in leaves) == sorted(flat)
    for leaf in leaves:
        assert leaf.help and "{choices}" not in leaf.help, leaf.path
        assert leaf.check(leaf.default) is None, (leaf.path, leaf.default)  # every default passes its own check
    assert config.field_docs()["model.quant"].startswith("the frozen base's weight format: bf16 | nvfp4 | mxfp4 | nf4")


def test_recipe_fields_are_those_declared_recipe():
    assert "rl.eps_low" in config.recipe_fields() and "lora.rank" not in config.recipe_fields()
    from qerl_jax.checkpoint import RECIPE_FIELDS

    assert RECIPE_FIELDS == config.recipe_fields()


@pytest.mark.parametrize(
    "check,value,message",
    [
        (number(0.0, 1.0, hi_open=True), 1.0, "must be in [0.0, 1.0)"),
        (number(0.0, lo_open=True), float("nan"), "expected a finite number, got nan"),
        (integer(2, " (why)"), 1, "must be >= 2 (why)"),
        (integer(), True, "expected an integer, got bool"),
        (choice(("x", "y")), "z", "expected one of x, y"),
        (positive_ints(), (64, 0), "expected a tuple of positive integers, got (64, 0)"),
        (positive_ints(), (True,), "expected a tuple of positive integers, got (True,)"),
        (positive_ints(), "64", "expected a tuple of positive integers, got '64'"),
        (positive_ints(nonempty=True), (), "must not be empty"),
    ],
)
def test_checks_say_what_is_wrong(check, value, message):
    assert check(value) == message


def test_positive_ints_take_tuples_and_lists_of_them():
    assert positive_ints()((64, 16)) is positive_ints()([8]) is positive_ints()(()) is None


def test_a_section_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.Settings().rl.eps_low = 0.1
