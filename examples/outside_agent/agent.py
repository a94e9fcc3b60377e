"""An agent in its own process that trains the policy of a run with `rollout.workflow.kind: external`.

It pulls tasks from the run's proxy (`GET /v1/tasks/next`; 429 means "later", after Retry-After), runs each
task as one episode with the `openai` client pointed at the episode's base URL, scores the reply itself and
ends the episode with its reward (`POST /sessions/<id>/end {"reward": r}`). It runs `--concurrency` episodes
at once. Started by itself, beside `areal-jax train`:

    python examples/outside_agent/agent.py --url http://127.0.0.1:8010 --concurrency 2

`--log FILE` writes one JSON line per event (claimed, ended, end_refused) with the episode's group id, sample
index and session id. The agent waits for the proxy to come up (the run compiles first), and exits once it has
been unreachable for `--give-up-s` seconds after that (the run ended). docs/agents.md describes the routes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import openai


class EventLog:
    """One JSON line per event, flushed at once (a killed agent leaves every line it wrote)."""

    def __init__(self, path: Path | None):
        self.file = path.open("a", encoding="utf-8") if path is not None else None

    def write(self, event: str, task: dict[str, Any], **fields: Any) -> None:
        if self.file is None:
            return
        row = {"event": event, "time": time.time(), "group_id": task["group_id"], "sample_index": task["sample_index"]}
        self.file.write(json.dumps({**row, "session_id": task["session_id"], **fields}) + "\n")
        self.file.flush()


def score(reply: str, answer: str | None) -> float:
    """The episode's reward: 1 when the reply's first line is the task's answer, 0.5 when the answer is
    elsewhere in it (partial credit), else 0."""
    if not answer:
        return 0.0
    first_line = reply.strip().splitlines()[0].strip() if reply.strip() else ""
    return 1.0 if first_line == answer.strip() else 0.5 if answer.strip() in reply else 0.0


async def run_episode(http: httpx2.AsyncClient, task: dict[str, Any], args: argparse.Namespace, log: EventLog) -> None:
    log.write("claimed", task)
    client = openai.AsyncOpenAI(base_url=task["base_url"], api_key="outside-agent", max_retries=0, http_client=http)
    response = await client.chat.completions.create(model="policy", messages=task["messages"])
    reply = response.choices[0].message.content or ""
    await asyncio.sleep(args.work_s)  # the agent's own work before it answers (its tools, a sandbox)
    reward = score(reply, task.get("answer"))
    ended = await http.post(task["end_url"], json={"reward": reward})
    if ended.status_code == 200:
        log.write("ended", task, reward=reward)
    else:  # the run released the episode's group (it ran past agent.episode_timeout_s)
        log.write("end_refused", task, status=ended.status_code)


async def worker(http: httpx2.AsyncClient, args: argparse.Namespace, log: EventLog) -> None:
    """Pull a task, run its episode, again, until the proxy has been gone for --give-up-s seconds."""
    reached, unreachable_since = False, None
    while True:
        try:
            answer = await http.get(f"{args.url}/v1/tasks/next")
        except httpx2.TransportError:
            unreachable_since = unreachable_since or time.monotonic()
            if reached and time.monotonic() - unreachable_since > args.give_up_s:
                return
            await asyncio.sleep(0.5)
            continue
        reached, unreachable_since = True, None
        if answer.status_code == 429:
            await asyncio.sleep(float(answer.headers.get("Retry-After", "1")))
            continue
        answer.raise_for_status()
        try:
            await run_episode(http, answer.json(), args, log)
        except (openai.APIConnectionError, httpx2.TransportError):
            continue  # the run went away mid-episode: the next pull finds out whether it comes back
        except openai.APIStatusError as err:
            print(f"episode refused: {err}", file=sys.stderr)


async def main(args: argparse.Namespace) -> None:
    log = EventLog(args.log)
    async with httpx2.AsyncClient(timeout=args.timeout_s) as http:
        await asyncio.gather(*(worker(http, args, log) for _ in range(args.concurrency)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the proxy, http://HOST:PORT (rollout.workflow.agent.port)")
    parser.add_argument("--concurrency", type=int, default=2, help="episodes run at once")
    parser.add_argument("--work-s", type=float, default=0.0, help="seconds of the agent's own work per episode")
    parser.add_argument(
        "--give-up-s", type=float, default=30.0, help="exit once the proxy is gone this long, having answered before"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="HTTP timeout of one request")
    parser.add_argument("--log", type=Path, default=None, help="append one JSON line per event to this file")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
