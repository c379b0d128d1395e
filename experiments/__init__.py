"""Built-in experiments. Importing this package registers them, together with the
graph builders, MFC interfaces and model backends they use."""
import graphs.sft  # noqa: F401  (registers the "sft" graph)
import mfc.sft  # noqa: F401  (registers the "sft" interface)
import parallel.backend  # noqa: F401  (registers the "megatron" backend)
import experiments.sft  # noqa: F401  (registers the "sft" experiment)
