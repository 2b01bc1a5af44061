"""The Tinker server's futures: each model's calls run in seq_id order, once each, on its
own lane; a seq_id outside the lane's window of next calls is refused naming it."""

import asyncio

import pytest

from rlexp.tinker.errors import BadRequest
from rlexp.tinker.futures import MAX_AHEAD, Futures, Lane


def test_lane_runs_calls_in_seq_id_order_once_each():
    futures, ran = Futures(), []

    def call(n):
        return lambda: ran.append(n) or n * 10

    async def main():
        lane, behind = Lane(futures, "test"), Lane(futures, "behind", next_seq=5)
        three = lane.submit(3, b"three", call(3))
        assert lane.submit(3, b"three", call(33)) == three  # an SDK retry: the same call
        one, two = lane.submit(1, b"one", call(1)), lane.submit(2, b"two", call(2))
        assert [await futures.get(r) for r in (one, two, three)] == [10, 20, 30]
        assert lane.submit(1, b"one", call(11)) == one  # a retry after it ran: not run again
        for bad, match in ((lambda: lane.submit(2, b"another body", call(22)), "already used"),
                           (lambda: behind.submit(4, b"four", call(4)), r"next calls \(5 \.\. "),
                           (lambda: behind.submit(5 + MAX_AHEAD, b"far", call(0)), "next calls")):
            with pytest.raises(BadRequest, match=match) as e:
                bad()
            assert e.value.field == "seq_id"
        await lane.run_now(lambda: None)  # after everything queued on the lane's thread
        lane.close()
        behind.close()

    asyncio.run(main())
    assert ran == [1, 2, 3]
