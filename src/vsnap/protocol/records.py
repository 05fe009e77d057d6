"""Frozen records read from JSON and checked field by field, without pydantic.

The control messages, the oracle, the manifest and the instance records are read by every
`vsnap restore` before its first phase. pydantic's import and its schemas cost a restore command
~0.14 s on the H200 host (docs/benchmarks/NOTES.md, session 10), so these records are plain frozen
dataclasses with a strict reader instead: ``Record.model_validate_json`` refuses what is not
exactly the declared shape (a missing field, an unknown one, a value of another JSON type, a
number out of its bounds), naming the path to the first bad value the way pydantic did. The
method names are pydantic's, so callers read the same.

What a field may hold: str (no lone surrogate), int (never a bool; 64 bits), float (finite; an
int is taken as a float), bool, None, ``X | None`` and other unions (the first that fits),
``Literal[...]``, ``list[X]``, ``dict[str, X]``, ``Any`` (any JSON value, its scalars held to the
same rules) and another Record (from a JSON object). ``field(ge=, le=)`` bounds a number,
``field(finite=False)`` takes NaN and infinities (the oracle's log probabilities: a NaN there is a
mismatch to report, not a malformed message). A record may check itself as a whole in ``_check``
(raise ValueError).

A leaf: imports nothing of vsnap (the engine tree imports it through protocol.control).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, Union

if TYPE_CHECKING:
    from typing_extensions import Self, dataclass_transform
else:
    def dataclass_transform(**_: Any) -> Any:
        return lambda cls: cls

R = TypeVar("R", bound="Record")
Loc = tuple[typing.Union[str, int], ...]


class RecordError(ValueError):
    """A document that does not fit a record: where (``loc``, the keys and indices to the first bad
    value) and what (``msg``, pydantic's wording)."""

    def __init__(self, loc: Loc, msg: str) -> None:
        self.loc, self.msg = loc, msg
        super().__init__(f"{self.where}: {msg}")

    @property
    def where(self) -> str:
        """``loc`` as one short line: keys that are not plain words shown quoted and cut (they
        come from the document, which may be anyone's)."""
        return ".".join(_shown_key(part) for part in self.loc) or "document"

    def errors(self) -> list[dict[str, Any]]:
        """One error, shaped as pydantic's ValidationError.errors() items."""
        return [{"loc": self.loc, "msg": self.msg}]


def _shown_key(part: Any) -> str:
    if isinstance(part, int) or (isinstance(part, str) and part.isascii() and part.replace("_", "a").isalnum()
                                 and len(part) <= 64):
        return str(part)
    if not isinstance(part, str):
        return type(part).__name__
    return repr(part[:40] + ("..." if len(part) > 40 else ""))


def field(*, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
          ge: float | None = None, le: float | None = None, finite: bool = True) -> Any:
    """A field with a default and/or bounds for its numbers (``ge``/``le``, and ``finite=False``
    to let its floats be NaN or infinite; inside lists and dicts too)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"ge": ge, "le": le, "finite": finite})


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(field,))
class Record:
    """Subclasses are frozen, keyword-only dataclasses whose values are checked (and nested
    records built from dicts) when they are made, from code or from JSON."""

    _hints: ClassVar[dict[str, Any] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True, kw_only=True)(cls)

    def __post_init__(self) -> None:
        hints = type(self)._type_hints()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = _check_value(hints[f.name], value, (f.name,), f.metadata)
            if checked is not value:
                object.__setattr__(self, f.name, checked)
        try:
            self._check()
        except RecordError:
            raise
        except ValueError as exc:
            raise RecordError((), f"Value error, {exc}") from None

    def _check(self) -> None:
        """Checks of the record as a whole, once every field fits (raise ValueError)."""

    @classmethod
    def _type_hints(cls) -> dict[str, Any]:
        if cls.__dict__.get("_hints") is None:  # each class its own, resolved at its first use
            cls._hints = typing.get_type_hints(cls)
        return cls._hints  # type: ignore[return-value]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def model_validate(cls, data: Any) -> Self:
        return _build(cls, data, ())

    @classmethod
    def model_validate_json(cls, data: bytes | str) -> Self:
        """From JSON text: UTF-8 only (json.loads would also take UTF-16 and UTF-32 bytes), no
        byte-order mark, nothing nested deeper than MAX_DEPTH, no lone surrogate in a string."""
        try:
            text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
            if text.startswith("\ufeff"):
                raise ValueError("a byte-order mark")
            document = json.loads(text)
        except RecursionError:
            raise RecordError((), "Invalid JSON: nested too deep") from None
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError among them
            raise RecordError((), f"Invalid JSON: {exc}") from None
        return cls.model_validate(document)

    @classmethod
    def model_construct(cls, **values: Any) -> Self:
        """A record of trusted ``values``, unchecked: the fields not given take their defaults
        (one without a default is left unset), as pydantic's model_construct. For tests."""
        record = object.__new__(cls)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in values:
                object.__setattr__(record, f.name, values[f.name])
            elif f.default is not dataclasses.MISSING:
                object.__setattr__(record, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                object.__setattr__(record, f.name, f.default_factory())
        return record

    def model_dump(self, *, include: set[str] | None = None, mode: str = "python") -> dict[str, Any]:
        """The record as JSON values (``mode`` is taken for pydantic's signature: every value is
        JSON already)."""
        return {f.name: _dump(getattr(self, f.name)) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if include is None or f.name in include}

    def model_dump_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.model_dump(), indent=indent, ensure_ascii=False,
                          separators=(",", ":") if indent is None else None)

    def model_copy(self, *, update: dict[str, Any] | None = None) -> Self:
        """A copy with ``update``'s fields replaced (and checked, as when the record was made)."""
        names = self.field_names()
        for name in update or {}:
            if name not in names:
                raise RecordError((name,), "Extra inputs are not permitted")
        return dataclasses.replace(self, **(update or {}))  # type: ignore[type-var]


def _build(cls: type[R], data: Any, loc: Loc) -> R:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise RecordError(loc, f"Input should be a valid dictionary or instance of {cls.__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            raise RecordError(loc + (key,), "Extra inputs are not permitted")
    for name, f in fields.items():
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecordError(loc + (name,), "Field required")
    try:
        return cls(**data)
    except RecordError as exc:
        raise RecordError(loc + exc.loc, exc.msg) from None


_MESSAGES = {str: "a valid string", int: "a valid integer", float: "a valid number", bool: "a valid boolean"}
MAX_DEPTH = 200  # of lists and dicts inside a field of type Any (pydantic refused deeper ones too)
INT_LIMIT = 1 << 63  # every int a record holds fits in 64 bits (sizes, pids, counts)


def _check_value(hint: Any, value: Any, loc: Loc, bounds: Any = None) -> Any:
    """``value`` as a field of type ``hint`` holds it (nested records built, lists and dicts
    new), or RecordError."""
    if hint is Any:
        _check_plain(value, loc)
        return value
    if hint is type(None):
        if value is not None:
            raise RecordError(loc, "Input should be None")
        return value
    if hint in _MESSAGES:
        return _check_scalar(hint, value, loc, bounds)
    if isinstance(hint, type) and issubclass(hint, Record):
        return _build(hint, value, loc)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        first: RecordError | None = None
        for option in (a for a in args if a is not type(None)):
            try:
                return _check_value(option, value, loc, bounds)
            except RecordError as exc:
                first = first or exc
        assert first is not None
        raise first
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in args):
            raise RecordError(loc, "Input should be " + _alternatives([repr(a) for a in args]))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecordError(loc, "Input should be a valid list")
        (item,) = args or (Any,)
        return [_check_value(item, v, loc + (i,), bounds) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(loc, "Input should be a valid dictionary")
        key_type, item = args or (str, Any)
        return {_check_value(key_type, k, loc + (k,) if isinstance(k, str) else loc):
                _check_value(item, v, loc + (k,), bounds) for k, v in value.items()}
    raise TypeError(f"records cannot hold {hint!r}")  # a programming error: the declared type


def _check_scalar(hint: type, value: Any, loc: Loc, bounds: Any) -> Any:
    if isinstance(value, bool) is not (hint is bool):  # a bool is an int to Python, never here
        raise RecordError(loc, f"Input should be {_MESSAGES[hint]}")
    if hint is float and isinstance(value, int):  # JSON has one kind of number: 900 for 900.0
        try:
            value = float(value)
        except OverflowError:
            raise RecordError(loc, "Input should be a finite number") from None
    elif not isinstance(value, hint):
        raise RecordError(loc, f"Input should be {_MESSAGES[hint]}")
    if hint is float and not math.isfinite(value) and (not bounds or bounds.get("finite", True)):
        raise RecordError(loc, "Input should be a finite number")  # NaN and Infinity, unless the field takes them
    if hint is int and not -INT_LIMIT <= value < INT_LIMIT:
        raise RecordError(loc, "Input should be an integer of at most 64 bits")
    if hint is str:
        _check_text(value, loc)
    if bounds:  # `not >=`: NaN is within no bounds
        if bounds.get("ge") is not None and not value >= bounds["ge"]:
            raise RecordError(loc, f"Input should be greater than or equal to {bounds['ge']}")
        if bounds.get("le") is not None and not value <= bounds["le"]:
            raise RecordError(loc, f"Input should be less than or equal to {bounds['le']}")
    return value


def _check_text(text: str, loc: Loc) -> None:
    """No lone surrogate (json.loads decodes "\\ud800"; it could not be written out as UTF-8)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError(loc, "Input should be a valid string (a lone surrogate)") from None


def _check_plain(value: Any, loc: Loc) -> None:
    """A value of a field of type Any: JSON's kinds only, at most MAX_DEPTH lists and dicts deep,
    no lone surrogate; walked without recursion."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (list, tuple, dict)):  # (a tuple from code is written as a list)
            if depth >= MAX_DEPTH:
                raise RecordError(loc, f"Input is nested deeper than {MAX_DEPTH} levels")
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        raise RecordError(loc, "Input should be a valid dictionary (its keys strings)")
                    _check_text(key, loc)
                pending.extend((v, depth + 1) for v in item.values())
            else:
                pending.extend((v, depth + 1) for v in item)
        elif isinstance(item, (str, bool, int, float)):  # as a field of that type holds it
            _check_scalar(next(t for t in (bool, str, float, int) if isinstance(item, t)), item, loc, None)
        elif item is not None:
            raise RecordError(loc, f"Input should be a JSON value, not {type(item).__name__}")


def is_plain(value: Any) -> bool:
    """Would a field of type Any hold ``value`` (the rules of _check_plain)? For a writer that
    leaves out what a record could not carry rather than fail."""
    try:
        _check_plain(value, ())
    except RecordError:
        return False
    return True


def _alternatives(shown: list[str]) -> str:
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + f" or {shown[-1]}"


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.model_dump()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value
