"""Everything a run writes stays inside its output root (issue 22, item 4).

Names with separators or ``..`` are refused where they are set; a symlink in an existing run
directory that leads out of ``fileroot`` is refused before anything is written, and the
writers themselves (checkpoints, recover points) resolve their target before writing.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from realflow.base.output_paths import OutputPathError, check_tree_inside, ensure_inside, output_root

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "realflow.apps.main_sft", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_paths_resolve_inside_the_root_or_are_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    (root / "exp" / "trial").mkdir(parents=True)
    outside.mkdir()
    assert output_root(str(root / "exp" / "trial")) == str(root)
    assert ensure_inside(str(root / "exp" / "trial" / "new" / "file"), str(root)).startswith(str(root))
    with pytest.raises(OutputPathError, match="outside the output root"):
        ensure_inside(str(root / "exp" / ".." / ".." / "x"), str(root))
    (root / "exp" / "trial" / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OutputPathError, match=r"checkpoint .*resolves to .*elsewhere.*a symlink on the way"):
        ensure_inside(str(root / "exp" / "trial" / "checkpoints" / "actor"), str(root), "checkpoint")
    with pytest.raises(OutputPathError, match="run directory entry"):
        check_tree_inside(str(root / "exp" / "trial"), str(root))
    # a symlink that stays inside is fine, and so is a root that is itself a symlink
    (root / "exp" / "trial" / "checkpoints").unlink()
    (root / "shared").mkdir()
    (root / "exp" / "trial" / "logs").symlink_to(root / "shared", target_is_directory=True)
    check_tree_inside(str(root / "exp" / "trial"), str(root))
    link_root = tmp_path / "link_root"
    link_root.symlink_to(root, target_is_directory=True)
    check_tree_inside(str(link_root / "exp" / "trial"), str(link_root))


def test_a_run_refuses_names_and_symlinks_that_lead_out(tmp_path):
    fileroot, outside = tmp_path / "out", tmp_path / "victim"
    outside.mkdir()
    res = _main(f"fileroot={fileroot}", "trial_name=a/../../escape", "--dry-run")
    assert res.returncode == 2 and "trial_name='a/../../escape'" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "escape").exists() and not (fileroot / "escape").exists()
    res = _main(f"fileroot={fileroot}", "experiment_name=..", "--dry-run")
    assert res.returncode == 2 and "experiment_name='..'" in res.stderr, res.stderr[-2000:]
    run_dir = fileroot / "sft" / "trial0"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(outside, target_is_directory=True)
    res = _main(f"fileroot={fileroot}", "--dry-run")
    assert res.returncode == 2, res.stdout[-2000:]
    assert "resolves to" in res.stderr and "outside the output root" in res.stderr and "checkpoints" in res.stderr
    assert os.listdir(outside) == []
