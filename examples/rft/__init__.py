"""Rejection-sampling fine-tuning as a user package: ``--import examples.rft`` registers the graph
``rft``, the interface ``rft`` and the experiment ``rft`` (see examples/rft/experiment.py)."""
import examples.rft.experiment  # noqa: F401  (experiment "rft")
import examples.rft.graph  # noqa: F401  (graph "rft")
import examples.rft.interface  # noqa: F401  (interface "rft")
import mfc.ppo_actor  # noqa: F401  (the built-in interfaces its graph uses by name)
import mfc.rule_reward  # noqa: F401
