"""qerl_jax.validate: every problem of a config at once, by its path, before any work; and the commands
(`qerl_jax.main`, `qerl_jax.eval`, `qerl_jax.quantize`) answering bad input with lines, not tracebacks."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, load_config, tiny_config

from qerl_jax import validate
from qerl_jax.validate import ConfigError, config_problems

_tiny = tiny_config


def _paths(problems):
    return [p.split(" ")[0].rstrip(":") for p in problems]


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir):
    """A copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_shipped_configs_are_valid(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the configs name hub ids; not in this (empty) hub cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert config_problems(_tiny(tmp_path, tiny_model_dir), "train") == []
    assert config_problems(_tiny(tmp_path, tiny_model_dir), "eval") == []
    tiny = load_config("tiny")
    tiny.workdir = str(tmp_path / "fresh")  # model.tiny: the model is built by the run
    assert config_problems(tiny) == []
    for name, arg in (("gsm8k", None), ("bigmath", "32b"), ("baselines", "bf16"), ("baselines", "nf4_aqn")) + tuple(
        ("gsm8k_claims", arm) for arm in ("bf16_lr5e-6", "bf16", "nvfp4", "nvfp4_aqn", "bf16_aqn")
    ):
        cfg = load_config(name, arg)
        cfg.workdir = str(tmp_path / name)
        assert _paths(config_problems(cfg)) == ["model.path"], (name, arg)  # only the model is not here


def test_every_problem_is_reported_at_once_by_its_path(tmp_path, tiny_model_dir):
    cfg = _tiny(
        tmp_path,
        tiny_model_dir,
        **{
            "rollout.group_size": 1,
            "rl.overlong_cache": 40,
            "optim.lr": -1.0,
            "lora.targets": ("q_proj", "qkv"),
            "rollout.top_p": 1.5,
            "train.total_steps": 1,
            "data.train": str(tmp_path / "missing.jsonl"),
            "rl.reward": "nope",
        },
    )
    problems = config_problems(cfg)
    assert sorted(_paths(problems)) == sorted(
        [
            "rollout.group_size",
            "optim.lr",
            "lora.targets",
            "rollout.top_p",
            "rl.overlong_cache",  # a penalty window longer than the 32 new tokens
            "aqn.num_stages",  # 2 stages in 1 step
            "rl.reward",
            "data.train",
        ]
    ), problems
    with pytest.raises(ConfigError) as e:
        validate.validate_config(cfg)
    assert e.value.exit_code == 2
    assert str(e.value).startswith("8 problems:\n  ")
    assert "rollout.group_size = 1: must be >= 2 (GRPO scores each completion" in str(e.value)


def test_types_and_missing_fields(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir)
    with cfg.unlocked():
        del cfg.rollout["group_size"]
        cfg.rollout.group_size = "8"  # as a hand-written config file could set it
        del cfg.rl["remat"]
        cfg.rl.remat = True  # a bool, as configs set it before remat had modes
        del cfg.train["max_nonfinite"]
    problems = config_problems(cfg)
    assert "rollout.group_size = '8': expected an integer, got str" in problems
    assert "rl.remat = True: expected one of auto, none, full, proj" in problems
    assert any(p.startswith("train.max_nonfinite: missing") for p in problems)


def test_micro_batch_and_logprob_chunk_of_zero_are_auto(tmp_path, tiny_model_dir, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "device_count", lambda: 2)  # the mesh below has its devices
    auto = {"rl.micro_batch_size": 0, "rl.logprob_chunk": 0, "rollout.prompts_per_step": 3, "mesh.data": 2}
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **auto)) == []  # 0 divides nothing: no rule applies
    problems = config_problems(_tiny(tmp_path, tiny_model_dir, **{"rl.micro_batch_size": -1, "rl.logprob_chunk": -2}))
    assert problems == [
        "rl.micro_batch_size = -1: must be >= 0 (0: auto, the largest that fits)",
        "rl.logprob_chunk = -2: must be >= 0 (0: auto, the largest that fits)",
    ]


def test_context_length_and_block_size_come_from_config_json(tmp_path, tiny_model_dir):
    # The tiny model's context is 2048 tokens, its hidden size 64.
    cfg = _tiny(tmp_path, tiny_model_dir, **{"data.max_prompt_len": 2000, "rollout.max_new_tokens": 64})
    (problem,) = config_problems(cfg)
    assert problem.startswith("data.max_prompt_len + rollout.max_new_tokens = 2000 + 64 = 2064: exceeds the model's")
    assert config_problems(cfg, "eval") == []  # eval generates eval.max_new_tokens (32)
    cfg = _tiny(tmp_path, tiny_model_dir, **{"data.max_prompt_len": 2030, "rollout.max_new_tokens": 8})
    assert _paths(config_problems(cfg, "eval")) == ["data.max_prompt_len"]  # 2030 + 32 > 2048
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    cfg = _tiny(tmp_path, tiny_model_dir, **{"model.quant": "nf4"})
    assert hidden % 64 == 0 and config_problems(cfg) == []
    odd = shutil.copytree(tiny_model_dir, tmp_path / "odd")
    raw = json.load(open(odd / "config.json"))
    raw["intermediate_size"] += 16  # down_proj's K, no longer a multiple of nf4's 64-element blocks
    json.dump(raw, open(odd / "config.json", "w"))
    problems = config_problems(_tiny(tmp_path, str(odd), **{"model.quant": "nf4"}))
    assert any(p.startswith("model.quant = 'nf4': needs each quantized projection's input size K") for p in problems)
    assert any("down_proj (K = " in p for p in problems)
    assert any("has shape" in p and "config.json implies" in p for p in problems)  # and the tensors disagree


def test_a_run_is_not_restarted_over_its_checkpoints(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir)
    os.makedirs(os.path.join(cfg.workdir, "checkpoints", "3"))
    os.makedirs(os.path.join(cfg.workdir, "checkpoints", "6"))
    (problem,) = config_problems(cfg)
    assert problem.startswith("resume = False, but workdir") and "(steps [3, 6])" in problem
    assert "--config.resume=True" in problem
    cfg.resume = True
    assert config_problems(cfg) == []
    assert config_problems(_tiny(tmp_path, tiny_model_dir), "eval") == []  # eval reads runs, never writes them


def test_eval_checks_its_checkpoint_and_datasets(tmp_path, tiny_model_dir):
    cfg = _tiny(
        tmp_path,
        tiny_model_dir,
        **{"eval.checkpoint": str(tmp_path / "no_run"), "eval.datasets": ("gsm8k", str(tmp_path / "none.jsonl"))},
    )
    assert _paths(config_problems(cfg, "eval")) == ["eval.datasets[1]", "eval.checkpoint"]
    assert _paths(config_problems(cfg, "train")) == ["eval.datasets[1]"]  # the run's own evaluation reads it
    cfg.eval.num_examples = 0
    assert config_problems(cfg, "train") == []  # ... when it evaluates (eval.num_examples > 0)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    cfg = _tiny(tmp_path, tiny_model_dir, **{"eval.checkpoint": str(empty)})
    assert config_problems(cfg, "eval") == [
        f"eval.checkpoint = {str(empty)!r}: holds no orbax checkpoint and no adapter_config.json"
    ]


# ----------------------------------------------------------------------------- files


def _file_problems(model_dir):
    from qerl_jax.model_io import loader

    config, raw = loader.read_config(str(model_dir))
    return validate.checkpoint_file_problems(str(model_dir), config, raw)


def test_truncated_and_garbled_safetensors_name_the_file(model_copy):
    weights = model_copy / "model.safetensors"
    assert _file_problems(model_copy) == []
    data = weights.read_bytes()
    for damaged in (data[:3000], data[:-100], b"\x07" * 64 + data[64:]):
        weights.write_bytes(damaged)
        (problem,) = _file_problems(model_copy)
        assert problem.startswith(f"{weights} is not a readable safetensors file (")
        assert problem.endswith("it is truncated or damaged: download it again")


def test_sharded_checkpoint_problems_name_the_shard(tmp_path):
    from conftest import make_hf_model, save_hf_model

    src = save_hf_model(make_hf_model(), tmp_path / "sharded", shard_size="40KB")
    with open(os.path.join(src, "tokenizer.json"), "w") as f:
        f.write('{"fake": true}')
    with open(os.path.join(src, "chat_template.jinja"), "w") as f:
        f.write("{{ messages }}")
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and _file_problems(src) == []
    # A tensor the index maps to the wrong shard.
    counts = {s: list(index["weight_map"].values()).count(s) for s in shards}
    name = next(n for n, s in index["weight_map"].items() if counts[s] > 1)  # its shard stays listed
    wrong = dict(
        index, weight_map={**index["weight_map"], name: next(s for s in shards if s != index["weight_map"][name])}
    )
    json.dump(wrong, open(os.path.join(src, "model.safetensors.index.json"), "w"))
    (problem,) = _file_problems(src)
    assert (
        "model.safetensors.index.json maps 1 tensor(s) to a shard that does not hold them" in problem
        and name in problem
    )
    json.dump(index, open(os.path.join(src, "model.safetensors.index.json"), "w"))
    os.remove(os.path.join(src, shards[1]))
    (problem,) = _file_problems(src)
    assert "lists shard(s) that do not exist" in problem and shards[1] in problem


def test_shapes_against_config_json_and_tokenizer_files(model_copy):
    raw = json.load(open(model_copy / "config.json"))
    raw["num_hidden_layers"] += 1
    json.dump(raw, open(model_copy / "config.json", "w"))
    (problem,) = _file_problems(model_copy)
    assert problem.startswith(f"{model_copy}: missing ") and "model.layers.2." in problem
    raw["num_hidden_layers"] -= 1
    raw["hidden_size"] *= 2
    raw["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // 2 // raw["num_attention_heads"]
    json.dump(raw, open(model_copy / "config.json", "w"))
    problems = _file_problems(model_copy)
    assert (
        problems[0].startswith(f"{model_copy / 'model.safetensors'}: tensor ") and "config.json implies" in problems[0]
    )
    raw["hidden_size"] //= 2
    json.dump(raw, open(model_copy / "config.json", "w"))
    (model_copy / "tokenizer.json").write_text('{"truncated": ')
    (problem,) = _file_problems(model_copy)
    assert problem.startswith(f"{model_copy / 'tokenizer.json'} is not valid JSON")
    os.remove(model_copy / "tokenizer.json")
    os.remove(model_copy / "tokenizer_config.json")
    assert _file_problems(model_copy) == [
        f"{model_copy}: no tokenizer files (expected tokenizer.json or tokenizer_config.json)"
    ]


def test_garbled_config_json_is_one_line(model_copy, tmp_path):
    (model_copy / "config.json").write_text("{nope")
    (problem,) = config_problems(_tiny(tmp_path, str(model_copy)))
    assert problem.startswith(f"model.path: {model_copy / 'config.json'} is not valid JSON (")


# ----------------------------------------------------------------------------- the commands


def _run(module, *args, cwd=REPO):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _assert_one_error(out, message, status=2):
    assert out.returncode == status, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out.stderr[-3000:]  # printed once, not also as a log line
    assert message in errors[0], errors[0]


def test_main_answers_bad_input_with_one_line(tmp_path, model_copy):
    workdir = tmp_path / "run"
    base = ["--config=configs/tiny.py", f"--config.workdir={workdir}"]
    out = _run("qerl_jax.main", *base, "--config.model.tiny=False", "--config.model.path=/nonexistent")
    _assert_one_error(out, "error: model.path: model path '/nonexistent' does not exist")
    out = _run("qerl_jax.main", *base, "--config.rollout.grop_size=3")
    _assert_one_error(
        out, "error: --config.rollout.grop_size: the config has no field 'grop_size'; did you mean \"group_size\"?"
    )
    out = _run("qerl_jax.main", *base, "--config.rollout.group_size=0")
    _assert_one_error(out, "error: rollout.group_size = 0: must be >= 2 (GRPO scores each completion")
    assert "rollout_batch" not in out.stderr
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    out = _run("qerl_jax.main", *base, "--config.model.tiny=False", f"--config.model.path={model_copy}")
    _assert_one_error(out, f"error: model.path: {weights} is not a readable safetensors file")
    out = _run("qerl_jax.main", "--config=configs/missing.py")
    _assert_one_error(out, "error: --config=configs/missing.py: cannot load the config file (No such file")
    out = _run("qerl_jax.main", "--config=configs/baselines.py:fp3")
    _assert_one_error(
        out, "--config=configs/baselines.py:fp3: the config file failed to load: ValueError: unknown baseline 'fp3'"
    )
    out = _run("qerl_jax.main", *base, "--config.rollout.group_size=two")
    _assert_one_error(out, "error: flag --config.rollout.group_size=two: invalid literal for int()")
    assert not workdir.exists()  # nothing was written before the problems were found


def test_main_lists_every_problem(tmp_path, tiny_model_dir):
    args = [
        "--config=configs/tiny.py",
        f"--config.workdir={tmp_path / 'run'}",
        "--config.model.tiny=False",
        f"--config.model.path={tiny_model_dir}",
        "--config.rollout.top_p=0",
        "--config.rl.micro_batch_size=5",
        "--config.data.max_prompt_len=4000",
    ]
    out = _run("qerl_jax.main", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0] == "error: 4 problems:"
    assert [line.split()[0] for line in lines[1:]] == [
        "rollout.top_p",
        "rl.micro_batch_size",  # 4 x 4 = 16 sequences: 5 does not divide them
        "data.max_prompt_len",
        "data.max_prompt_len",
    ]


def test_eval_answers_bad_input_with_lines(tmp_path, tiny_model_dir):
    args = [
        "--config=configs/tiny.py",
        f"--config.workdir={tmp_path / 'run'}",
        "--config.model.tiny=False",
        f"--config.model.path={tiny_model_dir}",
        f"--config.eval.checkpoint={tmp_path / 'no_run'}",
        "--config.eval.batch_size=0",
    ]
    out = _run("qerl_jax.eval", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.splitlines()[0] == "error: 2 problems:"
    assert "  eval.batch_size = 0: must be >= 1" in out.stderr and "  eval.checkpoint = " in out.stderr
    out = _run("qerl_jax.eval", "--config=configs/tiny.py", "--config.eval.numexamples=3")
    _assert_one_error(out, "error: --config.eval.numexamples: the config has no field 'numexamples'; did you mean")


def test_quantize_lists_every_problem_and_writes_nothing(tmp_path, model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    out_dir = tmp_path / "out"
    out = _run("qerl_jax.quantize", "--model", str(model_copy), "--out", str(out_dir), "--format", "nf4")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    first = lines.index("qerl-quantize: error: 2 problems:")
    assert lines[first:] == [
        "qerl-quantize: error: 2 problems:",
        "  --format 'nf4' cannot be written as a compressed-tensors checkpoint; expected one of ('nvfp4', 'mxfp4')",
        f"  {weights} is not a readable safetensors file (Error while deserializing header: incomplete metadata, "
        "file not fully covered); it is truncated or damaged: download it again",
    ]
    assert not out_dir.exists()


def test_every_default_field_has_a_check():
    """A field added to the default config without a check here would go unvalidated."""
    from qerl_jax.config import default_config
    from qerl_jax.validate import FIELDS

    flat = []

    def walk(node, prefix):
        for key, value in node.items():
            if hasattr(value, "items") and not isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat.append(f"{prefix}{key}")

    walk(default_config(), "")
    assert sorted(set(flat) - set(FIELDS)) == []


def test_generated_datasets_are_known(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir, **{"data.train": "arithmetic:train", "eval.datasets": ("arithmetic:test",)})
    assert config_problems(cfg) == []
    cfg = _tiny(tmp_path, tiny_model_dir, **{"data.train": "arithmetic:dev"})
    (problem,) = config_problems(cfg)
    assert problem.startswith("data.train = 'arithmetic:dev': ") and "arithmetic:train or arithmetic:test" in problem


def test_rollout_batch_is_zero_or_at_least_one_group(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir, **{"rollout.max_batch": 3, "rollout.group_size": 4})
    (problem,) = config_problems(cfg)
    assert problem.startswith("rollout.max_batch = 3: smaller than one group (rollout.group_size = 4)")
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **{"rollout.max_batch": 0})) == []  # 0: sized to memory


def test_loss_correction_and_reward_fields(tmp_path, tiny_model_dir):
    bad = {
        "rl.loss": "ppo",
        "rl.is_correction": "token_mask",
        "rl.is_cap": 0.5,
        "rl.scale_rewards": "prompt",
        "rl.reward_weights": ("1",),
    }
    problems = config_problems(_tiny(tmp_path, tiny_model_dir, **bad))
    assert sorted(_paths(problems)) == sorted(bad), problems
    assert "rl.is_cap = 0.5: must be in [1.0, inf]" in problems
    assert "rl.reward_weights = ('1',): expected a tuple of finite numbers, got ('1',)" in problems
    good = {"rl.loss": "bnpo", "rl.beta": 0.04, "rl.old_logp_source": "current", "rl.is_correction": "sequence_mask"}
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **good)) == []
    for off_policy in ({"rl.loss": "gspo"}, {"rl.loss": "cispo", "rl.beta": 0.04}, {"rl.old_logp_source": "proximal"}):
        assert config_problems(_tiny(tmp_path, tiny_model_dir, **off_policy)) == []
    dr = {"rl.loss": "dr_grpo", "rl.scale_rewards": "none", "rl.reward": "accuracy,format"}
    dr["rl.reward_weights"] = (1, 0.1)
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **dr)) == []


@pytest.mark.parametrize(
    "overrides,start",
    [
        ({"rl.is_correction": "sequence_mask"}, "rl.is_correction = 'sequence_mask': needs rl.old_logp_source=current"),
        ({"rl.is_correction": "token_truncate"}, "rl.is_correction = 'token_truncate': needs rl.old_logp_source="),
        ({"rl.loss": "dr_grpo"}, "rl.scale_rewards = 'group': Dr. GRPO (rl.loss=dr_grpo) does not divide"),
        ({"rl.loss": "dapo", "rl.beta": 0.04}, "rl.beta = 0.04: DAPO has no KL term"),
        (
            {"rl.old_logp_source": "proximal", "rl.is_correction": "token_truncate"},
            "rl.is_correction = 'token_truncate': needs rl.old_logp_source=current; with 'proximal' (decoupled PPO)",
        ),
        ({"rl.old_logp_source": "proximal", "rl.ppo_epochs": 2}, "rl.ppo_epochs = 2: rl.old_logp_source=proximal"),
        ({"rl.loss": "cispo", "rl.cispo_eps_max": 0.0}, "rl.cispo_eps_max = 0.0: must be in (0.0, inf]"),
        ({"rl.old_logp_source": "proximal", "rl.behav_weight_cap": 0.9}, "rl.behav_weight_cap = 0.9: must be in"),
        ({"rl.reward": "accuracy,format", "rl.reward_weights": (1.0,)}, "rl.reward = 'accuracy,format': 1 reward"),
        ({"rl.reward": "accuracy,nope"}, "rl.reward = 'accuracy,nope': unknown reward function 'nope'"),
        ({"rl.reward": "accuracy,,format"}, "rl.reward = 'accuracy,,format': reward spec"),
    ],
)
def test_loss_and_reward_rules_are_one_line_each(tmp_path, tiny_model_dir, overrides, start):
    (problem,) = config_problems(_tiny(tmp_path, tiny_model_dir, **overrides))
    assert problem.startswith(start), problem


def test_train_norms_must_be_a_bool_and_the_qerl_recipes_train_them():
    from qerl_jax.config import default_config

    cfg = default_config()
    cfg.lora.train_norms = None
    assert [p for p in config_problems(cfg) if p.startswith("lora.")] == [
        "lora.train_norms = None: expected True or False, got None"
    ]
    assert default_config().lora.train_norms is False
    for name, arg in (("gsm8k", None), ("bigmath", "7b"), ("baselines", "bf16"), ("baselines", "nvfp4_aqn")):
        assert load_config(name, arg).lora.train_norms is True, (name, arg)


def test_a_tokenizer_without_a_chat_template_is_one_line(tmp_path, model_copy):
    for name in ("chat_template.jinja", "chat_template.json"):
        if (model_copy / name).exists():
            os.remove(model_copy / name)
    tok_cfg = json.load(open(model_copy / "tokenizer_config.json"))
    tok_cfg.pop("chat_template", None)
    json.dump(tok_cfg, open(model_copy / "tokenizer_config.json", "w"))
    workdir = tmp_path / "run"
    out = _run("qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={workdir}",
               "--config.model.tiny=False", f"--config.model.path={model_copy}")
    _assert_one_error(out, f"error: model.path: {model_copy}: the model has no chat template")
    assert "Instruct" in out.stderr and not workdir.exists()


# ----------------------------------------------------------------------------- checks once the fields are valid


def _assert_refused_before_any_work(out, *needles):
    """One `error:` problem, exit status 2, no traceback, no memory plan printed."""
    _assert_one_error(out, needles[0])
    for needle in needles[1:]:
        assert needle in out.stderr, out.stderr[-3000:]
    assert "memory plan" not in out.stdout


@pytest.mark.parametrize("data, needle", [(2, "= 2 devices, but only 1 is available"),
                                          (3, "= 3 devices, but only 1 is available")])  # fmt: skip
def test_a_mesh_of_missing_devices_is_named_before_anything_is_written(tmp_path, data, needle):
    """One CPU device: mesh.data=2 (today exit 1 after the lock and the tiny model) and mesh.data=3
    (today blamed on rl.micro_batch_size) name the devices, and write nothing."""
    run = tmp_path / "run"
    out = _run("qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={run}", f"--config.mesh.data={data}")
    _assert_refused_before_any_work(out, f"error: mesh.data x mesh.model {needle}")
    assert "micro_batch_size" not in out.stderr
    assert not run.exists()  # no lock, no tiny model


def test_mesh_devices_rules(tmp_path, tiny_model_dir, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "device_count", lambda: 4)
    problems = lambda **o: config_problems(_tiny(tmp_path, tiny_model_dir, **o))  # noqa: E731
    assert problems(**{"mesh.data": 2, "mesh.model": 2}) == problems(**{"mesh.data": -1, "mesh.model": 2}) == []
    assert problems(**{"mesh.data": 2}) == [
        "mesh.data x mesh.model = 2 devices, but 4 are available: a mesh takes every device (set one axis to -1 "
        "for all remaining ones)"
    ]
    assert problems(**{"mesh.data": 8}) == ["mesh.data x mesh.model = 8 devices, but only 4 are available"]
    assert problems(**{"mesh.data": -1, "mesh.model": 3}) == [
        "mesh.data x mesh.model = -1 x 3: the 4 available devices do not split into an axis of 3 and one of the rest"
    ]
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **{"mesh.data": 8}), "eval") == []  # eval uses one
    partial = {"rollout.max_staleness": 1}  # partial rollouts on any mesh: each data shard carries its groups
    assert problems(**partial, **{"mesh.model": -1}) == problems(**partial, **{"mesh.data": -1}) == []
    assert problems(**partial, **{"mesh.data": 2, "mesh.model": 2}) == []


def test_an_unsupported_gguf_architecture_is_one_line_before_anything_is_written(tmp_path):
    import gguf

    file = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(file), "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    run = tmp_path / "run"
    out = _run("qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={run}", "--config.model.tiny=False",
               f"--config.model.path={file}")  # fmt: skip
    _assert_refused_before_any_work(out, f"error: model.path: {file}: GGUF architecture 'gemma' is not supported")
    assert not run.exists()  # today: exit 1, the workdir lock written


def test_prompts_longer_than_max_prompt_len_are_refused_before_the_tiny_model_is_built(tmp_path):
    """Today: exit 1 after the lock, the tiny model and the 20-line memory plan."""
    run = tmp_path / "run"
    out = _run("qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={run}", "--config.data.max_prompt_len=8",
               "--config.eval.num_examples=0")  # fmt: skip
    _assert_refused_before_any_work(
        out, "error: data.max_prompt_len = 8: 0 of the 7473 prompts of data.train = ",
        "(the shortest takes 143 tokens with the chat template), and each step needs rollout.prompts_per_step = 4; "
        "raise data.max_prompt_len",
    )  # fmt: skip
    assert not run.exists()


@pytest.fixture
def tiny_gguf(tmp_path, tiny_model_dir):
    """The tiny model's tokenizer in a tiny random GGUF file's metadata."""
    from test_gguf import write_gguf_with_tokenizer
    from transformers import AutoTokenizer

    return write_gguf_with_tokenizer(tmp_path / "tiny.gguf", AutoTokenizer.from_pretrained(tiny_model_dir))


def test_a_gguf_models_prompts_too_long_for_max_prompt_len_are_refused_before_anything_is_written(tmp_path, tiny_gguf):
    """Today: the check is skipped for a GGUF file, and the run fails after the lock and the memory plan."""
    run = tmp_path / "run"
    out = _run("qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={run}", "--config.model.tiny=False",
               f"--config.model.path={tiny_gguf}", "--config.data.max_prompt_len=8", "--config.eval.num_examples=0",
               f"--config.model.cache_dir={tmp_path / 'cache'}")  # fmt: skip
    _assert_refused_before_any_work(
        out, "error: data.max_prompt_len = 8: 0 of the 7473 prompts of data.train = ",
        "(the shortest takes 143 tokens with the chat template)",  # the tiny checkpoint's count: the same tokenizer
    )  # fmt: skip
    assert not run.exists()  # no lock
    assert not (tmp_path / "cache").exists()  # nothing converted


def test_a_gguf_models_cached_conversion_gives_the_tokenizer(tmp_path, tiny_gguf, tiny_model_dir, monkeypatch):
    """A conversion stored by load_cache: its saved tokenizer is read, the metadata is not converted."""
    from qerl_jax.model_io import gguf, load_cache

    fields = {"data.max_prompt_len": 8, "eval.num_examples": 0, "model.cache_dir": str(tmp_path / "cache")}
    cfg = _tiny(tmp_path, tiny_gguf, **fields)
    (problem,) = config_problems(cfg)
    assert problem.startswith("data.max_prompt_len = 8: 0 of the 7473 prompts of data.train = ")
    key = load_cache.cache_key(tiny_gguf, cfg.model.dtype, cfg.model.quant, tuple(cfg.model.quant_skip))
    shutil.copytree(tiny_model_dir, tmp_path / "cache" / key)  # config.json + the tokenizer files
    monkeypatch.setattr(gguf, "load_tokenizer", lambda path: pytest.fail("the metadata was converted"))
    assert config_problems(cfg) == [problem]


def test_prompt_fit_counts_prompts_per_need(tmp_path, tiny_model_dir):
    long = " ".join(str(i % 10) for i in range(300))  # a token a digit: 300+ tokens; the template takes ~120
    rows = "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in ("q", "q", long, long))
    data = tmp_path / "data.jsonl"
    data.write_text(rows)
    fit = {"data.train": str(data), "eval.datasets": (str(data),), "data.max_prompt_len": 200}
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **fit, **{"rollout.prompts_per_step": 2})) == []
    (problem,) = config_problems(
        _tiny(tmp_path, tiny_model_dir, **fit, **{"rollout.prompts_per_step": 3, "rl.micro_batch_size": 4})
    )
    assert problem.startswith(f"data.max_prompt_len = 200: 2 of the 4 prompts of data.train = {str(data)!r} fit")
    eval_only = {**fit, "eval.num_examples": 4, "eval.datasets": (str(data),)}
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **eval_only), "eval") == []
    rows = "".join(json.dumps({"question": long, "answer": "#### 1"}) + "\n" for _ in range(3))
    (tmp_path / "long.jsonl").write_text(rows)
    long_eval = {**eval_only, "eval.datasets": (str(tmp_path / "long.jsonl"),)}
    (problem,) = config_problems(_tiny(tmp_path, tiny_model_dir, **long_eval), "eval")
    assert problem.startswith("data.max_prompt_len = 200: every one of the 3 prompts of eval dataset ")


def test_the_reward_is_called_on_a_sample_row(tmp_path, tiny_model_dir):
    (problem,) = config_problems(_tiny(tmp_path, tiny_model_dir, **{"rl.reward": "accuracy,os:getcwd"}))
    assert problem.startswith("rl.reward = 'accuracy,os:getcwd': os:getcwd(completion, answer, ...) on data.train's "
                              "first row failed: TypeError: ")  # fmt: skip
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **{"rl.reward": "os:getcwd"}), "eval") == []  # not used


def test_resume_changes_names_recipe_fields(tmp_path, tiny_model_dir):
    cfg = _tiny(tmp_path, tiny_model_dir, **{"resume_changes": "optim.lr,lora.rank"})
    (problem,) = config_problems(cfg)
    assert problem.startswith("resume_changes = 'optim.lr,lora.rank': lora.rank is not a recipe field")
    assert config_problems(_tiny(tmp_path, tiny_model_dir, **{"resume_changes": "optim.lr, train.total_steps"})) == []
