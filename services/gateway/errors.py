"""Gateway errors in OpenAI's shape ({"error": {message, type, param, code}}), with the HTTP
status and gRPC code each maps to, so both front doors report a failure the same way."""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None
    rejected_by: str | None = None  # admission's reason when it refused the request (a metric label)
    # Close the connection after the response: refused before or while the body was read,
    # closing spares reading and dropping the rest (and a client that sent `Expect:
    # 100-continue` from waiting to send it).
    close: bool = False
    # False: answered with `x-should-retry: false`, which the OpenAI SDKs obey over their rule
    # of retrying every 5xx (a request past the deadline its caller set would run, and fail,
    # the same way again).
    should_retry: bool | None = None
    # A prompt refused for its length before it reached admission: its tokens, for the log.
    prompt_tokens: int | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        if self.close:
            headers["Connection"] = "close"
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return headers

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL)

    # -- the errors the gateway raises ----------------------------------------------------

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None,
                prompt_tokens: int | None = None) -> APIError:
        return cls(400, message, "invalid_request_error", param, code,
                   prompt_tokens=prompt_tokens)

    @classmethod
    def unauthorized(cls) -> APIError:
        return cls(401, "Incorrect or missing API key; send `Authorization: Bearer <key>`.",
                   "authentication_error", None, "invalid_api_key")

    @classmethod
    def model_not_found(cls, model: str, served: str) -> APIError:
        return cls(404, f"The model `{model}` does not exist; this gateway serves `{served}`.",
                   "invalid_request_error", "model", "model_not_found")

    @classmethod
    def not_found(cls, path: str) -> APIError:
        return cls(404, f"Unknown path {path}.", "invalid_request_error", None, "not_found")

    @classmethod
    def too_large(cls, limit: int) -> APIError:
        return cls(413, f"The request body is larger than this gateway's limit of {limit} bytes.",
                   "invalid_request_error", None, "request_too_large", close=True)

    @classmethod
    def body_timeout(cls, seconds: float) -> APIError:
        return cls(408, f"The request body did not arrive within {seconds:g} s.",
                   "invalid_request_error", None, "request_body_timeout", close=True)

    @classmethod
    def unsupported_media(cls, message: str) -> APIError:
        return cls(415, message, "invalid_request_error", None, "unsupported_media_type",
                   close=True)

    @classmethod
    def rate_limited(cls, message: str, retry_after_s: int = 1) -> APIError:
        return cls(429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after_s)

    @classmethod
    def overloaded(cls, message: str, retry_after_s: int = 1) -> APIError:
        return cls(503, message, "server_error", None, "overloaded", retry_after_s)

    @classmethod
    def shutting_down(cls) -> APIError:
        # Nothing was sent: another replica can serve it (UNAVAILABLE over gRPC).
        return cls(503, "The server is shutting down; retry the request.", "server_error",
                   None, "server_shutting_down", 1)

    @classmethod
    def timed_out(cls, message: str, code: str = "request_timeout") -> APIError:
        # 504, not 503: nothing is overloaded that a Retry-After would fix; this request
        # took longer than its deadline (or stalled) upstream of the gateway. Past the
        # caller's own deadline, a retry would only do the work again.
        return cls(504, message, "server_error", None, code,
                   should_retry=False if code == "request_timeout" else None)

    @classmethod
    def internal(cls, message: str) -> APIError:
        return cls(500, message, "server_error", None, "internal_error")


_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def from_worker_error(exc: grpc.aio.AioRpcError) -> APIError:
    """The error a client sees when every attempt at a request failed with `exc`."""
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError.invalid(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError.overloaded(f"No worker has room for this request now ({details}); retry.")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED):
        # The code, not gRPC's details: those name the worker's address ("failed to connect
        # to all addresses; ... ipv4:10.0.3.7:50061"), which is not the caller's business.
        return APIError.overloaded(f"No worker could serve this request ({code.name}); retry.")
    return APIError.internal(f"worker error: {details}")
