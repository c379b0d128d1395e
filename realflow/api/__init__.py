"""Public contracts of realflow: everything a user's experiment, graph or
interface touches, and everything the runtime knows about them.

registry (named extension points), mfc (MFCDef), dfg (DataFlowGraph), interface
(ModelInterface), batch (SequenceBatch), allocation (placement strings), config
(command-line dataclass configs). Import the submodules directly; this package
imports nothing so that ``realflow.api.config`` stays cheap (no torch).
"""
