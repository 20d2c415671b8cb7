"""Strict checking of configurations and arguments with pydantic, and its errors in this library's terms.

The configurations (``ModelConfig``, ``DrafterConfig``, ``ReTraceConfig``, the training config) declare
their fields with the types below. Strict means that nothing is converted on the way in: ``"8"`` and
``8.7`` are not an integer, ``"false"`` and ``1`` are not a bool (Python's ``bool("false")`` is True).
An integer is still taken where a number is expected.

pydantic's ``ValidationError`` never leaves the library: :func:`problems` turns it into one short line per
field (``train.block_size: expected an integer, got '8'``), which :func:`config_error` and
:func:`argument_error` raise as :class:`~retrace_jax.errors.ConfigError` or as ``TypeError`` /
``ValueError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from retrace_jax.errors import ConfigError


def _from_numpy(value):
    """NumPy scalars (``np.int32(4)``, ``np.float32(0.5)``) as the Python values they stand for."""
    return value.item() if isinstance(value, (np.integer, np.floating, np.bool_)) else value


Int = Annotated[int, BeforeValidator(_from_numpy), Field(strict=True)]
PositiveInt = Annotated[Int, Field(ge=1)]
NonNegativeInt = Annotated[Int, Field(ge=0)]
Number = Annotated[float, BeforeValidator(_from_numpy), Field(strict=True, allow_inf_nan=False)]
PositiveNumber = Annotated[Number, Field(gt=0)]
NonNegativeNumber = Annotated[Number, Field(ge=0)]
Bool = Annotated[bool, BeforeValidator(_from_numpy), Field(strict=True)]

STRICT = ConfigDict(strict=True, extra="forbid")
TYPE_ERRORS = {"int_type": "an integer", "bool_type": "true or false", "float_type": "a number",
               "string_type": "a string", "list_type": "a list", "tuple_type": "a list", "dict_type": "a mapping",
               "model_type": "a mapping", "model_attributes_type": "a mapping", "dataclass_type": "a mapping"}
BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def field_path(loc) -> str:
    """``("train", "round_weights", 1)`` -> ``"train.round_weights[1]"``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def message(error: dict) -> str:
    """One pydantic error as a short sentence: what was expected, and what was found."""
    kind, ctx, got = error["type"], error.get("ctx") or {}, short_repr(error.get("input"))
    if kind in TYPE_ERRORS:
        return f"expected {TYPE_ERRORS[kind]}, got {got}"
    if kind in BOUNDS:
        bound = next(iter(ctx.values()))
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound  # 1, not 1.0
        return f"must be {BOUNDS[kind]} {bound}, got {got}"
    if kind == "finite_number":
        return f"must be a finite number, got {got}"
    if kind == "literal_error":
        return f"must be {ctx['expected']}, got {got}"
    if kind == "too_short":
        return f"must not be empty, got {got}"
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg'][:1].lower()}{error['msg'][1:]}, got {got}"


def problems(err: ValidationError) -> list[tuple[str, str]]:
    """``(field path, message)`` for each error (the path is "" for a check of the whole object)."""
    return [(field_path(e["loc"]), message(e)) for e in err.errors()]


def join(found: list[tuple[str, str]], source: str | Callable[[str], str] = "", parent: str = "") -> str:
    """``"source: parent.path: message; ..."``: ``source`` names where the values came from (a file), or
    is a function of the path that returns the whole prefix (``"--set "``); ``parent`` names the object
    that holds the fields (``"retrace_config"``)."""
    lines = []
    for path, text in found:
        full = ".".join(filter(None, (parent, path)))
        prefix = source(path) if callable(source) else f"{source}: " if source else ""
        lines.append(prefix + (f"{full}: {text}" if full else text))
    return "; ".join(lines)


def config_error(err: ValidationError, source: str = "", parent: str = "") -> ConfigError:
    """A :class:`ConfigError` listing every problem of ``err`` (see :func:`join`)."""
    return ConfigError(join(problems(err), source, parent))


def validated(schema, data: Any, parent: str = ""):
    """``schema.model_validate(data)``, its problems raised as one :class:`ConfigError`."""
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise config_error(err, parent=parent) from None


def argument_error(err: ValidationError, caller: str) -> Exception:
    """Bad arguments of ``caller``: a ``TypeError`` when every problem is a wrong type, else a
    ``ValueError``; each names its argument."""
    kinds = {e["type"] for e in err.errors()}
    error = TypeError if kinds <= set(TYPE_ERRORS) else ValueError
    return error(f"{caller}: {join(problems(err))}")


def config_dataclass(cls=None, /, **kwargs):
    """A frozen, hashable dataclass (static in ``jit``, like ``dataclasses.dataclass(frozen=True)``) whose
    fields are checked strictly whenever it is built, ``dataclasses.replace`` included; a bad field raises
    :class:`ConfigError` naming it."""

    def wrap(cls):
        cls = pydantic_dataclass(frozen=True, config=STRICT, **kwargs)(cls)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kw):
            try:
                init(self, *args, **kw)
            except ValidationError as err:
                raise config_error(err) from None

        cls.__init__ = __init__
        return cls

    return wrap if cls is None else wrap(cls)


def _none_as(default):
    return BeforeValidator(lambda value: default if value is None else value)


class GenerateArguments(BaseModel):
    """The scalar arguments of ``rj.generate``, checked before anything is traced: a string, a float or a
    bool where an integer is due would fail deep inside tracing or be truncated (``int(8.7)``), and
    ``bool("no")`` is True. ``top_k=None`` and ``top_p=None`` mean no filter, as 0 and 1.0 do."""

    model_config = STRICT
    max_new_tokens: PositiveInt
    temperature: NonNegativeNumber
    top_k: Annotated[NonNegativeInt, _none_as(0)]
    top_p: Annotated[Number, Field(gt=0, le=1), _none_as(1.0)]
    seed: Annotated[Int, Field(ge=0, lt=2**32)]
    block_size: Annotated[Int, Field(ge=2)] | None
    use_retrace: Bool


def generate_arguments(**values) -> GenerateArguments:
    """:class:`GenerateArguments` of ``values``; a ``TypeError`` or ``ValueError`` naming each bad one."""
    try:
        return GenerateArguments(**values)
    except ValidationError as err:
        raise argument_error(err, "generate") from None
