"""Checks a run's whole config before any work, and reports every problem at once.

`validate_config(cfg, command)` runs before the model is loaded or anything is written to the
workdir (`run_config.build`, which `train.train` and `evaluation.evaluate` call first, runs it and
then turns the config into the run's typed tree). It checks each field's type
and range (the check each field declares in `qerl_jax.config`), the rules that tie fields together (group size >= 2, the micro-batch divides the
batch, prompt + completion within the model's context, AQN stages vs steps, the quantization
block size vs the model's shapes), and the files the run will read: the model directory
(config.json, every safetensors header, the shard index, tensor shapes against config.json,
tokenizer files; headers only, no tensor data) and the datasets. Each problem names its config
path (`rollout.group_size`); `ConfigError` carries them all and the commands print it without a
traceback, exit status 2. `qerl_jax.quantize` checks its arguments with `checkpoint_file_problems`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import ml_collections
from safetensors import SafetensorError, safe_open

from qerl_jax import aqn, rewards
from qerl_jax.checkpoint import RECIPE_FIELDS, latest_meta, resume_problems, saved_steps
from qerl_jax.config import field_checks
from qerl_jax.data import ALIASES, KNOWN_DATASETS, arithmetic
from qerl_jax.errors import UserFacingError
from qerl_jax.model_dir import resolve_model_dir, tiny_model_dir
from qerl_jax.model_io import loader
from qerl_jax.model_io.tiny import hf_config as tiny_hf_config
from qerl_jax.models.qwen2 import ModelConfig, projection_shapes
from qerl_jax.quant.formats import FORMATS, REGISTRY
from qerl_jax.schema import Check

COMMANDS = ("train", "eval")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json")


class ConfigError(UserFacingError):
    """Every problem of a config (or of a command's arguments), each a line naming its field."""

    exit_code = 2

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(format_problems(self.problems))


def format_problems(problems: Sequence[str]) -> str:
    """One problem as is; several as "N problems:" and one indented line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)


# ----------------------------------------------------------------------------- one field

FIELDS: dict[str, Check] = field_checks()  # path -> its check, as the config declares it (qerl_jax.config)


def _get(cfg: ml_collections.ConfigDict, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        node = node[part]  # KeyError when missing
    return node


# ----------------------------------------------------------------------------- the whole config


def config_problems(cfg: ml_collections.ConfigDict, command: str = "train") -> list[str]:
    """Every problem of `cfg` for `command` ("train" or "eval"), each "path: what is wrong"."""
    if command not in COMMANDS:
        raise ValueError(f"command {command!r} is unknown; expected one of {COMMANDS}")
    problems, good = [], {}  # good: path -> value of the fields that passed their own check
    for path, check in FIELDS.items():
        try:
            value = _get(cfg, path)
        except (KeyError, AttributeError):
            problems.append(f"{path}: missing (a config file should start from qerl_jax.config.default_config())")
            continue
        msg = check(value)
        if msg is None:
            good[path] = value
        else:
            problems.append(f"{path} = {value!r}: {msg}")
    problems += _rule_problems(good, command)
    problems += _unknown_field_problems(cfg)
    problems += _workdir_problems(good, command)
    problems += _file_problems(cfg, good, command)
    if not problems:  # these read the checkpoint, the datasets and the tokenizer the fields name
        problems += _content_problems(cfg, good, command)
    return problems


def validate_config(cfg: ml_collections.ConfigDict, command: str = "train") -> None:
    """Raises ConfigError listing every problem of `cfg` for `command`; returns None if there is none."""
    problems = config_problems(cfg, command)
    if problems:
        raise ConfigError(problems)


Rule = Callable[[dict[str, Any]], list[str]]  # the values of its fields -> its problems
_RULES: list[tuple[tuple[str, ...], bool, Rule]] = []  # (fields, train only, rule), in the order reported


def _rule(*paths: str, train_only: bool = True) -> Callable[[Rule], Rule]:
    """Registers a rule between `paths`, checked when each passed its own check (and, if `train_only`,
    for the train command only)."""

    def register(rule: Rule) -> Rule:
        _RULES.append((paths, train_only, rule))
        return rule

    return register


def _rule_problems(f: dict[str, Any], command: str) -> list[str]:
    """The rules between fields, each checked when its fields passed their own checks."""
    out = []
    for paths, train_only, rule in _RULES:
        if all(p in f for p in paths) and (command == "train" or not train_only):
            out += rule(f)
    return out


@_rule("mesh.data", "mesh.model")
def _mesh_devices(f):
    return _mesh_device_problems(f)


@_rule("rollout.prompts_per_step", "rollout.group_size", "rl.micro_batch_size")
def _micro_batch_divides_the_batch(f):
    batch = f["rollout.prompts_per_step"] * f["rollout.group_size"]
    if f["rl.micro_batch_size"] and batch % f["rl.micro_batch_size"]:  # 0: auto chooses a divisor
        return [
            f"rl.micro_batch_size = {f['rl.micro_batch_size']}: must divide the batch of "
            f"rollout.prompts_per_step x rollout.group_size = {batch} sequences"
        ]
    return []


@_rule("rl.micro_batch_size", "mesh.data", "mesh.model")
def _micro_batch_splits_over_the_mesh(f):
    if f["mesh.data"] > 1 and not _mesh_device_problems(f) and f["rl.micro_batch_size"] % f["mesh.data"]:
        return [  # 0 (auto) chooses a multiple
            f"rl.micro_batch_size = {f['rl.micro_batch_size']}: must be a multiple of mesh.data "
            f"({f['mesh.data']}): each micro-batch is split over the data-parallel devices"
        ]
    return []


@_rule("rollout.max_batch", "rollout.group_size")
def _rollout_batch_holds_a_group(f):
    if 0 < f["rollout.max_batch"] < f["rollout.group_size"]:
        return [
            f"rollout.max_batch = {f['rollout.max_batch']}: smaller than one group (rollout.group_size = "
            f"{f['rollout.group_size']}); set it to at least {f['rollout.group_size']}, or to 0 to size the "
            "rollout's rows to the free device memory"
        ]
    return []


@_rule("mesh.data", "mesh.model", train_only=False)
def _one_axis_takes_the_rest(f):
    if f["mesh.data"] == f["mesh.model"] == -1:
        return ["mesh.data = mesh.model = -1: only one axis may take all remaining devices"]
    return []


@_rule("rl.overlong_cache", "rollout.max_new_tokens")
def _overlong_window_within_the_completion(f):
    if 0 < f["rollout.max_new_tokens"] <= f["rl.overlong_cache"]:
        return [
            f"rl.overlong_cache = {f['rl.overlong_cache']}: the penalty window must be shorter than "
            f"rollout.max_new_tokens ({f['rollout.max_new_tokens']})"
        ]
    return []


@_rule("aqn.enabled", "model.quant", "aqn.num_stages", "train.total_steps", "aqn.sigma_start")
def _aqn_schedule(f):
    if not aqn_enabled(f["aqn.enabled"], f["model.quant"]):
        return []
    out = []
    if f["aqn.num_stages"] > f["train.total_steps"]:
        out.append(
            f"aqn.num_stages = {f['aqn.num_stages']}: more noise stages than train.total_steps "
            f"({f['train.total_steps']}); every stage needs at least one step"
        )
    if f["aqn.sigma_start"] <= 0:
        out.append("aqn.sigma_start = 0: AQN is on, so the first noise stage needs sigma_start > 0")
    if f.get("aqn.decay") == "exponential" and "aqn.sigma_end" in f and f["aqn.sigma_end"] <= 0:
        out.append("aqn.sigma_end = 0: the exponential decay needs sigma_end > 0 (or aqn.decay=linear)")
    return out


@_rule("eval.num_samples", "eval.temperature", train_only=False)
def _mean_at_k_samples(f):
    if f["eval.num_samples"] and f["eval.temperature"] == 0:
        return [
            f"eval.temperature = 0: mean@{f['eval.num_samples']} (eval.num_samples) needs sampling, temperature > 0"
        ]
    return []


@_rule("resume_changes")
def _resume_changes_are_recipe_fields(f):
    unknown = [n for n in f["resume_changes"].split(",") if n.strip() and n.strip() not in RECIPE_FIELDS]
    if unknown:
        return [
            f"resume_changes = {f['resume_changes']!r}: {', '.join(unknown)} is not a recipe field a resume "
            f"checks; expected comma-separated names from {', '.join(RECIPE_FIELDS)}"
        ]
    return []


@_rule("rl.reward", "rl.reward_weights")
def _reward_spec(f):
    try:
        rewards.parse_reward_spec(f["rl.reward"], f["rl.reward_weights"])
    except ValueError as e:
        return [f"rl.reward = {f['rl.reward']!r}: {e}"]
    return []


@_rule("rl.is_correction", "rl.old_logp_source")
def _is_correction_needs_the_current_logp(f):
    source = f["rl.old_logp_source"]
    if f["rl.is_correction"] != "none" and source == "rollout":
        return [
            f"rl.is_correction = {f['rl.is_correction']!r}: needs rl.old_logp_source=current; with "
            f"{source!r} the ratio's denominator already is the sampler's log-prob, so the "
            "PPO ratio is the sampler/trainer importance ratio"
        ]
    if f["rl.is_correction"] != "none" and source == "proximal":
        return [
            f"rl.is_correction = {f['rl.is_correction']!r}: needs rl.old_logp_source=current; with 'proximal' "
            "(decoupled PPO) the behaviour weight already corrects for the sampler (its cap: rl.behav_weight_cap)"
        ]
    return []


@_rule("rl.old_logp_source", "rl.ppo_epochs")
def _proximal_is_one_update(f):
    if f["rl.old_logp_source"] == "proximal" and f["rl.ppo_epochs"] > 1:
        return [
            f"rl.ppo_epochs = {f['rl.ppo_epochs']}: rl.old_logp_source=proximal recomputes the proximal policy in "
            "the step's one update; use rl.ppo_epochs=1 (or rl.old_logp_source=rollout)"
        ]
    return []


@_rule("rl.loss", "rl.scale_rewards")
def _dr_grpo_does_not_scale(f):
    if f["rl.loss"] == "dr_grpo" and f["rl.scale_rewards"] != "none":
        return [
            f"rl.scale_rewards = {f['rl.scale_rewards']!r}: Dr. GRPO (rl.loss=dr_grpo) does not divide advantages "
            "by a std; set rl.scale_rewards=none"
        ]
    return []


@_rule("rl.loss", "rl.beta")
def _dapo_has_no_kl(f):
    if f["rl.loss"] == "dapo" and f["rl.beta"] > 0:
        return [f"rl.beta = {f['rl.beta']}: DAPO has no KL term; use rl.loss=grpo or bnpo for a KL penalty"]
    return []


@_rule("workdir", "resume")
def _no_restart_over_checkpoints(f):
    steps = saved_steps(os.path.join(f["workdir"], "checkpoints")) if not f["resume"] else []
    if steps:
        return [
            f"resume = False, but workdir {f['workdir']!r} holds a run's checkpoints (steps {steps}): pass "
            "--config.resume=True to continue it, or a new --config.workdir to start over"
        ]
    return []


def _mesh_device_problems(f: dict[str, Any]) -> list[str]:
    """mesh.data x mesh.model against the devices the run sees (`sharding.make_mesh` takes them all)."""
    data, model = f["mesh.data"], f["mesh.model"]
    if (data, model) == (1, 1) or data == model == -1:
        return []  # one device needs no mesh; two -1 axes are reported apart
    import jax  # noqa: PLC0415 (starts the backend: only for a run that asks for a mesh)

    n = jax.device_count()
    available = f"only {n} {'is' if n == 1 else 'are'} available" if n < data * model else f"{n} are available"
    if -1 in (data, model):
        known = model if data == -1 else data
        if n % known:
            return [f"mesh.data x mesh.model = {data} x {model}: the {n} available devices do not split into an axis "
                    f"of {known} and one of the rest"]  # fmt: skip
        return []
    if data * model > n:
        return [f"mesh.data x mesh.model = {data * model} devices, but {available}"]
    if data * model < n:
        return [f"mesh.data x mesh.model = {data * model} devices, but {available}: a mesh takes every device "
                "(set one axis to -1 for all remaining ones)"]  # fmt: skip
    return []


def aqn_enabled(enabled: bool | None, quant: str) -> bool:
    """aqn.enabled as the run takes it: None is on iff the policy is quantized (`aqn.default_aqn_enabled`)."""
    return aqn.default_aqn_enabled(quant) if enabled is None else bool(enabled)


def _file_problems(cfg: ml_collections.ConfigDict, f: dict[str, Any], command: str) -> list[str]:
    """The files the command reads: datasets, the adapter to evaluate, the model directory."""
    out = []
    bad = f.get("data.max_bad_fraction", 1.0)
    if command == "train" and "data.train" in f:
        out += _dataset_problems("data.train", f["data.train"], bad)
    if "eval.datasets" in f and "eval.num_examples" in f and (command == "eval" or f["eval.num_examples"]):
        if not f["eval.datasets"]:
            out.append("eval.datasets = (): must name at least one dataset")
        for i, name in enumerate(f["eval.datasets"]):
            out += _dataset_problems(f"eval.datasets[{i}]", name, bad)
    if command == "eval" and f.get("eval.checkpoint"):
        out += _adapter_problems(f["eval.checkpoint"])
    if all(p in f for p in ("model.tiny", "model.path", "workdir")):
        config, raw, model_problems = _model_problems(cfg, f["model.tiny"])
        out += [f"model.path: {p}" for p in model_problems]
        if config is not None:
            out += _model_fit_problems(config, raw, f, command)
    return out


def _content_problems(cfg: ml_collections.ConfigDict, f: dict[str, Any], command: str) -> list[str]:
    """What a valid config's files say against it, before the model is loaded or anything written: a
    resumed run's recipe against its checkpoint's, each reward called on data.train's first row, and
    enough prompts within data.max_prompt_len (rendered with the model's tokenizer)."""
    train = command == "train"
    out = _resume_recipe_problems(cfg, f) if train and f["resume"] else []
    datasets = {"data.train": f["data.train"]} if train else {}
    if command == "eval" or f["eval.num_examples"]:
        datasets.update({f"eval.datasets[{i}]": name for i, name in enumerate(f["eval.datasets"])})
    loaded = {path: _local_dataset(name, f["data.max_bad_fraction"]) for path, name in datasets.items()}
    if train and loaded["data.train"] is not None and len(loaded["data.train"]):
        from qerl_jax import reward_guard  # noqa: PLC0415

        out += reward_guard.sample_row_problems(
            f["rl.reward"], f["rl.reward_weights"], loaded["data.train"][0], f["rl.reward_timeout_s"]
        )
    if any(d is not None for d in loaded.values()):
        tokenizer = _prompt_tokenizer(cfg, f)
        for path, dataset in loaded.items() if tokenizer is not None else ():
            if dataset is None:
                continue
            if path == "data.train":
                need = f["rollout.prompts_per_step"]
            else:  # eval reads the first eval.num_examples rows; one prompt within the limit is enough
                dataset, need = dataset.select(range(min(f["eval.num_examples"] or len(dataset), len(dataset)))), 1
            out += _prompt_fit_problems(path, datasets[path], dataset, tokenizer, f, need)
    return out


def _resume_recipe_problems(cfg: ml_collections.ConfigDict, f: dict[str, Any]) -> list[str]:
    """A resumed run's recipe fields against those its newest checkpoint was written with."""
    checkpoint_dir = os.path.abspath(os.path.join(f["workdir"], "checkpoints"))
    found = latest_meta(checkpoint_dir)
    if found is None or not isinstance(found[1].get("config"), dict):
        return []  # no readable checkpoint: the run says so when it restores
    step, meta = found
    current = cfg.to_dict()
    current["aqn"]["enabled"] = aqn_enabled(f["aqn.enabled"], f["model.quant"])  # saved resolved
    return resume_problems(current, meta["config"], step, os.path.join(checkpoint_dir, str(step)))[0]


def _local_dataset(name: str, max_bad_fraction: float):
    """The rows of a local dataset file or a generated source; None for a hub dataset (not read here)."""
    from qerl_jax.data import load_math_dataset  # noqa: PLC0415 (imports `datasets`)

    if arithmetic.parse_name(name) is None and not os.path.exists(os.path.expanduser(name)):
        return None
    return load_math_dataset(name, max_bad_fraction=max_bad_fraction)


def _prompt_tokenizer(cfg: ml_collections.ConfigDict, f: dict[str, Any]):
    """The tokenizer the run renders prompts with, or None where it is not had before the run (a hub id
    not downloaded yet, a checkpoint whose tokenizer does not load: the model load names it)."""
    if f["model.tiny"]:
        model_dir = tiny_model_dir(cfg)
        if not os.path.isdir(model_dir):
            from qerl_jax.model_io import tiny  # noqa: PLC0415

            return tiny.build_tiny_tokenizer()  # what the run will build: the same texts, the same BPE
    else:
        model_dir = resolve_model_dir(cfg, download=False)
    if model_dir is None:
        return None
    try:
        return _gguf_tokenizer(cfg, model_dir) if _is_gguf(model_dir) else loader.load_tokenizer(model_dir)
    except loader.CheckpointError:
        return None  # the model load names the problem


def _gguf_tokenizer(cfg: ml_collections.ConfigDict, path: str):
    """A GGUF model's tokenizer: the one its cached conversion saved (what the run then reads), else
    built from the file's metadata as the conversion does; no tensor data is read either way."""
    from qerl_jax import compile_cache  # noqa: PLC0415
    from qerl_jax.model_io import gguf, load_cache  # noqa: PLC0415

    file = gguf.find_gguf_file(path)
    root = compile_cache.cache_dir(cfg.model.cache_dir, load_cache.CACHE_NAME)
    key = load_cache.cache_key(file, cfg.model.dtype, cfg.model.quant, tuple(cfg.model.quant_skip))
    entry = os.path.join(root, key)
    if os.path.isfile(os.path.join(entry, load_cache.CONFIG_FILE)):
        try:
            return loader.load_tokenizer(entry)
        except loader.CheckpointError:
            pass  # a damaged entry: the run converts the file again
    return gguf.load_tokenizer(file)


def _prompt_fit_problems(path: str, name: str, dataset, tokenizer, f: dict[str, Any], need: int) -> list[str]:
    """Fewer than `need` prompts of `dataset` within data.max_prompt_len (tokenized until enough fit)."""
    from qerl_jax.data import prompt_lengths  # noqa: PLC0415

    limit, fits, shortest = f["data.max_prompt_len"], 0, None
    for start in range(0, len(dataset), 256):
        lengths = prompt_lengths(
            tokenizer, dataset[start : start + 256]["prompt"], f["data.template"], system_prompt=f["data.system_prompt"]
        )
        fits += sum(n <= limit for n in lengths)
        shortest = min([*lengths, shortest] if shortest is not None else lengths)
        if fits >= need:
            return []
    if path != "data.train":
        return [
            f"data.max_prompt_len = {limit}: every one of the {len(dataset)} prompts of eval dataset {name!r} is "
            f"longer (the shortest takes {shortest} tokens with the chat template), so nothing would be evaluated; "
            "raise data.max_prompt_len"
        ]
    return [
        f"data.max_prompt_len = {limit}: {fits} of the {len(dataset)} prompts of data.train = {name!r} fit (the "
        f"shortest takes {shortest} tokens with the chat template), and each step needs rollout.prompts_per_step "
        f"= {need}; raise data.max_prompt_len"
    ]


def _dataset_problems(path: str, name: str, max_bad_fraction: float = 1.0) -> list[str]:
    try:
        if arithmetic.parse_name(name) is not None:  # a generated source ("arithmetic:train")
            return []
    except ValueError as e:
        return [f"{path} = {name!r}: {e}"]
    if os.path.exists(os.path.expanduser(name)):
        return _dataset_content_problems(path, name, max_bad_fraction)
    if ALIASES.get(name.lower(), name) in KNOWN_DATASETS:
        return _hub_dataset_problems(path, name, KNOWN_DATASETS[ALIASES.get(name.lower(), name)].repo)
    known = ", ".join(sorted(KNOWN_DATASETS) + sorted(ALIASES) + ["arithmetic:train", "arithmetic:test"])
    return [f"{path} = {name!r}: no such file or directory, and not a known dataset name ({known})"]


def _hub_dataset_problems(path: str, name: str, repo: str) -> list[str]:
    """A hub dataset while the hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and not in the cache."""
    from datasets import config as datasets_config  # noqa: PLC0415

    if not datasets_config.HF_HUB_OFFLINE:
        return []
    if os.path.isdir(os.path.join(datasets_config.HF_DATASETS_CACHE, repo.replace("/", "___"))):
        return []
    return [
        f"{path} = {name!r}: the hub dataset {repo} is not cached and the hub is offline (HF_HUB_OFFLINE): "
        "pass a local .jsonl/.json/.parquet file instead"
    ]


def _gguf_model(path: str) -> tuple[ModelConfig | None, list[str]]:
    """(config, problems) of a GGUF model.path (a .gguf file, or a directory holding one): the whole
    header is checked (magic, truncation, architecture, tensor types, names and shapes; no weights)."""
    from qerl_jax.model_io import gguf  # noqa: PLC0415

    try:
        return gguf.open_gguf(path).config, []
    except loader.CheckpointError as e:
        return None, [str(e)]


def _dataset_content_problems(path: str, name: str, max_bad_fraction: float) -> list[str]:
    """Reads a local dataset as the run will: its rows, file type and malformed-row share are checked
    before the model is loaded."""
    from qerl_jax.data import load_math_dataset  # noqa: PLC0415 (imports `datasets`)

    try:
        load_math_dataset(name, max_bad_fraction=max_bad_fraction)
    except (OSError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [f"{path} = {name!r}: {reason[:400]}"]
    return []


def _unknown_field_problems(cfg: ml_collections.ConfigDict) -> list[str]:
    """Fields a config file set that `default_config()` does not have (a misspelt name is no new field)."""
    import difflib  # noqa: PLC0415

    from qerl_jax.config import default_config  # noqa: PLC0415

    def walk(node: Any, ref: Any, prefix: str) -> list[str]:
        out = []
        for key in node.keys():
            path = f"{prefix}{key}"
            if key not in ref:
                close = difflib.get_close_matches(key, list(ref.keys()), n=1)
                hint = f'; did you mean "{prefix}{close[0]}"?' if close else ""
                out.append(f"{path}: not a config field (set in the config file){hint}")
            elif isinstance(ref[key], ml_collections.ConfigDict) and isinstance(node[key], ml_collections.ConfigDict):
                out += walk(node[key], ref[key], f"{path}.")
        return out

    return walk(cfg, default_config(), "")


def _workdir_problems(f: dict[str, Any], command: str) -> list[str]:
    """The workdir a run writes to; resume=True on a workdir that holds no run; model.path next to model.tiny."""
    from qerl_jax import workdir  # noqa: PLC0415

    out = []
    if command == "train" and "workdir" in f:
        out += workdir.workdir_problems(f["workdir"])
        if f.get("resume") and not out and not os.path.isdir(os.path.join(f["workdir"], "checkpoints")):
            out.append(
                f"resume = True, but workdir {f['workdir']!r} holds no run to continue (no checkpoints/): check the "
                "workdir, or drop --config.resume=True to start a run"
            )
    if f.get("model.tiny") and f.get("model.path"):
        out.append(
            f"model.path = {f['model.path']!r}: ignored while model.tiny = True (the random tiny model); pass "
            "--config.model.tiny=False to train this model, or drop model.path"
        )
    return out


def _adapter_problems(path: str) -> list[str]:
    from qerl_jax.model_io.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # noqa: PLC0415 (torch-free safetensors only)

    if os.path.exists(path) and not os.path.isdir(path):
        return [f"eval.checkpoint = {path!r}: is a file (expected a run's workdir or a PEFT adapter folder)"]
    if not os.path.isdir(path):
        return [f"eval.checkpoint = {path!r}: does not exist (expected a run's workdir or a PEFT adapter)"]
    run_dir = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        return [f"eval.checkpoint = {path!r}: a PEFT adapter folder without its weights file {ADAPTER_WEIGHTS}"]
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) or saved_steps(run_dir):
        return []
    return [f"eval.checkpoint = {path!r}: holds no orbax checkpoint and no {ADAPTER_CONFIG}"]


def _is_gguf(model_dir: str) -> bool:
    from qerl_jax.model_io import gguf  # noqa: PLC0415

    try:
        return (model_dir.endswith(gguf.GGUF_SUFFIX) and os.path.isfile(model_dir)) or (
            os.path.isdir(model_dir) and gguf.find_gguf_file(model_dir) is not None
        )
    except loader.CheckpointError:  # several .gguf files: open_gguf names them
        return True


def _model_problems(cfg, tiny: bool) -> tuple[ModelConfig | None, dict | None, list[str]]:
    """(config, raw config.json, problems) of the model directory; tiny: only if already built."""
    if tiny:
        model_dir = tiny_model_dir(cfg)
        if not os.path.isdir(model_dir):  # built by the run; its config is known now
            raw = tiny_hf_config()
            return loader.parse_config(raw, "the tiny model's config.json"), raw, []
    else:
        try:
            model_dir = resolve_model_dir(cfg, download=False)  # a hub id not cached yet: downloaded by the run
        except UserFacingError as e:
            return None, None, [str(e)]
    if model_dir is not None and _is_gguf(model_dir):
        config, problems = _gguf_model(model_dir)
        return config, {}, problems
    if model_dir is None or not os.path.isdir(model_dir):
        return None, None, []
    try:
        config, raw = loader.read_config(model_dir)
    except loader.CheckpointError as e:
        return None, None, [str(e)]
    return config, raw, checkpoint_file_problems(model_dir, config, raw)


def checkpoint_file_problems(
    model_dir: str, config: ModelConfig | None, raw: dict, *, need_tokenizer: bool = True
) -> list[str]:
    """Problems of a checkpoint's weight and tokenizer files, from their headers (no tensor data).

    Each names the file: unreadable (truncated, garbled) safetensors, a shard the index names
    that is missing or lacks a tensor it maps there, tensors missing or shaped unlike config.json
    (skipped when `config` is None), tokenizer JSON files that do not parse, or none at all
    (when `need_tokenizer`).
    """
    problems = []
    try:
        files = loader.weight_files(model_dir)
    except loader.CheckpointError as e:
        return [str(e)]
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    owner[name] = file
        except (SafetensorError, OSError) as e:
            problems.append(loader.unreadable_safetensors(file, e))
    if problems:
        return problems
    index_file = os.path.join(model_dir, loader.SAFETENSORS_INDEX)
    if len(files) > 1 or not os.path.isfile(os.path.join(model_dir, loader.SAFETENSORS_FILE)):
        weight_map = loader.read_json(index_file)["weight_map"]
        wrong = [n for n, shard in weight_map.items() if owner.get(n) != os.path.join(model_dir, shard)]
        if wrong:
            problems.append(
                f"{index_file} maps {len(wrong)} tensor(s) to a shard that does not hold them: "
                + ", ".join(f"{n} -> {weight_map[n]}" for n in wrong[:3])
            )
    quantized = "quantization_config" in raw
    missing, misshapen = [], []
    for name, shape in (loader.expected_shapes(config) if config is not None else {}).items():
        if quantized and name.endswith("_proj.weight"):
            continue  # stored packed (weight_packed, weight_scale, ...), checked when read
        if name not in shapes:
            missing.append(name)
        elif shapes[name] != shape:
            misshapen.append(f"{owner[name]}: tensor {name!r} has shape {shapes[name]}; config.json implies {shape}")
    problems += misshapen[:3]
    if missing:
        shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        problems.append(f"{model_dir}: missing {len(missing)} tensor(s) that config.json implies: {shown}")
    return problems + tokenizer_file_problems(model_dir, need_tokenizer)


def tokenizer_file_problems(model_dir: str, need_tokenizer: bool) -> list[str]:
    """Tokenizer JSON files of `model_dir` that do not parse; none at all, or no chat template (when
    `need_tokenizer`)."""
    problems = []
    present = [f for f in TOKENIZER_JSON if os.path.isfile(os.path.join(model_dir, f))]
    if need_tokenizer and not present:
        problems.append(f"{model_dir}: no tokenizer files (expected tokenizer.json or tokenizer_config.json)")
    for f in present:
        try:
            loader.read_json(os.path.join(model_dir, f))
        except loader.CheckpointError as e:
            problems.append(str(e))
    if need_tokenizer and present and not _has_chat_template(model_dir):
        problems.append(
            f"{model_dir}: the model has no chat template (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja), and prompts are rendered with one: use a chat/instruct model (e.g. "
            "Qwen/Qwen2.5-0.5B-Instruct) or copy one's chat_template into tokenizer_config.json"
        )
    return problems


def _has_chat_template(model_dir: str) -> bool:
    """Whether a transformers tokenizer loaded from `model_dir` gets a chat template."""
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in ("chat_template.jinja", "chat_template.json")):
        return True
    if os.path.isdir(os.path.join(model_dir, "additional_chat_templates")):
        return True
    path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        return os.path.isfile(path) and bool(loader.read_json(path).get("chat_template"))
    except loader.CheckpointError:
        return True  # reported as not valid JSON


def _model_fit_problems(config: ModelConfig, raw: dict, f: dict[str, Any], command: str) -> list[str]:
    """Rules between the config and the model: context length, stored format, quantization block size."""
    out = []
    context = config.max_position_embeddings
    generated = {
        "rollout.max_new_tokens": command == "train",
        "eval.max_new_tokens": command == "eval" or bool(f.get("eval.num_examples")),
    }
    for path, used in generated.items():
        if used and "data.max_prompt_len" in f and path in f:
            total = f["data.max_prompt_len"] + f[path]
            if total > context:
                out.append(
                    f"data.max_prompt_len + {path} = {f['data.max_prompt_len']} + {f[path]} = {total}: exceeds the "
                    f"model's context of {context} tokens (max_position_embeddings in config.json)"
                )
    quant = f.get("model.quant")
    if "quantization_config" in raw:
        from qerl_jax.quant import compressed_tensors  # noqa: PLC0415

        try:
            stored = compressed_tensors.detect_format(raw)
        except ValueError as e:
            return out + [f"model.path: {e}"]
        if quant not in (None, "bf16", stored):
            out.append(f"model.quant = {quant!r}: the checkpoint is stored as {stored}; set model.quant={stored}")
    elif quant in FORMATS and "model.quant_skip" in f:
        block = REGISTRY[quant].block_size
        shapes = projection_shapes(config)
        bad = [f"{p} (K = {k})" for p, (_, k) in shapes.items() if k % block and p not in f["model.quant_skip"]]
        if bad:
            out.append(
                f"model.quant = {quant!r}: needs each quantized projection's input size K to be a multiple of {block}; "
                f"{', '.join(bad)} is not (add them to model.quant_skip or pick another format)"
            )
    return out
