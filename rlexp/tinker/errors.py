"""The server's answers to requests it cannot serve: a 4xx naming the field, never a 5xx."""

from __future__ import annotations


class BadRequest(Exception):
    """A request the server refuses: `status` (400 bad input, 404 unknown id, 409 a conflict
    with the model's state), `field` the request field at fault (a dotted path) or None."""

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field, self.status = field, status


def not_found(kind: str, given: str, field: str) -> BadRequest:
    return BadRequest(f"unknown {kind} {given!r}", field, 404)
