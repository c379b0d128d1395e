"""Any registered experiment: ``python -m realflow.apps.main experiment=NAME [--import MOD] [key=value ...]``.

``realflow plot RUN_DIR [--out DIR]`` draws a run's plots instead (:mod:`realflow.apps.plot`);
it is dispatched before the experiment's command line is parsed, so no experiment is imported.
"""
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:  # imported here: plotting needs neither torch nor the experiments
        from realflow.apps.plot import main as plot_main

        return plot_main(argv[1:])
    from realflow.apps.launch import main as launch_main

    return launch_main(None, argv, app="main")


if __name__ == "__main__":
    sys.exit(main())
