"""The one process entry point of every role a scheduler starts.

    python -m realflow.apps.worker --role ROLE --index I --experiment NAME [--import MODULE ...] -- key=value ...

ROLE is one of :data:`ROLES`: the trainer's ``master`` and ``model_worker``
(:mod:`realflow.system.roles`), and the rollout side's ``gen_server``,
``rollout_controller`` and ``rollout_worker`` (:mod:`realflow.rollout.roles`). Every
process loads the plugins (:func:`realflow.plugins.load_plugins`: the built-in ones, the
installed entry points and the ``--import`` items), rebuilds the experiment from the same
command line (nothing is pickled between processes), finds its peers through name
resolution and authenticates with the experiment secret (a 0600 file named by
``REALFLOW_SECRET_FILE``).

The launcher (:func:`realflow.apps.launch.worker_requests`) builds every command line
with :func:`role_command`; the schedulers (local, Slurm, Ray) run them as they are.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Sequence

__all__ = ["ROLES", "TRAINER_ROLES", "ROLLOUT_ROLES", "role_command", "main"]

TRAINER_ROLES = ("master", "model_worker")
ROLLOUT_ROLES = ("gen_server", "rollout_controller", "rollout_worker")
ROLES = TRAINER_ROLES + ROLLOUT_ROLES


def role_command(role: str, index: int, experiment: str, imports: Sequence[str], overrides: Sequence[str]
                 ) -> list[str]:
    """The command line of one process: this module, its role and index, the experiment, the
    user's ``--import`` modules (the built-in plugins load by themselves) and the overrides."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")
    argv = [sys.executable, "-m", "realflow.apps.worker", "--role", role, "--index", str(index),
            "--experiment", experiment]
    for mod in imports:
        argv += ["--import", mod]
    return argv + ["--"] + list(overrides)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="realflow.apps.worker")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--experiment", required=True)
    p.add_argument("--import", dest="imports", action="append", default=[])
    args = p.parse_args(argv)
    if args.role in ROLLOUT_ROLES:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s {args.role}/{args.index} %(levelname)s %(message)s")
    import torch

    from realflow.comm.auth import secret_from_env
    from realflow.plugins import load_plugins

    torch.set_num_threads(int(os.environ.get("REALFLOW_NUM_THREADS", "1")))
    if args.role in ROLLOUT_ROLES:  # a clean exit: finally blocks release resources (servers, pools)
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    load_plugins(args.imports)
    if args.role in TRAINER_ROLES:
        from realflow.system import roles as trainer

        _, setup = trainer.build_setup(args.experiment, overrides)
        secret = secret_from_env()
        if args.role == "master":
            return trainer.run_master(setup, secret)
        return trainer.run_model_worker(setup, args.index, secret)
    from realflow.rollout import roles as rollout

    setup = rollout.rollout_setup(args.experiment, overrides)
    secret = secret_from_env()
    if args.role == "gen_server":
        return rollout.run_gen_server(setup, args.index, secret)
    if args.role == "rollout_controller":
        return rollout.run_controller(setup, secret)
    return rollout.run_rollout_worker(setup, args.index, secret, args.imports)


if __name__ == "__main__":
    sys.exit(main())
