"""Any registered experiment: ``python -m realflow.apps.main experiment=NAME [--import MOD] [key=value ...]``.

``realflow plot RUN_DIR [--out DIR]`` draws a run's plots instead (:mod:`realflow.apps.plot`),
and ``realflow calibrate [--out FILE] [--threads N] [--world N] [--quick]`` measures this
machine's device profile for the planner (:mod:`realflow.apps.calibrate`); both are
dispatched before the experiment's command line is parsed, so no experiment is imported.
``realflow plan model=... cluster=... experiment=...`` searches allocations (:mod:`realflow.apps.plan`).
"""
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:  # imported here: plotting needs neither torch nor the experiments
        from realflow.apps.plot import main as plot_main

        return plot_main(argv[1:])
    if argv[:1] == ["calibrate"]:
        from realflow.apps.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv[:1] == ["plan"]:
        from realflow.apps.plan import main as plan_main

        return plan_main(argv[1:])
    from realflow.apps.launch import main as launch_main

    return launch_main(None, argv, app="main")


if __name__ == "__main__":
    sys.exit(main())
