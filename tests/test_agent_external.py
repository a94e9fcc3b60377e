"""`rollout.workflow.kind: external` on a tiny generator, over real HTTP: the rollout controller admits groups,
outside clients pull their tasks (`GET /v1/tasks/next`, 429 at the staleness bound), run them through the proxy
and end them with a reward (theirs, AReaL's `/rl/set_reward` form, or none: `reward.kind` scores the last turn);
a group whose episode is never ended is released after `agent.episode_timeout_s`, counted as a failure and
handed out again under the same group id. And the proxy's checks before admission: a malformed request gets
400/413 naming its field while admission is closed; only a valid episode-opening request gets 429."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import httpx2
import pytest

from areal_jax.agents.external import ExternalWorkflow
from areal_jax.agents.server import AgentProxy
from areal_jax.cli import configure_logging
from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.tokenizer import HFTokenizer
from areal_jax.rollout.agent_config import AgentConfig
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.failures import FailureBudgetConfig
from areal_jax.rollout.staleness import Admission, StalenessConfig, StalenessManager
from areal_jax.rollout.workflow import WorkflowConfig
from tests.test_agent_proxy import base_sampling, tiny_generator, tool_tokenizer_dir

TIMEOUT_S = 10.0  # agent.episode_timeout_s of the controller test: an episode must end within it, under load too


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    answer: str | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def http(method: str, url: str, body: Any = None, raw: bytes | None = None, **headers: str) -> tuple[int, dict, dict]:
    """(status, JSON answer, headers) of one request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer.from_dir(tool_tokenizer_dir(tmp_path_factory.mktemp("external-tokenizer")))


@pytest.fixture(scope="module")
def generator(tokenizer):
    generator, _ = tiny_generator(tokenizer)
    with generator:
        yield generator


class CountingGate:
    """An admission that is closed and counts how often it was asked."""

    def __init__(self) -> None:
        self.asked = 0

    def try_admit(self) -> Admission | None:
        self.asked += 1
        return None

    def release(self, admission: Admission) -> None:
        raise AssertionError("nothing was admitted")


def test_a_malformed_request_gets_400_naming_its_field_while_admission_is_closed(generator, tokenizer):
    gate = CountingGate()
    config = AgentConfig(max_n=4, max_body_bytes=4096)
    with AgentProxy(generator, tokenizer, config, base_sampling(tokenizer), admission=gate) as proxy:
        chat, headers = f"{proxy.url}/v1/chat/completions", {"X-Session-Id": "new-episode"}
        user = [{"role": "user", "content": "hi"}]
        refused = {
            "not JSON": (http("POST", chat, raw=b"{not json", **headers), 400, "the body is not JSON"),
            "no messages": (http("POST", chat, {"model": "p"}, **headers), 400, "messages: expected a non-empty list"),
            "a bad role": (
                http("POST", chat, {"messages": [{"role": "robot", "content": "x"}]}, **headers),
                400,
                "messages[0].role: got 'robot'",
            ),
            "max_tokens 0": (http("POST", chat, {"messages": user, "max_tokens": 0}, **headers), 400, "max_tokens:"),
            "n above the cap": (
                http("POST", chat, {"messages": user, "n": 5}, **headers),
                400,
                "n: expected an integer in [1, 4] (rollout.workflow.agent.max_n)",
            ),
            "an unknown tool format": (
                http("POST", chat, {"messages": user, "tools": [{"type": "web_search"}]}, **headers),
                400,
                "tools[0].type: got 'web_search'",
            ),
            "a body over the size": (
                http("POST", chat, {"messages": [{"role": "user", "content": "x" * 5000}]}, **headers),
                413,
                "body: ",
            ),
            "a completion without prompt": (
                http("POST", f"{proxy.url}/v1/completions", {"max_tokens": 2}, **headers),
                400,
                "prompt: expected",
            ),
        }
        for what, ((status, answer, _), want_status, want_message) in refused.items():
            assert status == want_status, (what, status, answer)
            assert want_message in answer["error"]["message"], (what, answer)
        assert "max_body_bytes=4096" in refused["a body over the size"][0][1]["error"]["message"]
        assert gate.asked == 0  # none of them got as far as admission
        status, answer, answer_headers = http("POST", chat, {"messages": user}, **headers)
        assert status == 429 and answer_headers["Retry-After"] == str(config.retry_after_s), answer
        assert gate.asked == 1
        status, answer, _ = http("GET", f"{proxy.url}/v1/tasks/next")  # a run of another kind hands out no tasks
        assert status == 404 and "rollout.workflow.kind is not 'external'" in answer["error"]["message"]


def test_a_bad_episode_timeout_names_its_key_and_range():
    with pytest.raises(ConfigError, match=r"rollout.workflow.agent.episode_timeout_s: value 0.0 .*allowed: > 0"):
        load_experiment(
            "configs/train_cpu.yaml", ["rollout.workflow.kind=external", "rollout.workflow.agent.episode_timeout_s=0"]
        )
    with pytest.raises(ConfigError, match=r"rollout.workflow.agent.max_n: value 0 .*allowed: >= 1 and <= 1024"):
        load_experiment("configs/train_cpu.yaml", ["rollout.workflow.agent.max_n=0"])
    with pytest.raises(ConfigError, match=r"eval.every_steps: .*kind is external"):
        load_experiment("configs/train_cpu.yaml", ["rollout.workflow.kind=external"])  # its held-out evaluation


# ------------------------------------------------------------------------------ the controller and outside clients


class Groups:
    """The controller's sink: the groups handed to it, in order."""

    def __init__(self) -> None:
        self.groups: list[list] = []
        self.changed = threading.Condition()

    def __call__(self, trajectories: list) -> None:
        with self.changed:
            self.groups.append(trajectories)
            self.changed.notify_all()

    def wait_for(self, count: int, timeout: float = 120.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.groups) >= count, timeout), f"{len(self.groups)} groups"


def next_task(url: str, timeout: float = 60.0) -> dict:
    """The next task handed out, asking again after each 429's Retry-After."""
    deadline = time.monotonic() + timeout
    while True:
        status, answer, headers = http("GET", f"{url}/v1/tasks/next")
        if status == 200:
            return answer
        assert status == 429 and time.monotonic() < deadline, (status, answer)
        time.sleep(min(float(headers["Retry-After"]), 0.05))


def turn(task: dict, *more: dict) -> dict:
    """One chat turn of the episode (its task's messages, then `more`) through its session's base URL: the
    reply's message."""
    body = {"messages": [*task["messages"], *more]}
    status, answer, _ = http("POST", f"{task['base_url']}/chat/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["message"]


def warm_up(proxy: AgentProxy) -> None:
    """Turns of a client's own episode (not a task's), one and two at once, so that no timed episode below
    waits for the generator's programs to compile."""
    body = {"messages": [{"role": "user", "content": "Question 9?"}]}
    url = f"{proxy.url}/sessions/warm-up/v1/chat/completions"
    threads = [threading.Thread(target=http, args=("POST", url, body)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reply = http("POST", url, body)[1]["choices"][0]["message"]
    assert http("POST", url, {"messages": [*body["messages"], reply, {"role": "user", "content": "again"}]})[0] == 200
    assert http("POST", f"{proxy.url}/sessions/warm-up/end", {})[0] == 200


def test_outside_clients_run_the_groups_the_controller_admits_and_a_lost_group_is_handed_out_again(
    generator, tokenizer
):
    config = WorkflowConfig(
        kind="external",
        n_samples=2,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
        agent=AgentConfig(episode_timeout_s=TIMEOUT_S),
    )
    scored = []

    def reward_fn(text: str, task: Task) -> tuple[float, dict[str, float]]:
        scored.append((task.id, text))
        return 0.25, {"scored_here": 1.0}

    tasks = [Task(f"task-{g}", f"Question {g}?", answer=str(g), metadata={"level": g}) for g in range(3)]
    # eta 2, B 1, one group at a time: the bound admits groups 0, 1 and 2 at version 0, then nothing
    staleness = StalenessManager(StalenessConfig(max_head_offpolicyness=2, batch_prompts=1, max_concurrent=1), 0)
    sink = Groups()
    with ExternalWorkflow(config, tokenizer, reward_fn) as workflow, workflow.serving(generator) as proxy:
        warm_up(proxy)
        controller = RolloutController(
            generator, workflow, iter(enumerate(tasks)), staleness, sink, failures=FailureBudgetConfig()
        ).start()
        try:
            url = proxy.url
            first = next_task(url)
            assert (first["task_id"], first["group_id"], first["sample_index"], first["n_samples"]) == (
                "task-0",
                0,
                0,
                2,
            )
            assert first["prompt"] == "Question 0?" and first["answer"] == "0" and first["metadata"] == {"level": 0}
            assert first["messages"] == [{"role": "user", "content": "Question 0?"}]
            assert first["base_url"] == proxy.session_url(first["session_id"]) and first["timeout_s"] == TIMEOUT_S
            turn(first)
            status, ended_first, _ = http("POST", first["end_url"], {"reward": 1.0})
            assert status == 200 and ended_first["reward"] == 1.0
            second = next_task(url)
            assert (second["group_id"], second["sample_index"]) == (0, 1)
            status, answer, headers = http("GET", f"{url}/v1/tasks/next")  # one group at a time: none to hand out
            assert status == 429 and headers["Retry-After"] == "1", answer
            reply = turn(second)
            turn(second, reply, {"role": "user", "content": "Are you sure?"})  # continues the recorded sequence
            status, ended_second, _ = http("POST", second["end_url"], {})  # no reward: reward.kind scores it
            assert status == 200 and ended_second["reward"] is None
            sink.wait_for(1)
            group = sink.groups[0]
            assert [(t.group_id, t.sample_index, t.prompt_id) for t in group] == [(0, 0, "task-0"), (0, 1, "task-0")]
            assert [t.reward for t in group] == [1.0, 0.25] and group[1].reward_components == {"scored_here": 1.0}
            assert [task_id for task_id, _ in scored] == ["task-0"]  # only the episode without a reward
            for trajectory, ended in zip(group, (ended_first, ended_second), strict=True):
                (sequence,) = ended["sequences"]
                assert trajectory.token_ids.tolist() == sequence["token_ids"]  # what the client's turns recorded
                assert trajectory.loss_mask.tolist() == [bool(m) for m in sequence["loss_mask"]]
            assert group[1].metadata["num_turns"] == 2

            # group 1: sample 0 is handed out and never ended (its client died); sample 1 ends (AReaL's form)
            before_lost = time.monotonic()
            lost, finished = next_task(url), next_task(url)
            assert (lost["group_id"], finished["group_id"]) == (1, 1)
            turn(finished)  # the lost one's client died before its first turn
            bearer = {"Authorization": f"Bearer {finished['session_id']}"}
            assert http("POST", f"{url}/rl/set_reward", {"reward": 0.5, "interaction_id": None}, **bearer)[0] == 200
            assert http("POST", f"{url}/rl/end_session", {}, **bearer)[0] == 200
            again = [next_task(url, timeout=TIMEOUT_S + 60), next_task(url)]
            assert time.monotonic() - before_lost >= TIMEOUT_S  # released at its episode's timeout, not before
            assert [(t["task_id"], t["group_id"], t["sample_index"]) for t in again] == [
                ("task-1", 1, 0),
                ("task-1", 1, 1),
            ]
            assert {t["session_id"] for t in again}.isdisjoint({lost["session_id"], finished["session_id"]})
            status, answer, _ = http("POST", lost["end_url"], {"reward": 1.0})  # its client comes back too late
            assert status == 404, answer
            status, answer, _ = http("POST", f"{lost['base_url']}/chat/completions", {"messages": lost["messages"]})
            assert status == 410, answer
            assert controller.stats.failed == 1 and controller.stats.reissued == 1
            for task in again:
                turn(task)
                assert http("POST", task["end_url"], {"reward": 0.0})[0] == 200
            third = [next_task(url), next_task(url)]
            for task in third:
                turn(task)
                assert http("POST", task["end_url"], {"reward": 1.0})[0] == 200
            sink.wait_for(3)
            status, answer, _ = http("GET", f"{url}/v1/tasks/next")  # the bound: 3 groups at version 0
            assert status == 429, answer
            assert [[(t.group_id, t.sample_index) for t in g] for g in sink.groups] == [
                [(0, 0), (0, 1)],
                [(1, 0), (1, 1)],
                [(2, 0), (2, 1)],
            ]  # each group once, the lost one under its own id
            assert [t.reward for t in sink.groups[1]] == [0.0, 0.0]  # the re-run's rewards, not the lost attempt's
            assert all((t.versions[t.loss_mask] == 0).all() and t.loss_mask.any() for g in sink.groups for t in g)
        finally:
            controller.stop()
    # read once its thread has stopped: it hands a group to the sink before it counts the group accepted
    assert controller.stats.accepted == 3 and controller.stats.started == 4
    assert generator.num_in_flight() == 0


def test_the_http_clients_per_request_lines_stay_out_of_the_log_at_the_default_level(caplog):
    """What `areal-jax` sets up: an agent's `openai` client (httpx2 under it) writes no INFO line per request."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, json={})

    configure_logging()
    with caplog.at_level(logging.INFO), httpx2.Client(transport=httpx2.MockTransport(answer)) as client:
        client.get("http://proxy/v1/models")
        logging.getLogger("areal_jax.test").info("an INFO line of the run")
    assert "an INFO line of the run" in caplog.text and "HTTP Request" not in caplog.text
