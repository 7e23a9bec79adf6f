"""`train.py --budget=...`: the recipe for a budget, each choice with its reason.

The laws (gptlite.scaling.laws: this data's on this machine, else the defaults measured here) give the model's
size for the budget; the recipe family (gptlite.scaling.recipe) gives the rest from the size. What the machine
decides is measured, not assumed: a few training steps of the chosen model on random tokens (`Probe`) give its step
time here, which sets the step count (and with it Muon's momentum and, for a run of few steps, the batch), and for a
time budget the share left for training once start-up and the final evaluation are counted.

On a CPU that other processes share, the probe times what the run will see: its steps run on the thread count
train.py's own will settle on (`ProbeThreads`: torch's threads spinning beside a busy core made every step many times
slower than the run's), the fastest of its timed steps is the step's time (a burst of other work makes some slower),
and a time budget that seems to leave too little to train is measured once more before it is refused.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from gptlite.scaling.laws import expected_loss, find_laws, power, size_at
from gptlite.scaling.recipe import (
    BLOCK_SIZE,
    FULL_WINDOWS,
    SHORT_STEPS,
    STEP_FLOOR,
    TOKENS_PER_STEP,
    WIDTHS,
    Budget,
    horizon_scale,
    parse_budget,
    recipe,
    shape,
    windows_per_step,
)

MARGIN_S = 1.5  # seconds a time budget keeps back for saving the checkpoint and the process's exit
LOAD_WINDOW = 0.5  # seconds over which the other processes' work is measured before a probe picks its threads
FRESH_EPOCHS = 4  # passes over the data that train about as well as new tokens (Muennighoff et al. 2023)


@functools.cache
def block_params(width: int) -> int:
    """The parameters of the blocks of the family's model at `width` (what the laws count): one block, built on the
    CPU, times the layers (a model's blocks are alike)."""
    from gptlite.config import GPTConfig
    from gptlite.model.network import Block

    config = GPTConfig(**shape(width), vocab_size=256, block_size=BLOCK_SIZE, pos_emb="rope")
    return config.n_layer * sum(p.numel() for p in Block(config).parameters())


def flops_per_token(keys: dict) -> float:
    """Training FLOPs per token of the model train.py's `keys` describe (GPT.flops_per_token), counted on the meta
    device: nothing is allocated."""
    import torch

    from gptlite.config import build_config
    from gptlite.model.network import Transformer

    with torch.device("meta"):
        return Transformer(build_config(keys).model).flops_per_token()


def nearest_width(params: float) -> int:
    """The family's width whose block parameters are nearest `params` in log."""
    return min(WIDTHS, key=lambda w: abs(math.log(block_params(w) / params)))


def process_age() -> float:
    """Seconds since this process started (its start-up, torch's import included, is in a time budget)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return max(0.0, time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


def train_config(keys: dict):
    """train.py's TrainConfig for a recipe's `keys`, less the time budget's keys (its clock is not a model's)."""
    from gptlite.config import build_config

    return build_config({k: v for k, v in keys.items() if k not in ("max_minutes", "lr_schedule")})


class Probe:
    """The model and optimizers of train.py's `keys`, built as train.py builds them, and a batch of random tokens of
    full windows, to time here: a training step (`step_seconds`) and the final evaluation (`eval_seconds_per_token`),
    each only when asked for, since with a large vocabulary each takes a second or more of a time budget."""

    def __init__(self, keys: dict, device: str):
        import torch

        from gptlite.model.network import Transformer
        from gptlite.train.optim import configure_optimizers

        self.cfg = train_config(keys)
        self.device = device
        self.model = Transformer(self.cfg.model).to(device)
        self.optimizers = configure_optimizers(self.model, self.cfg, device.split(":")[0])
        shape = (self.cfg.batch_size, self.cfg.model.block_size)
        self.x = torch.randint(0, self.cfg.model.vocab_size, shape, device=device)

    def step_seconds(self, steps: int = 3, seconds: float = 1.0) -> float:
        """Seconds a training step takes here: its loss computed as train.py computes it (the head and the
        cross-entropy in chunks), one step to warm up, then the fastest of `steps`, or of fewer once the measured
        ones have taken `seconds` (a step of a large vocabulary's head takes a second or more on a CPU). The fastest,
        not the mean: a burst of other work slows some steps, and the run's own steps are many more."""
        self.model.train()
        elapsed = 0.0
        fastest = math.inf
        for i in range(steps + 1):
            start = time.perf_counter()
            _, loss = self.model(self.x, self.x, return_logits=not self.cfg.chunked_loss)
            loss.backward()
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            synchronize(self.device)
            if i:
                took = time.perf_counter() - start
                elapsed += took
                fastest = min(fastest, took)
                if elapsed >= seconds:
                    break
        return fastest

    def eval_seconds_per_token(self, forwards: int = 3) -> float:
        """Seconds the final evaluation takes per token here: the median of `forwards` forwards of the batch without
        gradients, as the evaluation scores one (gptlite.evaluate.bpb), after one to warm up, over its tokens. One
        forward's time varies from run to run, and with a large vocabulary the evaluation is a large share of a short
        budget: priced from one forward, the training time swung by seconds (docs/scaling.md). A batch takes a third
        of a step for a small vocabulary, near half of one where the head is most of the work."""
        import torch

        self.model.eval()
        times = []
        with torch.no_grad():
            for _ in range(forwards + 1):
                start = time.perf_counter()
                self.model(self.x, self.x, reduction="none", return_logits=False)
                synchronize(self.device)
                times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) / self.x.numel()


class ProbeThreads:
    """torch's CPU thread count while the probes run: the count train.py's own (gptlite.device.CpuThreads) settles
    on under the work other processes do now, so that a probe times a step as the run will take it. torch's
    threads wait for each other by spinning, and beside a busy core every step at the full count was many times
    slower than the run's own once its count had followed. `fit()`, before each measurement, measures the other
    work over at least LOAD_WINDOW seconds (waiting out what is left of them) and sets the count; `restore()` gives
    torch its own count back, which the run starts from. Nothing changes where train.py's count does not follow the
    load either: on a GPU, under torchrun (RANK set), where the count is the user's (OMP_NUM_THREADS) or where the
    load cannot be read."""

    def __init__(self, device: str):
        import torch

        from gptlite.device import CpuThreads

        self.own = torch.get_num_threads()
        self.cpu = CpuThreads() if device == "cpu" and "RANK" not in os.environ else None

    def fit(self) -> str | None:
        """Measure the other work and fit the count to it; a line when the probe's count is not torch's own."""
        if self.cpu is None or not self.cpu.active:
            return None
        since = time.monotonic() - self.cpu.last[0]
        if since < LOAD_WINDOW:
            time.sleep(LOAD_WINDOW - since)
        note = self.cpu.update(window=LOAD_WINDOW)
        if self.cpu.threads == self.own or not note:
            return None
        return f"probe threads (the run's, once its own follow the other work): {note}"

    def restore(self) -> None:
        import torch

        torch.set_num_threads(self.own)


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work, so that a time measured on the host is the device's."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def split_tokens(data_dir: str, split: str) -> int:
    """The tokens of a split of the data (its shards' sizes: each is memory-mapped, not read)."""
    from gptlite.data.shards import find_shards, read_shard

    return sum(len(read_shard(p)) for p in find_shards(data_dir, split))


def step_tokens(keys: dict) -> int:
    """The tokens an optimizer step of train.py's `keys` trains on (one process's: batch_size windows of block_size,
    or total_batch_size where it is set)."""
    cfg = train_config(keys)
    return cfg.total_batch_size or cfg.batch_size * cfg.model.block_size


def batch_note(windows: int, full_steps: float) -> str:
    """Why a step trains on `windows` windows, where the family's FULL_WINDOWS would have given `full_steps`."""
    if windows == FULL_WINDOWS:
        return f"batch: {FULL_WINDOWS} windows of {BLOCK_SIZE} a step, the family's"
    return (
        f"batch: {windows} window(s) of {BLOCK_SIZE} a step, not the family's {FULL_WINDOWS}: those would give only "
        f"about {full_steps:,.0f} steps, under {STEP_FLOOR}, and so short a run is limited by its steps, not its "
        "tokens (gptlite.scaling.recipe.windows_per_step)"
    )


def repetition_note(tokens: int, data_dir: str) -> str | None:
    """A warning when a run's `tokens` pass over the data's training split more than FRESH_EPOCHS times: the laws
    price every token as new, and past a few passes a repeated token teaches less than a new one (Muennighoff et al.
    2023, "Scaling Data-Constrained Language Models"), so the run will do worse than the law's loss."""
    unique = split_tokens(data_dir, "train")
    epochs = tokens / max(1, unique)
    if epochs <= FRESH_EPOCHS:
        return None
    return (
        f"note: {tokens:,} tokens are {epochs:.1f} passes over the data's {unique:,} training tokens; past about "
        f"{FRESH_EPOCHS} a repeated token teaches less than a new one (Muennighoff et al. 2023) and a model sized for "
        "new tokens overfits, so expect a val loss above the law's: more data would serve this budget better"
    )


def derive(
    budget_text: str, data_dir: str, vocab_size: int, device: str, laws_file: str = "", given: dict | None = None
) -> tuple[dict, list[str]]:
    """(train.py's keys for the budget, a line per choice saying why). `vocab_size` is the data's; `given`, the keys
    the user set, which win over the recipe's: the probe times the model they describe (another width trains at
    another speed, and its final evaluation takes another share of the time)."""
    given = given or {}
    from gptlite.data.loader import data_identity
    from gptlite.data.shards import find_shards

    budget = parse_budget(budget_text)
    threads = ProbeThreads(device)  # from here on, the other processes' work is measured
    fingerprint = data_identity(find_shards(data_dir, "train"), "text")["data"]
    laws, source = find_laws(fingerprint, vocab_size, laws_file)
    notes = [f"--budget={budget.text}: from {source}"]
    try:
        if budget.kind == "seconds":
            keys, steps = for_time(budget, laws, data_dir, vocab_size, device, given, notes, threads)
        else:
            keys, steps = for_compute(budget, laws, vocab_size, device, given, notes, threads)
    finally:
        threads.restore()
    repeated = repetition_note(steps * step_tokens({**keys, **given}), data_dir)
    if repeated:
        notes.append(repeated)
    if "size_note" in laws:
        notes.append(f"note: {laws['size_note']}")
    scale = horizon_scale(steps)
    horizon = f", times {scale:.2f} for a run under {SHORT_STEPS} steps" if scale > 1 else ""
    notes.append(
        f"ingredients: rotary positions, SwiGLU {3}x wide, Muon for the block matrices (lr {keys['muon_lr']:.3g}: "
        f"0.03 at every width{horizon}) and AdamW for the rest (lr {keys['learning_rate']:.2e}: 4e-3 at width 96, "
        f"times sqrt(96/width){horizon}), windows growing from 64 to {BLOCK_SIZE} tokens over 60% of the run, "
        + (
            f"and a bigram embedding of every pair of the {vocab_size} ids"
            if keys["bigram_vocab"]
            else f"no bigram embedding (a table of every pair of {vocab_size:,} ids would not fit)"
        )
        + "; each measured on the 90-s CPU speedrun (docs/training.md)"
    )
    notes.append(
        f"Muon's momentum {keys['muon_momentum']}: "
        + ("under 2,000 steps less momentum measured better" if keys["muon_momentum"] < 0.9 else "the usual 0.95")
    )
    if device.startswith("cuda"):
        keys |= {"dtype": "bfloat16", "compile": budget.kind != "seconds" or budget.amount >= 600}
        notes.append(
            "precision bfloat16 (autocast) on the GPU; torch.compile "
            + ("on" if keys["compile"] else "off: compiling would take much of so short a budget")
        )
    else:
        keys |= {"dtype": "float32", "compile": False}
        notes.append(
            "precision float32 and no torch.compile on the CPU: bfloat16 autocast measured slower for small models "
            "on CPUs (docs/training.md), and compiling takes a minute or more of the budget"
        )
    return keys, notes


def for_time(
    budget: Budget,
    laws: dict,
    data_dir: str,
    vocab_size: int,
    device: str,
    given: dict,
    notes: list[str],
    threads: ProbeThreads,
) -> tuple[dict, int]:
    """A time budget: the size the law gives for the training time left, the step time measured here (of the model
    with the `given` keys over the recipe's), at fewer windows a step where the family's batch would leave fewer
    than STEP_FLOOR steps (unless the batch is given), and the final evaluation's time at the chosen batch. The
    size is chosen first for a rough training time (before the evaluation is priced); where the time left once it
    is gives another width, that width is measured again and kept. A measurement that leaves too little to train is
    taken once more (a burst of other work may have slowed it), and the budget is refused only if that one does too.
    Returns (the keys, the steps expected in that time)."""
    rough = budget.amount - process_age() - 3.0  # before the model is known: start-up and a few seconds' evaluation
    if rough < 5:
        raise ValueError(f"--budget={budget.text} leaves {rough:.1f} s to train after start-up; give at least 15s")
    val_tokens = split_tokens(data_dir, "val")

    def measured(width: int) -> tuple[int, float, float | None, float, float]:
        """(windows a step, step seconds, the family's steps or None, training seconds, evaluation seconds) of
        `width` here."""
        fitted = threads.fit()
        if fitted and fitted not in notes:
            notes.append(fitted)
        if batch_given(given):
            windows, full_steps = FULL_WINDOWS, None
            probe = Probe({**recipe(width, vocab_size, steps=1, seconds=rough), **given}, device)
            step_s = probe.step_seconds()
        else:

            def keys_at(windows: int) -> dict:
                return {**recipe(width, vocab_size, steps=1, seconds=rough, windows=windows), **given}

            windows, step_s, probe, full_steps = probe_batch(keys_at, device, rough)
        eval_token_s = probe.eval_seconds_per_token()
        del probe  # its model and optimizers' memory, before train.py (or the next probe) builds its own
        seconds, eval_s = training_time(budget, val_tokens, step_s, eval_token_s)
        return windows, step_s, full_steps, seconds, eval_s

    def check_left(seconds: float, eval_s: float) -> None:
        """Refuse a budget that leaves too little to train, before the laws are asked about so short a time (at
        none, the size law's power of a negative time is not a number)."""
        if seconds < 5:
            raise ValueError(
                f"--budget={budget.text} leaves {seconds:.1f} s to train once start-up and the final evaluation "
                f"({eval_s:.1f} s) are counted; give a larger budget"
            )

    def measured_twice_if_short(width: int) -> tuple[int, float, float | None, float, float]:
        """measured(width), and where that leaves too little to train, measured again: the one that leaves more."""
        first = measured(width)
        if first[3] >= 5:
            return first
        return max(first, measured(width), key=lambda m: m[3])

    width = nearest_width(size_at(laws, rough)[0])
    windows, step_s, full_steps, seconds, eval_s = measured_twice_if_short(width)
    check_left(seconds, eval_s)
    for_seconds = nearest_width(size_at(laws, seconds)[0])
    if for_seconds != width and "n_embd" not in given:  # one more measurement: the time left decides the width
        width = for_seconds
        windows, step_s, full_steps, seconds, eval_s = measured_twice_if_short(width)
        check_left(seconds, eval_s)
    steps = int(seconds / step_s)
    keys = recipe(width, vocab_size, steps=steps, seconds=seconds, windows=windows)
    held = size_at(laws, seconds)[1]
    notes.append(
        f"model: width {width}, {keys['n_layer']} layer(s), {keys['n_head']} heads ({block_params(width) / 1e6:.3g}M "
        f"block parameters): the law N* = {laws['params_per_second']['coef']:.3g} t^"
        f"{laws['params_per_second']['exponent']:.3f} gives {power(laws['params_per_second'], seconds) / 1e6:.3g}M "
        f"for {seconds:.1f} s of training" + range_note(laws["params_per_second"]) + (f", {held}" if held else "")
    )
    if full_steps is not None:
        notes.append(batch_note(windows, full_steps))
    notes.append(
        f"time: {seconds:.1f} s of training (lr_schedule=time: the decay and the windows follow the clock), after "
        f"{process_age():.1f} s of start-up and before about {eval_s:.1f} s of final evaluation, one step kept back "
        "for the last one's overrun; "
        f"{1000 * step_s:.1f} ms a step measured here: about {steps:,} steps of {step_tokens({**keys, **given}):,} "
        "tokens"
    )
    notes.append(loss_note(laws["loss_per_second"], seconds, vocab_size, "L*(t)"))
    return keys, steps


def probe_batch(keys_at: Callable[[int], dict], device: str, seconds: float) -> tuple[int, float, Probe, float]:
    """(windows a step for a run of about `seconds` of training whose keys at w windows a step are keys_at(w), its
    step time here, the Probe that timed it, the steps the family's FULL_WINDOWS would take): windows_per_step of
    those steps. One window's step is timed first: six of them last at least as long as one step of six (a step's
    fixed costs count six times), and unless those costs outweigh the tokens' work, at most twice as long. Where
    even twice the steps that bound gives would call for one window (a large vocabulary's head at a short budget,
    where a step of six windows takes a second), the run trains on one window, timed once; else a step of the
    family's batch is timed, and then one of the windows it calls for, where those are fewer."""
    probe = Probe(keys_at(1), device)
    one_s = probe.step_seconds()
    at_least = seconds / (FULL_WINDOWS * one_s)
    if windows_per_step(2 * at_least) == 1:
        return 1, one_s, probe, at_least
    probe = Probe(keys_at(FULL_WINDOWS), device)
    full_s = probe.step_seconds()
    full_steps = seconds / full_s
    windows = windows_per_step(full_steps)
    if windows == FULL_WINDOWS:
        return windows, full_s, probe, full_steps
    probe = Probe(keys_at(windows), device)
    return windows, probe.step_seconds(), probe, full_steps


def training_time(budget: Budget, val_tokens: int, step_s: float, eval_token_s: float) -> tuple[float, float]:
    """(seconds left to train in a time budget, seconds the final evaluation of `val_tokens` will take): the budget
    less the process's age so far, the evaluation (20% more than measured: a margin), MARGIN_S and one step, since
    train.py reads the clock after each step and the last one can end up to a step past max_minutes."""
    eval_s = 1.2 * val_tokens * eval_token_s
    return budget.amount - process_age() - eval_s - MARGIN_S - step_s, eval_s


def batch_given(given: dict) -> bool:
    """Whether the user set the batch (then the derivation keeps it)."""
    return "batch_size" in given or "total_batch_size" in given


def for_compute(
    budget: Budget, laws: dict, vocab_size: int, device: str, given: dict, notes: list[str], threads: ProbeThreads
) -> tuple[dict, int]:
    """A FLOPs or tokens budget: the size the law gives for the FLOPs (for tokens: the FLOPs whose optimal run
    trains on that many), the step count from the tokens (at fewer windows a step where the family's batch would
    take fewer than STEP_FLOOR steps, unless the batch is given), the step time measured here (of the model with
    the `given` keys over the recipe's). Returns (the keys, the steps)."""
    if budget.kind == "flops":
        flops = budget.amount
    else:  # D* = H C^b, inverted, in logs: a law's power of a budget may pass what a float holds
        law = laws["tokens_per_flop"]
        log_flops = (math.log(budget.amount) - math.log(law["coef"])) / law["exponent"]
        if not -700 < log_flops < 700:
            raise ValueError(
                f"--budget={budget.text}: the law D* = {law['coef']:.3g} C^{law['exponent']:.3f} gives "
                f"10^{log_flops / math.log(10):.0f} FLOPs for it, past what a float holds; give a budget nearer the "
                "budgets the laws were fitted at"
            )
        flops = math.exp(log_flops)
    width = nearest_width(power(laws["params_per_flop"], flops))
    per_token = flops_per_token(recipe(width, vocab_size, steps=1))
    tokens = budget.amount if budget.kind == "tokens" else flops / per_token
    full_steps = tokens / TOKENS_PER_STEP
    windows = FULL_WINDOWS if batch_given(given) else windows_per_step(full_steps)
    per_step = step_tokens({**recipe(width, vocab_size, steps=1, windows=windows), **given})
    steps = max(1, math.ceil(tokens / per_step))
    keys = recipe(width, vocab_size, steps=steps, windows=windows)
    fitted = threads.fit()
    if fitted:
        notes.append(fitted)
    step_s = Probe({**keys, **given}, device).step_seconds()
    notes.append(
        f"model: width {width}, {keys['n_layer']} layer(s), {keys['n_head']} heads ({block_params(width) / 1e6:.3g}M "
        f"block parameters): the law N* = {laws['params_per_flop']['coef']:.3g} C^"
        f"{laws['params_per_flop']['exponent']:.3f} gives {power(laws['params_per_flop'], flops) / 1e6:.3g}M for "
        f"{flops:.3g} FLOPs" + range_note(laws["params_per_flop"])
    )
    if not batch_given(given):
        notes.append(batch_note(windows, full_steps))
    notes.append(
        f"tokens: {steps:,} steps of {per_step:,} = {steps * per_step:,} tokens; "
        f"{1000 * step_s:.1f} ms a step measured here: about {steps * step_s / 60:.1f} min"
    )
    notes.append(loss_note(laws["loss_per_flop"], flops, vocab_size, "L*(C)"))
    return keys, steps


def loss_note(law: dict, x: float, vocab_size: int, name: str) -> str:
    """The val loss the loss law expects at `x`, held at a uniform guess's (gptlite.scaling.laws.expected_loss)."""
    loss, held = expected_loss(law, x, vocab_size)
    return f"expected val loss {loss:.3f} (the law {name}{'; ' + held if held else ''})"


def range_note(law: dict) -> str:
    low_high = law.get("range")
    return f" (exponent {low_high[0]:.3f} to {low_high[1]:.3f} leaving one run out)" if low_high else ""
