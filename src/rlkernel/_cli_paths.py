"""Checks of the ``rlkernel`` commands' path arguments, made before any work starts.

A command that writes its results at the end (``bench`` after the whole suite, ``consistency``
after every model run) must not discover an unusable ``--out``/``--json`` only then, and a
``--model`` that is not a local checkpoint must not reach Hugging Face's loader (which reads a
missing path as a Hub repo id and fails with "Repo id must be ..."). Each check returns ``None``
or one line saying what is wrong; the command prints ``rlkernel <cmd>: error: <line>`` and exits 2.

Writability is judged without creating anything: the nearest existing ancestor of a folder to be
created must be a folder we may write to (``os.access``; a read-only file system counts, file
permission bits do not stop root).
"""

from __future__ import annotations

import os
from pathlib import Path


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a file below which nothing can be created
    also "exists": ``/dev/null`` for ``/dev/null/x``)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _writable_dir(p: Path) -> bool:
    return os.access(p, os.W_OK | os.X_OK)


def output_dir_problem(option: str, path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (created and) used as an output folder, or ``None``."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            return f"{option} {path}: exists and is not a folder"
        if not _writable_dir(path):
            return f"{option} {path}: the folder is not writable"
        return None
    base = _nearest_existing(path)
    if not base.is_dir():
        return f"{option} {path}: cannot create a folder there ({base} is not a folder)"
    if not _writable_dir(base):
        return f"{option} {path}: cannot create a folder there ({base} is not writable)"
    return None


def output_file_problem(option: str, path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be written as a file (its folder must exist), or ``None``."""
    path = Path(path)
    if path.is_dir():
        return f"{option} {path}: is a folder, expected a file path"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{option} {path}: the file is not writable"
    parent = path.absolute().parent
    if not parent.exists():
        base = _nearest_existing(parent)
        reason = f"{base} is not a folder" if not base.is_dir() else f"{parent} does not exist"
        return f"{option} {path}: cannot write a file there ({reason})"
    if not parent.is_dir():
        return f"{option} {path}: cannot write a file there ({parent} is not a folder)"
    if not _writable_dir(parent):
        return f"{option} {path}: cannot write a file there ({parent} is not writable)"
    return None


def input_dir_problem(option: str, path: str | os.PathLike, *, must_contain: str | None = None) -> str | None:
    """Why ``path`` is not an existing folder (holding ``must_contain``, if given), or ``None``."""
    path = Path(path)
    if not path.exists():
        return f"{option} {path}: no such folder"
    if not path.is_dir():
        return f"{option} {path}: is not a folder"
    if must_contain is not None and not (path / must_contain).is_file():
        return f"{option} {path}: the folder has no {must_contain}"
    return None


def input_file_problem(option: str, path: str | os.PathLike, *, writable: bool = False) -> str | None:
    """Why ``path`` is not an existing (and, with ``writable``, writable) file, or ``None``."""
    path = Path(path)
    if not path.exists():
        return f"{option} {path}: no such file"
    if path.is_dir():
        return f"{option} {path}: is a folder, expected a file"
    if writable and not os.access(path, os.W_OK):
        return f"{option} {path}: the file is not writable"
    return None


def first_problem(*problems: str | None) -> str | None:
    """The first of ``problems`` that is not ``None``."""
    return next((p for p in problems if p is not None), None)
