"""A request's output constraint, from whichever field carries it: OpenAI's ``response_format``
(``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``) or the older ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar``. At most one may be given; the constraint is compiled
before the request is queued (in the grammar compiler's own threads, within its size limits and
time limit: samebits.engine.grammar), so a schema, regex or grammar that is invalid, too large,
too slow to compile or satisfiable by no output is a 400 naming its field.
"""

from __future__ import annotations

from samebits.server.errors import APIError
from samebits.server.protocol import SamplingFields
from samebits.server.serving import ServingContext
from samebits.structured_outputs import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def requested_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field that gave it), or (None, None)."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format(req)))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                  "grammar": so.grammar, "json_object": so.json_object}
        found.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
    for name, kind in _GUIDED.items():
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]}: only one output constraint may be given (also got "
                       f"{found[0][0]})", param=found[1][0])
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except ValueError as e:
        message = str(e).removeprefix("structured_outputs")
        raise APIError(400, f"{field}{message if message[:1] in '.:' else ': ' + message}",
                       param=field) from None


def _response_format(req: SamplingFields) -> dict:
    rf = req.response_format
    assert rf is not None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema is required for type "
                       "'json_schema'", param="response_format")
    return {"json": rf.json_schema.schema_}


async def check_constraint(ctx: ServingContext, spec: StructuredOutputsParams | None,
                           field: str | None) -> None:
    """Compile the constraint at admission (off the event loop, bounded in size and time; the
    engine then finds it in the compiler's cache)."""
    if spec is None:
        return
    if ctx.grammars is None:
        raise APIError(400, f"{field}: this model has no tokenizer, so no structured output",
                       param=field)
    try:
        await ctx.grammars.compile_async(spec)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None
