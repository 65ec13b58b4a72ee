"""``/openapi.json`` with every request body documented.

Routes parse their bodies themselves (strictly, with OpenAI-shaped 400s), so FastAPI cannot see
the body models; this adds each one as the route's ``application/json`` request body, with the
models' schemas under ``components/schemas``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve an OpenAPI document in which ``POST path`` takes ``bodies[path]`` as its body."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _with_bodies(
                get_openapi(title=app.title, version=app.version, routes=app.routes), bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _with_bodies(spec: dict[str, Any], bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        operation = spec.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
    return spec
