"""Every config field with its documentation, as ``drmas config --docs`` prints it: the
field docstrings of the schema are the reference."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel

__all__ = ["describe_fields"]


def describe_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per field, 'section.field (type, default): docstring', recursively."""
    lines = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _section_type(field.annotation)
        if nested is not None:
            lines.append(f"{path}: {field.description or ''}")
            lines += describe_fields(nested, prefix=f"{path}{_container_suffix(field)}.")
            continue
        default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
        lines.append(
            f"{path} ({_type_name(field.annotation)}, {default}): {(field.description or '').replace(chr(10), ' ')}"
        )
    return lines


def _type_name(annotation: typing.Any) -> str:
    """A field's type as the user writes its value: a Literal as its allowed values
    ('none' | 'by_model'), so that the docs say what the field takes."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(option) for option in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")  # a generic: dict[str, list[str]]


def _section_type(annotation: typing.Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _container_suffix(field: typing.Any) -> str:
    """'[]' for a list of sections, '.<name>' for a mapping of them."""
    origin = typing.get_origin(field.annotation)
    return "[]" if origin is list else ".<name>" if origin is dict else ""
