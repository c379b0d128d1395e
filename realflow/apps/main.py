"""The ``realflow`` command: run any registered experiment, or one of the tools.

    realflow [run] experiment=NAME [--config FILE ...] [key=value ...]   # any experiment (run may be left out)
    realflow plot RUN_DIR [--out DIR]                                   # a run's plots (realflow.apps.plot)
    realflow calibrate [--out FILE] [--quick]                           # this machine's device profile
    realflow plan model=... cluster=... experiment=...                  # search allocations
    realflow doctor mismatch RUN_DIR [--step N]                         # why gen and trainer log-probs differ
    realflow help [COMMAND]                                             # the commands, or one command's help

``python -m realflow.apps.main`` is the same command.  The tools are dispatched on the
first word before anything else is imported (plotting needs neither torch nor the
experiments); a first word that is neither a command nor an option nor ``key=value`` is a
one-line error naming the closest command.
"""
from __future__ import annotations

import re
import sys
from typing import Callable, Optional

#: every command with its one line for ``realflow --help`` and how to get its own help
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run an experiment (the word run may be left out): realflow run experiment=NAME [key=value ...]",
            "realflow run experiment=NAME --help"),
    "plan": ("the fastest allocations of an experiment on a real or described cluster", "realflow plan --help"),
    "plot": ("draw a run's stats to PNG files: realflow plot RUN_DIR", "realflow plot --help"),
    "calibrate": ("measure this machine's device profile for the planner", "realflow calibrate --help"),
    "doctor": ("find why the generator's log-probs differ from the trainer's: realflow doctor mismatch RUN_DIR",
               "realflow doctor --help"),
    "help": ("this text; realflow help COMMAND shows that command's help", "realflow help"),
}
#: the commands that are tools (each one's main imported only when asked for)
TOOLS = ("plot", "calibrate", "plan", "doctor")
#: the one-word entry points of the built-in experiments (setup.py console scripts)
ENTRY_POINTS = {"realflow-sft": "sft", "realflow-sync-ppo": "grpo-math", "realflow-async-ppo": "async-grpo-math"}


def _tool(name: str) -> Callable[[list[str]], int]:
    """A tool's ``main``, imported only when it is the one asked for."""
    if name == "plot":
        from realflow.apps.plot import main as tool
    elif name == "calibrate":
        from realflow.apps.calibrate import main as tool
    elif name == "doctor":
        from realflow.apps.doctor import main as tool
    else:
        from realflow.apps.plan import main as tool
    return tool


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argv[0] if argv else None
    if first in TOOLS:
        return _tool(first)(argv[1:])
    if first is None or first == "help":
        return _help(argv[1:])
    if first == "run":
        argv = argv[1:]
    elif not first.startswith("-") and "=" not in first:
        return _unknown_command(first)
    if _top_level_help(argv):  # `realflow --help`: no experiment named, so the commands
        return _help([], imports=_imports(argv))
    from realflow.apps.launch import main as launch_main

    return launch_main(None, argv, app="main")


def _top_level_help(argv: list[str]) -> bool:
    """--help asked and nothing names an experiment (neither experiment= nor a --config file)."""
    return (any(a in ("-h", "--help") for a in argv) and not any(a.startswith("experiment=") for a in argv)
            and not any(a == "--config" or a.startswith("--config=") for a in argv))


def _imports(argv: list[str]) -> list[str]:
    mods = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--import"]
    return mods + [a.split("=", 1)[1] for a in argv if a.startswith("--import=")]


def _help(topic: list[str], imports: Optional[list[str]] = None) -> int:
    """``realflow help``: every command and experiment; ``realflow help X``: X's own help."""
    if topic and topic[0] in TOOLS:
        return _tool(topic[0])(["--help"])
    names = _experiments(imports or [])
    if names is None:
        return 2
    if topic and topic[0] not in ("run", "help"):
        if topic[0] in names:
            from realflow.apps.launch import main as launch_main

            return launch_main(topic[0], ["--help"], app="main")
        return _unknown_command(topic[0], names)
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: realflow COMMAND [ARGS ...]",
             "       realflow [run] experiment=NAME [--config FILE ...] [key=value ...] "
             "[--check | --dry-run | --print-config]",
             "", "RL post-training of LLMs: an experiment's graph of model calls, placed on processes and devices.",
             "", "commands:"]
    for name, (what, how) in COMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {what}")
        if name != "help":
            lines.append(f"  {' ' * width}  help: {how}")
    exp_width = max([len(n) for n in names] + [4])
    lines += ["", "experiments (realflow run experiment=NAME; their keys: realflow run experiment=NAME --help):"]
    for name in names:
        lines.append(f"  {name.ljust(exp_width)}  {_summary(name)}")
    lines += ["", "one-word entry points: " + ", ".join(f"{ep} = experiment={exp}" for ep, exp in ENTRY_POINTS.items()),
              "your own experiments: realflow run experiment=NAME --import MY_PACKAGE"]
    print("\n".join(lines))
    return 0


def _experiments(imports: list[str]) -> Optional[list[str]]:
    """The registered experiment names (built-in ones and those of ``imports``); None after a one-line error."""
    from realflow.api.experiment import experiment_registry
    from realflow.config.cli import ConfigError
    from realflow.plugins import load_plugins

    try:
        load_plugins(imports)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return experiment_registry.names()


def _summary(name: str) -> str:
    """The first sentence of an experiment config's docstring: one line of ``realflow --help``."""
    from realflow.api.experiment import experiment_registry

    doc = " ".join((experiment_registry.get(name).__doc__ or "").strip().split("\n\n")[0].split())
    if doc.startswith(experiment_registry.get(name).__name__ + "("):  # the signature dataclasses generates
        return ""
    sentence = re.sub(r"\s*\(see [^)]*\)", "", doc.split(". ")[0]).rstrip(".")
    return sentence if len(sentence) <= 100 else sentence[:97] + "..."


def _unknown_command(word: str, experiments: Optional[list[str]] = None) -> int:
    """One line: the closest command, else (a registered experiment's name) how to run it."""
    from realflow.api.registry import closest

    hint = closest(word, list(COMMANDS))
    if hint:
        msg = f"did you mean {' or '.join(hint)}?"
    else:
        names = experiments if experiments is not None else (_experiments([]) or [])
        near = [word] if word in names else closest(word, names, n=1)
        msg = (f"to run experiment {near[0]!r}: realflow run experiment={near[0]}" if near
               else f"commands: {', '.join(COMMANDS)}; key=value items configure an experiment")
    print(f"error: unknown command {word!r}; {msg} (realflow --help lists them)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
