"""Typed settings, checked by one validator: the base of params.yaml's sections (pipeline/config.py), of
every precision backend's options and of the probe's settings (model/precision/options.py).

A settings class is a dataclass whose fields say what they take: the type, the allowed values as
`Literal[...]` (`choices()` lists them), a docstring, and in `MINIMUM` the smallest value a number may
take; `check()` adds what relates several fields (litgpt's `__post_init__` checks). A class with a fixed
place in params.yaml (`KEY`, e.g. 'precision.fp8') checks itself on construction; one used in several
places (a training stage's block) is checked where it is built, under that place's key. Every error is a
`SettingError` naming the full key and what it takes (`runtime.parallel must be one of ddp, fsdp; got
'zero3'`).

Deliberately free of torch, so the configuration and the command line's `--help` load quickly.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping


class SettingError(ValueError):
    """A bad setting; the message names its key (e.g. pretrain.matrix_lr) and what it takes."""


def choices(tp) -> tuple:
    """The allowed values of a Literal type, e.g. choices(TERecipe) == ('delayed', 'current', ...)."""
    return typing.get_args(tp)


def join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


@dataclass
class Settings:
    KEY: ClassVar[str] = ""
    """Where params.yaml holds these settings, e.g. 'precision.fp8'; '' where the place decides."""
    MINIMUM: ClassVar[dict[str, float]] = {}
    """field -> the smallest value it may take."""

    def __post_init__(self):
        if self.KEY:
            self.check(self.KEY)

    def check(self, key: str) -> None:
        """Each field's type and allowed values (a number stored as the field's type), then `MINIMUM`.
        Subclasses add the checks that relate fields, after calling this one."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, Settings):  # a nested block checked itself as it was built
                setattr(self, f.name, _checked(value, hints[f.name], join(key, f.name)))
        for name, low in self.MINIMUM.items():
            if getattr(self, name) < low:
                raise SettingError(f"{join(key, name)} must be >= {low}, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, key: str | None = None, base: "Settings | None" = None):
        """These settings from a params block (field -> value; a nested block for a field that is itself
        settings), over `base` (a profile overlays params.yaml) if given, checked under `key` (default KEY)."""
        key = cls.KEY if key is None else key
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise SettingError(f"{key or 'params'} must be a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise SettingError(f"unknown key '{join(key, unknown[0])}' (known keys: {', '.join(names)})")
        values = {}
        for name in names:
            tp = hints[name]
            if isinstance(tp, type) and issubclass(tp, Settings):
                values[name] = tp.from_dict(data.get(name), join(key, name), getattr(base, name, None))
            elif name in data:
                values[name] = data[name]
        out = dataclasses.replace(base, **values) if base is not None else cls(**values)
        out.check(key)
        return out

    @classmethod
    def parse(cls, pairs: Mapping[str, str]):
        """These settings from text values (`key=value` on a command line), each read as its field's type."""
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        typed = {}
        for k, text in pairs.items():
            if k not in names:
                raise SettingError(f"unknown key '{join(cls.KEY, k)}' (known keys: {', '.join(names)})")
            typed[k] = _from_text(text, hints[k], join(cls.KEY, k))
        return cls(**typed)

    @classmethod
    def docs(cls) -> dict[str, str]:
        """field -> its docstring on one line (the source's string after each field), so a command line's
        help says what the class says instead of restating it."""
        import ast
        import inspect
        import textwrap

        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        return {item.target.id: " ".join(after.value.value.split())
                for item, after in zip(body, body[1:])
                if isinstance(item, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)}

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a label or a probe row records)."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def _shown(value) -> str:
    return '""' if value == "" else str(value)


def _checked(value, tp, key):
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise SettingError(f"{key} must be one of {', '.join(map(_shown, typing.get_args(tp)))}; got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise SettingError(f"{key} must be a list, got {type(value).__name__} ({value!r})")
        return [_checked(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool and not isinstance(value, bool):
        raise SettingError(f"{key} must be true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise SettingError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str and not isinstance(value, str):
        raise SettingError(f"{key} must be a string, got {value!r}")
    return value


def _from_text(text: str, tp, key):
    if tp is bool:
        if text not in ("true", "false"):
            raise SettingError(f"{key} must be true or false, got {text!r}")
        return text == "true"
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise SettingError(f"{key} must be {'an integer' if tp is int else 'a number'}, got {text!r}") from None
    if typing.get_origin(tp) is list:  # a list on one line: a+b
        return [s for s in text.split("+") if s]
    return text
