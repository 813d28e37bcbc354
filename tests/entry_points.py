"""Run the console scripts and example scripts in this process, as a shell would run them.

Starting Python, torch, Lightning and transformers costs several seconds per process on the CI machine;
an in-process run costs under one. The console scripts are the functions ``pyproject.toml`` names, and
``sys.argv`` is what the shell would pass. Logging set up by a Hydra run is undone afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import runpy
import shlex
import sys
from collections.abc import Iterator

CONSOLE_SCRIPTS = {
    "megatrain-train": "megatrain_lightning.train:main",
    "megatrain": "megatrain_lightning.cli:main",
}


@contextlib.contextmanager
def _restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    loggers = {n: logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")}
    saved = {n: (list(lg.handlers), lg.propagate, lg.level) for n, lg in loggers.items()}
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, (hs, propagate, lvl) in saved.items():
            loggers[name].handlers[:] = hs
            loggers[name].propagate = propagate
            loggers[name].setLevel(lvl)


def run_command(command: str | list[str]) -> int:
    """Run ``megatrain-train ...``, ``megatrain ...`` or ``python SCRIPT ...``; return its exit code."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    program, args = argv[0], argv[1:]
    if program in ("python", "python3"):
        target, script_args = args[0], args[1:]
    elif program in CONSOLE_SCRIPTS:
        target, script_args = CONSOLE_SCRIPTS[program], args
    else:
        raise ValueError(f"not a console script or python script: {program!r}")
    old_argv = sys.argv
    sys.argv = [program if target in CONSOLE_SCRIPTS.values() else target, *script_args]
    try:
        with _restored_logging():
            if target in CONSOLE_SCRIPTS.values():
                module, func = target.split(":")
                __import__(module)
                getattr(sys.modules[module], func)()
            else:
                runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = old_argv
    return 0
