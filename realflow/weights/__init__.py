"""Weight sync: how a new policy version travels from the trainer to the generation servers.

The pieces, in the order a version meets them:

* **what a version is** -- :mod:`.version`: ``WeightUpdate`` (a version and its weights as a
  shared-memory handle, a broadcast, or a checkpoint path), the ``publish_weights`` request
  the trainer's master sends (``publish_request``) and the one writer's answer
  (``writer_reply``); where disk sync writes (``checkpoint_dir``) and what it removes.
* **delta updates** -- :mod:`.delta`: a version as a manifest (base version, a named subset of
  tensors and 1 MiB blocks, digests); ``DeltaWriter`` (the writer's digests of its last version)
  and ``DeltaReceiver`` (a server's copy of the last applied version); the controller's plan
  names the base each way's receivers hold (:mod:`.broadcast_groups`).
* **how a writer publishes** (the trainer's writer model worker):
  :mod:`.publisher` (``WeightPublisher``: shared memory for servers on its host, a broadcast
  for the others; disk publishes are the interface's ``save``), :mod:`.broadcast_writer`
  (``WeightSender``: the background broadcast, one version in flight), :mod:`.broadcast`
  (``WeightGroup``: a standalone gloo group with the servers, ``GroupSpec``, ``TensorMeta``).
* **who receives how** (the rollout controller): :mod:`.broadcast_groups` (``WeightGroups``:
  who is in the broadcast group under which generation, and the receivers' side of a round),
  :mod:`.rounds` (``update_servers``: stage -> pause -> swap/update -> continue), driven by
  :class:`~realflow.rollout.controller.RolloutController`, which queues versions.
* **how a receiver stages and swaps** (a generation server): :mod:`.receiver` (``GroupSlot``:
  join the group, receive a version; its HTTP routes are
  :mod:`realflow.rollout.gen_server_weight_group`); shared-memory and disk updates and the
  staged swap are the server's ``load_weights`` and its backend's ``stage_weights_from_tensors``.

Dependencies: realflow/weights imports realflow/comm and realflow/base only; the servers the
rounds update are described by the protocols of :mod:`.servers`. The trainer
(``realflow.system``) and the rollout side (``realflow.rollout``) import it.
"""
