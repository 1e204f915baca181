"""Error types. bcc raises bare `Exception`; we wrap what we catch into these so callers can tell
a retryable fault from one that needs a person."""

from __future__ import annotations


class CozyError(Exception):
    """Base class of every error cozyebpf raises on purpose. Its message names the object and,
    where there is one, the fix."""


class PermanentError(CozyError):
    """Retrying does not help: bad configuration, a foreign program in the way, a missing
    prerequisite."""


class TemporaryError(CozyError):
    """May succeed later: a source that cannot be read right now, a busy kernel object."""


class DatapathError(PermanentError):
    """Loading, attaching or programming the BPF datapath failed."""


class SourceError(TemporaryError):
    """A source of desired state (manifest file, API server) could not be read."""
