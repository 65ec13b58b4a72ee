"""Limits on the size of an output constraint, checked before anything compiles it.

Compiling a constraint costs time and memory that grow with its size, and past some sizes
super-linearly (measured with xgrammar on 2 CPU cores: 1,024 optional properties 20 s, 1,024 long
choices 8 s and 24 MB, a 20,000-value enum 60 s and 74 MB). These limits keep every admitted
constraint to well under a second of compile time; anything over one is a ``ValueError`` naming
the limit (a 400 over HTTP). ``docs/LIMITS.md`` lists them.

The walk over a JSON schema is iterative, so a schema nested far deeper than Python's recursion
limit is refused by the depth limit instead of raising ``RecursionError``.
"""

from __future__ import annotations

import json
from typing import Any

from samebits.structured_outputs import StructuredOutputsParams

MAX_CONSTRAINT_BYTES = 32 * 1024  # a schema (as JSON), regex, grammar, or the choices together
MAX_SCHEMA_DEPTH = 64  # nesting of the schema document (each object or array a level)
MAX_SCHEMA_PROPERTIES = 256  # property names over the whole schema
MAX_ENUM_VALUES = 256  # enum values (and consts) over the whole schema
MAX_CHOICES = 256  # strings in a ``choice`` constraint


def check_limits(spec: StructuredOutputsParams) -> None:
    """``ValueError`` naming the first limit ``spec`` exceeds; None when it is within all."""
    kind = spec.kind
    if kind == "json":
        _check_schema(_schema(spec.json))
    elif kind == "choice":
        choices = list(spec.choice or ())
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"has {len(choices)} choices; the limit is {MAX_CHOICES}")
        _check_bytes(sum(len(c.encode("utf-8", "surrogatepass")) for c in choices), "the choices")
    elif kind in ("regex", "grammar"):
        _check_bytes(len(getattr(spec, kind).encode("utf-8", "surrogatepass")), f"the {kind}")


def _check_bytes(size: int, what: str) -> None:
    if size > MAX_CONSTRAINT_BYTES:
        raise ValueError(f"{what} is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")


def _schema(value: str | dict[str, Any] | None) -> Any:
    """The schema as a Python value (a string is parsed; a parse error is left to the compiler,
    which names it)."""
    if not isinstance(value, str):
        return value
    _check_bytes(len(value.encode("utf-8", "surrogatepass")), "the JSON schema")
    try:
        return json.loads(value)
    except RecursionError:
        raise ValueError(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} "
                         "levels") from None
    except ValueError:
        return None


def _check_schema(schema: Any) -> None:
    """Depth, property and enum counts of a parsed schema, then its size as JSON. The walk stops
    early once the schema is certainly over a limit, so it is cheap whatever the schema."""
    properties = enums = nodes = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1 + (len(node) if isinstance(node, dict | list) else 0)
        if nodes > MAX_CONSTRAINT_BYTES // 2:  # each value takes 2 bytes of JSON or more
            raise ValueError(f"the JSON schema is larger than {MAX_CONSTRAINT_BYTES} bytes")
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            props = node.get("properties")
            properties += len(props) if isinstance(props, dict) else 0
            enum = node.get("enum")
            enums += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    if properties > MAX_SCHEMA_PROPERTIES:
        raise ValueError(f"the JSON schema has {properties} properties; the limit is "
                         f"{MAX_SCHEMA_PROPERTIES}")
    if enums > MAX_ENUM_VALUES:
        raise ValueError(f"the JSON schema has {enums} enum values; the limit is "
                         f"{MAX_ENUM_VALUES}")
    if schema is not None:
        try:
            text = json.dumps(schema, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the JSON schema is not JSON ({e})") from None
        _check_bytes(len(text.encode("utf-8", "surrogatepass")), "the JSON schema")
