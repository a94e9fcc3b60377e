"""The offline "own model and data" fixture: its tokenizer, checkpoint and datasets load with the project's
own readers, and its code problems are graded by the real code reward."""

from __future__ import annotations

import json

import pytest

from areal_jax.data.datasets import DatasetConfig, load_prompts
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.models.tokenizer import HFTokenizer, load_tokenizer
from areal_jax.rewards.code import CodeRewardConfig, CodeVerifier
from tests.tiny_hf_run import TinyRun, make_tiny_hf_run, reference_solution

TEXTS = [
    "Mia has 3 boxes with 12 pencils each. How many pencils? 3 * 12 = 36.",
    "The answer is \\boxed{1234567890}.",
    "```python\ndef f(x):\n    return x + 1\n```\n",
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "  tabs\tand spaces, élèves 数学 🙂\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> TinyRun:
    return make_tiny_hf_run(tmp_path_factory.mktemp("tiny-hf-run"))


@pytest.fixture(scope="module")
def tokenizer(run) -> HFTokenizer:
    tok = load_tokenizer(str(run.checkpoint))
    assert isinstance(tok, HFTokenizer)
    return tok


def test_tokenizer_round_trips_text_code_and_digits(run, tokenizer):
    assert tokenizer.vocab_size == run.tokenizer_vocab
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < run.tokenizer_vocab for i in ids)
    code = TEXTS[2]
    assert len(tokenizer.encode(code)) < len(code.encode()), "BPE merges should compress the corpus's own code"
    assert len(tokenizer.encode("2024")) == 4, "digits are split one by one, as in Qwen2"


def test_chat_template_renders_chatml_and_stops_on_im_end(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages) == tokenizer.encode(text)
    without = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False, tokenize=False)
    assert without.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert without.endswith("<|im_end|>\n")

    im_end, endoftext = (tokenizer.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert tokenizer.encode("<|im_end|>") == [im_end]
    assert tokenizer.eos_id == im_end and tokenizer.pad_id == endoftext
    assert tokenizer.stop_token_ids == (im_end, endoftext)


def test_checkpoint_loads_with_a_padded_vocab(run):
    files = {p.name for p in run.checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    cfg, model = load_hf_checkpoint(run.checkpoint)
    assert cfg.family == "qwen2" and cfg.tie_word_embeddings
    assert cfg.vocab_size == run.model_vocab > run.tokenizer_vocab
    assert run.model_vocab % 64 == 0
    assert model.embed.get_value().shape == (run.model_vocab, cfg.hidden_size)


def test_datasets_load_without_skipped_rows(run):
    gsm8k = load_prompts(DatasetConfig(path=str(run.gsm8k), mapping="gsm8k", on_error="skip"))
    assert len(gsm8k) == 20 and not gsm8k.skipped
    raw = [json.loads(line) for line in run.gsm8k.read_text().splitlines()]
    for record, row in zip(gsm8k, raw, strict=True):
        assert record.prompt == row["question"]
        assert record.answer == str(int(row["answer"].rsplit("#### ", 1)[1]))
    deepcoder = load_prompts(DatasetConfig(path=str(run.deepcoder), mapping="deepcoder", on_error="skip"))
    assert len(deepcoder) == 20 and not deepcoder.skipped
    assert len({r.id for r in deepcoder}) == 20
    assert all(len(r.tests) == 3 and r.tests[0]["testtype"] == "stdin" for r in deepcoder)


@pytest.mark.multiprocess
def test_code_reward_passes_reference_solutions_and_fails_wrong_ones(run, tmp_path):
    rows = load_prompts(DatasetConfig(path=str(run.deepcoder), mapping="deepcoder"))[:4]
    config = CodeRewardConfig(
        timeout_s=3.0, memory_mb=256, max_parallel=2, uid_base=230_000_000, uid_span=16, work_root=str(tmp_path)
    )
    with CodeVerifier(config) as verifier:
        right = [(reference_solution(r.prompt), r.tests, None) for r in rows]
        assert [res.reward for res in verifier.score_batch(right)] == [1.0] * 4
        response = f"Here it is.\n```python\n{reference_solution(rows[0].prompt)}```"
        assert verifier.score_response(response, rows[0].tests).reward == 1.0
        wrong = verifier.score("print(-12345)\n", rows[0].tests)
        assert wrong.reward == 0.0 and wrong.verdict == "wrong_answer"
