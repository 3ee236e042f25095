"""RequestError: a client mistake, with the code and param its 4xx or `error` event names."""

from __future__ import annotations


class RequestError(ValueError):
    """A client mistake, reported as an `error` event (or HTTP 4xx) with code and param."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param
