"""Checks of command-line values that argparse and the library do not make: counts in range, and output paths that
can be written, checked before any work starts so that a bad path costs nothing and leaves nothing behind."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import ConfigError
from ..train.files import CONFIG


def count(minimum: int):
    """argparse ``type=`` for an integer of at least ``minimum``."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, but it must be an integer of at least {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"got {value}, but it must be at least {minimum}")
        return value

    convert.__name__ = "int"
    return convert


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def output_dir(path: str | Path, what: str) -> Path:
    """``path`` as a directory that exists or can be created and written, else ConfigError naming ``what``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file; give a directory (it is created if missing).")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ConfigError(f"{what} {path} lies under the file {base}; give a directory path.")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} cannot be written ({base} is not writable); choose a writable directory.")
    return path


def output_file(path: str | Path, what: str) -> Path:
    """``path`` as a file that can be written (missing folders are created), else ConfigError naming ``what``."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; give a file path, such as {path / 'out'}.")
    base = _nearest_existing(path.absolute().parent)
    if not base.is_dir():
        raise ConfigError(f"{what} {path} lies under the file {base}; give a path in a folder.")
    if not os.access(base, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{what} {path} cannot be written (permission denied); choose a writable path.")
    return path


def run_dir(path: str | Path) -> Path:
    """``path`` if it looks like a run directory (it has a config.yaml), else ConfigError; checked before torch loads."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ConfigError(f"{path} is not a run directory (it has no config.yaml); give a directory made by "
                          "attnlab train.")
    return path
