"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's shape).

Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (the
output is one of these strings), ``grammar`` (EBNF/GBNF with a ``root`` rule, or Lark) or
``json_object=True`` (any JSON object) is set. The engine compiles it with xgrammar
(samebits.engine.grammar) and masks the request's own logits row at every step; an invalid
constraint raises ``ValueError`` when the request is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar "
                             f"or json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or a string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar (JSON keys keep their
        order: a schema's property order is the output's)."""
        kind = self.kind
        if kind == "json":
            value = self.json
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    return kind, value  # not JSON: the compiler reports it
            return kind, json.dumps(value, ensure_ascii=False)  # key order matters
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)
