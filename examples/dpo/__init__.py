"""DPO as a user package: ``--import examples.dpo`` registers the graph ``dpo``, the interface
``dpo``, the preference data source and the experiment ``dpo`` (see examples/dpo/experiment.py)."""
import examples.dpo.experiment  # noqa: F401  (experiment "dpo")
import examples.dpo.graph  # noqa: F401  (graph "dpo")
import examples.dpo.interface  # noqa: F401  (interface "dpo")
import examples.preference  # noqa: F401  (format and data source "preference")
import mfc.ppo_critic  # noqa: F401  (the built-in interface "ppo_ref" the graph's ref_inf uses)
