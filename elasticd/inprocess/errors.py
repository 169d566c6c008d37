"""The exceptions of in-process restart.

``RankShouldRestart`` derives from ``BaseException`` on purpose: it is raised
asynchronously inside the user's training function to unwind it, and a
training loop's ``except Exception:`` must not swallow it.
"""

from __future__ import annotations

__all__ = ["HealthCheckError", "InProcessError", "RankShouldRestart", "RestartError"]


class InProcessError(Exception):
    """Base of the errors the in-process wrapper raises to the caller."""


class RestartError(InProcessError):
    """This rank cannot take part in the next iteration (it was left out of the new world)."""


class HealthCheckError(InProcessError):
    """The rank's health check failed; the rank leaves and the others go on without it."""


class RankShouldRestart(BaseException):  # noqa: N818 - a signal to unwind, not an error
    """Raised inside the wrapped function to make it return to the wrapper for a restart."""
