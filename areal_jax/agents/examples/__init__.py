"""Example agents for `rollout.workflow.kind: agent` (configs/recipes/agent_*.yaml)."""
