"""What `qerl_jax.main` and `qerl_jax.eval` share: their flags, and errors as lines without a traceback.

A bad flag, a config file that does not load, a misspelt config field (`--config.rollout.grop_size=3`)
or a config that `qerl_jax.validate` refuses ends the command with status 2 and one `error:` line
per problem on stderr; a problem found while running (`errors.UserFacingError`) with its own status.
"""

from __future__ import annotations

import os
import re
import sys
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
    """absl's `flags_parser`: the remaining arguments, or one line and exit status 2 on a bad flag."""
    try:
        return flags.FLAGS(argv)
    except SystemExit:
        if any(a in HELP_FLAGS for a in argv[1:]):  # absl printed its flags: add the config's fields
            print(config_help())
        raise
    except flags.Error as e:
        fail(_flag_error(str(e)))
    except (AttributeError, KeyError) as e:  # ml_collections: an override of a field that does not exist
        fail(_unknown_field(e, argv))
    except OSError as e:  # ml_collections: an override on a config file that did not load
        fail(_config_file_error(e, argv))
    except SyntaxError as e:  # the config file itself does not parse
        fail(f"--{CONFIG_FLAG}={e.filename}:{e.lineno}: the config file does not parse: {e.msg}")
    except (ImportError, NameError) as e:  # the config file's module-level code failed
        fail(f"--{CONFIG_FLAG}: the config file failed to load: {type(e).__name__}: {e}")


HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull")


def config_help() -> str:
    """Every field of `qerl_jax.config.default_config()`, one `--config.<path>=<default>` line each."""
    from qerl_jax.config import default_config  # noqa: PLC0415 (only for --help)

    def lines(node: ml_collections.ConfigDict, prefix: str) -> list[str]:
        out = []
        for key, value in node.items():
            if isinstance(value, ml_collections.ConfigDict):
                out += lines(value, f"{prefix}{key}.")
            else:
                out.append(f"  --{CONFIG_FLAG}.{prefix}{key}={_flag_value(value)}")
        return out

    header = (
        f"\nConfig fields (defaults of qerl_jax.config.default_config(); a --{CONFIG_FLAG} file may change them), "
        f"each settable as --{CONFIG_FLAG}.<section>.<field>=value:"
    )
    return "\n".join([header, *lines(default_config(), "")])


def _flag_value(value: Any) -> str:
    """A default as it is written on the command line."""
    if isinstance(value, str):
        return value if value and not any(c.isspace() for c in value) else repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


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
    except KeyboardInterrupt:
        hint = ""
        if resumable:
            hint = (
                f"; its last checkpoint is kept: continue with --config.resume=True "
                f"(workdir {os.path.abspath(str(cfg.workdir))})"
            )
        fail(f"interrupted{hint}", INTERRUPTED_EXIT)


def _flag_error(text: str) -> str:
    if f"--{CONFIG_FLAG}=None" in text:
        return f"--{CONFIG_FLAG} is required, e.g. --{CONFIG_FLAG}=configs/tiny.py"
    if "Error whilst parsing config file" in text:  # get_config raised: keep its last line, not the traceback
        lines = [line for line in text.splitlines() if line.strip()]
        return f"the config file failed to load: {lines[-1].strip()}"
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


def _config_file_error(error: OSError, argv: list[str] = ()) -> str:
    path = next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{CONFIG_FLAG}=")), None)
    if path is None:
        try:
            path = config_flags.get_config_filename(flags.FLAGS[CONFIG_FLAG])
        except Exception:  # noqa: BLE001 (the message still says why)
            path = "?"
    reason = re.search(r"\[Errno \d+\] ([^\n]+)", str(error))
    return f"--{CONFIG_FLAG}={path}: cannot load the config file ({reason.group(1) if reason else error})"
