"""gptlite.inference.cpu.choices: timing the candidates in turns."""

from __future__ import annotations

import time

from gptlite.inference.cpu import choices


def test_a_hopeless_kind_is_timed_one_round_only():
    """A kind slower than HOPELESS times the fastest in the first round runs only that round (after its warm-up), while
    the others run every round; each kind's time is still reported, the slow one's slower."""
    runs = {"fast": 0, "close": 0, "slow": 0}

    def call(name: str, seconds: float):
        def run():
            runs[name] += 1
            time.sleep(seconds)

        return run

    calls = {
        "fast": [call("fast", 0.001)] * 2,
        "close": [call("close", 0.0015)] * 2,
        "slow": [call("slow", 0.02)] * 2,
    }
    times = choices.time_in_turns(calls, rounds=4)
    assert runs == {"fast": 2 + 4 * 2, "close": 2 + 4 * 2, "slow": 2 + 1 * 2}
    assert times["slow"] > choices.HOPELESS * times["fast"]
    assert min(times, key=times.get) == "fast"
