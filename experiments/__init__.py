"""Built-in experiments. Importing this package registers them, together with the
graph builders, MFC interfaces and model backends they use."""
import graphs.grpo  # noqa: F401  (registers the "grpo" graph)
import graphs.ppo  # noqa: F401  (registers the "ppo" graph)
import graphs.sft  # noqa: F401  (registers the "sft" graph)
import mfc.ppo_actor  # noqa: F401  (registers the "ppo_actor" interface)
import mfc.ppo_critic  # noqa: F401  (registers "ppo_critic" and "ppo_ref")
import mfc.rule_reward  # noqa: F401  (registers the "rule_reward" interface)
import mfc.sft  # noqa: F401  (registers the "sft" interface)
import parallel.backend  # noqa: F401  (registers the "megatron" backend)
import experiments.ppo_math  # noqa: F401  (registers "ppo-math" and "grpo-math")
import experiments.sft  # noqa: F401  (registers the "sft" experiment)
