"""Example user packages: algorithms and agents written against realflow's public API only
(loaded with ``--import examples.<package>``; nothing here is imported by realflow itself)."""
