"""The rollout side: workflows that turn prompts into trajectories (`workflow.py`; the ids after a model turn:
`turns.py`), the rewards and environments they consult (`environments.py`), and admission control (`staleness.py`)."""
