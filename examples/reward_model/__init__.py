"""Reward-model training as a user package: ``--import examples.reward_model`` registers the
graph ``reward_model``, the interface ``bradley_terry``, the preference data source and the
experiment ``reward-model`` (see the README, "Write your own algorithm")."""
import examples.preference  # noqa: F401  (format and data source "preference")
import examples.reward_model.experiment  # noqa: F401  (experiment "reward-model")
import examples.reward_model.graph  # noqa: F401  (graph "reward_model")
import examples.reward_model.interface  # noqa: F401  (interface "bradley_terry")
