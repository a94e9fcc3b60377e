"""Rollout workflows on a real tiny engine: single-turn groups, truncation modes, multi-turn token in / token out,
rewards off the generator thread, environments and the chat-template reply delta."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from typing import Any

import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.data.datasets import PromptRecord
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.requests import GenerationResult
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.seeds import mix_seed
from areal_jax.models.decoder import Decoder
from areal_jax.models.tokenizer import DEFAULT_ALPHABET, CharTokenizer, HFTokenizer
from areal_jax.rewards.code import CodeRewardConfig, CodeVerifier
from areal_jax.rewards.math import MathRewardConfig, MathVerifier
from areal_jax.rewards.synthetic import ArithmeticProblem, arithmetic_reward
from areal_jax.rollout.environments import (
    CodeFeedbackEnvironment,
    CodeRewardFn,
    EnvStep,
    MathRetryEnvironment,
    MathRewardFn,
    SyntheticRewardFn,
    arithmetic_prompt_record,
)
from areal_jax.rollout.turns import TurnRenderer
from areal_jax.rollout.workflow import MultiTurnWorkflow, RLVRWorkflow, WorkflowConfig
from tests.engine_fixtures import TINY
from tests.test_tokenizer import build_tokenizer_dir

TOKENIZER = CharTokenizer(DEFAULT_ALPHABET + "abcdefghijklmnopqrstuvwxyzYT")
MAX_LENGTH = 64
RETRY = "Try again."
PROMPT_IDS = TOKENIZER.encode("Q: 1+2\nA: ")
KEEP_GOING = set(TOKENIZER.encode("0123456789\n"))
# Every token but digits and newline ends a turn, so the random model's turns stop after a few tokens.
STOP_QUICKLY = SamplingParams(
    temperature=1.0,
    max_new_tokens=6,
    seed=11,
    stop_token_ids=tuple(i for i in range(TOKENIZER.vocab_size) if i not in KEEP_GOING),
)


class RecordingGenerator(Generator):
    """A generator that keeps every request it was given: request id -> (prompt ids, n, future)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.calls: dict[str, tuple[tuple[int, ...], SamplingParams, int, concurrent.futures.Future]] = {}

    def submit(self, prompt_ids, sampling, n=1, request_id=None):
        future = super().submit(prompt_ids, sampling, n, request_id)
        self.calls[request_id] = (tuple(prompt_ids), sampling, n, future)
        return future

    def results(self, request_id: str) -> tuple[tuple[int, ...], list[GenerationResult]]:
        prompt, _, _, future = self.calls[request_id]
        return prompt, future.result(timeout=0)


@pytest.fixture(scope="module")
def generator():
    model = Decoder(TINY.replace(vocab_size=TOKENIZER.vocab_size), nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=4, max_length=MAX_LENGTH))
    with RecordingGenerator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        gen.model_state = nnx.state(model)
        yield gen


def _task(task_id: str, prompt: str = "1+2", answer: str | None = "3") -> PromptRecord:
    return PromptRecord(id=task_id, prompt=prompt, answer=answer, tests=None, source="test", metadata={})


def _assert_model_tokens(traj, start: int, result: GenerationResult) -> int:
    """The trajectory holds `result`'s tokens at `start` with its log-probs and versions; returns the end."""
    end = start + len(result.output_ids)
    np.testing.assert_array_equal(traj.token_ids[start:end], result.output_ids)
    np.testing.assert_array_equal(traj.behav_logprobs[start:end], np.float32(result.output_logprobs))
    np.testing.assert_array_equal(traj.versions[start:end], result.output_versions)
    return end


# ---------------------------------------------------------------------------------------------- single turn


def test_single_turn_group_is_prompt_plus_outputs(generator):
    seen = []

    def reward_fn(text: str, task: PromptRecord) -> tuple[float, dict[str, float]]:
        seen.append((text, task.id))
        return float(len(text)), {"chars": float(len(text))}

    config = WorkflowConfig(n_samples=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    with RLVRWorkflow(config, TOKENIZER, reward_fn) as workflow:
        trajectories = asyncio.run(workflow.run(generator, _task("p0"), group_id=5))

    prompt, results = generator.results("p0:g5")
    assert prompt == tuple(PROMPT_IDS) and generator.calls["p0:g5"][2] == 3
    assert TOKENIZER.eos_id in generator.calls["p0:g5"][1].stop_token_ids
    assert [t.sample_index for t in trajectories] == [0, 1, 2]
    assert {t.group_id for t in trajectories} == {5} and {t.prompt_id for t in trajectories} == {"p0"}
    p = len(PROMPT_IDS)
    for traj, result in zip(trajectories, results, strict=True):
        np.testing.assert_array_equal(traj.token_ids, [*PROMPT_IDS, *result.output_ids])
        assert traj.prompt_length == p and traj.token_ids.dtype == np.int32
        np.testing.assert_array_equal(traj.loss_mask, [False] * p + [True] * len(result.output_ids))
        assert not traj.behav_logprobs[:p].any() and (traj.versions[:p] == -1).all()
        assert _assert_model_tokens(traj, p, result) == traj.length
        text = TOKENIZER.decode(result.output_ids, skip_special_tokens=True)
        assert traj.reward == len(text) and traj.reward_components == {"chars": len(text)}
        assert traj.metadata["finish_reason"] == result.finish_reason
        assert traj.metadata["num_turns"] == 1 and traj.metadata["num_interruptions"] == 0
        assert traj.timings["reward"] >= 0 and traj.timings["total"] >= traj.timings["generate"]
    expected = [(TOKENIZER.decode(r.output_ids, skip_special_tokens=True), "p0") for r in results]
    assert sorted(seen) == sorted(expected)


def test_a_groups_seed_comes_from_the_one_derivation(generator):
    """A seeded workflow asks for seed `mix_seed(seed, group_id)`: a group run again gets the same samples,
    another group other ones."""
    config = WorkflowConfig(n_samples=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=7))
    with RLVRWorkflow(config, TOKENIZER, lambda text, task: (0.0, {})) as workflow:
        runs = [asyncio.run(workflow.run(generator, _task(f"seed-{i}"), group_id=g)) for i, g in enumerate((3, 3, 4))]
    assert [generator.calls[f"seed-{i}:g{g}"][1].seed for i, g in enumerate((3, 3, 4))] == [
        mix_seed(7, 3),
        mix_seed(7, 3),
        mix_seed(7, 4),
    ]
    tokens = [[t.token_ids.tolist() for t in run] for run in runs]
    assert tokens[0] == tokens[1] != tokens[2]


@pytest.mark.parametrize("mode", ["keep", "mask", "penalize"])
def test_truncation_modes(generator, mode):
    truncating = SamplingParams(temperature=1.0, max_new_tokens=3, seed=2)
    stopping = SamplingParams(
        temperature=1.0, max_new_tokens=3, seed=2, stop_token_ids=tuple(range(TOKENIZER.vocab_size))
    )
    p = len(PROMPT_IDS)
    for name, sampling in [("trunc", truncating), ("stop", stopping)]:
        config = WorkflowConfig(
            n_samples=2, sampling=sampling, stop_at_tokenizer_stops=False, truncation=mode, truncation_penalty=-0.5
        )
        with RLVRWorkflow(config, TOKENIZER, lambda text, task: (1.0, {"one": 1.0})) as workflow:
            trajectories = asyncio.run(workflow.run(generator, _task(f"{name}-{mode}"), group_id=0))
        for traj in trajectories:
            truncated = name == "trunc"
            assert traj.metadata["finish_reason"] == ("length" if truncated else "stop")
            assert traj.metadata["truncated"] is truncated
            trains = not (truncated and mode == "mask")
            assert traj.num_loss_tokens == (traj.length - p if trains else 0)
            assert traj.reward == (-0.5 if truncated and mode == "penalize" else 1.0)
            assert traj.reward_components == {"one": 1.0}
            assert ("raw_reward" in traj.metadata) is (truncated and mode == "penalize")


def test_rewards_run_off_the_generator_thread(generator):
    """A reward function that blocks until another request has been decoded to the end: it can only return
    if rewards run neither on the generator's thread nor on the event loop."""
    other_tokens = 24
    in_reward, other_finished = threading.Event(), threading.Event()
    record: dict[str, Any] = {}

    def blocking_reward(text: str, task: PromptRecord) -> tuple[float, dict[str, float]]:
        record["thread"] = threading.current_thread().name
        steps = generator.stats.decode_steps
        in_reward.set()
        record["other_finished_during_reward"] = other_finished.wait(timeout=60)
        record["steps_during"] = generator.stats.decode_steps - steps
        return 0.0, {}

    async def scenario() -> GenerationResult:
        slow = asyncio.create_task(workflow.run(generator, _task("slow"), group_id=0))
        assert await asyncio.get_running_loop().run_in_executor(None, in_reward.wait, 60)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=other_tokens, seed=4)
        (other,) = await generator.generate(PROMPT_IDS, sampling, request_id="other")
        other_finished.set()
        await slow
        return other

    config = WorkflowConfig(n_samples=1, sampling=SamplingParams(temperature=1.0, max_new_tokens=4, seed=3))
    with RLVRWorkflow(config, TOKENIZER, blocking_reward) as workflow:
        other = asyncio.run(scenario())
    assert len(other.output_ids) == other_tokens and other.finish_reason == "length"
    assert record["other_finished_during_reward"], "the other request did not finish while the reward ran"
    assert record["steps_during"] >= other_tokens
    assert record["thread"].startswith("areal-reward")


def test_cancelled_run_aborts_its_request_and_the_generator_goes_on(generator):
    # No stop token: a sample the random model ended with eos before the abort arrived would finish "stop".
    sampling = SamplingParams(temperature=1.0, max_new_tokens=100, seed=5)
    config = WorkflowConfig(n_samples=2, sampling=sampling, stop_at_tokenizer_stops=False)

    async def scenario() -> GenerationResult:
        run = asyncio.create_task(workflow.run(generator, _task("cancelled"), group_id=0))
        while "cancelled:g0" not in generator.calls:
            await asyncio.sleep(0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        (after,) = await generator.generate(PROMPT_IDS, SamplingParams(max_new_tokens=4, seed=6), request_id="after")
        return after

    with RLVRWorkflow(config, TOKENIZER, lambda text, task: (0.0, {})) as workflow:
        after = asyncio.run(scenario())
    assert len(after.output_ids) == 4
    aborted = generator.calls["cancelled:g0"][3].result(timeout=30)
    assert {r.finish_reason for r in aborted} == {"abort"}


def test_boundary_errors_name_the_offender(generator):
    config = WorkflowConfig(n_samples=1, sampling=SamplingParams(max_new_tokens=2, seed=0))
    with RLVRWorkflow(config, TOKENIZER, lambda text, task: (math.nan, {})) as workflow:
        with pytest.raises(ValueError, match=r"prompt 'nan' sample 0: reward nan"):
            asyncio.run(workflow.run(generator, _task("nan"), group_id=0))
        with pytest.raises(ValueError, match=r"prompt 'long': prompt length 67"):
            asyncio.run(workflow.run(generator, _task("long", prompt="1" * 60), group_id=0))
        with pytest.raises(ValueError, match="group_id must be >= 0, got -1"):
            asyncio.run(workflow.run(generator, _task("neg"), group_id=-1))


def test_config_validation():
    with pytest.raises(ConfigError, match=r"truncation: got 'drop'; allowed: 'mask', 'penalize', 'keep'"):
        WorkflowConfig(truncation="drop")
    with pytest.raises(ConfigError, match="n_samples"):
        WorkflowConfig(n_samples=0)
    with pytest.raises(ConfigError, match="max_turns"):
        WorkflowConfig(max_turns=0)
    for discount in (0.0, 1.5):
        with pytest.raises(ConfigError, match="turn_discount"):
            WorkflowConfig(turn_discount=discount)


# ---------------------------------------------------------------------------------------------- multi turn


class ScriptedEnv:
    """Replies "no<turn>" until turn `done_at` (then done with `reward`); records what it saw."""

    def __init__(self, done_at: int | None, reward: float = 1.0):
        self.done_at = done_at
        self.reward = reward
        self.seen: list[tuple[int, str, tuple]] = []

    def step(self, task: Any, history, completion: str) -> EnvStep:
        turn = sum(m["role"] == "assistant" for m in history) + 1
        self.seen.append((turn, completion, tuple(history)))
        if self.done_at is not None and turn >= self.done_at:
            return EnvStep(None, self.reward, True, {"turn": float(turn)})
        return EnvStep(self.reply(turn), 0.0, False, {"turn": float(turn)})

    @staticmethod
    def reply(turn: int) -> str:
        return f"no{turn}"


def _rebuild(generator: RecordingGenerator, task_id: str, traj, replies: list[str]) -> list[int]:
    """The sequence from the generator's own results and the replies' template text; checks each turn's prompt."""
    prompt, (first,) = generator.results(f"{task_id}:g0:s{traj.sample_index}:t1")  # each episode asks alone
    assert list(prompt) == PROMPT_IDS
    sequence = [*PROMPT_IDS, *first.output_ids]
    for turn, reply in enumerate(replies, start=2):
        sequence += TOKENIZER.encode(f"\nQ: {reply}\nA: ")
        prompt, (result,) = generator.results(f"{task_id}:g0:s{traj.sample_index}:t{turn}")
        assert list(prompt) == sequence, "a turn's prompt is not the exact concatenation of what came before"
        sequence += result.output_ids
    return sequence


@pytest.mark.parametrize(("done_at", "max_turns", "turns", "end"), [(3, 4, 3, "done"), (None, 2, 2, "max_turns")])
def test_multi_turn_is_token_in_token_out(generator, done_at, max_turns, turns, end):
    env = ScriptedEnv(done_at)
    config = WorkflowConfig(n_samples=2, sampling=STOP_QUICKLY, max_turns=max_turns, turn_discount=0.5)
    task_id = f"mt-{end}"
    with MultiTurnWorkflow(config, TOKENIZER, env) as workflow:
        trajectories = asyncio.run(workflow.run(generator, _task(task_id), group_id=0))

    assert [t.sample_index for t in trajectories] == [0, 1]
    p = len(PROMPT_IDS)
    for traj in trajectories:
        assert traj.metadata["num_turns"] == turns and traj.metadata["end_reason"] == end
        assert traj.metadata["finish_reason"] == "stop" and traj.prompt_length == p
        replies = [ScriptedEnv.reply(turn) for turn in range(1, turns)]
        np.testing.assert_array_equal(traj.token_ids, _rebuild(generator, task_id, traj, replies))
        model_results = [
            generator.results(f"{task_id}:g0:s{traj.sample_index}:t{turn}")[1][0] for turn in range(1, turns + 1)
        ]
        mask = np.zeros(traj.length, bool)
        start = p
        for turn, result in enumerate(model_results, start=1):
            end_ = _assert_model_tokens(traj, start, result)
            mask[start:end_] = True
            start = end_ + (len(TOKENIZER.encode(f"\nQ: {ScriptedEnv.reply(turn)}\nA: ")) if turn < turns else 0)
        assert start == traj.length
        np.testing.assert_array_equal(traj.loss_mask, mask)
        assert not traj.behav_logprobs[~mask].any() and (traj.versions[~mask] == -1).all()
        expected_reward = 0.5 ** (turns - 1) if done_at else 0.0
        assert traj.reward == expected_reward and traj.metadata["env_reward"] == (1.0 if done_at else 0.0)
        assert traj.reward_components == {"turn": float(turns)}
        history: list[dict[str, str]] = [{"role": "user", "content": "1+2"}]
        for turn, result in enumerate(model_results, start=1):
            completion = TOKENIZER.decode(result.output_ids, skip_special_tokens=True)
            assert (turn, completion, tuple(history)) in env.seen
            history += [{"role": "assistant", "content": completion}, {"role": "user", "content": env.reply(turn)}]
    assert len(env.seen) == 2 * turns


def test_multi_turn_keeps_each_turns_policy_version(generator):
    """Weights published between two turns: the second turn's tokens carry the new version, the first keep theirs."""
    version = generator.version

    class PublishingEnv(ScriptedEnv):
        def step(self, task: Any, history, completion: str) -> EnvStep:
            generator.update_params(generator.model_state, version + 1).result(timeout=60)
            return super().step(task, history, completion)

    config = WorkflowConfig(n_samples=1, sampling=STOP_QUICKLY, max_turns=2)
    with MultiTurnWorkflow(config, TOKENIZER, PublishingEnv(None)) as workflow:
        (traj,) = asyncio.run(workflow.run(generator, _task("mt-version"), group_id=0))
    assert traj.metadata["num_turns"] == 2
    model_versions = traj.versions[traj.loss_mask]
    _, (first,) = generator.results("mt-version:g0:s0:t1")
    turn_one = len(first.output_ids)
    assert (model_versions[:turn_one] == version).all() and (model_versions[turn_one:] == version + 1).all()
    assert traj.oldest_version() == version


def test_multi_turn_truncated_turn_ends_the_episode(generator):
    env = ScriptedEnv(None)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, seed=8)
    config = WorkflowConfig(
        n_samples=2, sampling=sampling, stop_at_tokenizer_stops=False, max_turns=3, truncation="mask"
    )
    with MultiTurnWorkflow(config, TOKENIZER, env) as workflow:
        trajectories = asyncio.run(workflow.run(generator, _task("mt-trunc"), group_id=0))
    for traj in trajectories:
        assert traj.metadata["end_reason"] == "truncated" and traj.metadata["num_turns"] == 1
        assert traj.num_loss_tokens == 0 and traj.length == len(PROMPT_IDS) + 3
    assert len(env.seen) == 2


def test_multi_turn_stops_when_the_context_is_full(generator):
    config = WorkflowConfig(n_samples=1, sampling=STOP_QUICKLY, max_turns=100)
    with MultiTurnWorkflow(config, TOKENIZER, ScriptedEnv(None)) as workflow:
        (traj,) = asyncio.run(workflow.run(generator, _task("mt-full"), group_id=0))
    assert traj.metadata["end_reason"] == "context_full"
    next_reply = TOKENIZER.encode(f"\nQ: {ScriptedEnv.reply(traj.metadata['num_turns'])}\nA: ")
    assert traj.length <= MAX_LENGTH <= traj.length + len(next_reply)


def test_math_retry_environment_in_the_loop(generator):
    env = MathRetryEnvironment(SyntheticRewardFn(arithmetic_reward), retry_message=RETRY)
    config = WorkflowConfig(n_samples=2, sampling=STOP_QUICKLY, max_turns=2, turn_discount=0.9)
    with MultiTurnWorkflow(config, TOKENIZER, env) as workflow:
        trajectories = asyncio.run(workflow.run(generator, _task("mt-math"), group_id=0))
    retry = TOKENIZER.encode(f"\nQ: {RETRY}\nA: ")
    for traj in trajectories:
        turns, end = traj.metadata["num_turns"], traj.metadata["end_reason"]
        assert end == "done" if traj.metadata["env_reward"] == 1.0 else (turns, end) == (2, "max_turns")
        assert traj.reward == pytest.approx(traj.metadata["env_reward"] * 0.9 ** (turns - 1))
        text = TOKENIZER.decode(traj.token_ids.tolist())
        assert text.count(RETRY) == turns - 1
        if turns == 2:
            at = text.index(RETRY) - len("\nQ: ")
            np.testing.assert_array_equal(traj.token_ids[at : at + len(retry)], retry)
            assert not traj.loss_mask[at : at + len(retry)].any()


def test_math_retry_environment_steps():
    env = MathRetryEnvironment(SyntheticRewardFn(arithmetic_reward), retry_message="again")
    task = arithmetic_prompt_record(ArithmeticProblem(prompt_id=4, question="1+2", answer="3"))
    assert task.id == "arith-4" and task.prompt == "1+2"
    assert env.step(task, (), " 3") == EnvStep(None, 1.0, True, {"correct": 1.0, "format": 1.0})
    assert env.step(task, (), "4") == EnvStep("again", 0.0, False, {"correct": 0.0, "format": 1.0})


def test_code_feedback_environment_and_reward(tmp_path):
    config = CodeRewardConfig(timeout_s=2.0, max_parallel=2, uid_base=220_000_000, uid_span=8, work_root=str(tmp_path))
    task = PromptRecord(
        id="c0",
        prompt="add",
        answer=None,
        tests={"inputs": ["1 2", "3 4"], "outputs": ["3", "7"]},
        source="test",
        metadata={},
    )
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    with CodeVerifier(config) as verifier:
        env = CodeFeedbackEnvironment(verifier)
        passed = env.step(task, (), right)
        failed = env.step(task, (), wrong)
        missing = env.step(task, (), "no code here")
        reward, components = CodeRewardFn(verifier)(wrong, task)
    assert passed.done and passed.reply is None and passed.reward == 1.0
    assert not failed.done and failed.reward == 0.0
    assert failed.reply.startswith("Your code failed test 1 of 2: wrong_answer (got '-1")
    assert "No code block found" in missing.reply and missing.components["format"] == 0.0
    assert reward == 0.0 and components == {"correct": 0.0, "pass_rate": 0.0, "format": 1.0}


# ---------------------------------------------------------------------------------------------- reply delta


def test_reply_delta_with_a_chatml_template(tmp_path):
    tokenizer = HFTokenizer.from_dir(build_tokenizer_dir(tmp_path / "tok"))
    renderer = TurnRenderer(tokenizer)
    assert renderer.turn_end == "<|im_end|>\n"
    question, answer, reply = "What is 7 * 6?", "The answer is 42.", "Wrong, try again."
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    output = [*tokenizer.encode(answer), tokenizer.backend.token_to_id("<|im_end|>")]
    delta = renderer.reply_ids(reply, output)
    assert delta == tokenizer.encode(f"\n<|im_start|>user\n{reply}<|im_end|>\n<|im_start|>assistant\n")
    conversation = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": reply},
    ]
    assert tokenizer.decode(prompt + output + delta) == tokenizer.apply_chat_template(conversation, tokenize=False)
    cut_short = tokenizer.encode(answer)  # a turn that did not end with <|im_end|> gets it from the delta
    assert tokenizer.decode(renderer.reply_ids(reply, cut_short)).startswith("<|im_end|>\n<|im_start|>user")


def test_reply_delta_with_the_char_template():
    renderer = TurnRenderer(TOKENIZER)
    assert renderer.turn_end == "\n"
    output = [*TOKENIZER.encode("42"), TOKENIZER.eos_id]
    assert renderer.reply_ids("no", output) == TOKENIZER.encode("\nQ: no\nA: ")
    assert renderer.reply_ids("no", TOKENIZER.encode("42\n")) == TOKENIZER.encode("Q: no\nA: ")


# Like Qwen3's template: the last assistant message (after the last user turn) gets an empty thinking block.
THINKING_TEMPLATE = """{%- for m in messages %}
{%- if m['role'] == 'assistant' and loop.last %}
{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_reply_delta_when_the_template_renders_the_last_turn_differently(tmp_path):
    base = HFTokenizer.from_dir(build_tokenizer_dir(tmp_path / "tok"))
    tokenizer = HFTokenizer(
        base.backend, path=base.path, special_tokens=base.special_tokens, chat_templates={"default": THINKING_TEMPLATE}
    )
    output = [*tokenizer.encode("<think>\nhm\n</think>\n\n42"), tokenizer.backend.token_to_id("<|im_end|>")]
    delta = TurnRenderer(tokenizer).reply_ids("again", output)
    assert delta == tokenizer.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")


def test_math_reward_fn():
    task = _task("m0", prompt="What is 1/2 + 1/4?", answer="\\frac{3}{4}")
    with MathVerifier(MathRewardConfig(num_workers=1, timeout_s=20.0)) as verifier:
        reward_fn = MathRewardFn(verifier)
        assert reward_fn("So the sum is \\boxed{0.75}.", task) == (1.0, {"correct": 1.0, "format": 1.0})
        assert reward_fn("\\boxed{2/3}", task) == (0.0, {"correct": 0.0, "format": 1.0})
        with pytest.raises(ValueError, match="task 'm1' has answer None"):
            reward_fn("\\boxed{1}", _task("m1", answer=None))
