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
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
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


# The largest speculative block (anchor + proposals) that ``generate`` runs. A block is one verify pass of
# the target and one drafter pass; trained DFlash drafters use 16, and acceptance falls off well before
# this bound, while the caches, the verify logits and the compile time grow with the block.
MAX_BLOCK_SIZE = 256
# Sampling divides float32 logits by the temperature. Below MIN_TEMPERATURE sampling is greedy decoding
# but for near-ties (a logit gap of 1e-4 becomes 100) and far below it the scaled logits overflow float32
# (to inf, then NaN probabilities); above MAX_TEMPERATURE the distribution is uniform to float32 precision
# for any sane model, and past float32's range the temperature itself becomes inf.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6
# The compiled programs take top_k as an int32 (any value from the vocabulary size up keeps every token).
MAX_TOP_K = 2**31 - 1


def _temperature(value: float) -> float:
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, got {value!r}")
    return value


class GenerateArguments(BaseModel):
    """The scalar arguments of ``rj.generate``, checked before anything is traced: a string, a float or a
    bool where an integer is due would fail deep inside tracing or be truncated (``int(8.7)``), and
    ``bool("no")`` is True. ``top_k=None`` and ``top_p=None`` mean no filter, as 0 and 1.0 do. The
    temperature is 0 or in ``[MIN_TEMPERATURE, MAX_TEMPERATURE]``; ``top_k`` at most ``MAX_TOP_K``;
    ``block_size`` at most ``MAX_BLOCK_SIZE``."""

    model_config = STRICT
    max_new_tokens: PositiveInt
    temperature: Annotated[NonNegativeNumber, AfterValidator(_temperature)]
    top_k: Annotated[NonNegativeInt, Field(le=MAX_TOP_K), _none_as(0)]
    top_p: Annotated[Number, Field(gt=0, le=1), _none_as(1.0)]
    seed: Annotated[Int, Field(ge=0, lt=2**32)]
    block_size: Annotated[Int, Field(ge=2, le=MAX_BLOCK_SIZE)] | None
    use_retrace: Bool
    slots: Annotated[PositiveInt, Field(le=2**31 - 1)] | None = None
    rounds_per_call: Annotated[PositiveInt, Field(le=2**31 - 1)] = 64  # an int32 in the programs


def generate_arguments(**values) -> GenerateArguments:
    """:class:`GenerateArguments` of ``values``; a ``TypeError`` or ``ValueError`` naming each bad one."""
    try:
        return GenerateArguments(**values)
    except ValidationError as err:
        raise argument_error(err, "generate") from None


class LoadDrafterArguments(BaseModel):
    """``rj.load_drafter``'s ``retrace`` when it is not a ``ReTraceConfig`` (that is taken as it is): True,
    False or None, as strict as ``generate``'s ``use_retrace`` (``"no"`` and ``0`` are not False)."""

    model_config = STRICT
    retrace: Bool | None


def load_drafter_arguments(**values) -> LoadDrafterArguments:
    """:class:`LoadDrafterArguments` of ``values``; a ``TypeError`` or ``ValueError`` naming each bad one."""
    try:
        return LoadDrafterArguments(**values)
    except ValidationError as err:
        raise argument_error(err, "load_drafter") from None


def token_ids(ids, vocab_size: int, what: str, at: str = "position {}", *, allow_set: bool = False) -> np.ndarray:
    """``ids`` (a list, tuple or 1-D integer array of token ids; with ``allow_set`` also a set) as an int64
    array, checked entry by entry so that an error names ``what`` and, through ``at`` (a format string of
    the index), the entry at fault: ``True`` is not token 1, ``2.0`` is not token 2, a nested list is not
    a token, and a mapping's keys are not its ids. A wrong type raises ``TypeError``, an id outside
    ``[0, vocab_size)`` ``ValueError``."""
    if isinstance(ids, (str, bytes, Mapping)) or not (
            isinstance(ids, Sequence) or (allow_set and isinstance(ids, AbstractSet)) or hasattr(ids, "__array__")):
        kind = "a list or set" if allow_set else "a list"
        raise TypeError(f"{what} must be {kind} of token ids, got {type(ids).__name__} {short_repr(ids)}")
    if isinstance(ids, AbstractSet):  # the positions of a set mean nothing
        ids, at = sorted(ids, key=lambda v: (type(v).__name__, repr(v))), "an entry"
    if hasattr(ids, "__array__") and not isinstance(ids, Sequence):  # a NumPy or JAX array: checked whole
        values = np.asarray(ids)
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise TypeError(f"{what} must be a flat list of integer token ids, got an array of shape "
                            f"{values.shape} and dtype {values.dtype}")
        values = values.tolist()
    else:
        values = list(ids)
        for j, value in enumerate(values):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{what} must hold integer token ids; {at.format(j)} is {type(value).__name__} "
                                f"{short_repr(value)}")
    try:
        arr = np.array(values, dtype=np.int64)
        inside = not arr.size or bool(arr.min() >= 0 and arr.max() < vocab_size)
    except OverflowError:  # a Python int past 64 bits
        inside = False
    if not inside:
        j = next(j for j, value in enumerate(values) if not 0 <= value < vocab_size)
        raise ValueError(f"{what}: {at.format(j)} holds token id {int(values[j])}, outside the vocabulary "
                         f"[0, {vocab_size})")
    return arr
