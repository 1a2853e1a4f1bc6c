"""Logging helpers: libraries only get loggers; entry points decide where the records go."""

import logging

_ROOT = "fusionllm"
_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def get_logger(module_name: str) -> logging.Logger:
    """The logger for one module, always under the ``fusionllm`` hierarchy.

    Modules call ``get_logger(__name__)``; names from an installed package already start with
    ``fusionllm.``, anything else (scripts, tests) is put under it so one switch controls all.
    """
    if module_name == _ROOT or module_name.startswith(_ROOT + "."):
        return logging.getLogger(module_name)
    return logging.getLogger(f"{_ROOT}.{module_name}")


def configure_logging(level: int | str = logging.INFO) -> None:
    """Send fusionllm's records to stderr; for command-line entry points, not libraries."""
    root = logging.getLogger(_ROOT)
    if not any(getattr(h, "_fusionllm", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._fusionllm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
