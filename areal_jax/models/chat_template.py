"""Chat templates of a Hugging Face tokenizer directory, rendered as `transformers` renders them.

The named templates are read from `chat_template.jinja`, `additional_chat_templates/*.jinja` or the
`chat_template` entry of `tokenizer_config.json`, compiled in the sandboxed jinja2 environment `transformers`
uses (its filters and globals included), so a conversation renders to the same text as
`AutoTokenizer.apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

Messages = Sequence[Mapping[str, Any]]

DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The jinja2 environment `transformers` renders chat templates in."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def read_chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates of a tokenizer directory whose `tokenizer_config.json` is `config`;
    `chat_template.jinja` and `additional_chat_templates/` win over the config entry."""
    from_files: dict[str, str] = {}
    default_file = directory / "chat_template.jinja"
    if default_file.is_file():
        from_files[DEFAULT_TEMPLATE] = default_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for template_file in sorted(extra_dir.glob("*.jinja")):
            from_files[template_file.stem] = template_file.read_text(encoding="utf-8")
    if from_files:
        return from_files
    entry = config.get("chat_template")
    where = f"{directory / 'tokenizer_config.json'}: chat_template"
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {DEFAULT_TEMPLATE: entry}
    if isinstance(entry, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in entry
    ):
        return {t["name"]: t["template"] for t in entry}
    raise ValueError(f"{where}: expected a string or a list of {{'name', 'template'}} dicts, got {entry!r}")


class ChatTemplates:
    """A tokenizer's named chat templates, compiled; `path` (the tokenizer directory) names them in errors."""

    def __init__(self, sources: Mapping[str, str], path: Path):
        self.sources = dict(sources)
        self.path = path
        env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        for name, source in self.sources.items():
            try:
                self._compiled[name] = env.from_string(source)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ValueError(f"{path}: chat template {name!r} does not compile: {e}") from e

    def render(
        self,
        messages: Messages,
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
        template_name: str | None = None,
    ) -> str:
        """The conversation's text; `variables` (special token strings, `tools`, `enable_thinking`, ...) reach
        the template. `template_name` picks one of the templates; by default "tool_use" when tools are given
        and there is one, else "default"."""
        if not messages:
            raise ValueError("apply_chat_template needs at least one message, got an empty conversation")
        template = self._template(template_name, has_tools=variables.get("tools") is not None)
        return template.render(
            messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
            add_generation_prompt=add_generation_prompt,
            **{"tools": None, "documents": None, **variables},
        )

    def _template(self, name: str | None, has_tools: bool) -> jinja2.Template:
        if not self._compiled:
            raise ValueError(
                f"tokenizer at {self.path} has no chat template: looked for chat_template.jinja and the "
                "chat_template entry of tokenizer_config.json"
            )
        if name is None:
            name = TOOL_USE_TEMPLATE if has_tools and TOOL_USE_TEMPLATE in self._compiled else DEFAULT_TEMPLATE
        if name not in self._compiled:
            raise ValueError(f"tokenizer at {self.path} has no chat template {name!r}; it has {sorted(self._compiled)}")
        return self._compiled[name]
