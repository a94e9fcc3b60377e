"""Reward functions: math verification, sandboxed code execution, synthetic tasks."""
