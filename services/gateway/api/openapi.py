"""The public API's OpenAPI document (served on the admin port): the real request bodies, as
pydantic's strict JSON schemas of protocol.py's models, and OpenAI's error body for every
refusal a route can give."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from services.gateway.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from services.gateway.api.responses_protocol import ResponsesRequest
from services.gateway.api.unsupported_fields import document_accepted_values


def body_doc(body_type) -> dict:
    """The routes read their raw bodies (size-limited, parsed off the event loop), so FastAPI
    cannot see the body model: the document names it here."""
    ref = {"$ref": f"#/components/schemas/{body_type.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {str(status): {"description": what, "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
                for status, what in _ERRORS.items()}}


_ERRORS = {400: "invalid request (names the parameter)", 401: "missing or unknown API key",
           404: "unknown model or path", 408: "body not in within --request-read-timeout-s",
           413: "body over --max-body-bytes", 415: "body not JSON, or compressed",
           429: "over the tenant's quota", 503: "no capacity now (Retry-After)",
           504: "the request's deadline passed"}


def openapi_document(app: FastAPI) -> dict:
    """The public API's OpenAPI document, with the real request bodies (protocol.py's models
    in the strict JSON schema pydantic derives from them) and OpenAI's error body."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version="1", routes=app.routes)
        # FastAPI's 422 never leaves: http.py's error handlers answer a bad parameter with 400.
        for operation in (op for path in document["paths"].values() for op in path.values()):
            if operation["responses"].pop("422", None) is not None:
                operation["responses"].setdefault("400", body_doc(CompletionRequest)[
                    "responses"]["400"])
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        for body_type in (CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                          TokenizeRequest, TokenizeChatRequest, DetokenizeRequest):
            schema = body_type.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[body_type.__name__] = schema
        document_accepted_values(schemas)
        schemas["ErrorBody"] = {"type": "object", "required": ["error"], "properties": {
            "error": {"type": "object", "required": ["message", "type", "param", "code"],
                      "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                     "param": {"type": ["string", "null"]},
                                     "code": {"type": ["string", "null"]}}}}}
        app.openapi_schema = document
    return app.openapi_schema
