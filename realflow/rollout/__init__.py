"""The rollout side of asynchronous PPO: generation servers, the rollout controller, rollout workers.

It depends on ``realflow.api``, ``realflow.comm`` and ``realflow.base`` only; the trainer
(``realflow.system``) learns about trajectories through the data plane and batch type
it already uses (see :mod:`realflow.api.rollout`).
"""
