"""Allocation planning: device profiles, a cost model, a simulator and a search.

``realflow calibrate`` measures a device profile (:mod:`.calibrate`); :mod:`.simulate`
predicts an allocation's MFC times, hooks, transfers, memory and step time through the
plan compiler the runtime uses (:func:`realflow.system.plan.compile_plan`); :mod:`.search`
ranks allocations (``realflow plan``, ``allocation=auto``).
"""
