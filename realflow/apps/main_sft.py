"""Supervised fine-tuning: ``python -m realflow.apps.main_sft [--config FILE ...] [key=value ...]``.

With no arguments it trains a tiny Qwen2-architecture model from scratch on a
locally generated arithmetic task on 2 data-parallel CPU workers.
"""
import sys
from typing import Optional

from realflow.apps.launch import main as launch_main


def main(argv: Optional[list[str]] = None) -> int:
    """The console script's entry: ``--help`` lists every key and option; the exit code is the run's."""
    return launch_main("sft", argv, app="main_sft")


if __name__ == "__main__":
    sys.exit(main())
