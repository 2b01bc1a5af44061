"""Every error rlexp raises on purpose, in one place.

Bad input, reported as one line before anything expensive starts:
    ConfigError      a config value, data file or prompt that cannot work
    SessionError     a chat request the policy server cannot serve (answered with a 4xx)
    CheckpointError  no usable checkpoint where one was asked for
One sample goes wrong (the run goes on; the reason lands in the sample's trace):
    JudgeError       the judge raised, hung, or returned a reward that is not a finite number
    InjectedFault    raised on purpose by the faulty agent / judge (fire drills, tests)
The run cannot usefully go on (it stops with the reason and the resume command):
    RunStopped       too many failed samples in a step
    ProgrammingError an agent or judge raised a programming error (TypeError, NameError, ...)
    EngineDead       the rollout engine's process died
    TrainerDead      a trainer worker's process died (cluster=ray, trainer.workers > 1)
    SyncMismatch     the engine's logprobs differ from the trainer's past the bound, or its
                     tokens are older than the scheduler allows: a weight sync did not land
                     (rlexp/trainer/sync_check.py)
    SyncUnchecked    a step's sync check compared none of the tokens it had to
    SyncHung         a weight sync did not finish within `sync_timeout_s`
    Interrupted      SIGTERM or SIGINT stopped the run (rlexp/signals.py); exit code 128 + the
                     signal's number
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hydra.errors import InstantiationException


class ConfigError(ValueError):
    """A bad config value, reported as one line before anything expensive starts."""


@contextmanager
def config_error_unwrapped() -> Iterator[None]:
    """Around Hydra's `instantiate`: a ConfigError that a `_target_` raises (wrapped by Hydra in
    an InstantiationException) reaches the user as its own one line."""
    try:
        yield
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise


class SessionError(ValueError):
    """A request the chat session cannot serve (bad messages, unknown session, too long).

    The server answers it with `status` and an OpenAI-style body naming `param`, the field
    at fault ("messages.[0].content"), and `code` ("model_not_found")."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for."""


class JudgeError(RuntimeError):
    """The judge could not score a sample (raised, hung, or returned a non-finite reward)."""


class TeacherError(RuntimeError):
    """The teacher could not score a sample (unreachable, timed out, or a reply that is not one
    finite logprob per token): that sample fails, counted with the other failures."""


class InjectedFault(RuntimeError):
    """The error a faulty agent or judge raises on purpose."""


class RunStopped(RuntimeError):
    """The run cannot usefully go on; the message says why and how to resume."""


class ProgrammingError(RunStopped):
    """An agent or judge raised an error that means its code is wrong (`guards.PROGRAMMING_ERRORS`),
    not that its environment failed: counting it as a failed sample would hide it."""


class EngineDead(RunStopped):
    """The rollout engine's process died; every request from now on would fail."""


class TrainerDead(RunStopped):
    """A rank of the trainer group died; the group cannot go on without it."""


class SyncMismatch(RunStopped):
    """Tokens generated at the trainer's current policy version have logprobs the trainer's
    weights do not give, or the batch's tokens come from an older version than the scheduler
    allows: the engine does not serve the weights the trainer pushed."""


class SyncUnchecked(RunStopped):
    """A step's batch held tokens the sync check had to compare (generated at the trainer's
    version, none of them allowed to be stale) and the trainer's check compared none."""


class SyncHung(RunStopped):
    """A weight sync (the transfer and the engine's reload) did not finish in time."""


class Interrupted(RunStopped):
    """SIGTERM (`kill`, `scancel`, SLURM's time limit) or SIGINT (Ctrl-C) stopped the run:
    rlexp/signals.py. The process exits with `exit_code`, 128 + the signal's number, as a
    shell reports a process the signal ended (143, 130)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
