"""Tokenizers for rollouts and training: HF tokenizer directories read without `transformers`, and a character one.

`HFTokenizer.from_dir` reads a Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json`,
optionally `special_tokens_map.json`, `generation_config.json`, `chat_template.jinja`) through the `tokenizers`
package; its chat templates render as `transformers` renders them (`chat_template.py`), so the text and ids
match `AutoTokenizer.apply_chat_template`. `CharTokenizer` is a fixed-alphabet tokenizer for
synthetic tasks. Both satisfy the `Tokenizer` protocol; `load_tokenizer(spec)` picks one from a config string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, overload, runtime_checkable

import tokenizers

from areal_jax.models.chat_template import ChatTemplates, Messages, read_chat_templates

CHAR_SPEC = "char"
REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes that are not (yet) a whole character
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@runtime_checkable
class Tokenizer(Protocol):
    """What rollout and training code needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = ...,
        tokenize: Literal[True] = ...,
        **extra_vars: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[False],
        **extra_vars: Any,
    ) -> str: ...


class IncrementalDecoder:
    """The text of a growing token sequence, a few tokens at a time: `push(token)` returns the text that
    token completes, and the pushed pieces joined equal `decode(all tokens)` (less any trailing incomplete
    character). Each push decodes only the tokens since the last complete character plus the previous
    piece's tokens as context, so a tokenizer whose text of a token depends on its neighbour (a
    SentencePiece leading space) decodes as it would in the whole sequence; a multi-byte character split
    over several byte-level tokens is held back until its last byte arrives."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._context = 0  # first token of the window decoded for context
        self._read = 0  # tokens whose text has been returned

    def push(self, token: int) -> str:
        self._ids.append(token)
        done = self._decode(self._ids[self._context : self._read])
        text = self._decode(self._ids[self._context :])
        if len(text) <= len(done) or text.endswith(REPLACEMENT_CHAR):
            return ""  # no new text yet, or it ends inside a multi-byte character
        self._context, self._read = self._read, len(self._ids)
        return text[len(done) :]


def load_tokenizer(spec: str) -> HFTokenizer | CharTokenizer:
    """`CharTokenizer()` for the spec "char", else the HF tokenizer directory at path `spec`."""
    if spec == CHAR_SPEC:
        return CharTokenizer()
    return HFTokenizer.from_dir(spec)


# --------------------------------------------------------------------------------------------- HF directories


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """The string of a token entry that is null, a string or an AddedToken dict `{"content": ...}`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a token string or {{'content': ...}}, got {value!r}")


def _added_token(value: Any, where: str, special: bool) -> tokenizers.AddedToken:
    """An AddedToken from a string or a serialized AddedToken dict; strings take the given `special` flag."""
    content = _token_content(value, where)
    if content is None:
        raise ValueError(f"{where}: expected a token, got null")
    if isinstance(value, str):
        return tokenizers.AddedToken(content, special=special)
    flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
    return tokenizers.AddedToken(content, **{k: bool(value[k]) for k in flags if k in value})


def _special_tokens(
    config: Mapping[str, Any], special_map: Mapping[str, Any], config_file: Path
) -> tuple[dict[str, tokenizers.AddedToken], list[tokenizers.AddedToken]]:
    """Named special tokens (`*_token` keys; the config wins over special_tokens_map.json) and unnamed extras."""
    named: dict[str, tokenizers.AddedToken] = {}
    for key in dict.fromkeys([*NAMED_SPECIAL_TOKENS, *config, *special_map]):
        value = config.get(key)
        if value is None:
            value = special_map.get(key)
        if key.endswith("_token") and isinstance(value, str | Mapping):
            named[key] = _added_token(value, f"{config_file}: {key}", special=True)
    extras: list[tokenizers.AddedToken] = []
    for key in ("extra_special_tokens", "additional_special_tokens"):
        value = config.get(key) or special_map.get(key) or []
        if isinstance(value, Mapping):
            named.update({k: _added_token(v, f"{config_file}: {key}.{k}", special=True) for k, v in value.items()})
        else:
            extras.extend(_added_token(v, f"{config_file}: {key}", special=True) for v in value)
    return named, extras


def _add_missing_tokens(
    backend: tokenizers.Tokenizer,
    added_tokens_decoder: Mapping[str, Any],
    special: Sequence[tokenizers.AddedToken],
    config_file: Path,
) -> None:
    """Adds the config's added tokens, then its special tokens, that tokenizer.json lacks, as `transformers` does."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    to_add: dict[str, tokenizers.AddedToken] = {}
    for index in sorted(added_tokens_decoder, key=int):
        token = _added_token(added_tokens_decoder[index], f"{config_file}: added_tokens_decoder.{index}", False)
        if token.content not in present:
            to_add.setdefault(token.content, token)
    for token in special:
        if token.content not in present and token.content not in to_add:
            token.special = True
            to_add[token.content] = token
    backend.add_tokens(list(to_add.values()))


def _eos_ids_from_generation_config(path: Path, generation_config: Mapping[str, Any]) -> list[int]:
    value = generation_config.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


class HFTokenizer:
    """A Hugging Face tokenizer directory, read through `tokenizers`; its chat templates render as in `transformers`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        path: Path,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        extra_eos_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        pad_id: int | None = None,
    ):
        """Wraps `backend`; `special_tokens` maps names like "eos_token" to token strings already in `backend`."""
        self.backend = backend
        self.path = path
        self.special_tokens = dict(special_tokens)
        self.stop_strings = tuple(stop_strings)
        self._ids = {name: backend.token_to_id(token) for name, token in self.special_tokens.items()}
        self._templates = ChatTemplates(chat_templates, path)
        self.chat_templates = self._templates.sources

        stop_ids = [] if self.eos_id is None else [self.eos_id]
        stop_ids += extra_eos_ids
        for text in self.stop_strings:
            ids = backend.encode(text, add_special_tokens=False).ids
            if len(ids) == 1:
                stop_ids.append(ids[0])
        self._stop_token_ids = tuple(dict.fromkeys(stop_ids))

        pad = self._ids.get("pad_token") if pad_id is None else pad_id
        pad = self.eos_id if pad is None else pad
        if pad is None:
            raise ValueError(f"{path}: tokenizer has neither a pad_token nor an eos_token to pad with")
        self._pad_id = pad

    @classmethod
    def from_dir(cls, path: str | Path, stop_strings: Sequence[str] = ()) -> HFTokenizer:
        """Loads a tokenizer directory; `stop_strings` that encode to one token join `stop_token_ids`."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}: expected a Hugging Face tokenizer directory")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        backend.no_padding()
        backend.no_truncation()

        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file)
        special_map = _read_json(directory / "special_tokens_map.json")
        generation_file = directory / "generation_config.json"
        generation_config = _read_json(generation_file)

        named, extras = _special_tokens(config, special_map, config_file)
        _add_missing_tokens(backend, config.get("added_tokens_decoder") or {}, [*named.values(), *extras], config_file)

        pad_id = generation_config.get("pad_token_id") if "pad_token" not in named else None
        return cls(
            backend,
            path=directory,
            special_tokens={name: token.content for name, token in named.items()},
            chat_templates=read_chat_templates(directory, config),
            extra_eos_ids=_eos_ids_from_generation_config(generation_file, generation_config),
            stop_strings=stop_strings,
            pad_id=pad_id if isinstance(pad_id, int) else None,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (`len(hf_tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._ids.get("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._ids.get("eos_token")

    @property
    def pad_id(self) -> int:
        """The pad token's id; else generation_config's pad_token_id; else the eos id."""
        return self._pad_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The eos id, generation_config's eos ids, and the ids of single-token `stop_strings`, in that order."""
        return self._stop_token_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer.json post-processor (e.g. a bos)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @overload
    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = ...,
        tokenize: Literal[True] = ...,
        *,
        template_name: str | None = ...,
        **extra_vars: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[False],
        template_name: str | None = ...,
        **extra_vars: Any,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        *,
        template_name: str | None = None,
        **extra_vars: Any,
    ) -> list[int] | str:
        """The conversation rendered by the chat template as `transformers` does, as ids or (tokenize=False) text.

        `extra_vars` (e.g. `tools`, `enable_thinking`) reach the template next to the special token strings.
        `template_name` picks one of several named templates; by default "tool_use" when tools are given and
        the tokenizer has one, else "default".
        """
        variables = {**self.special_tokens, **extra_vars}
        text = self._templates.render(messages, add_generation_prompt, variables, template_name)
        return self.encode(text) if tokenize else text


# --------------------------------------------------------------------------------------------- characters

DEFAULT_ALPHABET = "0123456789+-*/=()., :QA\n"
CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


class TextNotEncodable(ValueError):
    """Text with a character the tokenizer has no id for (the char tokenizer's fixed alphabet)."""


class CharTokenizer:
    """One token per character of a fixed alphabet, after `<pad>`=0, `<bos>`=1, `<eos>`=2.

    Its chat template is "Q: {user}\\n" per user turn, "A: {assistant}\\n" per assistant turn and "A: " as the
    generation prompt, so one user turn renders as "Q: {user}\\nA: ".
    """

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not alphabet:
            raise ValueError("CharTokenizer alphabet is empty")
        seen: set[str] = set()
        for position, char in enumerate(alphabet):
            if char in seen:
                raise ValueError(f"CharTokenizer alphabet {alphabet!r} repeats {char!r} at position {position}")
            seen.add(char)
        self.alphabet = alphabet
        self.pad_id = 0
        self.bos_id = 1
        self.eos_id = 2
        self._char_to_id = {c: i + len(CHAR_SPECIAL_TOKENS) for i, c in enumerate(alphabet)}
        self._id_to_text = [*CHAR_SPECIAL_TOKENS, *alphabet]

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_text)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One id per character; `add_special_tokens` prepends `<bos>`."""
        ids = [self.bos_id] if add_special_tokens else []
        for position, char in enumerate(text):
            token = self._char_to_id.get(char)
            if token is None:
                raise TextNotEncodable(
                    f"character {char!r} at position {position} of {text!r} is not in the alphabet {self.alphabet!r}"
                )
            ids.append(token)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The characters of `ids`; special tokens appear as "<pad>", "<bos>", "<eos>" unless skipped."""
        pieces = []
        for position, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} at position {position} is outside [0, {self.vocab_size})")
            if not (skip_special_tokens and token < len(CHAR_SPECIAL_TOKENS)):
                pieces.append(self._id_to_text[token])
        return "".join(pieces)

    @overload
    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = ...,
        tokenize: Literal[True] = ...,
        **extra_vars: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[False],
        **extra_vars: Any,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **extra_vars: Any,
    ) -> list[int] | str:
        """The fixed Q/A template over user and assistant turns; `extra_vars` are accepted and unused."""
        prefixes = {"user": "Q: ", "assistant": "A: "}
        parts = []
        for index, message in enumerate(messages):
            role = message.get("role")
            if role not in prefixes:
                raise ValueError(f"message {index} has role {role!r}; CharTokenizer renders only {sorted(prefixes)}")
            parts.append(f"{prefixes[role]}{message['content']}\n")
        if add_generation_prompt:
            parts.append(prefixes["assistant"])
        text = "".join(parts)
        return self.encode(text) if tokenize else text
