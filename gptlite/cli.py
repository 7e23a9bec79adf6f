"""What every command does the same way: a user's error is one line on stderr (exit 2), and SIGINT or SIGTERM,
sent to the process group or to the main process alone, is an interruption that ends the command cleanly
(exit 130 or 143, as shells report them) with a line saying what was kept and how to continue.

train.py handles its signals itself: it finishes the step and saves a checkpoint first.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

USER_ERRORS = (ValueError, TypeError, OSError, ConnectionError, ImportError)  # OSError covers missing files


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Interrupted(signum)


def run_command(prog: str, body: Callable[[], int], on_interrupt: str = "nothing was saved") -> int:
    """body()'s exit code, with one-line errors and clean interruptions (see the module docstring).
    `on_interrupt` completes the line printed then (what was kept, how to continue)."""
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return body()
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"\n{prog}: interrupted ({signal.Signals(signum).name}); {on_interrupt}", file=sys.stderr)
        return 128 + signum
    except USER_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
