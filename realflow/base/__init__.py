"""Process-level utilities shared by every realflow component: logging, stats, tracing,
seeding, networking, name resolution. Import submodules directly; this package imports
nothing on purpose, so that small processes (watchdogs, name-resolve clients) stay light."""
