"""Agents that know nothing about the trainer: plain async functions using the official
``openai`` client against realflow's OpenAI-compatible proxy (see README, "Agents")."""
