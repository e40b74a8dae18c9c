"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, param=param, code="invalid_request")

    @classmethod
    def model_not_found(cls, model: str) -> APIError:
        return cls(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    @classmethod
    def unauthorized(cls) -> APIError:
        return cls(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                   code="invalid_api_key")

    @classmethod
    def not_ready(cls) -> APIError:
        return cls(503, "The server is starting up (loading the model); retry shortly.",
                   type="server_error", code="not_ready")

    @classmethod
    def stopping(cls) -> APIError:
        return cls(503, "The server is shutting down.", type="server_error", code="shutting_down")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def check_model_name(model: str | None, served: tuple[str, ...]) -> None:
    """A request's ``model``, if given, must be one of the names the server answers to."""
    if model is not None and model not in served:
        raise APIError.model_not_found(model)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
