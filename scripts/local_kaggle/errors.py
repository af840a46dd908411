"""The one error every part of the local Kaggle raises: an HTTP status and the message the client shows."""

from __future__ import annotations


class ApiError(Exception):
    """Sent to the client as `{"code": status, "message": message}` with HTTP `status` (a 3xx as a redirect)."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
