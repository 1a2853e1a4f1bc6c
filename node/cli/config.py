"""Where a command's options come from: flags over ``FUSIONLLM_*`` variables over a TOML file.

Every name comes from the command's argparse definitions, so an option is declared once: its
TOML key is the long flag without the dashes (``--lane-port`` -> ``lane-port``), its
environment variable ``FUSIONLLM_`` + the same name upper-cased with ``_`` for ``-``
(``FUSIONLLM_LANE_PORT``). The file is ``--config FILE`` (or ``$FUSIONLLM_CONFIG``). Values
from the file and the environment are checked like flags (type, choices) and then become the
parser's defaults, so a flag still wins and argparse keeps its own rules (required, append).
The environment is read when the command runs (``apply``), never at import.

Every command that calls ``add_config_option`` (node, swarm, train) gets the same mechanism.
A file names one command's options, so a key the command lacks is refused. The environment is
shared by every command a shell runs, so a variable that names another configurable command's
option is left to that command; one no command knows (a typo) is refused.
"""

import argparse
import difflib
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger

logger = get_logger(__name__)

ENV_PREFIX = "FUSIONLLM_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
SOURCES_DEST = "config_sources"  # on the parsed namespace: dest -> where its value came from
_MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; refuse a huge one unread
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_UNSET = object()


@dataclass(frozen=True, kw_only=True)
class Option:
    """One option a file or the environment may set, named after its flag."""

    action: argparse.Action
    key: str  # TOML key: "lane-port"
    env: str  # environment variable: "FUSIONLLM_LANE_PORT"

    @property
    def dest(self) -> str:
        return self.action.dest

    @property
    def is_flag(self) -> bool:  # store_true / store_false: a boolean, no value on the line
        return self.action.nargs == 0

    @property
    def is_list(self) -> bool:
        return self.action.nargs in ("+", "*") or isinstance(self.action, argparse._AppendAction)


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """--config, and each option's variable in its help; call after every other option."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"a TOML file of options (${CONFIG_ENV}); keys are the long flags without the "
        'dashes, e.g. lane-port = 4003, bootstrap = ["/ip4/..."]. Precedence: flags over '
        f"{ENV_PREFIX}* environment variables (named in each option's help) over the file "
        "over the defaults",
    )
    for option in options_of(parser):
        if option.action.help is not None:
            option.action.help += f" [${option.env}]"
    parser.epilog = (
        f"Every option can also come from a {ENV_PREFIX}NAME environment variable or a TOML "
        "--config file (key: the option's long name without the dashes; true/false for "
        "switches, a list of strings for options that take several values). Flags win over "
        "the environment, which wins over the file. At start the command logs each effective "
        "value and where it came from (a secret is named by its file's path only)."
    )


def is_configurable(parser: argparse.ArgumentParser) -> bool:
    return any(action.dest == "config" for action in parser._actions)


def options_of(parser: argparse.ArgumentParser) -> list[Option]:
    """The options a file or the environment may set: the documented long flags."""
    options = []
    for action in parser._actions:
        longs = [flag for flag in action.option_strings if flag.startswith("--")]
        if not longs or action.help == argparse.SUPPRESS or action.dest in ("help", "config"):
            continue
        name = longs[0][2:]
        options.append(Option(action=action, key=name, env=ENV_PREFIX + _env_name(name)))
    return options


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def apply(
    parser: argparse.ArgumentParser,
    command: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
) -> argparse.Namespace:
    """Parse ``argv`` with ``command``'s options layered: flag > environment > file > default.

    The namespace carries ``config_sources`` (dest -> "flag", "env NAME", "file PATH" or
    "default"). Raises ConfigError naming the file or variable and the key.
    """
    options = options_of(command)
    others = _other_commands_variables(parser, command)
    given = _given_on_command_line(parser, command, options, argv)
    args = parser.parse_args(argv)
    path = args.config or environ.get(CONFIG_ENV) or None
    layered: dict[str, tuple[object, str]] = {}
    if path:
        for dest, value in read_file(Path(path), options).items():
            layered[dest] = (value, f"file {path}")
    for dest, (value, name) in read_environment(environ, options, others).items():
        layered[dest] = (value, f"env {name}")
    sources = {option.dest: "flag" if option.dest in given else "default" for option in options}
    for dest, (_, source) in layered.items():
        if dest not in given:
            sources[dest] = source
    command.set_defaults(**{d: v for d, (v, _) in layered.items() if d not in given})
    for option in options:  # a required option the file or environment gave is given
        if option.dest in layered:
            option.action.required = False
    args = parser.parse_args(argv)
    setattr(args, SOURCES_DEST, sources)
    logger.info("effective configuration (flag > env > file > default):\n  %s",
                "\n  ".join(describe(args)))  # fmt: skip
    return args


def command_parser(
    parser: argparse.ArgumentParser, name: str | None
) -> argparse.ArgumentParser | None:
    """The subcommand's own parser, where its options live."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _other_commands_variables(
    parser: argparse.ArgumentParser, command: argparse.ArgumentParser
) -> frozenset[str]:
    """The variables of the other configurable commands' options (not also ``command``'s)."""
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for other in set(action.choices.values()) - {command}:
                if is_configurable(other):
                    names.update(option.env for option in options_of(other))
    return frozenset(names - {option.env for option in options_of(command)})


def _given_on_command_line(parser, command, options, argv) -> set[str]:
    """The dests the command line itself sets: parse once with every default a sentinel."""
    saved = {option.dest: option.action.default for option in options}
    required = {option.dest: option.action.required for option in options}
    try:
        for option in options:
            option.action.required = False
        command.set_defaults(**dict.fromkeys(saved, _UNSET))
        args = parser.parse_args(argv)
    finally:
        command.set_defaults(**saved)
        for option in options:
            option.action.required = required[option.dest]
    return {dest for dest in saved if getattr(args, dest, _UNSET) is not _UNSET}


def read_file(path: Path, options: Sequence[Option]) -> dict[str, object]:
    """The options a TOML file sets, by dest, checked; ConfigError names the file and key."""
    try:
        with path.open("rb") as file:
            data = file.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from exc
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: over {_MAX_CONFIG_BYTES} bytes")
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from exc
    by_key = {option.key: option for option in options}
    values = {}
    for key, value in table.items():
        option = by_key.get(key)
        if option is None:
            raise ConfigError(f"config file {path}: unknown key {key!r}{_hint(key, by_key)}")
        try:
            values[option.dest] = _from_toml(option, value)
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: key {key!r}: {exc}") from None
    return values


def read_environment(
    environ: Mapping[str, str], options: Sequence[Option], others: frozenset[str] = frozenset()
) -> dict[str, tuple[object, str]]:
    """The options ``FUSIONLLM_*`` variables set, by dest: (value, variable name); ``others``:
    variables of other commands, skipped."""
    by_env = {option.env: option for option in options}
    values = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        if name in others:
            logger.debug("%s is another command's option; not this one's", name)
            continue
        option = by_env.get(name)
        if option is None:
            raise ConfigError(f"environment variable {name}: no such option{_hint(name, by_env)}")
        try:
            values[option.dest] = (_from_text(option, text), name)
        except ConfigError as exc:
            raise ConfigError(f"environment variable {name}={text!r}: {exc}") from None
    return values


def _hint(name: str, known: Mapping[str, Option]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _from_text(option: Option, text: str) -> object:
    if option.is_flag:
        word = text.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ConfigError("expected true/false (1/0, yes/no, on/off)")
        return _switch(option, word in _TRUE)
    if option.is_list:
        items = [_scalar(option, item) for item in text.split()]
        if not items:
            raise ConfigError("expected one or more values, separated by spaces")
        return items
    return _scalar(option, text)


def _from_toml(option: Option, value: object) -> object:
    if option.is_flag:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {type(value).__name__}")
        return _switch(option, value)
    if option.is_list:
        if not isinstance(value, list) or not value:
            raise ConfigError(f"expected a non-empty list, got {type(value).__name__}")
        return [_toml_scalar(option, item) for item in value]
    return _toml_scalar(option, value)


def _switch(option: Option, on: bool) -> bool:
    """What the flag's dest holds when the switch is on or off (store_false inverts)."""
    return option.action.const if on else option.action.default


def _toml_scalar(option: Option, value: object) -> object:
    kind = option.action.type
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"expected {_kind_name(kind)}, got {type(value).__name__}")
    if kind is int:
        if not isinstance(value, int):
            raise ConfigError(f"expected an integer, got {value!r}")
    elif kind is float:
        value = float(value)
    elif not isinstance(value, str):
        raise ConfigError(f"expected a string, got {type(value).__name__}")
    elif kind not in (None, str):  # a custom type parses the flag's own text
        return _scalar(option, value)
    return _checked_choice(option, value)


def _scalar(option: Option, text: str) -> object:
    kind = option.action.type
    try:
        value = text if kind is None else kind(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"expected {_kind_name(kind)}: {exc}") from None
    return _checked_choice(option, value)


def _checked_choice(option: Option, value: object) -> object:
    choices = option.action.choices
    if choices is not None and value not in choices:
        raise ConfigError(f"{value!r} is not one of {', '.join(map(str, choices))}")
    return value


def _kind_name(kind) -> str:
    return {int: "an integer", float: "a number", None: "a string", str: "a string"}.get(
        kind, "a value"
    )


def describe(args: argparse.Namespace) -> list[str]:
    """One line per option, ``name = value (source)``, for the log at start."""
    sources = getattr(args, SOURCES_DEST, {})
    lines = []
    for dest in sorted(sources):
        # Values only: a secret lives in a file, and the file's path is what an option holds.
        lines.append(f"{dest.replace('_', '-')} = {getattr(args, dest, None)!r} ({sources[dest]})")
    return lines
