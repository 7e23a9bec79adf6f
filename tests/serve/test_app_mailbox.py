"""How the server hands the engine's pieces to its event loop (gptlite.serve.app's Mailbox and Generation): in the
order emitted, on as few wake-ups of the loop as the timing allows, a response sent whole handed over once, and
nothing lost or stuck when the loop has gone."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gptlite.serve.app import Generation, Mailbox
from gptlite.serve.engine import Params, Piece


def on_a_thread(work) -> None:
    """Run `work` on another thread (as the engine's), and wait for it."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_pieces_posted_before_the_loop_runs_arrive_in_order_on_one_wake_up():
    loop = asyncio.new_event_loop()
    try:
        mailbox = Mailbox(loop)
        deliveries = []
        deliver = mailbox.deliver
        mailbox.deliver = lambda: deliveries.append(1) or deliver()
        queue = asyncio.Queue()
        batches = [[(0, Piece("a", 1))], [(1, Piece("b", 1)), (1, Piece("c", 2))], [(0, Piece("d", 2, "length"))]]
        on_a_thread(lambda: [mailbox.post(queue, batch) for batch in batches])

        async def drain():
            return [await queue.get() for _ in range(4)]

        got = loop.run_until_complete(drain())
    finally:
        loop.close()
    assert [(i, p.text) for i, p in got] == [(0, "a"), (1, "b"), (1, "c"), (0, "d")]
    assert deliveries == [1]


def test_a_post_after_the_loop_has_closed_raises():
    loop = asyncio.new_event_loop()
    mailbox = Mailbox(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        mailbox.post(asyncio.Queue(), [(0, Piece("a", 1))])


@pytest.mark.parametrize("hold", [True, False])
def test_a_held_response_is_handed_over_once_with_its_last_piece(hold):
    """hold (a response sent whole): nothing reaches the loop until the job's last piece, then all of its pieces in
    order; not held (a stream): each piece as it comes."""

    async def run() -> tuple[int, list[str]]:
        gen = Generation([([1, 2], Params(max_tokens=3))], Mailbox(asyncio.get_running_loop()), hold=hold)
        emit = gen.jobs[0].emit
        on_a_thread(lambda: [emit(Piece(text, n)) for n, text in enumerate("ab", start=1)])
        await asyncio.sleep(0.05)  # room for any wake-up posted to run
        early = gen.queue.qsize()
        on_a_thread(lambda: emit(Piece("c", 3, "length")))
        texts = []
        while gen.open:
            texts.append((await gen.next())[1].text)
        return early, texts

    early, texts = asyncio.run(run())
    assert texts == ["a", "b", "c"]
    assert early == (0 if hold else 2)


def test_a_job_whose_loop_has_closed_is_cancelled():
    async def make() -> Generation:
        return Generation([([1], Params(max_tokens=2))], Mailbox(asyncio.get_running_loop()), hold=False)

    gen = asyncio.run(make())  # asyncio.run closes its loop on return
    on_a_thread(lambda: gen.jobs[0].emit(Piece("a", 1)))
    assert gen.jobs[0].cancelled
