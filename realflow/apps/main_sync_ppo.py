"""Synchronous PPO / GRPO: ``python -m realflow.apps.main_sync_ppo [--config FILE ...] [key=value ...]``.

With no arguments it runs ``grpo-math``: the SFT default's checkpoint (trained first if
absent) improved with group-normalised PPO on the same arithmetic task, on 2 CPU
workers, training tensor-parallel and generating data-parallel. ``experiment=ppo-math``
runs actor-critic PPO with GAE instead.
"""
import sys
from typing import Optional

from realflow.apps.launch import main as launch_main


def main(argv: Optional[list[str]] = None) -> int:
    """The console script's entry: ``--help`` lists every key and option; the exit code is the run's."""
    return launch_main("grpo-math", argv, app="main_sync_ppo")


if __name__ == "__main__":
    sys.exit(main())
