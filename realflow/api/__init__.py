"""Public contracts of realflow: everything a user's experiment, graph or
interface touches, and everything the runtime knows about them.

registry (named extension points), mfc (MFCDef), dfg (DataFlowGraph), interface
(ModelInterface), batch (SequenceBatch), allocation (placement strings), experiment
(the experiment config contract), config_values (how a config field's value is typed and
travels as plain data), dataset (the data-set contract: ``DatasetSpec``-level format
registry). Import the submodules directly; this package imports nothing so that the
config parser (``realflow.config``) stays cheap (no torch).

Machinery lives elsewhere: the ``key=value``/``--config`` parser in ``realflow.config``,
tokenising data sets in ``realflow.data``, drawing in ``realflow.system.plan_draw``.
"""
