"""What `qerl_jax.main` and `qerl_jax.eval` share: their flags, and errors as lines without a traceback.

A bad flag, a config file that does not load, a misspelt config field (`--config.rollout.grop_size=3`)
or a config that `qerl_jax.validate` refuses ends the command with status 2 and one `error:` line
per problem on stderr; a problem found while running (`errors.UserFacingError`) with its own status.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any, Callable, NoReturn

import ml_collections
from absl import app, flags
from ml_collections import config_flags

CONFIG_FLAG = "config"


def define_config_flag() -> flags.FlagHolder:
    """The `--config=configs/<name>.py[:arg]` flag (fields overridable as `--config.a.b=value`)."""
    return config_flags.DEFINE_config_file(
        CONFIG_FLAG, None, "Path to an ml_collections config file.", lock_config=True
    )


def fail(message: str, exit_code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's `flags_parser`: the remaining arguments, or one line and exit status 2 on a bad flag or a
    config file that fails; `--help` (with or without --config) prints the config's fields and exits 0."""
    if any(a in HELP_FLAGS for a in argv[1:]):
        print_help([a for a in argv if a not in HELP_FLAGS])
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(_flag_error(str(e), argv))
    except SyntaxError as e:  # the config file itself does not parse
        fail(f"--{CONFIG_FLAG}={e.filename}:{e.lineno}: the config file does not parse: {e.msg}")
    except OSError as e:  # ml_collections: an override on a config file that did not load
        fail(_config_file_error(e, argv))
    except Exception as e:  # noqa: BLE001 (the config file's own code, or an override of a field it lacks)
        raised_there = _config_file_failure(e, argv)
        if raised_there is not None:
            fail(raised_there)
        if isinstance(e, (AttributeError, KeyError)):  # ml_collections: an override of a field that does not exist
            fail(_unknown_field(e, argv))
        raise


HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull")


def print_help(argv: list[str]) -> NoReturn:
    """The command's usage and every config field with its value (of the --config file in `argv`, its
    overrides applied; else of `default_config()`) and its help line; exit status 0."""
    from qerl_jax.config import default_config  # noqa: PLC0415 (only for --help)

    source, cfg = "qerl_jax.config.default_config()", default_config()
    if _config_arg(argv[1:]) is not None:
        parse_flags(argv)  # a bad flag or config file: one line, exit status 2
        try:
            cfg = flags.FLAGS[CONFIG_FLAG].value
            cfg["workdir"]  # ml_collections defers a config file's failed load to its first use
        except OSError as e:
            fail(_config_file_error(e, argv))
        source = config_flags.get_config_filename(flags.FLAGS[CONFIG_FLAG])
    usage = (sys.modules["__main__"].__doc__ or "").strip()
    try:
        print(f"{usage}\n\n  --{CONFIG_FLAG}=PATH[:ARG]\n      an ml_collections config file (required), e.g. "
              "configs/tiny.py; ARG is passed to its get_config()")  # fmt: skip
        print(config_help(cfg, source), flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)


def config_help(cfg: ml_collections.ConfigDict, source: str = "qerl_jax.config.default_config()") -> str:
    """Every field of `cfg`: a `--config.<path>=<value>` line, then its help (`config.field_docs`)."""
    from qerl_jax.config import field_docs  # noqa: PLC0415 (only for --help)
    from qerl_jax.schema import flag_value  # noqa: PLC0415

    docs = field_docs()

    def lines(node: ml_collections.ConfigDict, prefix: str) -> list[str]:
        out = []
        for key, value in node.items():
            if isinstance(value, ml_collections.ConfigDict):
                out += lines(value, f"{prefix}{key}.")
            else:
                doc = docs.get(prefix + key, "(not a field of qerl_jax.config.default_config())")
                out += [f"  --{CONFIG_FLAG}.{prefix}{key}={flag_value(value)}", f"      {doc}"]
        return out

    header = f"\nConfig fields (the values of {source}), each settable as --{CONFIG_FLAG}.<section>.<field>=value:"
    return "\n".join([header, *lines(cfg, "")])


def run(main: Callable[[list[str]], Any]) -> None:
    """`app.run(main)` with `parse_flags` and --config required."""
    flags.mark_flags_as_required([CONFIG_FLAG])
    app.run(main, flags_parser=parse_flags)


INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def run_command(
    command: Callable[[Any], Any], config_flag: flags.FlagHolder, argv: list[str], *, resumable: bool = False
) -> Any:
    """`command(config)`, printing a problem the user can fix as `error: ...` (no traceback).

    Ctrl-C ends it with one line (for a `resumable` command: how to continue) and status 130.
    """
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])} (config fields are set as --config.<section>.<field>=value)")
    from qerl_jax.errors import UserFacingError  # noqa: PLC0415 (after flag parsing: fast --help)

    cfg = None
    try:
        cfg = config_flag.value
        if not isinstance(cfg, ml_collections.ConfigDict):
            cfg["workdir"]  # ml_collections defers a config file's failed load to its first use
    except OSError as e:
        fail(_config_file_error(e))
    except (KeyError, TypeError, AttributeError):
        pass  # not a ConfigDict: refused below
    if not isinstance(cfg, ml_collections.ConfigDict):
        fail(f"--{CONFIG_FLAG}: get_config() returned {type(cfg).__name__}; expected an ml_collections.ConfigDict")
    try:
        return command(cfg)
    except UserFacingError as e:
        fail(str(e), e.exit_code)
    except ImportError as e:
        missing = missing_package(e)
        if missing is None:
            raise
        fail(f"a package this command needs is not installed: {missing} (install it with `pip install {missing}`)")
    except KeyboardInterrupt:
        fail(_interrupted(cfg) if resumable else "interrupted", INTERRUPTED_EXIT)


def missing_package(error: ImportError) -> str | None:
    """The package an ImportError says is missing (ours never count: that is a bug, not an install), or None.

    A module not found names itself; a library that checks for an optional package of its own says so in
    its message (transformers: "apply_chat_template requires jinja2 ... `pip install jinja2`")."""
    name = getattr(error, "name", None)
    if isinstance(error, ModuleNotFoundError) and name:
        top = name.split(".")[0]
        return None if top in ("qerl_jax", "pallas_kernels") else top
    hint = re.search(r"pip install ([A-Za-z0-9_.\-\[\]]+)", str(error))
    return hint.group(1).rstrip(".") if hint else None


def _interrupted(cfg: ml_collections.ConfigDict) -> str:
    """Ctrl-C's line for a run: how to continue it, if it wrote a checkpoint."""
    from qerl_jax.checkpoint import saved_steps  # noqa: PLC0415

    workdir = os.path.abspath(str(cfg.workdir))
    steps = saved_steps(os.path.join(workdir, "checkpoints"))
    if steps:
        return (
            f"interrupted; its last checkpoint (step {steps[-1]}) is kept: continue with --config.resume=True "
            f"(workdir {workdir})"
        )
    return (
        "interrupted before its first checkpoint, so there is nothing to continue: the same command starts it "
        f"again (workdir {workdir})"
    )


def _flag_error(text: str, argv: list[str]) -> str:
    if f"--{CONFIG_FLAG}=None" in text:
        return f"--{CONFIG_FLAG} is required, e.g. --{CONFIG_FLAG}=configs/tiny.py"
    if "Error whilst parsing config file" in text:  # get_config raised: keep its last line, not the traceback
        lines = [line for line in text.splitlines() if line.strip()]
        return f"--{CONFIG_FLAG}={_config_arg(argv) or '?'}: the config file failed to load: {lines[-1].strip()}"
    return text


def _unknown_field(error: Exception, argv: list[str]) -> str:
    text = str(error).replace("\\n", "\n")  # ml_collections nests the KeyError's repr
    field = re.search(r"(\w+)", text)
    field = field.group(1) if field else None
    flag = None
    if field is not None:
        pattern = re.compile(rf"^--{CONFIG_FLAG}(?:\.\w+)*\.{field}(?:\.\w+)*$")
        flag = next((a.split("=", 1)[0] for a in argv if pattern.match(a.split("=", 1)[0])), None)
    message = f"{flag or 'a --config override'}: the config has no field {field!r}"
    hint = re.search(r'Did you mean "([\w.]+)"', text)
    return message + (f'; did you mean "{hint.group(1)}"?' if hint else "")


def _config_file_failure(error: BaseException, argv: list[str]) -> str | None:
    """The line for an exception raised by the --config file's own code (its import or get_config()),
    found in the traceback; None if the file's code is not in it."""
    path = _config_arg(argv)
    if path is None:
        return None
    file = os.path.realpath(path.split(":", 1)[0])
    frames = [fr for fr in traceback.extract_tb(error.__traceback__) if os.path.realpath(fr.filename) == file]
    if not frames:
        return None
    text = " ".join(str(error).split())
    return (
        f"--{CONFIG_FLAG}={path}: the config file failed to load: {type(error).__name__}"
        f"{': ' + text if text else ''} (line {frames[-1].lineno})"
    )


def _config_arg(argv: list[str]) -> str | None:
    """The --config flag's value in `argv` ("--config=PATH[:ARG]" or "--config PATH[:ARG]"), or None."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{CONFIG_FLAG}="):
            return a.split("=", 1)[1]
        if a == f"--{CONFIG_FLAG}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _config_file_error(error: OSError, argv: list[str] = ()) -> str:
    path = _config_arg(argv)
    if path is None:
        try:
            path = config_flags.get_config_filename(flags.FLAGS[CONFIG_FLAG])
        except Exception:  # noqa: BLE001 (the message still says why)
            path = "?"
    reason = re.search(r"\[Errno \d+\] ([^\n]+)", str(error))
    return f"--{CONFIG_FLAG}={path}: cannot load the config file ({reason.group(1) if reason else error})"
