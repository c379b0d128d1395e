"""The config parser: ``key=value`` overrides and ``--config`` files into experiment dataclasses.

* :mod:`.cli` -- the command line (``parse_overrides``, ``parse_cli``, presets, ``--help``);
* :mod:`.files` -- YAML/JSON config files, and the resolved ``config.yaml`` a run writes.

The configs themselves are contracts and live in ``realflow.api`` (the experiment
dataclasses in :mod:`realflow.api.experiment`; the typed value rules, ``ConfigError`` and
the plain-data form workers rebuild configs from in :mod:`realflow.api.config_values`).
This package imports ``realflow.api`` only, and no torch: every entry point (the apps, the
per-role process entry point) parses with it.
"""
