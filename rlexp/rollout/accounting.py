"""What every rollout engine shares: generated tokens, busy time, and which conversation a
request belongs to (a pool of replicas keeps a conversation on one replica)."""

from __future__ import annotations

import time
from contextvars import ContextVar

# Tokens generated on behalf of the current asyncio task tree (a scheduler sets a fresh list
# per prompt group; engines add to it), so tokens that were generated but never trained
# are counted exactly, whatever agent produced them.
generated_tokens: ContextVar[list[int] | None] = ContextVar("generated_tokens", default=None)


# The conversation the current task's requests belong to: any object that lives as long as
# the conversation (the sample's rollout sets one; a chat session is one). A RolloutPool
# sends every request of one conversation to the same replica, whose prefix cache holds it.
conversation: ContextVar[object | None] = ContextVar("conversation", default=None)


def count_generated(n: int) -> None:
    meter = generated_tokens.get()
    if meter is not None:
        meter[0] += n


class BusyMeter:
    """Seconds during which at least one request was being generated (engine busy time),
    the tokens generated and the tokens prefilled again (a completion's prompt and tokens so
    far, sent again after a pause cut it short: update_mode=abort); the engine adds them."""

    def __init__(self):
        self.tokens = 0
        self.prefilled_again = 0
        self.active = 0
        self._busy = 0.0
        self._since = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._busy += time.perf_counter() - self._since

    @property
    def busy_s(self) -> float:
        return self._busy + (time.perf_counter() - self._since if self.active else 0.0)
