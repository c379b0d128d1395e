"""Asynchronous PPO / GRPO: ``python -m realflow.apps.main_async_ppo [--config FILE ...] [key=value ...]``.

With no arguments it runs ``async-grpo-math`` on CPU: the SFT default's checkpoint
(trained first if absent) improved with asynchronous GRPO, one generation server and
one trainer process (``allocation="gen:d1+train:d1"``), staleness bounded by
``rollout.max_head_offpolicyness`` and weights pushed to the server in memory after
every step. ``--help`` lists every field; ``--dry-run`` prints the plan and draws it.
"""
import sys
from typing import Optional

from realflow.apps.launch import main as launch_main


def main(argv: Optional[list[str]] = None) -> int:
    """The console script's entry: ``--help`` lists every key and option; the exit code is the run's."""
    return launch_main("async-grpo-math", argv, app="main_async_ppo")


if __name__ == "__main__":
    sys.exit(main())
