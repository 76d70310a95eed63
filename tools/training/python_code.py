"""The standard library's Python files, split into training and held-out by a hash of their path relative
to the stdlib root: the code specialist (fusion.tools.training.python_functions) and the router's mix
draw from the training files only, so bits per byte on held-out Python are measured on whole files no
training read.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELD_OUT_PERCENT = 5


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def stdlib_files(*, held_out: bool) -> list[Path]:
    """The stdlib's .py files (no site-packages), sorted, from one side of the split."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/"):
            continue
        if is_held_out(rel) == held_out:
            files.append(path)
    return files
