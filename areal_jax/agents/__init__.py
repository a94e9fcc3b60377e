"""Agentic RL: an OpenAI-compatible proxy in front of the generator that records the exact tokens of every
turn, and the `agent` rollout workflow that runs a user's agent against it (docs/agents.md)."""
