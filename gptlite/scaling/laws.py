"""Scaling laws fitted to a sweep's runs, and where they are kept.

A sweep (gptlite.scaling.sweep) trains the recipe family (gptlite.scaling.recipe) at several widths for each of
several time budgets. For each budget the loss against log(parameters) is a valley: a parabola through it gives the
compute-optimal size at that budget and the loss there (`optimum`), as in Chinchilla's IsoFLOP profiles (Hoffmann
et al. 2022, approach 2), with a time budget in place of a FLOP count because time is what a user of one machine
spends. The laws are fitted through those optima:
- the optimal size against the budget, a power law N* = G t^a (and against the FLOPs the optimal run did);
- the tokens it trains on against the FLOPs, D* = H C^b;
- the loss against the budget, L* = E + A t^-alpha (and against the FLOPs), E being what no budget gets below.
Parameters N are the blocks' (what every token's matmuls use); the embeddings are a lookup. The uncertainty of each
exponent is its range over the fits that leave one run out. A budget whose best size is the smallest or largest run
only bounds its optimum, and one whose best run trained fewer than MIN_FIT_STEPS steps measured the clock more than
the size: each is left out of the size and token laws where two others remain (its loss stays in the loss laws);
where they do not, the laws carry a "size_note" saying so and which widths or budgets to sweep next.

`fit_laws` returns a JSON-ready dict; `save_laws` writes it to the sweep's folder and to gptlite's cache under the
data's fingerprint and the machine (`laws_path`), where `train.py --budget` finds it; `DEFAULT_LAWS` are the laws
measured for this project (docs/scaling.md), used with a note where no sweep ran for the data and machine.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from gptlite.files import write_json

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gptlite" / "scaling"
DEFAULT_LAWS = Path(__file__).with_name("defaults.json")  # {"char": laws, "bpe": laws}, measured here
# A budget whose best run trained fewer steps than this is left out of the size laws. Early in a run the loss falls
# so fast that a step more or less, which the clock decides, moves it more than the size does: on Python's standard
# library with GPT-2's 50,257 ids (docs/scaling.md) the loss fell by 0.04 nat a step around step 40, where the
# widths of one budget lay within 0.09 of each other; a sweep of such budgets fitted an optimal size that shrank
# with the budget (N* ~ t^-0.22, its exponent -1.2 to 2.1 leaving one run out).
MIN_FIT_STEPS = 50


# ---------------------------------------------------------------------------------------------
# Fits


def fit_power(x: list[float], y: list[float]) -> dict:
    """y = coef * x^exponent, by least squares in log-log: {"coef", "exponent"}."""
    exponent, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return {"coef": float(math.exp(intercept)), "exponent": float(exponent)}


def fit_saturating(x: list[float], y: list[float]) -> dict:
    """y = E + A x^-alpha, E in [0, min(y)): for each E on a fine grid the rest is a line in log-log; the E whose fit
    has the least squared error in y wins. {"E", "A", "alpha"}."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    best = None
    for E in np.linspace(0.0, 0.999 * y.min(), 400):
        slope, intercept = np.polyfit(np.log(x), np.log(y - E), 1)
        error = float(((E + np.exp(intercept) * x**slope - y) ** 2).sum())
        if best is None or error < best[0]:
            best = (error, E, float(math.exp(intercept)), float(-slope))
    _, E, A, alpha = best
    return {"E": float(E), "A": A, "alpha": alpha}


def power(law: dict, x: float) -> float:
    return law["coef"] * x ** law["exponent"]


def saturating(law: dict, x: float) -> float:
    return law["E"] + law["A"] * x ** -law["alpha"]


def expected_loss(law: dict, x: float, vocab_size: int) -> tuple[float, str]:
    """The loss law L = E + A x^-alpha at `x` (seconds or FLOPs), held at ln(vocab_size), the loss of a uniform guess
    over the ids, and "" or why it was held. No model does worse than that guess on average, but the law, fitted
    through budgets far larger than a tiny one, extrapolates to any loss at all below them."""
    try:
        loss = saturating(law, x)
    except OverflowError:  # x^-alpha past what a float holds: far below the budgets fitted
        loss = math.inf
    uniform = math.log(vocab_size)
    if loss <= uniform:
        return loss, ""
    return uniform, (
        f"held at ln {vocab_size} = {uniform:.3f}, a uniform guess's loss over the {vocab_size:,} ids: the law gives "
        f"{loss:.1f} this far below the budgets it was fitted at"
    )


def optimum(runs: list[dict]) -> dict:
    """The best size for one budget's runs (each with "params", "val_loss", "flops", "tokens"): the parabola in
    log(params) through the best run and its two neighbours in size, its lowest point (the valley is not a parabola
    far from its bottom: too small a model saturates, too large a one hardly trains, so the runs far from the best
    are left out). Where the best run is the smallest or the largest, that run, with `edge` True: the budget wanted
    a size the sweep did not reach, and `side` says which ("smallest" or "largest"; "" inside). The FLOPs and
    tokens of a run at that size are interpolated in log-log between the three runs; `steps` are the best run's
    optimizer steps."""
    runs = sorted(runs, key=lambda r: r["params"])
    u = np.log([r["params"] for r in runs])
    loss = np.array([r["val_loss"] for r in runs])
    best = int(loss.argmin())
    edge = best == 0 or best == len(runs) - 1
    first = max(0, min(best - 1, len(runs) - 3))
    near = slice(first, first + 3)  # the best run and its neighbours (the three at that end, at an edge)
    a, b, c = np.polyfit(u[near], loss[near], 2)
    if edge or a <= 0:
        u_star = float(u[best])
        loss_star = float(loss[best])
    else:
        u_star = float(np.clip(-b / (2 * a), u[best - 1], u[best + 1]))
        loss_star = float(np.polyval([a, b, c], u_star))
    flops = np.polyfit(u[near], np.log([r["flops"] for r in runs[near]]), 1)
    tokens = np.polyfit(u[near], np.log([r["tokens"] for r in runs[near]]), 1)
    return {
        "params": float(math.exp(u_star)),
        "val_loss": loss_star,
        "flops": float(math.exp(np.polyval(flops, u_star))),
        "tokens": float(math.exp(np.polyval(tokens, u_star))),
        "edge": bool(edge),
        "side": ("smallest" if best == 0 else "largest") if edge else "",
        "steps": int(runs[best]["steps"]),
    }


def size_at(laws: dict, seconds: float) -> tuple[float, str]:
    """The optimal block parameters for `seconds` of training, and "" or why: the law N*(t), held within what the
    sweep's edge budgets bound. A budget whose best run was the smallest width run says that its optimum is at most
    that size; the optimal size grows with the budget, so it is at most that size for a shorter run too (a largest
    width best: at least that size for a longer run). The law, fitted through the budgets whose optimum lay inside
    the widths, knows nothing of those bounds, and extrapolated below its shortest budget it can give a size the
    sweep measured to be too large. A budget whose best run trained fewer than MIN_FIT_STEPS steps bounds nothing:
    its clock, not its size, decided it. (Laws fitted before the frontier recorded an edge's side hold no bounds.)"""
    params = power(laws["params_per_second"], seconds)
    why = ""
    for point in sorted(laws["frontier"], key=lambda p: p["seconds"]):
        side = point.get("side", "")
        if not side or point["steps"] < MIN_FIT_STEPS:
            continue
        below = side == "smallest" and seconds <= point["seconds"] and params > point["params"]
        above = side == "largest" and seconds >= point["seconds"] and params < point["params"]
        if below or above:
            params = point["params"]
            why = (
                f"held at {'most' if below else 'least'} {params / 1e6:.3g}M: the sweep's best run at "
                f"{point['seconds']:g} s was its {side} width, and a {'shorter' if below else 'longer'} run's "
                f"optimum is no {'larger' if below else 'smaller'}"
            )
    return params, why


def frontier(runs: list[dict]) -> dict[float, dict]:
    """Each budget's optimum (budgets with at least three sizes run)."""
    budgets = sorted({r["seconds"] for r in runs})
    at = {b: [r for r in runs if r["seconds"] == b] for b in budgets}
    return {b: optimum(at[b]) for b in budgets if len({r["params"] for r in at[b]}) >= 3}


def laws_of(runs: list[dict]) -> dict:
    """The laws through the optima of `runs` (see the module docstring), without their uncertainty."""
    every = frontier(runs)
    if len(every) < 2:
        raise ValueError(
            f"the laws need the optimum of at least 2 budgets, each with at least 3 sizes run; these runs give "
            f"{len(every)}: run more of the sweep"
        )
    # a budget whose best size is the smallest or the largest run only bounds where its optimum is, and one whose
    # best run took fewer than MIN_FIT_STEPS steps says more about the clock than the size: each is left out of the
    # size and token laws where two others remain. Its best loss is still near the optimum's: the loss laws keep it.
    short = {b: p["steps"] for b, p in every.items() if p["steps"] < MIN_FIT_STEPS}
    trained = {b: p for b, p in every.items() if b not in short}
    inside = {b: p for b, p in trained.items() if not p["edge"]}
    sized = inside if len(inside) >= 2 else every
    all_flops = [p["flops"] for p in every.values()]
    all_loss = [p["val_loss"] for p in every.values()]
    flops = [p["flops"] for p in sized.values()]
    laws = {
        "params_per_second": fit_power(list(sized), [p["params"] for p in sized.values()]),
        "loss_per_second": fit_saturating(list(every), all_loss),
        "params_per_flop": fit_power(flops, [p["params"] for p in sized.values()]),
        "tokens_per_flop": fit_power(flops, [p["tokens"] for p in sized.values()]),
        "loss_per_flop": fit_saturating(all_flops, all_loss),
        "frontier": [{"seconds": s, **p, "fitted": s in sized} for s, p in every.items()],
    }
    if len(inside) < 2:
        notes = [short_note(short, list(every))] if short else []
        if any(p["edge"] for p in trained.values()):  # where a short budget's best size lies says little either
            notes.append(bound_note(trained, runs))
        laws["size_note"] = "; ".join(notes)
    return laws


def short_note(short: dict[float, int], budgets_run: list[float]) -> str:
    """What the size laws are worth when fewer than two budgets' best runs trained MIN_FIT_STEPS steps or more
    (`short`: budget -> its best run's steps, for those that did not), and which budgets to sweep next: twice and
    four times the longest."""
    fewest, most = min(short.values()), max(short.values())
    steps = f"{fewest}" if fewest == most else f"{fewest}-{most}"
    longest = max(budgets_run)
    budgets = ",".join(f"{seconds:g}s" for seconds in [*budgets_run, 2 * longest, 4 * longest])
    return (
        f"the best run at {', '.join(f'{s:g} s' for s in short)} trained only {steps} steps (fewer than "
        f"{MIN_FIT_STEPS}), where the clock moves the loss more than the size does, so the size laws through it say "
        f"little; add longer budgets (--budgets={budgets}) and run the sweep again (the runs done are kept)"
    )


def bound_note(every: dict[float, dict], runs: list[dict]) -> str:
    """What the size laws are worth when fewer than two budgets' optima lie inside the widths run (each edge
    optimum only says the best size is past the smallest or largest run), and which widths to sweep next."""
    from gptlite.scaling.recipe import WIDTHS

    widths = sorted({r["width"] for r in runs})
    below, above = [], []
    for seconds, point in every.items():
        if point["edge"]:
            (below if point["side"] == "smallest" else above).append(seconds)
    if len(below) >= len(above):
        side, edge_width, budgets, more = "smallest", widths[0], below, [w for w in WIDTHS if w < widths[0]][-2:]
    else:
        side, edge_width, budgets, more = "largest", widths[-1], above, [w for w in WIDTHS if w > widths[-1]][:2]
    advice = (
        f"add widths {','.join(map(str, more))} (--widths={','.join(map(str, sorted(more + widths)))})"
        if more
        else "the recipe family has no width further out"
    )
    return (
        f"the best size at {', '.join(f'{s:g} s' for s in budgets)} was the {side} width run ({edge_width}): the "
        f"optimum lies past it, and the size laws through it only bound the optimum; {advice} and run the sweep again "
        "(the runs done are kept)"
    )


def fit_laws(runs: list[dict]) -> dict:
    """`laws_of(runs)` with each exponent's range over the fits that leave one run out ("range": [low, high])."""
    laws = laws_of(runs)
    spread: dict[str, list[float]] = {}
    for i in range(len(runs)):
        try:
            fewer = laws_of(runs[:i] + runs[i + 1 :])
        except ValueError:  # too few runs left for a budget: this one is needed
            continue
        for name, law in fewer.items():
            if name not in ("frontier", "size_note"):  # the laws, not the points or the note
                spread.setdefault(name, []).append(law.get("exponent", law.get("alpha")))
    for name, values in spread.items():
        laws[name]["range"] = [float(min(values)), float(max(values))]
    return laws


# ---------------------------------------------------------------------------------------------
# Where the laws are kept


def machine_key() -> str:
    """The machine the step times belong to: the CPU model and the cores this process may use, and the GPU."""
    import torch

    from gptlite.device import cpu_summary

    gpu = f" | {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return cpu_summary() + gpu


def laws_path(data_fingerprint: str, machine: str) -> Path:
    """The cache file of the laws of this data on this machine."""
    digest = hashlib.sha256(machine.encode()).hexdigest()[:12]
    return CACHE / f"{data_fingerprint}-{digest}.json"


def save_laws(laws: dict, path: Path) -> None:
    """Write the laws to `path` and to the cache for their data and machine (laws["data"]["fingerprint"],
    laws["machine"]), atomically each."""
    write_json(path, laws)
    cached = laws_path(laws["data"]["fingerprint"], laws["machine"])
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_json(cached, laws)


def find_laws(data_fingerprint: str, vocab_size: int, laws_file: str = "") -> tuple[dict, str]:
    """(the laws to derive a recipe from, a line saying which they are and how strong): `laws_file` if given,
    however weak; else the ones a sweep fitted for this data on this machine, unless their own checks call them weak
    (`weakness`); else, or then, the defaults measured for this project (a character vocabulary's or a BPE's)."""
    if laws_file:
        laws = read_laws(Path(laws_file))
        weak = weakness(laws)
        return laws, f"the laws in {laws_file}: {strength(laws)}" + (f"; weak: {weak}" if weak else "")
    defaults = json.loads(DEFAULT_LAWS.read_text())
    kind = "char" if vocab_size <= 256 else "bpe"
    default = defaults.get(kind) or defaults["char"]
    measured = (
        f"the defaults measured for gptlite on {default['data']['name']} ({default['machine']}): {strength(default)}"
    )
    cached = laws_path(data_fingerprint, machine_key())
    if not cached.is_file():
        return default, (
            f"{measured}; no laws were fitted for this data on this machine (`python -m gptlite.scaling "
            "--data_dir=...` fits your own)"
        )
    laws = read_laws(cached)
    weak = weakness(laws)
    if not weak:
        return laws, f"the laws fitted for this data on this machine ({cached}): {strength(laws)}"
    return default, (
        f"{measured}; not the laws fitted for this data on this machine ({cached}), which their own checks call weak: "
        f"{weak} (--scaling_laws={cached} uses them anyway)"
    )


def weakness(laws: dict) -> str:
    """What the laws' own checks found against them: the sweep's note on its size laws (too few budgets' optima inside
    the widths run, or trained long enough), or its check run's miss of the loss law past CHECK_TOLERANCE; "" if
    nothing."""
    return laws.get("size_note") or (laws.get("check") or {}).get("note") or ""


def strength(laws: dict) -> str:
    """How far the laws reach, in their own figures: the size law's exponent with its range over the fits that leave
    one run out, the budgets it went through, and the check run's distance from the loss law where one ran."""
    law = laws["params_per_second"]
    low, high = law.get("range", [law["exponent"], law["exponent"]])
    frontier = laws.get("frontier", [])
    budgets = [f"{point['seconds']:g}" for point in frontier if point.get("fitted", True)]
    text = (
        f"N* ~ t^{law['exponent']:.2f} ({low:.2f} to {high:.2f} leaving one run out) through the optima at "
        f"{', '.join(budgets) or 'no'} s"
    )
    check = laws.get("check")
    if check:
        return text + f"; its check at {check['seconds']:g} s lay {100 * check['off']:+.1f}% from the loss law"
    return text + "; no check run (python -m gptlite.scaling --check)"


def read_laws(path: Path) -> dict:
    try:
        laws = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot read the scaling laws in {path} ({e}); fit them again with python -m gptlite.scaling"
        ) from None
    if not isinstance(laws, dict) or "params_per_second" not in laws:
        raise ValueError(f"{path} holds no scaling laws of gptlite's; fit them with python -m gptlite.scaling")
    return laws
