"""Everything a run writes stays inside its output root (``fileroot``).

Why resolve and not only check names: experiment and trial names are already refused when
they hold a separator or ``..``, but a symlink inside the run directory (``checkpoints ->
/elsewhere``, left by a user or a previous job) would still send checkpoints, logs or recover
points out of the tree the user chose -- onto another job's files or a full disk. Every
writer resolves its target (symlinks followed) and refuses a path that lands outside.
"""
from __future__ import annotations

import os


class OutputPathError(ValueError):
    """A path a run would write resolves outside the run's output root."""


def output_root(run_dir: str) -> str:
    """The output root of a run directory ``<fileroot>/<experiment>/<trial>``."""
    return os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))


def ensure_inside(path: str, root: str, what: str = "output") -> str:
    """``path`` with symlinks resolved, if it lies inside ``root`` (also resolved); else
    :class:`OutputPathError` naming both. Parts that do not exist yet resolve as written."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        hint = " (a symlink on the way?)" if real != os.path.abspath(path) else ""
        raise OutputPathError(f"{what} {path} resolves to {real}, outside the output root {real_root}{hint}; "
                              f"refusing to write there")
    return real


def check_tree_inside(top: str, root: str, what: str = "run directory") -> None:
    """Refuse ``top`` or any symlink below it that resolves outside ``root`` (before a run
    writes into a directory that already exists)."""
    ensure_inside(top, root, what)
    if not os.path.isdir(top):
        return
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                ensure_inside(p, root, f"{what} entry")
