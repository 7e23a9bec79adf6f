"""The kernel measured fastest for a layer's shape on this CPU, kept per machine: each candidate timed in turns
(`time_in_turns`) on weights spanning more memory than the CPU's caches (COLD_BYTES), the fastest taken where it beat
the default by a margin, and the choice kept in a small JSON file (`choices_file`) under the CPU's model name, the
thread count and torch's version (`machine_key`), so that later processes start without measuring. The float32
kernels of gptlite.inference.cpu.decode and the int8 and int4 ways of gptlite.inference.quantize are chosen here.

A measurement taken while other processes kept the CPU busy is used by the process that took it and not kept, as the
load shifts one kernel's time more than another's; deleting the file measures again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gptlite.device import CpuThreads, cpu_info, cpu_times
from gptlite.files import write_text

MARGIN = 0.9  # another kernel replaces the default one where it measured at least 10% faster
PACK_MIN_WEIGHTS = 1 << 18  # smaller layers (the char model's) decode faster as they are: per-call overhead
COLD_BYTES = 128 << 20  # measured weights span at least this much memory, more than a CPU's last-level cache
HOPELESS = 3.0  # a kind this many times slower than the fastest in a measurement's first round is timed no further
# other processes kept at least this many cores busy, on average, while a measurement ran: its choice holds for this
# process only, and the next one measures again (the load slows each kernel by its own share, not alike)
LOADED = CpuThreads.BUSY
_choices: dict[Path, dict[str, dict[str, str]]] = {}  # each choices file's contents, read once per process
_unkept: dict[tuple[str, str], str] = {}  # (machine, key) -> a choice measured under load, for this process only


def choices_file() -> Path:
    """Where the measured choices are kept: $XDG_CACHE_HOME/gptlite (or ~/.cache/gptlite)/cpu_linear.json."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "gptlite" / "cpu_linear.json"


def machine_key() -> str:
    """What a measurement holds for: the CPU's model, the thread count, torch's version."""
    return f"{cpu_info()[0]} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def time_in_turns(calls: dict[str, list[Callable[[], object]]], rounds: int = 5) -> dict[str, float]:
    """The seconds one call of each kind takes: the best of `rounds` rounds over all of that kind's calls (each on
    a copy of the weight of its own, so that each reads memory, not cache), the kinds taking turns within each
    round so that a burst of other work slows all of them alike. Every call runs once first (allocations, packing).
    A kind that took HOPELESS times the fastest one's time or more in the first round is timed no further (its one
    round stands): no margin makes it the choice, and a slow kernel (PyTorch's int4 at float32 activations) would
    otherwise take most of a first run's measuring."""
    best = dict.fromkeys(calls, float("inf"))
    running = dict(calls)
    with torch.no_grad():
        for each in calls.values():
            for call in each:
                call()
        for turn in range(rounds):
            for name, each in running.items():
                start = time.perf_counter()
                for call in each:
                    call()
                best[name] = min(best[name], (time.perf_counter() - start) / len(each))
            if turn == 0:
                fastest = min(best.values())
                running = {name: each for name, each in running.items() if best[name] < HOPELESS * fastest}
    return best


def remembered_choice(key: str, names: Sequence[str], default: str, measure: Callable[[], dict[str, float]]) -> str:
    """The choice among `names` kept for `key` on this machine (`machine_key`) in the choices file, or, when there
    is none, `measure()`'s fastest among `names` where it beat `default` by the margin (else `default`), kept in the
    file for the next process, unless other processes kept LOADED cores or more busy while it measured: then the
    choice holds for this process only, and the next measures again. The candidates are part of the key: another set
    of them is measured again."""
    path = choices_file()
    if path not in _choices:
        _choices[path] = read_choices(path)
    choices = _choices[path]
    machine = machine_key()
    key = f"{key} among {', '.join(names)}"
    kept = choices.get(machine, {}).get(key, _unkept.get((machine, key)))
    if kept in names:
        return kept
    before = cpu_times()
    start = time.monotonic()
    times = measure()
    others = cores_busy_elsewhere(before, cpu_times(), time.monotonic() - start)
    choice = default
    fastest = min((name for name in names if name in times), key=times.get)  # only a candidate, whatever was timed
    if times[fastest] < MARGIN * times[choice]:
        choice = fastest
    if others is not None and others >= LOADED:
        _unkept[machine, key] = choice  # measured while other work ran: not kept for good
        return choice
    choices.setdefault(machine, {})[key] = choice
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(choices, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home: the choice holds for this process, and is measured again in the next
    return choice


def cores_busy_elsewhere(
    before: tuple[float, float] | None, after: tuple[float, float] | None, seconds: float
) -> float | None:
    """How many cores other processes kept busy, on average, over `seconds` between two of gptlite.device's
    `cpu_times` (the machine's busy time less this process's own); None where the load cannot be read."""
    if before is None or after is None:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / max(seconds, 1e-9)


def read_choices(path: Path) -> dict[str, dict[str, str]]:
    """The choices file's {machine: {shape: kernel}}; empty when there is none yet or it is not such a table (then
    what is measured next replaces it)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        return {}
    return table
