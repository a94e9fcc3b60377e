"""Typed, frozen configuration sections: YAML in, dotted overrides, validation that names the key.

A section is a frozen dataclass deriving from `Config`; each field is declared with `option(...)`,
which carries its documentation and its allowed range. `load(cls, path, overrides)` reads YAML,
applies `a.b.c=value` overrides and builds the typed tree; every refusal is a `ConfigError` whose
message names the dotted key, the offending value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from areal_jax import storage

logger = logging.getLogger(__name__)

C = TypeVar("C", bound="Config")

_MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A configuration value was refused; `key` is the dotted path of the offending entry."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.detail = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key placed below `prefix`."""
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.detail)


def option(
    default: Any = _MISSING,
    *,
    default_factory: Any = _MISSING,
    doc: str = "",
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A documented config field with an optional numeric range (inclusive `ge`/`le`, strict `gt`/`lt`)."""
    metadata = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _allowed_range(meta: Mapping[str, Any]) -> str:
    parts = []
    if meta.get("ge") is not None:
        parts.append(f">= {meta['ge']}")
    if meta.get("gt") is not None:
        parts.append(f"> {meta['gt']}")
    if meta.get("le") is not None:
        parts.append(f"<= {meta['le']}")
    if meta.get("lt") is not None:
        parts.append(f"< {meta['lt']}")
    return " and ".join(parts)


def _check_range(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    ok = (
        (meta.get("ge") is None or value >= meta["ge"])
        and (meta.get("gt") is None or value > meta["gt"])
        and (meta.get("le") is None or value <= meta["le"])
        and (meta.get("lt") is None or value < meta["lt"])
    )
    if not ok:
        raise ConfigError(name, f"value {value!r} is out of range; allowed: {_allowed_range(meta)}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_choice(tp: Any) -> bool:
    """A `Literal[...]` field, or an optional one."""
    if typing.get_origin(tp) is Literal:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(typing.get_origin(a) is Literal for a in typing.get_args(tp))
    return False


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every configuration section: range checks on construction plus a cross-field hook.

    `REMOVED_KEYS` names keys a section had and no longer has, with why: a config that still sets one (an
    older run's config.yaml, which lists every key) loads with a warning instead of being refused."""

    REMOVED_KEYS: typing.ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))  # type: ignore[arg-type]  # mypy checks a class by its instances' __hash__
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_range(f.name, value, f.metadata)
            if _is_choice(hints[f.name]):
                _coerce(f.name, value, hints[f.name])  # refuses a value outside the Literal, also in code
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise `ConfigError(field_name, message)`."""

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML-loaded value to `tp`, refusing anything that does not fit."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(key, f"got {value!r}; allowed: {', '.join(repr(a) for a in allowed)}{suggestion}")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for candidate in options:
            if candidate is type(None):
                continue
            if isinstance(value, Mapping) and isinstance(candidate, type) and issubclass(candidate, Config):
                return _coerce(key, value, candidate)  # a section's own errors name its inner key
            try:
                return _coerce(key, value, candidate)
            except ConfigError:
                continue
        raise ConfigError(key, f"got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")
        (item_type, *_rest) = typing.get_args(tp)
        return tuple(_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value))
    if isinstance(tp, type) and issubclass(tp, Config):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                key, f"got {value!r} ({type(value).__name__}); expected a mapping for section {tp.__name__}"
            )
        try:
            return from_dict(tp, value)
        except ConfigError as err:
            raise err.under(key) from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r} ({type(value).__name__}); expected bool (true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r} ({type(value).__name__}); expected int")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, f"got {value!r} ({type(value).__name__}); expected float")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"got {value!r} ({type(value).__name__}); expected str")
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _unknown_key_error(cls: type, key: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    hint = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return ConfigError(key, f"unknown key for {cls.__name__}{suggestion} (known: {', '.join(names)})")


def from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
    """Build `cls` from a plain mapping, refusing unknown keys, wrong types and out-of-range values."""
    hints = typing.get_type_hints(cls)
    field_names = {f.name for f in dataclasses.fields(cls)}
    removed = getattr(cls, "REMOVED_KEYS", {})
    for key in data:
        if key in removed and key not in field_names:
            logger.warning("config key %r of %s is ignored: it was removed (%s)", key, cls.__name__, removed[key])
        elif key not in field_names:
            raise _unknown_key_error(cls, str(key))
    kwargs = {name: _coerce(name, value, hints[name]) for name, value in data.items() if name in field_names}
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is _MISSING and f.default_factory is _MISSING:
            raise ConfigError(f.name, f"required key is missing ({_type_name(hints[f.name])})")
    return cls(**kwargs)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of a config (tuples become lists), the inverse of `from_dict`."""

    def plain(value: Any) -> Any:
        if isinstance(value, Config):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        return value

    return plain(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(text, "override must look like section.key=value")
    dotted, raw = text.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(dotted, "override key has an empty part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(cls: type[Config], data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Set `a.b.c=value` entries into a nested dict, checking each key path against `cls`."""
    data = _deep_copy(data)
    for text in overrides:
        keys, value = _parse_override(text)
        section_cls: Any = cls
        node = data
        for depth, key in enumerate(keys):
            dotted = ".".join(keys[: depth + 1])
            names = {f.name for f in dataclasses.fields(section_cls)}
            if key not in names:
                err = _unknown_key_error(section_cls, key)
                raise err.under(".".join(keys[:depth])) if depth else err
            field_type = typing.get_type_hints(section_cls)[key]
            if depth == len(keys) - 1:
                node[key] = value
                break
            inner = _section_type(field_type)
            if inner is None:
                raise ConfigError(
                    dotted, f"is a {_type_name(field_type)}, not a section; it has no key {keys[depth + 1]!r}"
                )
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                raise ConfigError(dotted, "expected a mapping")
            section_cls = inner
    return data


def _section_type(tp: Any) -> type[Config] | None:
    """The Config class of a section field, also when declared optional (`Section | None`)."""
    candidates = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Config):
            return candidate
    return None


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


BASE_KEY = "base"


def _yaml_mapping(location: str, read: Callable[[], str]) -> dict[str, Any]:
    """The top-level mapping of the YAML text `read` returns for `location`."""
    try:
        text = read()
    except OSError as err:
        raise ConfigError("", f"cannot read config file {location!r}: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError("", f"{location}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{location}: top level must be a mapping, got {type(data).__name__}")
    return data


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML mapping. A top-level `base: other.yaml` (relative to this file) is read first and this
    file's keys are merged over it, section by section. A gs:// file is read too (a run's own config.yaml,
    which has no base)."""
    if storage.is_remote(path):
        data = _yaml_mapping(str(path), lambda: storage.read_text(path))
        if BASE_KEY in data:
            raise ConfigError(BASE_KEY, f"{path}: a config on gs:// cannot name a base file; flatten it")
        return data
    path = Path(path)
    if path.resolve() in _seen:
        raise ConfigError(BASE_KEY, f"{path}: the base chain comes back to itself ({' -> '.join(map(str, _seen))})")
    data = _yaml_mapping(str(path), path.read_text)
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(BASE_KEY, f"{path}: expected a YAML file name, got {base!r}")
    return _merge(read_yaml(path.parent / base, (*_seen, path.resolve())), data)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = _deep_copy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load(cls: type[C], path: str | Path | None = None, overrides: Iterable[str] = ()) -> C:
    """Read a YAML file (optional), apply dotted overrides, and build a validated `cls`."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(cls, data, overrides))


def describe(cls: type[Config], prefix: str = "") -> list[str]:
    """One line per field, `key (type, default, range): doc`, recursing into sections (an optional section,
    e.g. `model.lora`: its own line, then its fields)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if isinstance(tp, type) and issubclass(tp, Config):
            lines.extend(describe(tp, prefix=f"{key}."))
            continue
        default = f.default if f.default is not _MISSING else "required"
        allowed = _allowed_range(f.metadata)
        extra = f", {allowed}" if allowed else ""
        lines.append(f"{key} ({_type_name(tp)}, default {default!r}{extra}): {f.metadata.get('doc', '')}")
        section = _optional_section(tp)
        if section is not None:
            lines.extend(describe(section, prefix=f"{key}."))
    return lines


def _optional_section(tp: Any) -> type[Config] | None:
    """The section of a `Section | None` field, else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    sections = [a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, Config)]
    return sections[0] if len(sections) == 1 else None
