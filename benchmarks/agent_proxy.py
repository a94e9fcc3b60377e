"""The agent proxy's overhead: the same multi-turn episodes through the OpenAI-compatible proxy (an agent on the
real `openai` client, `rollout.workflow.kind: agent`) and through the built-in multi-turn workflow.

Both run G groups of n episodes of T model turns on one generator and engine (the `--model` default, 12m, is
a 12M-parameter Qwen2 shape), all groups at once as the rollout controller keeps them; each turn samples up to
`max_new_tokens` tokens and the environment (built-in) or the agent (proxy) answers with the same fixed user
message. Every turn is seeded by (group, sample, turn) in every mode (the agents pass `seed` per turn, read
from their session id), so all modes generate the same tokens (`{mode}_tokens` shows it) and the ratio compares
the same work. Each episode asks for its first turn alone in every mode; the generator prefills a group's
shared prompt once (`GeneratorStats.shared_prefills`). The proxy path adds the `openai` client's work
(building the request, parsing the answer: about 1.4 ms of CPU a turn), the proxy's (JSON, the chat template's
rendering per turn, the session records) and, with `--transport http`, HTTP over the loopback. Each mode runs
`--repeats` times, alternating, after one untimed pass each; the best run of each counts. The proxy shortens
the interpreter's GIL switch interval (`agent.switch_interval_s`) when it starts, before the timed runs of
either mode, so both run under the same interval (printed).

A third mode, `raw`, runs the same agent without the `openai` client: it posts each turn's JSON body straight
to the proxy's handler (`AgentProxy.answer`, what both transports call) and reads the JSON answer, so
`ratio raw_vs_builtin` is the proxy's own cost (request parsing, the chat template, the session records, the
answer) and the gap between it and the headline is the `openai` client's.

`{mode}_cpu_seconds` is the process's CPU time over the run (all threads, XLA's included).

Prints `name: value unit` lines; the last is `ratio proxy_vs_builtin: X.XX` (generated tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import jax
from common import MODEL_100M, QWEN2_3M, QWEN2_12M
from flax import nnx

from areal_jax.agents.server import AgentProxy, Route
from areal_jax.agents.workflow import AgentWorkflow
from areal_jax.compilation_cache import enable_compilation_cache
from areal_jax.data.datasets import PromptRecord
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.seeds import mix_seed
from areal_jax.models.decoder import Decoder
from areal_jax.models.tokenizer import DEFAULT_ALPHABET, CharTokenizer
from areal_jax.rollout.agent_config import AgentConfig
from areal_jax.rollout.environments import EnvStep
from areal_jax.rollout.workflow import MultiTurnWorkflow, RolloutWorkflow, WorkflowConfig

REPLY = "1+1=2. (3)"
TURNS = 3
STOPS = "=.:"  # a turn of the random policy ends at one of these (about every 9th token) or at max_new_tokens
SEED = 7  # the episodes' sampling seed: each turn's, (group, sample, turn) mixed in, is the same in every mode
POLICIES = {"3m": QWEN2_3M, "12m": QWEN2_12M, "100m": MODEL_100M}


class FixedReply:
    """The built-in workflow's environment: the same reply after every turn, reward 0."""

    def step(self, task: Any, history: Any, completion: str) -> EnvStep:
        return EnvStep(reply=REPLY, reward=0.0, done=False)


def session_id(base_url: Any) -> str:
    """The session of the episode whose client has `base_url` (`.../sessions/<id>/v1`)."""
    return str(base_url).rstrip("/").split("/sessions/")[1].split("/")[0]


def turn_seed(base_url: Any, turn: int) -> int:
    """The seed the built-in workflow gives this episode's turn: the session id is `g{group}-s{sample}-<random>`."""
    group, sample = session_id(base_url).split("-")[:2]
    return mix_seed(SEED, int(group[1:]), int(sample[1:]), turn)


async def fixed_reply_agent(client: Any, task: Any) -> float:
    """The same episode as an agent: up to T turns, each answered with the same user message; a turn cut at
    max_new_tokens ends the episode, as in the built-in workflow. Each turn asks for the built-in workflow's
    seed, so both sample the same tokens."""
    messages = [{"role": "user", "content": task.prompt}]
    for turn in range(1, TURNS + 1):
        seed = turn_seed(client.base_url, turn)
        response = await client.chat.completions.create(model="policy", messages=messages, seed=seed)
        if response.choices[0].finish_reason == "length":
            break
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        messages.append({"role": "user", "content": REPLY})
    return 0.0


PROXY: AgentProxy | None = None  # the proxy the raw agent posts to (set by main)


async def raw_reply_agent(client: Any, task: Any) -> float:
    """`fixed_reply_agent` without the `openai` client: the same requests as JSON bodies to the proxy's handler."""
    assert PROXY is not None
    route = Route("chat", session_id(client.base_url))
    messages = [{"role": "user", "content": task.prompt}]
    for turn in range(1, TURNS + 1):
        body = {"model": "policy", "messages": messages, "seed": turn_seed(client.base_url, turn)}
        answer = await PROXY.answer(route, json.dumps(body).encode())
        choice = json.loads(answer.body)["choices"][0]
        if choice["finish_reason"] == "length":
            break
        messages.append({"role": "assistant", "content": choice["message"]["content"]})
        messages.append({"role": "user", "content": REPLY})
    return 0.0


def run_groups(workflow: RolloutWorkflow, generator: Generator, groups: int) -> tuple[float, int, int, int, int, float]:
    """(seconds, generated tokens, turns, prefill calls, decode steps, CPU seconds) of `groups` groups run at
    once."""
    stats = dataclasses.replace(generator.stats)
    tasks = [PromptRecord(f"t{g}", f"{g}+{g}=", str(2 * g), None, "bench", {}) for g in range(groups)]

    async def all_groups() -> list:
        return await asyncio.gather(*(workflow.run(generator, task, g) for g, task in enumerate(tasks)))

    started, cpu_started = time.perf_counter(), time.process_time()
    results = asyncio.run(all_groups())
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    trajectories = [t for group in results for t in group]
    tokens = sum(t.num_loss_tokens for t in trajectories)
    turns = sum(t.metadata["num_turns"] for t in trajectories)
    now = generator.stats
    prefill_calls, decode_steps = now.prefill_calls - stats.prefill_calls, now.decode_steps - stats.decode_steps
    return seconds, tokens, turns, prefill_calls, decode_steps, cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 groups of 4 episodes (~40 s on 2 cores with the compilation cache warm, ~65 s cold)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (the best counts)")
    parser.add_argument(
        "--transport",
        choices=("local", "http"),
        default="local",
        help="agent.transport of the proxy's agents: in-process ('local', the default) or over the proxy's port",
    )
    parser.add_argument(
        "--model",
        choices=tuple(POLICIES),
        default="12m",
        help="the policy: common.QWEN2_3M, QWEN2_12M (the default) or MODEL_100M",
    )
    args = parser.parse_args()
    enable_compilation_cache("auto")  # as the CLI's default: a second run loads the engine's programs
    print(f"backend: {jax.default_backend()}")
    print(f"policy: {args.model}")
    print(f"transport: {args.transport}")
    # --quick: 2 prefill buckets and batches up to 4 (12 prefill/insert programs to compile on a cold cache)
    groups, n, new_tokens, slots, length, bucket, batch = (
        (16, 4, 16, 32, 128, 64, 4) if args.quick else (64, 8, 64, 128, 512, 32, 8)
    )
    tokenizer = CharTokenizer(DEFAULT_ALPHABET)
    policy = POLICIES[args.model]
    model = Decoder(policy.replace(vocab_size=tokenizer.vocab_size), nnx.Rngs(0))
    engine = Engine(
        model, EngineConfig(max_slots=slots, max_length=length, min_prefill_bucket=bucket, max_prefill_batch=batch)
    )
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=tuple(tokenizer.encode(STOPS)), seed=SEED
    )
    config = WorkflowConfig(n_samples=n, sampling=sampling, max_turns=TURNS)
    agent = config.replace(
        kind="agent", agent=AgentConfig(function="agent_proxy:fixed_reply_agent", transport=args.transport)
    )
    raw = agent.replace(agent=agent.agent.replace(function="agent_proxy:raw_reply_agent"))
    no_reward = lambda text, task: (0.0, {})  # noqa: E731
    global PROXY
    with (
        Generator(engine, engine.load_params(nnx.state(model), 0), detokenize=tokenizer.decode) as generator,
        MultiTurnWorkflow(config, tokenizer, FixedReply()) as builtin,
        AgentWorkflow(agent, tokenizer, no_reward) as proxy,
    ):
        PROXY = proxy.proxy_for(generator)
        raw_proxy = proxy.resampled(raw)  # the raw agent's episodes, on the same proxy
        modes = {"builtin": builtin, "raw": raw_proxy, "proxy": proxy}
        started = time.perf_counter()
        for workflow in modes.values():
            run_groups(workflow, generator, groups)  # compiles, starts the proxy
        print(f"warmup_seconds: {time.perf_counter() - started:.1f} s")
        best: dict[str, tuple[float, int, int, int, int, float]] = {}
        for _ in range(args.repeats):
            for name, workflow in modes.items():
                run = run_groups(workflow, generator, groups)
                if name not in best or run[1] / run[0] > best[name][1] / best[name][0]:
                    best[name] = run
    print(f"gil_switch_interval: {sys.getswitchinterval() * 1e3:.2f} ms")
    for name, (seconds, tokens, turns, prefill_calls, decode_steps, cpu_seconds) in best.items():
        print(f"{name}_throughput: {tokens / seconds:.1f} tokens/s")
        print(f"{name}_tokens: {tokens} tokens")
        print(f"{name}_seconds: {seconds:.2f} s")
        print(f"{name}_cpu_seconds: {cpu_seconds:.2f} s")
        print(f"{name}_turns: {turns} turns")
        print(f"{name}_prefill_calls: {prefill_calls} calls")
        print(f"{name}_decode_steps: {decode_steps} steps")

    def throughput(name: str) -> float:
        return best[name][1] / best[name][0]

    print(f"ratio raw_vs_builtin: {throughput('raw') / throughput('builtin'):.2f}")
    print(f"ratio proxy_vs_builtin: {throughput('proxy') / throughput('builtin'):.2f}")


if __name__ == "__main__":
    sys.modules["agent_proxy"] = sys.modules["__main__"]  # the agents named "agent_proxy:..." are these, PROXY too
    main()
