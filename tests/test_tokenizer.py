"""Tokenizers: parity with `transformers` on a tiny Qwen-style directory built here, and the character tokenizer."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from areal_jax.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "Let me think step by step: 7 * 6 = 42, so the result is 42.\n\n",
    "system\nYou are a helpful assistant.\nuser\nHello!\nassistant\nHi, how can I help?",
    "Les élèves étudient les mathématiques. 数学很有趣。 🙂",
    "def add(a, b):\n    return a + b\n",
] * 4

# A ChatML template in the style of Qwen2.5: default system message, tools rendered through `tojson`,
# indented block tags (trim_blocks/lstrip_blocks), loop controls and an `enable_thinking` switch.
CHATML_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] }}
{%- set loop_messages = messages[1:] %}
{%- else %}
{{- '<|im_start|>system\\nYou are a careful assistant. Reason step by step.' }}
{%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
{{- '\\n\\n# Tools' }}
    {% for tool in tools %}
{{ tool | tojson(indent=2) }}
    {% endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
{{ raise_exception('Conversation roles must be user or assistant, got ' + message['role']) }}
    {% endif %}
    {% if message['content'] == '' %}
        {% continue %}
    {% endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"

CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "What is 12 + 30?"}], {}),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}], {}),
    (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 7 * 6?"},
            {"role": "assistant", "content": "  7 * 6 = 42.  "},
            {"role": "user", "content": "Les élèves: 数学 🙂 and <|im_end|> inside text."},
        ],
        {},
    ),
    (
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "second", "name": None},
        ],
        {"enable_thinking": False},
    ),
    (
        [{"role": "user", "content": "Add 2 and 3."}],
        {"tools": [{"name": "add", "description": "Addiert zwei Zahlen — schnell", "parameters": {"a": "int"}}]},
    ),
]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.\n\n",
    "  leading and trailing spaces  ",
    "12345 + 678 = 7023",
    "Les élèves 数学很有趣 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<tool_call>{}</tool_call> tab\there",
    "",
]


def _train_backend() -> BackendTokenizer:
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer, and its special tokens after the vocab."""
    backend = BackendTokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return backend


def _added_token_entry(content: str, special: bool) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": not special,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def build_tokenizer_dir(
    directory: Path,
    *,
    tokenizer_class: str = "Qwen2Tokenizer",
    template_in_file: bool = False,
    eos_ids: int | list[int] | None = None,
    config_updates: dict[str, Any] | None = None,
) -> Path:
    """Writes tokenizer.json, tokenizer_config.json and generation_config.json (and chat_template.jinja)."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = _train_backend()
    backend.save(str(directory / "tokenizer.json"))
    ids = {t: backend.token_to_id(t) for t in SPECIAL}
    tool_call_id = backend.get_vocab_size(with_added_tokens=True)  # only in the config: loaders must add it
    decoder = {str(ids[t]): _added_token_entry(t, special=True) for t in SPECIAL}
    decoder[str(tool_call_id)] = _added_token_entry("<tool_call>", special=False)
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }
    if template_in_file:
        (directory / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    else:
        config["chat_template"] = [
            {"name": "default", "template": CHATML_TEMPLATE},
            {"name": "plain", "template": PLAIN_TEMPLATE},
        ]
    config.update(config_updates or {})
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if eos_ids is None:
        eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": eos_ids, "pad_token_id": ids["<|endoftext|>"]}
    (directory / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return directory


@pytest.fixture(scope="module", params=["Qwen2Tokenizer", "PreTrainedTokenizerFast"])
def tokenizer_pair(request, tmp_path_factory) -> tuple[HFTokenizer, Any]:
    """Ours and `transformers`' tokenizer over the same directory."""
    import transformers

    directory = build_tokenizer_dir(tmp_path_factory.mktemp("tok"), tokenizer_class=request.param)
    return HFTokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture
def tok_dir(tmp_path) -> Path:
    return build_tokenizer_dir(tmp_path / "tok")


# ------------------------------------------------------------------------------------------------ parity


def test_vocab_and_special_ids_match_transformers(tokenizer_pair):
    ours, hf = tokenizer_pair
    assert ours.vocab_size == len(hf)
    assert ours.encode("<tool_call>") == [len(hf) - 1]
    assert ours.eos_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.pad_id == hf.pad_token_id
    assert ours.bos_id is None and hf.bos_token_id is None


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_decode_match_transformers(tokenizer_pair, add_special_tokens):
    ours, hf = tokenizer_pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        assert ours.decode(ids) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tokenizer_pair, case, add_generation_prompt):
    ours, hf = tokenizer_pair
    messages, extra = CONVERSATIONS[case]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    assert text == expected
    ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    expected_ids = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **extra
    )
    assert ids == expected_ids
    assert ours.decode(ids) == text
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_named_template_matches_transformers(tokenizer_pair):
    ours, hf = tokenizer_pair
    messages, _ = CONVERSATIONS[2]
    text = ours.apply_chat_template(messages, tokenize=False, template_name="plain")
    assert text == hf.apply_chat_template(messages, tokenize=False, chat_template="plain", add_generation_prompt=True)
    assert text.startswith("system: You are a helpful assistant.<|im_end|>\n")


def test_chat_template_files_match_transformers(tmp_path):
    import transformers

    directory = build_tokenizer_dir(tmp_path / "tok", template_in_file=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "plain.jinja").write_text(PLAIN_TEMPLATE, encoding="utf-8")
    ours = HFTokenizer.from_dir(directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    for messages, extra in CONVERSATIONS:
        assert ours.apply_chat_template(messages, tokenize=False, **extra) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    messages, _ = CONVERSATIONS[2]
    assert ours.apply_chat_template(messages, template_name="plain") == hf.apply_chat_template(
        messages, chat_template="plain", return_dict=False
    )


# ------------------------------------------------------------------------------------------------ loading


def test_generation_prompt_and_default_system(tok_dir):
    tok = HFTokenizer.from_dir(tok_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a careful assistant. Reason step by step.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_stop_token_ids_include_all_eos_ids(tok_dir):
    tok = HFTokenizer.from_dir(tok_dir, stop_strings=["<tool_call>", "\n\nUser:"])
    im_end, endoftext, tool_call = (tok.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<tool_call>"))
    assert tok.stop_token_ids == (im_end, endoftext, tool_call)
    assert tok.stop_strings == ("<tool_call>", "\n\nUser:")


def test_generation_config_eos_as_int(tmp_path):
    probe = _train_backend()
    endoftext = probe.token_to_id("<|endoftext|>")
    tok = HFTokenizer.from_dir(build_tokenizer_dir(tmp_path / "tok", eos_ids=endoftext))
    assert tok.stop_token_ids == (probe.token_to_id("<|im_end|>"), endoftext)


def test_added_token_dicts_and_special_tokens_map(tmp_path):
    directory = build_tokenizer_dir(
        tmp_path / "tok",
        config_updates={"eos_token": None, "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>"}},
    )
    special_map = {"eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "special": True}}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    tok = HFTokenizer.from_dir(directory)
    assert tok.eos_id == tok.backend.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.backend.token_to_id("<|endoftext|>")
    assert tok.special_tokens["eos_token"] == "<|im_end|>"


def test_template_helpers_behave_like_transformers(tok_dir):
    tok = HFTokenizer.from_dir(tok_dir)
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must be user or assistant, got tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    helpers = "{{ strftime_now('%Y') }} {{ {'k': 'é'} | tojson }}"
    tok = HFTokenizer(tok.backend, path=tok_dir, special_tokens=tok.special_tokens, chat_templates={"default": helpers})
    rendered = tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    year = datetime.date.today().year
    assert rendered in {f'{y} {{"k": "é"}}' for y in (year, year + 1)}


def test_missing_tokenizer_json_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        HFTokenizer.from_dir(tmp_path)


def test_missing_chat_template_names_the_path(tmp_path):
    directory = build_tokenizer_dir(tmp_path / "tok")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_dir(directory)
    assert tok.encode("hi") == tok.backend.encode("hi").ids
    with pytest.raises(ValueError, match=f"{directory}.*no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unknown_template_name_lists_the_known_ones(tok_dir):
    tok = HFTokenizer.from_dir(tok_dir)
    with pytest.raises(ValueError, match=r"no chat template 'nope'; it has \['default', 'plain'\]"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], template_name="nope")


def test_load_tokenizer_dispatches_on_spec(tok_dir):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    hf = load_tokenizer(str(tok_dir))
    assert isinstance(hf, HFTokenizer)
    assert isinstance(hf, Tokenizer) and isinstance(load_tokenizer("char"), Tokenizer)


# ------------------------------------------------------------------------------------------------ characters


def test_char_round_trip():
    tok = CharTokenizer()
    text = "Q: 12+30=42\nA: 42"
    ids = tok.encode(text)
    assert min(ids) >= 3 and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == [tok.bos_id, *ids]
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(tok.alphabet)
    assert tok.stop_token_ids == (tok.eos_id,)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == f"<bos>{text}<eos><pad>"
    assert tok.decode([tok.bos_id, *ids, tok.eos_id], skip_special_tokens=True) == text


def test_char_unknown_character_names_it_and_its_position():
    with pytest.raises(ValueError, match=r"character 'x' at position 3"):
        CharTokenizer().encode("12+x")
    with pytest.raises(ValueError, match="token id 99 at position 1"):
        CharTokenizer().decode([3, 99])
    with pytest.raises(ValueError, match=r"repeats '1' at position 2"):
        CharTokenizer("121")


def test_char_chat_template():
    tok = CharTokenizer()
    user = [{"role": "user", "content": "1+2"}]
    assert tok.apply_chat_template(user, tokenize=False) == "Q: 1+2\nA: "
    assert tok.apply_chat_template(user) == tok.encode("Q: 1+2\nA: ")
    turns = [*user, {"role": "assistant", "content": "3"}, {"role": "user", "content": "3*4"}]
    assert tok.apply_chat_template(turns, tokenize=False) == "Q: 1+2\nA: 3\nQ: 3*4\nA: "
    assert tok.apply_chat_template(turns[:2], add_generation_prompt=False, tokenize=False) == "Q: 1+2\nA: 3\n"
    with pytest.raises(ValueError, match="message 0 has role 'system'"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
