"""Errors of the job layer and the exit codes the CLI maps them to.

A ``JobError`` is a user mistake or an environment problem that deserves one clear line on
stderr, never a traceback. Anything else escaping the job layer is a bug (or an engine failure).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EXIT_OK = 0
EXIT_ERROR = 1  # user mistake: bad job file, missing input, unknown model, config mismatch, ...
EXIT_USAGE = 2  # bad command line (click's own code)
EXIT_ERROR_RATE = 65  # done, but more of the rows are errors than output.max_error_rate / --max-error-rate allow
EXIT_ENGINE = 70  # the engine or batchgen itself failed (EX_SOFTWARE); finished rows are saved
EXIT_LOCKED = 73  # another run holds this shard's lock; nothing was done
EXIT_INTERRUPTED = 75  # stopped by SIGTERM/SIGINT (EX_TEMPFAIL); rerun the same command to resume


class JobError(Exception):
    """A problem the user can fix; its message is shown as is."""

    exit_code = EXIT_ERROR


class LockedError(JobError):
    exit_code = EXIT_LOCKED


@dataclass(frozen=True)
class Problem:
    """One validation problem, located by its path in the job file (``sampling.top_p``)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def yaml_words(message: str) -> str:
    """A message of the Python API (``must be an integer >= 1 or None``, ``got None``) in the words of
    the job file, which writes YAML's ``null``."""
    return re.sub(r"(\bor |\(got |\bbe )None\b", r"\1null", message)


class JobInvalid(JobError):
    """The job file has one or more problems; all of them are listed (in YAML's words: ``null``)."""

    def __init__(self, problems: list[Problem]):
        problems = [Problem(p.path, yaml_words(p.message)) for p in problems]
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))
