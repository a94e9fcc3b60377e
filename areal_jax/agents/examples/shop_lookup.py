"""A multi-step tool task: a shop's price list lives in the task (`metadata.prices`); the question asks for the
cost of a basket, so the model looks prices up (`lookup`) and adds them (`calculator`) before it answers.
The agent scores the episode itself: 1 when the last answer holds the right total, else 0.

`write_tasks` writes such tasks as jsonl (read them with the dataset fields `prompt: question`, `answer:
answer`, `metadata: [prices]`). `run` lets the model choose its tools; `run_tools_first` forces a lookup on
the first turn and a calculation on the second (the smoke recipe uses it with an untrained model).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from pathlib import Path
from typing import Any

from areal_jax.agents.examples.tools import answer_calls, ask, function_tool

MAX_TURNS = 5
ITEMS = ("apple", "pear", "plum", "fig", "kiwi", "lime", "date", "melon")
SYSTEM = "Answer with the total cost. Use lookup for prices and calculator for sums. End with 'Total: <number>'."
LOOKUP = function_tool("lookup", "The price of one item in this shop.", item="the item's name")
CALCULATOR = function_tool("calculator", "Evaluate an arithmetic expression.", expression="e.g. 3*2+4")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_TOTAL = re.compile(r"Total:\s*(-?\d+(?:\.\d+)?)")


def write_tasks(path: Path, rows: int, seed: int = 0) -> Path:
    """`rows` tasks: a price list of 4 items and a basket of 2 of them."""
    rng = random.Random(seed)
    lines = []
    for index in range(rows):
        prices = {item: rng.randint(1, 9) for item in rng.sample(ITEMS, 4)}
        basket = {item: rng.randint(1, 3) for item in rng.sample(sorted(prices), 2)}
        question = "What do " + " and ".join(f"{n} {item}s" for item, n in basket.items()) + " cost?"
        total = sum(prices[item] * n for item, n in basket.items())
        lines.append(json.dumps({"id": f"shop-{index}", "question": question, "answer": str(total), "prices": prices}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def calculate(expression: str) -> float:
    """The value of an expression of numbers, + - * / and parentheses (anything else raises ValueError)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as err:
        raise ValueError(str(err)) from None


def _tools(task: Any) -> dict[str, Any]:
    prices = task.metadata.get("prices") or {}

    async def lookup(arguments: dict[str, Any]) -> str:
        item = str(arguments.get("item", "")).strip().lower().removesuffix("s")
        return str(prices[item]) if item in prices else f"error: this shop sells {', '.join(sorted(prices))}"

    async def calculator(arguments: dict[str, Any]) -> str:
        try:
            return str(calculate(str(arguments.get("expression", ""))))
        except ValueError as err:
            return f"error: {err}"

    return {"lookup": lookup, "calculator": calculator}


async def _episode(client: Any, task: Any, forced: list[str]) -> float:
    tools = _tools(task)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    text = ""
    for turn in range(MAX_TURNS):
        choice = {"type": "function", "function": {"name": forced[turn]}} if turn < len(forced) else "auto"
        message = await ask(client, messages=messages, tools=[LOOKUP, CALCULATOR], tool_choice=choice)
        if message is None:
            break
        text = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        messages.extend(await answer_calls(message, tools))
    found = _TOTAL.findall(text)
    return float(bool(found) and float(found[-1]) == float(task.answer))


async def run(client: Any, task: Any) -> float:
    return await _episode(client, task, [])


async def run_tools_first(client: Any, task: Any) -> float:
    return await _episode(client, task, ["lookup", "calculator"])
