"""RequestError: a client mistake, with the code and param its 4xx or `error` event names."""

from __future__ import annotations


class RequestError(ValueError):
    """A client mistake, reported as an `error` event (or HTTP 4xx) with code and param;
    status: its HTTP status (429 for a quota the client may retry after)."""

    def __init__(
        self, message: str, code: str = "invalid_request", param: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.code, self.param, self.status = code, param, status
