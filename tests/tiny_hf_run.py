"""A user's own model and data, built offline: a trained byte-level BPE tokenizer, a tiny random Qwen2
checkpoint next to it, and GSM8K / DeepCoder jsonl files, for end-to-end tests of `areal-jax train` and
`areal-jax eval` without a network.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import save_hf_checkpoint
from areal_jax.models.init import create_decoder

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_VOCAB = 352  # the 256 byte symbols plus merges; the special tokens come after
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
DEFAULT_SYSTEM = "You are a helpful assistant."

# Qwen2's pre-tokenizer split: words, single digits, punctuation runs, newlines and spaces.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5's ChatML template without tools: an optional system message, else a default one.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message['role'] == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CORPUS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "A train travels 45 miles per hour for 4 hours. How far does it go?",
    "Mia has 3 boxes with 12 pencils each. She gives away 7 pencils. How many pencils does she have left?",
    "Let's think step by step. 3 * 12 = 36, and 36 - 7 = 29. The answer is \\boxed{29}.",
    "First, 48 / 2 = 24. Then 48 + 24 = 72. So the final answer is \\boxed{72}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 25 50 100 144 250 1000 2024 -3 3.5 0.25 1/2 50%",
    "Read two integers a and b from standard input and print their sum.",
    "Write a Python program that reads a list of numbers and prints the largest one.",
    "```python\ndef f(x):\n    return x + 1\n```",
    "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\nimport sys\n\ndef main():\n    data = sys.stdin.read().split()\n    n = int(data[0])\n"
    "    print(sum(int(v) for v in data[1 : n + 1]))\n\n\nif __name__ == '__main__':\n    main()\n```",
    "for i in range(n):\n    if nums[i] > best:\n        best = nums[i]\nreturn best\n",
    "s = input().strip()\nprint(s[::-1])\nprint(len(s))\n",
    "system\nYou are a helpful assistant.\nuser\nWhat is 7 * 6?\nassistant\n7 * 6 = 42. The answer is 42.",
)


# ---------------------------------------------------------------------------------------------- tokenizer


def _added_token_entry(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def make_bpe_tokenizer_dir(directory: Path) -> Path:
    """Train a byte-level BPE on a small math-and-code corpus and write a Qwen2.5-style ChatML tokenizer
    directory (tokenizer.json, tokenizer_config.json, generation_config.json) at `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.save(str(directory / "tokenizer.json"))

    ids = {t: backend.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[t]): _added_token_entry(t) for t in SPECIAL_TOKENS},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return directory


def tokenizer_vocab_size(directory: Path) -> int:
    """Number of token ids of the tokenizer at `directory`, special tokens included."""
    return Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


# ---------------------------------------------------------------------------------------------- checkpoint


def padded_vocab_size(tokenizer_vocab: int) -> int:
    """The embedding rows of a checkpoint for `tokenizer_vocab` ids: rounded up to 64, plus 64 spare."""
    return -(-tokenizer_vocab // 64) * 64 + 64


def tiny_qwen2_config(vocab_size: int, dtype: str = "bfloat16") -> ModelConfig:
    """A Qwen2-shaped model small enough to train on CPU in seconds, stored in `dtype` (bf16, as every Qwen and
    Llama checkpoint ships)."""
    return ModelConfig(
        export_dtype=dtype,
        family="qwen2",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=1000000.0,
        qkv_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )


def make_tiny_qwen2_checkpoint(
    directory: Path,
    tokenizer_vocab: int,
    seed: int = 0,
    padded_vocab: int | None = None,
    *,
    tokenizer_dir: Path | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """Write a tiny random Qwen2 HF checkpoint stored in `dtype` whose embedding has `padded_vocab` rows
    (default `padded_vocab_size(tokenizer_vocab)`), plus the tokenizer files of `tokenizer_dir` when given."""
    vocab = padded_vocab_size(tokenizer_vocab) if padded_vocab is None else padded_vocab
    if vocab < tokenizer_vocab:
        raise ValueError(f"padded_vocab={vocab} is smaller than the tokenizer's {tokenizer_vocab} ids")
    cfg = tiny_qwen2_config(vocab, dtype)
    save_hf_checkpoint(cfg, create_decoder(cfg, seed, mesh=None), directory)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, directory / name)
    return directory


# ---------------------------------------------------------------------------------------------- GSM8K

_NAMES = ("Mia", "Tom", "Ava", "Liam", "Noah", "Emma", "Zoe", "Omar")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies")


def _gsm8k_row(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b, c = rng.randint(5, 40), rng.randint(2, 30), rng.randint(1, 5)
        total, left = a + b, a + b - c
        question = f"{name} has {a} {item}. {name} buys {b} more and then gives away {c}. How many {item} are left?"
        steps = [f"After buying, {name} has {a} + {b} = <<{a}+{b}={total}>>{total} {item}."]
        steps.append(f"After giving {c} away, {total} - {c} = <<{total}-{c}={left}>>{left} are left.")
        answer = left
    elif kind == 1:
        boxes, per_box, used = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 6)
        total, left = boxes * per_box, boxes * per_box - used
        question = (
            f"{name} has {boxes} boxes with {per_box} {item} each and uses {used} of them. How many {item} remain?"
        )
        steps = [f"There are {boxes} * {per_box} = <<{boxes}*{per_box}={total}>>{total} {item}."]
        steps.append(f"{total} - {used} = <<{total}-{used}={left}>>{left} remain.")
        answer = left
    elif kind == 2:
        friends, each = rng.randint(2, 8), rng.randint(2, 15)
        total = friends * each
        question = f"{name} shares {total} {item} equally among {friends} friends. How many does each friend get?"
        steps = [f"Each friend gets {total} / {friends} = <<{total}/{friends}={each}>>{each} {item}."]
        answer = each
    else:
        speed, hours = rng.randint(10, 60), rng.randint(2, 6)
        distance = speed * hours
        question = f"A bus drives {speed} miles per hour for {hours} hours. How many miles does it travel?"
        steps = [f"It travels {speed} * {hours} = <<{speed}*{hours}={distance}>>{distance} miles."]
        answer = distance
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"}


def write_gsm8k_jsonl(path: Path, rows: int = 20, seed: int = 0) -> Path:
    """`rows` GSM8K-format arithmetic word problems (`question`, `answer` ending in "#### <int>")."""
    rng = random.Random(seed)
    return _write_jsonl(path, [_gsm8k_row(rng) for _ in range(rows)])


# ---------------------------------------------------------------------------------------------- DeepCoder


@dataclasses.dataclass(frozen=True)
class _CodeTask:
    problem: str
    solution: str
    case: Callable[[random.Random], tuple[str, str]]  # (stdin, expected stdout)


def _sum_case(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(-100, 100), rng.randint(-100, 100)
    return f"{a} {b}\n", f"{a + b}\n"


def _max_case(rng: random.Random) -> tuple[str, str]:
    nums = [rng.randint(-50, 50) for _ in range(rng.randint(1, 6))]
    return f"{len(nums)}\n{' '.join(map(str, nums))}\n", f"{max(nums)}\n"


def _reverse_case(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefxyz") for _ in range(rng.randint(1, 8)))
    return f"{word}\n", f"{word[::-1]}\n"


def _evens_case(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 20)
    return f"{n}\n", f"{sum(1 for k in range(1, n + 1) if k % 2 == 0)}\n"


CODE_TASKS = (
    _CodeTask(
        "Read two integers a and b on one line and print their sum.",
        "a, b = map(int, input().split())\nprint(a + b)\n",
        _sum_case,
    ),
    _CodeTask(
        "The first line holds n; the second holds n integers. Print the largest of them.",
        "input()\nprint(max(map(int, input().split())))\n",
        _max_case,
    ),
    _CodeTask(
        "Read one word and print it reversed.",
        "print(input().strip()[::-1])\n",
        _reverse_case,
    ),
    _CodeTask(
        "Read an integer n and print how many even numbers lie between 1 and n inclusive.",
        "n = int(input())\nprint(n // 2)\n",
        _evens_case,
    ),
)


def reference_solution(problem: str) -> str:
    """A correct stdin/stdout Python solution to a problem statement that `write_deepcoder_jsonl` writes."""
    for task in CODE_TASKS:
        if task.problem == problem:
            return task.solution
    raise KeyError(f"no reference solution for problem {problem!r}; known: {[t.problem for t in CODE_TASKS]}")


def write_deepcoder_jsonl(path: Path, rows: int = 20, seed: int = 0, cases: int = 3) -> Path:
    """`rows` DeepCoder-format problems (`id`, `problem`, `tests` as a JSON string of stdin cases)."""
    rng = random.Random(seed)
    out = []
    for index in range(rows):
        task = CODE_TASKS[index % len(CODE_TASKS)]
        tests = [{"input": i, "output": o, "testtype": "stdin"} for i, o in (task.case(rng) for _ in range(cases))]
        out.append({"id": f"tiny-coder-{index}", "problem": task.problem, "tests": json.dumps(tests), "metadata": "{}"})
    return _write_jsonl(path, out)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- all of it


@dataclasses.dataclass(frozen=True)
class TinyRun:
    """Paths of a complete checkpoint directory and two datasets, and the vocab sizes involved."""

    checkpoint: Path
    gsm8k: Path
    deepcoder: Path
    tokenizer_vocab: int
    model_vocab: int


def make_tiny_hf_run(directory: Path, seed: int = 0) -> TinyRun:
    """Build the tokenizer, the checkpoint (with the tokenizer files) and both datasets under `directory`."""
    tokenizer_dir = make_bpe_tokenizer_dir(directory / "tokenizer")
    tokenizer_vocab = tokenizer_vocab_size(tokenizer_dir)
    model_vocab = padded_vocab_size(tokenizer_vocab)
    checkpoint = make_tiny_qwen2_checkpoint(
        directory / "tiny-qwen2", tokenizer_vocab, seed, model_vocab, tokenizer_dir=tokenizer_dir
    )
    return TinyRun(
        checkpoint=checkpoint,
        gsm8k=write_gsm8k_jsonl(directory / "data" / "gsm8k.jsonl", seed=seed),
        deepcoder=write_deepcoder_jsonl(directory / "data" / "deepcoder.jsonl", seed=seed),
        tokenizer_vocab=tokenizer_vocab,
        model_vocab=model_vocab,
    )
