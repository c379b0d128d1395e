"""Any registered experiment: ``python -m realflow.apps.main experiment=NAME [--import MOD] [key=value ...]``."""
import sys

from realflow.apps.launch import main as launch_main


def main(argv=None) -> int:
    return launch_main(None, argv, app="main")


if __name__ == "__main__":
    sys.exit(main())
