"""User-facing errors.

Every problem a user can fix (bad recipe, missing file, mismatched target, ...) is raised as a
:class:`SpecgraftError` whose message is ONE line naming the problem and the fix. The CLI prints it as
``error: <message>`` on stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations


class SpecgraftError(Exception):
    """A problem with the user's input, described in one line with the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ConfigError(SpecgraftError):
    """A recipe or command-line override is invalid."""


class TargetMismatchError(SpecgraftError):
    """A head, cache or draft was made for a different target model or tokenizer."""
