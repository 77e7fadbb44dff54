"""Every error the server answers, in OpenAI's JSON shape:
{"error": {"message", "type", "param", "code"}} with the HTTP status that fits.

A client mistake is a 4xx naming the field (`param`); a request the engine failed is a
500 (`server_error`) whose message says what failed, and on a stream the same error
arrives as one event before `[DONE]`, so a client never sees a cut stream or plain text.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException


class BadRequest(Exception):
    """A request the server refuses; the handler below turns it into its JSON error."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def server_error(message: str) -> JSONResponse:
    """A request the server failed (the engine failed it, its chat template broke): 500."""
    return error_response(500, message, type="server_error")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed"

    @app.exception_handler(RequestValidationError)
    async def invalid_fields(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # (its "loc" is a character's offset, no field)
            reason = first.get("ctx", {}).get("error", "JSON decode error")
            message = f"the body is not JSON ({reason} at character {first['loc'][-1]}): send a JSON object"
            return error_response(400, message)
        where = [str(part) for part in first["loc"] if part != "body"]
        param = ".".join(where) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return error_response(400, message, param=param)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        code = exc.code or ("model_not_found" if exc.status == 404 else None)
        return error_response(exc.status, str(exc), param=exc.param, code=code)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:  # logged by uvicorn
        return server_error(f"internal error: {type(exc).__name__}: {exc}")
