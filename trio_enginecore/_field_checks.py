"""Checking a msgspec Struct's fields against its annotations (pure, synchronous).

msgspec checks types when it decodes, never when a Struct is built in Python: a
``SamplingParams(seed="1")`` is built, encoded and sent, and only the engine's typed
decoder finds out, naming a wire position rather than the field. Worse, an engine in
the caller's process never decodes at all. :class:`FieldCheck` reads a Struct's
annotations once (through :mod:`msgspec.inspect`, so a field added to the Struct is
checked with no change here) and checks an instance's values against them, naming the
field: ``SamplingParams.seed must be an int or None, got str '1'``.

Ints must also fit in the 64 bits msgpack carries (a signed or an unsigned one), so a
value that could not be encoded is refused where it was set rather than at send time.

The check runs on every request a client sends, so its common case is cheap: the
exact types of the values (one C-level pass) are looked up in a table of the type
combinations seen before, which says which values still need a look (the items of a
non-empty list, the range of the ints). A new combination is planned once.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Iterable
from typing import Any, Final, cast, final

import attrs
import msgspec
import msgspec.inspect as mi

__all__ = ["FieldCheck", "describe"]

_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
# Enough for every combination a program really uses; a program that builds endless
# new ones only costs a re-plan per call.
_MAX_PLANS: Final = 256
_NONE_TYPE: Final = type(None)
_astuple: Final = msgspec.structs.astuple
_CONTAINERS: Final = frozenset({list, set, frozenset, tuple, dict})


def describe(value: object) -> str:
    """``str '1'``: a value's type and (shortened) repr, for error messages."""
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= 120 else text[:117] + "..."


@final
@attrs.frozen
class _Rule:
    """What one annotation accepts.

    ``check`` is the whole truth. ``plain`` are the value types accepted on their type
    alone; ``deep`` maps those whose value must still be checked (items, ranges) to
    the check for a value of that type;
    ``ints`` says that a plain int is accepted when in the 64-bit range, which the
    table checks for every such field at once. ``anything`` skips the field.
    """

    check: Callable[[object], bool]
    what: str
    plain: frozenset[type] = frozenset()
    deep: dict[type, Callable[[object], bool]] = attrs.field(
        factory=dict[type, Callable[[object], bool]]
    )
    ints: bool = False
    anything: bool = False
    items: _Rule | None = None
    int_only: bool = False


def _in_range(value: int) -> bool:
    return _INT_MIN <= value <= _INT_MAX


def _int_rule(t: mi.IntType) -> _Rule:
    low = _INT_MIN
    high = _INT_MAX
    if t.ge is not None:
        low = max(low, t.ge)
    if t.gt is not None:
        low = max(low, t.gt + 1)
    if t.le is not None:
        high = min(high, t.le)
    if t.lt is not None:
        high = min(high, t.lt - 1)
    if (low, high) == (_INT_MIN, _INT_MAX) and t.multiple_of is None:
        return _Rule(lambda v: type(v) is int and _in_range(v), "an int", ints=True, int_only=True)
    step = t.multiple_of or 1

    def check(v: object) -> bool:
        return type(v) is int and low <= v <= high and v % step == 0

    return _Rule(check, f"an int in [{low}, {high}]", deep={int: check})


def _float_rule(t: mi.FloatType) -> _Rule:
    if (t.ge, t.gt, t.le, t.lt, t.multiple_of) == (None,) * 5:
        # An int is a float to a reader of "temperature=1"; a bool is not.
        return _Rule(
            lambda v: type(v) is float or (type(v) is int and _in_range(v)),
            "a float",
            plain=frozenset({float}),
            ints=True,
        )
    bounds = (t.ge, t.gt, t.le, t.lt)

    def check(v: object) -> bool:
        if type(v) is not float and type(v) is not int:
            return False
        ge, gt, le, lt = bounds
        return (
            (ge is None or v >= ge)
            and (gt is None or v > gt)
            and (le is None or v <= le)
            and (lt is None or v < lt)
        )

    low = (t.ge, "[", ">=") if t.ge is not None else (t.gt, "(", ">")
    high = (t.le, "]", "<=") if t.le is not None else (t.lt, ")", "<")
    if low[0] is not None and high[0] is not None:
        what = f"in {low[1]}{low[0]:g}, {high[0]:g}{high[1]}"
    else:
        bound, _, word = low if low[0] is not None else high
        what = f"{word} {bound:g}"
    # Meta(multiple_of=...) on a float is not used by the protocol; it is left to msgspec.
    return _Rule(check, f"a float {what}", deep={float: check, int: check})


def _all_items(values: Iterable[object], item: _Rule) -> bool:
    if item.int_only:
        # Token ids by the thousand: C-level passes instead of a call per item.
        seen = set(map(type, values))
        if not seen:
            return True
        if seen != {int}:
            return False
        numbers: Any = values
        return _in_range(min(numbers)) and _in_range(max(numbers))
    if not item.deep and not item.ints and not item.anything:
        # Items judged by their type alone (strs, bools): one C-level pass too.
        return set(map(type, values)) <= item.plain
    return all(map(item.check, values))


def _sequence_rule(kind: type, noun: str, item: _Rule) -> _Rule:
    def check(v: object) -> bool:
        return type(v) is kind and _all_items(v, item)  # type: ignore[arg-type]

    return _Rule(check, f"a {noun} of {_plural(item.what)}", deep={kind: check}, items=item)


def _dict_rule(key: _Rule, value: _Rule) -> _Rule:
    def check(v: object) -> bool:
        if type(v) is not dict:
            return False
        mapping: dict[object, object] = v  # pyright: ignore[reportUnknownVariableType]
        return (key.anything or _all_items(mapping.keys(), key)) and (
            value.anything or _all_items(mapping.values(), value)
        )

    return _Rule(
        check,
        f"a dict of {_plural(key.what)} to {_plural(value.what)}",
        deep={dict: check},
    )


def _plural(what: str) -> str:
    """``an int`` -> ``int``, ``a list of str`` -> ``list of str``: for "a list of ..."."""
    for article in ("an ", "a "):
        if what.startswith(article):
            return what[len(article) :]
    return what


def _exact(kind: type, what: str) -> _Rule:
    return _Rule(lambda v: type(v) is kind, what, plain=frozenset({kind}))


def _rule(t: mi.Type) -> _Rule:
    if isinstance(t, mi.NoneType):
        return _Rule(lambda v: v is None, "None", plain=frozenset({_NONE_TYPE}))
    if isinstance(t, mi.BoolType):
        return _exact(bool, "a bool")
    if isinstance(t, mi.IntType):
        return _int_rule(t)
    if isinstance(t, mi.FloatType):
        return _float_rule(t)
    if isinstance(t, mi.StrType):
        if (t.min_length, t.max_length, t.pattern) == (None, None, None):
            return _exact(str, "a str")
        return _exact(str, "a str")  # msgspec's own string constraints: its decoder judges
    if isinstance(t, mi.BytesType):
        return _exact(bytes, "bytes")
    if isinstance(t, mi.ListType):
        return _sequence_rule(list, "list", _rule(t.item_type))
    if isinstance(t, mi.SetType):
        return _sequence_rule(set, "set", _rule(t.item_type))
    if isinstance(t, mi.FrozenSetType):
        return _sequence_rule(frozenset, "frozenset", _rule(t.item_type))
    if isinstance(t, mi.VarTupleType):
        return _sequence_rule(tuple, "tuple", _rule(t.item_type))
    if isinstance(t, mi.DictType):
        return _dict_rule(_rule(t.key_type), _rule(t.value_type))
    if isinstance(t, mi.EnumType):
        cls: type[enum.Enum] = t.cls
        if not issubclass(cls, enum.IntEnum):
            return _exact(cls, f"a {cls.__name__}")
        # An IntEnum's value travels as the int: the int itself is as good.
        values = frozenset(member.value for member in cls)

        def check_enum(v: object) -> bool:
            return type(v) is cls or (type(v) is int and v in values)

        return _Rule(
            check_enum,
            f"a {cls.__name__} (or one of the ints {sorted(values)})",
            plain=frozenset({cls}),
            deep={int: check_enum},
        )
    if isinstance(t, mi.LiteralType):
        allowed = frozenset(t.values)
        literal = allowed.__contains__
        return _Rule(
            literal,
            " or ".join(sorted(map(repr, allowed))),
            deep={type(v): literal for v in allowed},
        )
    if isinstance(t, mi.StructType):
        nested = FieldCheck(t.cls)

        def check_struct(v: object) -> bool:
            return isinstance(v, msgspec.Struct) and type(v) is nested.cls and not nested.problem(v)

        return _Rule(check_struct, f"a {t.cls.__name__}", deep={t.cls: check_struct})
    if isinstance(t, mi.UnionType):
        return _union([_rule(member) for member in t.types])
    if isinstance(t, mi.CustomType):
        custom: type = t.cls
        return _Rule(
            lambda v: isinstance(v, custom),
            f"a {custom.__name__}",
            plain=frozenset({custom}),
        )
    # Any, and what these Structs never use (datetimes, UUIDs, ...): msgspec's
    # encoder is the judge.
    return _Rule(lambda v: True, "anything", anything=True)


def _union(members: list[_Rule]) -> _Rule:
    if any(member.anything for member in members):
        return _Rule(lambda v: True, "anything", anything=True)
    checks = [member.check for member in members]
    # "None" last reads best: "an int or None".
    ordered = sorted(members, key=lambda member: member.what == "None")
    return _Rule(
        lambda v: any(check(v) for check in checks),
        " or ".join(member.what for member in ordered),
        plain=frozenset[type]().union(*(member.plain for member in members)),
        deep={kind: c for member in reversed(members) for kind, c in member.deep.items()},
        ints=any(member.ints for member in members),
        items=next((member.items for member in members if member.items is not None), None),
    )


@final
@attrs.frozen
class _Plan:
    """For one combination of value types: which values still need a look."""

    ints: Callable[[tuple[Any, ...]], Any] | None
    containers: tuple[tuple[int, Callable[[object], bool]], ...]
    others: tuple[tuple[int, Callable[[object], bool]], ...]


@final
class FieldCheck:
    """Checks an instance of one Struct class against its annotations.

    ``problem(obj)`` returns ``None`` or an exception naming the first bad field
    (``TypeError`` for a wrong type, ``ValueError`` for an int beyond 64 bits or
    outside its declared range); ``check(obj)`` raises it. Neither changes ``obj``.
    """

    def __init__(self, cls: type[msgspec.Struct]) -> None:
        self.cls = cls
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        self._names = tuple(field.name for field in info.fields)
        self._rules = tuple(_rule(field.type) for field in info.fields)
        self._plans: dict[tuple[type, ...], _Plan] = {}

    def check(self, obj: msgspec.Struct) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first bad field of ``obj``."""
        problem = self.problem(obj)
        if problem is not None:
            raise problem

    def problem(self, obj: msgspec.Struct) -> TypeError | ValueError | None:
        """The error naming the first bad field of ``obj``, or ``None``."""
        values = _astuple(obj)
        plan = self._plans.get(tuple(map(type, values)))
        if plan is None:
            return self._first_problem(values)
        ints = plan.ints
        if ints is not None:
            numbers: tuple[int, ...] = ints(values)
            if min(numbers) < _INT_MIN or max(numbers) > _INT_MAX:
                return self._first_problem(values)
        for index, check in plan.containers:
            container = values[index]
            # An empty one passes: its type was matched with the shape.
            if container and not check(container):
                return self._first_problem(values)
        for index, check in plan.others:
            if not check(values[index]):
                return self._first_problem(values)
        return None

    def _first_problem(self, values: tuple[Any, ...]) -> TypeError | ValueError | None:
        """The slow path: find the culprit, or learn this combination of types."""
        for index, (rule, value) in enumerate(zip(self._rules, values, strict=True)):
            if not rule.anything and not rule.check(value):
                return self._error(index, value)
        self._learn(tuple(map(type, values)))
        return None

    def _learn(self, shape: tuple[type, ...]) -> None:
        int_fields: list[int] = []
        containers: list[tuple[int, Callable[[object], bool]]] = []
        others: list[tuple[int, Callable[[object], bool]]] = []
        for index, (rule, kind) in enumerate(zip(self._rules, shape, strict=True)):
            if rule.anything or kind in rule.plain:
                continue
            if kind is int and rule.ints:
                int_fields.append(index)
            else:
                check = rule.deep.get(kind, rule.check)
                (containers if kind in _CONTAINERS else others).append((index, check))
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[shape] = _Plan(
            # Twice the first index: itemgetter gives a tuple even for one field.
            ints=operator.itemgetter(int_fields[0], *int_fields) if int_fields else None,
            containers=tuple(containers),
            others=tuple(others),
        )

    def _error(self, index: int, value: object) -> TypeError | ValueError:
        rule = self._rules[index]
        where = f"{self.cls.__name__}.{self._names[index]}"
        if type(value) is int and rule.ints and not _in_range(value):
            return ValueError(
                f"{where} is {value}: it must fit in 64 bits "
                f"(from {_INT_MIN} to {_INT_MAX}), as msgpack carries ints"
            )
        detail = _bad_item(rule, value)
        return TypeError(f"{where} must be {rule.what}, got {describe(value)}{detail}")


def _bad_item(rule: _Rule, value: object) -> str:
    """``" (item 1 is str 'a')"`` when ``value`` is a list whose items are the trouble."""
    item_rule = rule.items
    if item_rule is None or not isinstance(value, list | tuple | set | frozenset):
        return ""
    items = cast("Iterable[object]", value)
    for index, item in enumerate(items):
        if not item_rule.check(item):
            return f" (item {index} is {describe(item)})"
    return ""
