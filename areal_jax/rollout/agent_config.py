"""Configuration of the agent workflow and its OpenAI-compatible proxy (`rollout.workflow.agent`; run by
`areal_jax.agents`). A leaf of the rollout package, so that the workflow config names it without importing
the proxy."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option

_USER_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

TemplateRule = Literal["keep_prefix", "split"]
ToolFormat = Literal["auto", "hermes", "llama3"]


@dataclasses.dataclass(frozen=True)
class AgentConfig(Config):
    """The user's agent and the proxy it talks to."""

    function: str = option(
        "",
        doc="the agent, 'package.module:function': async def run(client, task) -> float | None, `client` an "
        "openai.AsyncOpenAI pointed at this episode's session of the proxy; None = score with reward.kind",
    )
    host: str = option("127.0.0.1", doc="address the proxy listens on")
    port: int = option(0, ge=0, le=65535, doc="proxy port of rollout server 0 (server i: port + i); 0 = any free port")
    template_rule: TemplateRule = option(
        "keep_prefix",
        doc="when the chat template renders earlier turns differently once new messages follow (Qwen3/R1 drop "
        "earlier <think>): 'keep_prefix' the next prompt is still the recorded ids plus the new messages (one "
        "sequence, what the model saw); 'split' the next prompt is the template's own rendering, starting a new "
        "sequence (the earlier one is kept as its own)",
    )
    extra_sequences: Literal["train_last", "all", "fail"] = option(
        "train_last",
        doc="an episode recorded as several sequences (split rule, branches): 'train_last' trains the sequence "
        "that ended last and counts the others in metadata; 'all' trains every sequence, each with the episode's "
        "reward, the group's advantages taken over episodes (an episode counts once whatever its sequences); "
        "'fail' fails the episode",
    )
    tool_format: ToolFormat = option(
        "auto",
        doc="tool-call syntax of the model: 'hermes' (Qwen2.5/Qwen3 <tool_call>{json}</tool_call>), 'llama3' "
        "(JSON {name, parameters}, optional <|python_tag|>); 'auto' = llama3 when the chat template uses "
        "<|eot_id|>, else hermes",
    )
    transport: Literal["local", "http"] = option(
        "local",
        doc="how the workflow's agents reach the proxy: 'local' hands each request to the proxy's handler on its "
        "own loop (same answers and records, no socket; the agents run on the proxy's loop), 'http' over the "
        "proxy's port like an outside client",
    )
    switch_interval_s: float = option(
        0.0005,
        ge=0,
        doc="the interpreter's GIL switch interval (sys.setswitchinterval, process-wide) set when a proxy starts, "
        "if it is longer; 0 = leave it. The proxy's loop (with the agents) and the generator's loop thread share "
        "the GIL: at Python's 5 ms each hand-over (a reply's wake-up, each decode step's wait for the device) "
        "can wait 5 ms",
    )
    retry_after_s: int = option(1, ge=1, doc="Retry-After of a 429 answer (a new episode while admission is closed)")
    fixed_temperature: bool = option(
        True,
        doc="refuse (HTTP 400) a request temperature other than rollout.workflow.sampling.temperature, the one "
        "the trainer scores at",
    )
    episode_timeout_s: float = option(
        600.0,
        gt=0,
        doc="an agent still running after this long fails its episode; kind 'external': an episode handed out "
        "(GET /v1/tasks/next) and not ended after this long releases its group, counted against rollout.failures, "
        "and the group's task is handed out again",
    )
    max_n: int = option(64, ge=1, le=1024, doc="the largest `n` (samples) one request may ask for; more is a 400")
    max_body_bytes: int = option(
        64 << 20, ge=1024, le=1 << 30, doc="the largest request body the proxy reads; a larger one is a 413"
    )

    def validate(self) -> None:
        if self.function and not _USER_FUNCTION.match(self.function):
            raise ConfigError("function", f"got {self.function!r}; expected 'package.module:function'")
