"""qerl_jax.run_config: the ConfigDict checked once and turned into one typed, frozen tree."""

import dataclasses
import importlib
import json
import os

import ml_collections
import numpy as np
import pytest
from conftest import REPO, load_config, tiny_config

from qerl_jax import aqn, lora, optim, run_config
from qerl_jax.checkpoint import CheckpointMismatchError, mismatch_message
from qerl_jax.config import default_config
from qerl_jax.validate import ConfigError

_tiny = tiny_config


def _leaves(node: ml_collections.ConfigDict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _shipped_configs():
    """(name, arg) of every configs/*.py, each arm / variant it offers."""
    out = []
    for file in sorted(os.listdir(os.path.join(REPO, "configs"))):
        if not file.endswith(".py") or file.startswith("_"):
            continue
        name = file[:-3]
        module = importlib.import_module(f"configs.{name}")
        arms = getattr(module, "ARMS", None) or getattr(module, "VARIANTS", None)
        if name == "baselines":
            arms = ("bf16", "nf4", "nf4_aqn", "mxfp4", "nvfp4", "nvfp4_aqn")
        out += [(name, arm) for arm in arms] if arms else [(name, None)]
    return out


def _assert_mirrors(run: run_config.RunConfig, cfg: ml_collections.ConfigDict):
    """Each ConfigDict field is the tree's field of the same path (sequences as tuples)."""
    for path, value in _leaves(cfg):
        got = run
        for part in path.split("."):
            got = getattr(got, part)
        if path == "aqn.enabled":
            assert got == (aqn.default_aqn_enabled(cfg.model.quant) if value is None else value)
        elif isinstance(value, (list, tuple)):
            assert isinstance(got, tuple) and got == tuple(value), path
        else:
            assert got == value and type(got) is type(value), path


def test_the_tree_of_the_defaults_has_every_field_and_the_saved_form_is_the_configdicts():
    cfg = default_config()
    run = run_config.from_config_dict(cfg)
    _assert_mirrors(run, cfg)
    assert isinstance(run.lora, lora.LoraConfig) and isinstance(run.aqn, aqn.AQNConfig)
    assert run.aqn.total_steps == cfg.train.total_steps and run.aqn.enabled  # nvfp4: on
    saved = run_config.to_dict(run)
    expected = json.loads(cfg.to_json())
    expected["aqn"]["enabled"] = True  # the resolved value
    assert saved == expected
    assert json.loads(json.dumps(saved)) == saved


@pytest.mark.parametrize("name,arg", _shipped_configs())
def test_every_shipped_config_gives_its_tree(name, arg):
    cfg = load_config(name, arg)
    run = run_config.from_config_dict(cfg)
    _assert_mirrors(run, cfg)
    assert hash(run)  # frozen all the way down: usable as a static argument


def test_build_checks_then_builds(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir, **{"rollout.group_size": 4, "lora.targets": ["q_proj", "v_proj"]})
    run = run_config.build(cfg, "train")
    assert run.rollout.group_size == 4 and run.lora.targets == ("q_proj", "v_proj")
    assert run.workdir == str(tmp_path / "run") and run.model.path == tiny_model_dir
    assert run_config.build(cfg, "eval").aqn.enabled is False  # eval samples without noise


def test_bad_values_are_reported_at_once_by_their_paths(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir, **{"rollout.top_p": 1.5, "optim.lr": -1.0, "mesh.data": 0})
    with pytest.raises(ConfigError) as e:
        run_config.build(cfg)
    assert e.value.exit_code == 2
    assert sorted(p.split(" ")[0] for p in e.value.problems) == ["mesh.data", "optim.lr", "rollout.top_p"]
    assert "optim.lr = -1.0: must be in (0.0, inf]" in e.value.problems


def test_a_cross_field_rule_is_reported_once(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir, **{"rollout.prompts_per_step": 3, "rollout.group_size": 2})
    cfg.rl.micro_batch_size = 4  # does not divide 3 x 2 = 6
    with pytest.raises(ConfigError) as e:
        run_config.build(cfg)
    assert e.value.problems == [
        "rl.micro_batch_size = 4: must divide the batch of rollout.prompts_per_step x rollout.group_size = 6 sequences"
    ]


def test_the_tree_is_frozen_and_changed_by_replace():
    run = run_config.from_config_dict(default_config())
    for obj, field in ((run, "workdir"), (run.rl, "micro_batch_size"), (run.lora, "rank"), (run.aqn, "enabled")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, getattr(obj, field))
    fitted = dataclasses.replace(run, rl=dataclasses.replace(run.rl, micro_batch_size=2))
    assert fitted.rl.micro_batch_size == 2 and run.rl.micro_batch_size == 0  # 0: auto
    assert run_config.to_dict(fitted)["rl"]["micro_batch_size"] == 2


@pytest.mark.parametrize("quant,enabled,want", [("bf16", None, False), ("nf4", None, True), ("nvfp4", False, False)])
def test_aqn_enabled_resolves_against_the_quantization(quant, enabled, want):
    cfg = default_config()
    cfg.model.quant = quant
    cfg.aqn.enabled = enabled
    assert run_config.from_config_dict(cfg).aqn.enabled is want


def test_library_objects_of_the_tree():
    cfg = default_config()
    cfg.rl.loss, cfg.rl.beta, cfg.rollout.max_new_tokens, cfg.rollout.top_k = "grpo", 0.04, 64, 5
    cfg.optim.lr, cfg.optim.warmup_frac, cfg.train.total_steps = 2e-5, 0.2, 50
    run = run_config.from_config_dict(cfg)
    loss = run_config.loss_config(run)
    assert (loss.kind, loss.beta, loss.eps_high, loss.max_completion_len) == ("grpo", 0.04, 0.28, 64)
    cfg.rl.loss, cfg.rl.old_logp_source, cfg.rl.gspo_eps_high, cfg.rl.cispo_eps_max = "gspo", "proximal", 1e-3, 4.0
    cfg.rl.behav_weight_cap = 2.0
    loss = run_config.loss_config(run_config.from_config_dict(cfg))
    assert (loss.kind, loss.old_logp_source, loss.gspo_eps_low, loss.gspo_eps_high) == ("gspo", "proximal", 3e-4, 1e-3)
    assert (loss.cispo_eps_max, loss.behav_weight_cap) == (4.0, 2.0)

    class Policy:
        stop_ids, pad_id = (7, 9), 3

    sampling = run_config.sampling_config(run, Policy())
    assert (sampling.top_k, sampling.max_new_tokens, sampling.eos_ids, sampling.pad_id) == (5, 64, (7, 9), 3)
    Policy.backend = "xla"
    assert run_config.rollout_options(run, Policy()).norm_parts is True
    assert run_config.rollout_options(run, Policy()).smaller_rows == (64, 16)
    cfg.rollout.norm_parts, cfg.rollout.compaction_rows = False, (128, 32)
    options = run_config.rollout_options(run_config.from_config_dict(cfg), Policy())
    assert options.norm_parts is False and options.smaller_rows == (128, 32)
    _, schedule = run_config.optimizer_from_config(run)
    reference = optim.make_schedule(2e-5, warmup_steps=10, total_steps=50, schedule="cosine")
    for step in (0, 5, 10, 30, 49):
        np.testing.assert_allclose(float(schedule(step)), float(reference(step)), rtol=1e-6)
    assert float(schedule(10)) == pytest.approx(2e-5)  # warm-up ends at round(0.2 x 50) = 10 steps


def test_a_checkpoint_mismatch_is_named_by_the_saved_forms_fields():
    run = run_config.from_config_dict(default_config())
    old = json.loads(default_config().to_json())  # a checkpoint's saved ConfigDict (aqn.enabled None)
    old["lora"]["rank"] = 8
    error = CheckpointMismatchError("checkpoint /r/3 holds other shapes", {"config": old})
    assert mismatch_message(error, run_config.to_dict(run)) == "lora.rank 16 differs from the checkpoint's 8 (/r/3)"
