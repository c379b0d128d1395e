"""Weights & Biases as an optional third sink of :class:`realflow.base.stats.StatsLogger`.

TensorBoard and ``stats.jsonl`` stay the run's own record; W&B is for teams that compare
runs in one place. It is off unless ``wandb.mode`` says otherwise, and ``wandb`` is imported
only then, so the package stays an optional extra (``pip install -e ".[wandb]"``).

A relaunched run (resumed from a recover point) continues the same W&B run: the first
attempt stores the run id in ``<run_dir>/wandb_run_id`` and later attempts resume it.
W&B keeps steps monotonic, so rows of steps after the recover point that the failed
attempt already sent stay as that attempt logged them; the resumed run's rows for those
steps are dropped by W&B (``stats.jsonl`` and TensorBoard are rewound exactly).
"""
from __future__ import annotations

import os
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

WANDB_MODES = ("disabled", "online", "offline")
RUN_ID_FILE = "wandb_run_id"
_INSTALL_HINT = 'pip install -e ".[wandb]"'


@dataclass
class WandbConfig:
    """Where (and whether) a run's per-step stats also go to Weights & Biases."""

    mode: str = field(default="disabled", metadata={
        "help": "disabled | online | offline (offline: written under dir, upload later with `wandb sync`)"})
    project: str = field(default="realflow", metadata={"help": "W&B project"})
    entity: str = field(default="", metadata={"help": "W&B team or user ('' = the account's default)"})
    name: str = field(default="", metadata={"help": "run name ('' = <experiment>/<trial>)"})
    group: str = field(default="", metadata={"help": "run group, e.g. to compare seeds ('' = none)"})
    tags: list[str] = field(default_factory=list, metadata={"help": "run tags, a comma list"})
    dir: str = field(default="", metadata={"help": "where W&B writes its files ('' = the run directory)"})

    def __post_init__(self) -> None:
        # checked where the user sets it: a typo must not silently disable logging
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={self.mode!r} is not a mode; choose one of {', '.join(WANDB_MODES)}")

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


def check_installed(cfg: WandbConfig) -> None:
    """Fail in the launcher, in one line, when W&B is asked for but not installed (cheap: no import)."""
    import importlib.util

    if cfg.enabled and importlib.util.find_spec("wandb") is None:
        raise ImportError(f"wandb.mode={cfg.mode} needs the wandb package, which is not installed; "
                          f"install it with: {_INSTALL_HINT}")


def import_wandb() -> Any:
    """``import wandb``, or an ImportError that says how to install it."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"wandb.mode needs the wandb package, which is not installed ({e}); "
                          f"install it with: {_INSTALL_HINT}") from None
    return wandb


def run_id_for(run_dir: Path, resume: bool) -> tuple[str, bool]:
    """(W&B run id, whether it continues an earlier attempt's run).

    A fresh run gets a new id (and overwrites the file, so a new run of the same trial
    is a new W&B run); a resumed one reuses the stored id when there is one.
    """
    path = run_dir / RUN_ID_FILE
    if resume and path.exists():
        stored = path.read_text().strip()
        if stored:
            return stored, True
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id, False


class WandbSink:
    """One W&B run: started on construction, one ``log`` per stats row, finished on close."""

    def __init__(self, cfg: WandbConfig, run_dir: str | os.PathLike, default_name: str = "",
                 config: Optional[Mapping[str, Any]] = None, resume: bool = False) -> None:
        """``resume``: the run continues from a recover point, so reuse the stored run id."""
        if not cfg.enabled:
            raise ValueError("WandbSink needs wandb.mode online or offline")
        wandb = import_wandb()
        self.run_dir = Path(run_dir)
        self.run_id, resumed = run_id_for(self.run_dir, resume)
        wandb_dir = Path(cfg.dir or self.run_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=cfg.mode, project=cfg.project, entity=cfg.entity or None, name=cfg.name or default_name or None,
            group=cfg.group or None, tags=list(cfg.tags) or None, dir=str(wandb_dir), id=self.run_id,
            resume="allow" if resumed else None, config=dict(config or {}))

    def log(self, step: int, row: Mapping[str, float]) -> None:
        self._run.log(dict(row), step=step)

    def close(self, failed: bool = False) -> None:
        """Finish the run (a failed run is marked failed in W&B)."""
        self._run.finish(exit_code=1 if failed else 0)
