"""gptlite.scaling: budgets read as written, the fits against laws they must recover, the sweep (resumable, one
train.py process per run) and train.py --budget's recipe, every key still overridable."""

import json
import math
import re

import numpy as np
import pytest

from gptlite.scaling.derive import Probe, block_params, nearest_width
from gptlite.scaling.laws import fit_laws, fit_power, fit_saturating, optimum, power, saturating, size_at
from gptlite.scaling.recipe import (
    FULL_WINDOWS,
    SHORT_STEPS,
    STEP_FLOOR,
    WIDTHS,
    parse_budget,
    recipe,
    shape,
    windows_per_step,
)
from gptlite.train.metrics import read_metrics
from tests.conftest import ROOT, run_train, shared_file


@pytest.mark.parametrize(
    "text, kind, amount",
    [
        ("90s", "seconds", 90),
        ("20min", "seconds", 1200),
        ("3h", "seconds", 10800),
        ("1e15flops", "flops", 1e15),
        ("2Pflops", "flops", 2e15),
        ("50Mtokens", "tokens", 5e7),
        ("2e9tokens", "tokens", 2e9),
    ],
)
def test_a_budget_reads_as_written(text, kind, amount):
    budget = parse_budget(text)
    assert budget.kind == kind and budget.amount == pytest.approx(amount)


@pytest.mark.parametrize("text", ["90", "fast", "3Ms", "-5s", "0s", "10 parsecs"])
def test_a_budget_that_is_not_one_is_named(text):
    with pytest.raises(ValueError, match=f"--budget={text!r} (is not a budget|must be more)"):
        parse_budget(text)


@pytest.mark.parametrize(
    "text, said",
    [
        ("1e400flops", "is inf flops, outside what gptlite can plan a run for: give 1 to 1e+30 flops"),
        ("1e400s", "is inf seconds, outside what gptlite can plan a run for: give up to 1e+08 seconds"),
        ("1e400tokens", "is inf tokens, outside what gptlite can plan a run for: give 1 to 1e+16 tokens"),
        ("2e30Pflops", "is 2e+45 flops, outside"),
        ("0.5tokens", "is 0.5 tokens, outside what gptlite can plan a run for: give 1 to 1e+16 tokens"),
    ],
)
def test_a_budget_past_what_the_laws_can_take_is_refused_where_it_is_read(text, said, tmp_path):
    """A budget the laws' powers cannot take (infinity, a power past what a float holds) is refused as train.py
    reads it, in one line with the range: never the math's own error ("math domain error") from deep inside."""
    with pytest.raises(ValueError, match=f"^--budget={text!r} {re.escape(said)}"):
        parse_budget(text)
    run = run_train(f"--data_dir={tmp_path / 'none'}", f"--out_dir={tmp_path / 'run'}", f"--budget={text}")
    assert run.code == 2 and f"--budget={text!r} {said}" in run.err and len(run.err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_loss_law_far_below_its_budgets_is_held_at_a_uniform_guess():
    """L = E + A x^-alpha grows without bound as x shrinks; no model does worse than a uniform guess over its ids,
    ln(vocab_size), so the expected loss is held there, and says why."""
    from gptlite.scaling.laws import expected_loss

    law = {"E": 1.27, "A": 491.2, "alpha": 0.256}
    assert expected_loss(law, 1e15, 65) == (pytest.approx(saturating(law, 1e15)), "")
    loss, why = expected_loss(law, 4.3e-6, 65)
    assert loss == pytest.approx(math.log(65)) and why.startswith("held at ln 65 = 4.174, a uniform guess's loss")
    assert "the law gives 11" in why
    assert expected_loss({"E": 0.0, "A": 1.0, "alpha": 400.0}, 1e-3, 50257)[0] == pytest.approx(math.log(50257))


def test_the_family_at_width_96_is_the_hand_tuned_speedrun_model():
    keys = recipe(96, 65, steps=1350, seconds=87.0)
    tuned = {"n_layer": 2, "n_embd": 96, "n_head": 4, "ffn_hidden": 288, "bigram_vocab": 4226, "batch_size": 6}
    assert {k: keys[k] for k in tuned} == tuned
    assert keys["muon_lr"] == 0.03 and keys["learning_rate"] == pytest.approx(4e-3) and keys["muon_momentum"] == 0.8
    assert keys["lr_schedule"] == "time" and keys["max_minutes"] == pytest.approx(1.45)
    # AdamW's rate goes as 1/sqrt(width); Muon's stays; a long run keeps the usual momentum; no pair table for BPE
    wide = recipe(384, 50304, steps=5000)
    assert wide["learning_rate"] == pytest.approx(4e-3 / 2) and wide["muon_lr"] == 0.03
    assert wide["muon_momentum"] == 0.95 and wide["bigram_vocab"] == 0 and wide["max_iters"] == 5000
    for width in WIDTHS:  # every width is a model: heads divide it, a layer per 48
        assert shape(width)["n_embd"] % shape(width)["n_head"] == 0


def test_a_short_run_trains_at_higher_learning_rates():
    base = recipe(96, 65, steps=SHORT_STEPS)
    assert base["muon_lr"] == 0.03 and base["learning_rate"] == pytest.approx(4e-3)
    for steps, scale in ((4 * SHORT_STEPS, 1.0), (SHORT_STEPS * 3 // 4, 4 / 3), (SHORT_STEPS // 2, 2.0), (10, 2.0)):
        keys = recipe(96, 65, steps=steps)
        assert keys["muon_lr"] == pytest.approx(0.03 * scale)
        assert keys["learning_rate"] == pytest.approx(4e-3 * scale)
        assert keys["min_lr"] == pytest.approx(keys["learning_rate"] / 40)


def test_a_run_of_few_steps_trains_on_fewer_windows_a_step():
    """Under STEP_FLOOR steps of the family's batch, the windows a step shrink in proportion, to one at least."""
    assert windows_per_step(STEP_FLOOR) == windows_per_step(100 * STEP_FLOOR) == FULL_WINDOWS == 6
    assert windows_per_step(STEP_FLOOR / 2) == 3 and windows_per_step(STEP_FLOOR / 3) == 2
    assert windows_per_step(STEP_FLOOR / 6) == windows_per_step(STEP_FLOOR / 100) == windows_per_step(0) == 1
    assert recipe(48, 50257, steps=10, seconds=20.0, windows=2)["batch_size"] == 2
    assert recipe(48, 50257, steps=10)["batch_size"] == FULL_WINDOWS


def test_block_params_count_the_blocks_as_the_model_does():
    from gptlite.config import GPTConfig
    from gptlite.gpt import GPT

    model = GPT(GPTConfig(**shape(72), vocab_size=65, block_size=64, pos_emb="rope"))
    assert block_params(72) == sum(p.numel() for p in model.blocks.parameters())
    assert nearest_width(block_params(144) * 1.1) == 144


def test_the_fits_recover_the_laws_they_are_given():
    x = np.geomspace(1e12, 1e15, 6)
    assert fit_power(x, 3.0 * x**0.5) == pytest.approx({"coef": 3.0, "exponent": 0.5}, rel=1e-6)
    law = fit_saturating(x, 1.2 + 40 * x**-0.1)
    assert law["E"] == pytest.approx(1.2, abs=0.01) and law["alpha"] == pytest.approx(0.1, rel=0.05)
    assert saturating(law, 3e15) == pytest.approx(1.2 + 40 * 3e15**-0.1, rel=1e-3)


def synthetic_runs(noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Runs drawn from a known law: at budget t the loss is a valley in log N whose bottom lies at N* = 1e3 t^0.6,
    its depth L* = 1.3 + 2 t^-0.3; a run of N parameters for t seconds does 6 N D FLOPs at 1e9 FLOPs a second, in
    steps of 3,072 tokens (the best run of each budget takes 136-313 of them)."""
    rng = np.random.default_rng(seed)
    runs = []
    for t in (10.0, 20.0, 40.0, 80.0):
        best = 1e3 * t**0.6
        for n in np.geomspace(best / 8, best * 8, 5):
            loss = 1.3 + 2 * t**-0.3 + 0.05 * math.log(n / best) ** 2 + noise * rng.standard_normal()
            flops = 1e9 * t
            tokens = flops / (6 * n)
            runs.append({"seconds": t, "width": int(n), "params": float(n), "val_loss": loss, "flops": flops,
                         "tokens": tokens, "steps": int(tokens // 3072)})  # fmt: skip
    return runs


def test_the_laws_of_a_sweep_recover_its_optima_and_exponents():
    laws = fit_laws(synthetic_runs())
    assert laws["params_per_second"]["exponent"] == pytest.approx(0.6, rel=1e-3)
    assert laws["params_per_second"]["coef"] == pytest.approx(1e3, rel=1e-2)
    assert laws["loss_per_second"]["alpha"] == pytest.approx(0.3, rel=0.05)
    assert saturating(laws["loss_per_second"], 240.0) == pytest.approx(1.3 + 2 * 240**-0.3, rel=2e-3)
    # against FLOPs (1e9 a second): N* = 1e3 (C / 1e9)^0.6, and D* = C / (6 N*)
    assert power(laws["params_per_flop"], 1e11) == pytest.approx(1e3 * 100**0.6, rel=1e-2)
    assert laws["tokens_per_flop"]["exponent"] == pytest.approx(0.4, rel=1e-2)
    assert not any(point["edge"] for point in laws["frontier"])
    # with noise, each exponent comes with its range over the fits that leave one run out, around the truth
    noisy = fit_laws(synthetic_runs(noise=0.01, seed=1))
    low, high = noisy["params_per_second"]["range"]
    assert low < noisy["params_per_second"]["exponent"] < high and low < 0.75 and high > 0.45


def test_an_optimum_past_the_sizes_run_is_flagged():
    runs = [r for r in synthetic_runs() if r["seconds"] == 80.0]
    small = sorted(runs, key=lambda r: r["params"])[:3]  # the valley's bottom is at the largest of these
    point = optimum(small)
    assert point["edge"] and point["params"] == pytest.approx(small[-1]["params"]) and point["side"] == "largest"
    large = sorted(runs, key=lambda r: r["params"])[-3:]  # the bottom is below the smallest of these
    assert optimum(large)["side"] == "smallest" and optimum(runs)["side"] == ""
    with pytest.raises(ValueError, match="at least 2 budgets"):
        fit_laws(runs)


def edge_laws(short_steps: int = 200) -> dict:
    """Laws whose size law N* = 1e3 t is fitted through 40 s and 80 s, with a 20-s budget whose best run was the
    smallest width (5,000 parameters, its run `short_steps` steps long) and a 320-s one whose best was the largest
    (1e6): the law gives 19,000 at 19 s and 400,000 at 400 s, past what those bounds allow."""
    point = {"val_loss": 3.0, "flops": 1e12, "tokens": 1e5}
    return {
        "params_per_second": {"coef": 1e3, "exponent": 1.0},
        "frontier": [
            {**point, "seconds": 20.0, "params": 5e3, "edge": True, "side": "smallest", "steps": short_steps},
            {**point, "seconds": 40.0, "params": 4e4, "edge": False, "side": "", "steps": 300},
            {**point, "seconds": 80.0, "params": 8e4, "edge": False, "side": "", "steps": 400},
            {**point, "seconds": 320.0, "params": 1e6, "edge": True, "side": "largest", "steps": 900},
        ],
    }


def test_the_size_law_is_held_within_what_the_edge_budgets_bound():
    """A budget whose best run was the smallest width bounds the optimum from above there and at any shorter
    budget (the optimal size grows with the budget); the largest width, from below there and at any longer one.
    Inside, and where the edge's best run was too short to say (MIN_FIT_STEPS), the law alone."""
    from gptlite.scaling.laws import MIN_FIT_STEPS

    laws = edge_laws()
    params, why = size_at(laws, 19.0)
    assert params == 5e3 and why.startswith("held at most 0.005M: the sweep's best run at 20 s was its smallest")
    assert size_at(laws, 20.0)[0] == 5e3 and size_at(laws, 10.0)[0] == 5e3
    assert size_at(laws, 25.0) == (pytest.approx(25e3), "")  # past the 20-s bound: the law
    assert size_at(laws, 4.0) == (pytest.approx(4e3), "")  # the law is already below the bound
    params, why = size_at(laws, 400.0)
    assert params == 1e6 and "held at least 1M" in why and "its largest width" in why
    assert size_at(laws, 300.0) == (pytest.approx(3e5), "")
    assert size_at(edge_laws(short_steps=MIN_FIT_STEPS - 1), 19.0) == (pytest.approx(19e3), "")
    for point in laws["frontier"]:  # laws fitted before the frontier named an edge's side: no bounds
        del point["side"]
    assert size_at(laws, 19.0) == (pytest.approx(19e3), "")


def test_a_time_budget_sizes_the_model_for_the_training_time_left(char_data, tmp_path, monkeypatch):
    """The width is chosen first for a rough training time, before the final evaluation is priced; where the time
    left once it is (here far less: a slow evaluation) calls for another width, that one is measured too and
    trains. A width the user gives is kept, measured once."""
    from gptlite.scaling import derive as derive_module

    laws = {**edge_laws(), "loss_per_second": {"E": 1.0, "A": 1.0, "alpha": 0.5}}
    monkeypatch.setattr(derive_module, "find_laws", lambda *args: (laws, "test laws"))
    monkeypatch.setattr(derive_module, "process_age", lambda: 4.0)
    val = derive_module.split_tokens(str(char_data), "val")
    eval_token_s = 35.0 / (1.2 * val)  # 35 s of final evaluation
    probed = []
    monkeypatch.setattr(derive_module, "Probe", fake_probe(lambda keys: 0.01, probed, eval_token_s))
    keys, notes = derive_module.derive("60s", str(char_data), 65, "cpu", given={"batch_size": "6"})
    rough = 60 - 4.0 - 3.0  # 53 s: N* = 53,000, width 48 (30,000 block parameters); 19.5 s left: held at 5,000
    assert nearest_width(power(laws["params_per_second"], rough)) == 48 and nearest_width(5e3) == 24
    assert [k["n_embd"] for k in probed] == [48, 24] and keys["n_embd"] == 24
    trained = 60 - 4.0 - 35.0 - derive_module.MARGIN_S - 0.01
    assert keys["max_minutes"] * 60 == pytest.approx(trained) and trained < 20
    assert "held at most 0.005M" in " ".join(notes)
    probed.clear()
    keys, _ = derive_module.derive("60s", str(char_data), 65, "cpu", given={"batch_size": "6", "n_embd": "48"})
    assert [k["n_embd"] for k in probed] == ["48"]


def too_short(runs: list[dict], budgets: tuple[float, ...]) -> list[dict]:
    """`runs` with those of `budgets` cut to 20 steps, their valley's bottom moved to 6 times the true size (the
    clock, not the size, deciding such runs' losses)."""
    out = []
    for r in runs:
        if r["seconds"] in budgets:
            best = 1e3 * r["seconds"] ** 0.6
            loss = 1.3 + 2 * r["seconds"] ** -0.3 + 0.05 * math.log(r["params"] / (6 * best)) ** 2
            r = {**r, "val_loss": loss, "steps": 20}
        out.append(r)
    return out


def test_budgets_whose_best_runs_took_few_steps_are_left_out_of_the_size_laws():
    laws = fit_laws(too_short(synthetic_runs(), (10.0, 20.0)))
    # through the two budgets that trained long enough, the size law is the true one
    assert laws["params_per_second"]["exponent"] == pytest.approx(0.6, rel=1e-3)
    assert laws["params_per_second"]["coef"] == pytest.approx(1e3, rel=1e-2)
    assert [(p["seconds"], p["steps"], p["fitted"]) for p in laws["frontier"]] == [
        (10.0, 20, False),
        (20.0, 20, False),
        (40.0, 237, True),
        (80.0, 313, True),
    ]
    assert "size_note" not in laws
    # with one such budget left, the laws go through every budget and say why they are worth little
    laws = fit_laws(too_short(synthetic_runs(), (10.0, 20.0, 40.0)))
    assert all(p["fitted"] for p in laws["frontier"])
    assert laws["size_note"].startswith("the best run at 10 s, 20 s, 40 s trained only 20 steps (fewer than 50)")
    assert "--budgets=10s,20s,40s,80s,160s,320s" in laws["size_note"]


@pytest.mark.parametrize(
    "sizes, side, advice",
    [
        (slice(2, 5), "smallest width run (96)", "add widths 48,72 (--widths=48,72,96,144,192)"),
        (slice(0, 3), "largest width run (192)", "add widths 240,288 (--widths=96,144,192,240,288)"),
    ],
)
def test_laws_whose_optima_lie_past_the_widths_say_so_and_what_to_sweep(sizes, side, advice):
    every = synthetic_runs()
    assert "size_note" not in fit_laws(every)
    runs = []
    for t in (10.0, 20.0, 40.0, 80.0):  # three of each budget's five sizes, with the valley's bottom at one end
        at = sorted((r for r in every if r["seconds"] == t), key=lambda r: r["params"])[sizes]
        runs += [{**r, "width": w} for r, w in zip(at, (96, 144, 192), strict=True)]
    laws = fit_laws(runs)
    assert all(point["edge"] for point in laws["frontier"])
    assert laws["size_note"].startswith(f"the best size at 10 s, 20 s, 40 s, 80 s was the {side}: the optimum lies")
    assert advice in laws["size_note"]


def test_a_check_that_misses_the_law_says_which_budget_to_add(tmp_path, capsys):
    """The check at 3x the longest budget, its run already in runs.jsonl (`earlier`): within 2% of the law it says
    nothing more; past it, by how much, which way, and the sweep's budgets with twice the longest added."""
    from gptlite.scaling.sweep import SweepOptions, check_run

    laws = fit_laws(synthetic_runs())
    budgets = [10.0, 20.0, 40.0, 80.0]
    predicted = saturating(laws["loss_per_second"], 240.0)
    width = nearest_width(power(laws["params_per_second"], 240.0))
    for ratio, said in [(1.019, ""), (0.985, ""), (1.035, "3.5% above"), (0.97, "3.0% below")]:
        earlier = [{"width": width, "seconds": 240.0, "val_loss": ratio * predicted, "check": True}]
        check = check_run(SweepOptions(data_dir=str(tmp_path)), tmp_path, laws, budgets, 65, earlier)
        printed = capsys.readouterr().out
        assert check["predicted"] == pytest.approx(predicted) and check["off"] == pytest.approx(ratio - 1)
        assert f"check: 240 s of training (3x the largest budget) at width {width}" in printed
        if not said:
            assert check["note"] == "" and "note:" not in printed
            continue
        assert check["note"].startswith(f"the check lay {said} the law, more than 2%: ")
        assert ("flattened more" if ratio > 1 else "fell further") in check["note"]
        assert "--budgets=10s,20s,40s,80s,160s" in check["note"] and f"note: {check['note']}" in printed
    assert not (tmp_path / "runs.jsonl").exists()  # nothing trained: the check's run was the earlier one


def test_a_run_that_repeats_the_data_more_than_a_few_times_is_warned(char_data, tmp_path, monkeypatch):
    from gptlite.scaling import laws as laws_module
    from gptlite.scaling.derive import FRESH_EPOCHS, derive, repetition_note, split_tokens

    train = split_tokens(char_data, "train")
    assert train == json.loads((char_data / "manifest.json").read_text())["train_tokens"]
    assert repetition_note(FRESH_EPOCHS * train, str(char_data)) is None
    note = repetition_note(10 * train, str(char_data))
    assert f"are 10.0 passes over the data's {train:,} training tokens" in note
    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")  # the defaults' laws
    keys, notes = derive("3Mtokens", str(char_data), 65, "cpu")
    warned = [line for line in notes if "passes over the data's" in line]
    tokens = keys["max_iters"] * keys["batch_size"] * keys["block_size"]
    assert len(warned) == 1 and f"{tokens / train:.1f} passes" in warned[0]
    _, notes = derive("200Ktokens", str(char_data), 65, "cpu")
    assert not any("passes over the data's" in line for line in notes)


def test_a_budget_that_leaves_no_time_to_train_says_so_before_the_laws_are_asked(char_data, tmp_path, monkeypatch):
    """A time budget whose final evaluation alone takes longer than it (a large vocabulary's at 20 s) leaves a
    negative time to train: the refusal that says so comes before the size law is asked about that time, whose
    power of a negative number is not a real one (once "'>' not supported between 'complex' and 'float'")."""
    from gptlite.scaling import derive as derive_module
    from gptlite.scaling import laws as laws_module

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")
    monkeypatch.setattr(derive_module, "process_age", lambda: 2.0)
    val = derive_module.split_tokens(str(char_data), "val")
    monkeypatch.setattr(derive_module, "Probe", fake_probe(lambda keys: 0.05, eval_token_s=40.0 / (1.2 * val)))
    with pytest.raises(ValueError, match=r"^--budget=20s leaves -2\d\.\d s to train once start-up and the final "
                                         r"evaluation \(40\.0 s\) are counted; give a larger budget$"):  # fmt: skip
        derive_module.derive("20s", str(char_data), 65, "cpu", given={"max_iters": "2"})


def test_a_budget_far_below_the_laws_expects_no_worse_than_a_uniform_guess(char_data, tmp_path, monkeypatch):
    """--budget=1tokens: the loss law L*(C) at the FLOPs the token law gives for one token is in the thousands for
    65 characters; the expected loss said is ln 65, and why."""
    from gptlite.scaling import derive as derive_module
    from gptlite.scaling import laws as laws_module

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")  # the defaults' laws
    monkeypatch.setattr(derive_module, "Probe", fake_probe(lambda keys: 0.01))
    _, notes = derive_module.derive("1tokens", str(char_data), 65, "cpu")
    said = next(line for line in notes if line.startswith("expected val loss"))
    assert said.startswith("expected val loss 4.174 (the law L*(C); held at ln 65 = 4.174, a uniform guess's loss")


def fake_probe(step_s, probed: list | None = None, eval_token_s: float = 1e-5):
    """A stand-in for gptlite.scaling.derive.Probe: the model of `keys` takes step_s(keys) seconds a step and
    `eval_token_s` a token to evaluate; the keys of each one built are appended to `probed`."""

    class FakeProbe:
        def __init__(self, keys, device):
            self.keys = keys
            if probed is not None:
                probed.append(keys)

        def step_seconds(self):
            return step_s(self.keys)

        def eval_seconds_per_token(self):
            return eval_token_s

    return FakeProbe


def test_the_probe_times_the_model_the_given_keys_describe(char_data, tmp_path, monkeypatch):
    """A width given on the command line is the model that trains, so it is the one whose step time sets the steps
    (and, for a time budget, the final evaluation's share); the recipe's own width where none is given."""
    from gptlite.scaling import derive as derive_module
    from gptlite.scaling import laws as laws_module

    probed = []
    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")  # the defaults' laws
    monkeypatch.setattr(derive_module, "Probe", fake_probe(lambda keys: 0.5, probed))
    keys, notes = derive_module.derive("200Ktokens", str(char_data), 65, "cpu")
    assert probed[-1]["n_embd"] == keys["n_embd"] and "500.0 ms a step" in " ".join(notes)
    other = 192 if keys["n_embd"] != 192 else 144
    given = {key: str(value) for key, value in shape(other).items()} | {"data_dir": str(char_data)}
    derive_module.derive("200Ktokens", str(char_data), 65, "cpu", given=given)
    assert all(probed[-1][key] == given[key] for key in shape(other)) and probed[-1]["n_embd"] == str(other)


def test_a_time_budget_keeps_back_a_step_for_the_last_ones_overrun(char_data, tmp_path, monkeypatch):
    """train.py reads the clock after each step, so the last step can end a whole step past max_minutes: the
    training time is the budget less the start-up, the final evaluation, the margin and one step."""
    from gptlite.scaling import derive as derive_module
    from gptlite.scaling import laws as laws_module

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")
    monkeypatch.setattr(derive_module, "process_age", lambda: 4.0)
    for step_s in (0.1, 2.0):
        monkeypatch.setattr(derive_module, "Probe", fake_probe(lambda keys, step_s=step_s: step_s))
        keys, notes = derive_module.derive("60s", str(char_data), 65, "cpu")
        eval_s = 1.2 * derive_module.split_tokens(str(char_data), "val") * 1e-5
        trained = 60 - 4.0 - eval_s - derive_module.MARGIN_S - step_s
        assert keys["max_minutes"] * 60 == pytest.approx(trained)
        assert f"time: {trained:.1f} s of training" in " ".join(notes)


def test_a_time_budget_of_few_steps_trains_on_fewer_windows(char_data, tmp_path, monkeypatch):
    """A time budget times one window's step first: six of them bound a step of the family's batch from above, and
    where even twice the steps that bound gives are too few for two windows, the run trains on one, timed once;
    else a step of the family's batch is timed, and one of the windows its steps call for (windows_per_step), where
    those are fewer. The step time of the windows chosen sets the steps, and the final evaluation is priced per
    token of the val split whatever the batch. A batch the user gives is kept and timed once."""
    from gptlite.scaling import derive as derive_module
    from gptlite.scaling import laws as laws_module

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")
    monkeypatch.setattr(derive_module, "process_age", lambda: 4.0)
    val = derive_module.split_tokens(str(char_data), "val")
    rough = 60 - 4.0 - 3.0  # the training time the batch is chosen for: before the evaluation is timed
    # the family's batch would take these shares of STEP_FLOOR steps; the windows and the steps timed that follow
    for share, windows, timed in ((0.05, 1, [1]), (0.6, 3, [1, FULL_WINDOWS, 3]), (2.0, 6, [1, FULL_WINDOWS])):
        probed = []
        per_window = rough / (STEP_FLOOR * share) / FULL_WINDOWS  # no fixed costs: six windows take six times one
        monkeypatch.setattr(
            derive_module, "Probe", fake_probe(lambda k, w=per_window: w * int(k["batch_size"]), probed)
        )
        assert windows_per_step(STEP_FLOOR * share) == windows  # the test's own premise
        keys, notes = derive_module.derive("60s", str(char_data), 65, "cpu")
        assert [int(k["batch_size"]) for k in probed] == timed and keys["batch_size"] == windows
        step_s = per_window * windows
        trained = 60 - 4.0 - 1.2 * val * 1e-5 - derive_module.MARGIN_S - step_s
        assert keys["max_minutes"] * 60 == pytest.approx(trained)
        said = " ".join(notes)
        if windows < FULL_WINDOWS:
            assert f"batch: {windows} window(s) of 512 a step, not the family's 6: those would give only about" in said
        else:
            assert "batch: 6 windows of 512 a step, the family's" in said
        steps = int(trained / step_s)
        assert f"{1000 * step_s:.1f} ms a step measured here: about {steps:,} steps of {windows * 512:,} tokens" in said

    probed.clear()
    given = {"batch_size": "6", "data_dir": str(char_data)}
    keys, notes = derive_module.derive("60s", str(char_data), 65, "cpu", given=given)
    assert [int(k["batch_size"]) for k in probed] == [FULL_WINDOWS] and not any(
        line.startswith("batch:") for line in notes
    )


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """A small char-level preparation of tiny Shakespeare."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("scaling")
    text = root / "text.txt"
    text.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:200_000])
    done = subprocess.run(
        [sys.executable, ROOT / "data/prepare.py", f"--input={text}", "--tokenizer=char", f"--out_dir={root / 'data'}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return root / "data"


def test_the_sweep_resumes_fits_and_feeds_train_budget(char_data, tmp_path, monkeypatch, capsys):
    from gptlite.scaling import laws as laws_module
    from gptlite.scaling.sweep import main

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "cache")
    out = tmp_path / "sweep"
    options = [f"--data_dir={char_data}", f"--out_dir={out}", "--budgets=1s,2s", "--widths=48,72,96"]
    assert main([*options, "--widths=48,72"]) == 2  # too few widths: refused before anything runs
    assert "at least 3 widths" in capsys.readouterr().err and not out.exists()
    assert main(options) == 0
    printed = capsys.readouterr().out
    assert "[6/6] width 96" in printed and "optimal size: N* =" in printed
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted((r["seconds"], r["width"]) for r in runs) == [(s, w) for s in (1, 2) for w in (48, 72, 96)]
    for run in runs:  # each run's figures are its own train.py run's
        rows = [json.loads(line) for line in (out / "runs" / f"w{run['width']}-{run['seconds']:g}s" / "metrics.jsonl")
                .read_text().splitlines()]  # fmt: skip
        assert run["val_loss"] == [r for r in rows if "val_loss" in r][-1]["val_loss"]
    laws = json.loads((out / "laws.json").read_text())
    assert len(laws["frontier"]) == 2 and (out / "frontier.png").stat().st_size > 0
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == laws

    # run again: nothing left to train, the same laws
    (out / "runs.jsonl").write_text((out / "runs.jsonl").read_text() + '{"cut short')  # an interrupted append
    assert main(options) == 0
    assert "0 to go" in capsys.readouterr().out

    # train.py --budget finds these laws for this data on this machine, says each choice, and takes overrides.
    # (train.py runs inside pytest's process here: its start-up is taken as a command's, 2 s.) Budgets of 1-2 s may
    # leave the size laws a note that they are weak, which would send --budget to the defaults: here they are taken
    # as sound (test_weak_laws_give_way_to_the_defaults tests the other way)
    cached[0].write_text(json.dumps({k: v for k, v in laws.items() if k != "size_note"}))
    monkeypatch.setattr("gptlite.scaling.derive.process_age", lambda: 2.0)
    run = run_train(f"--data_dir={char_data}", f"--out_dir={tmp_path / 'run'}", "--budget=15s", "--beta2=0.95")
    assert run.code == 0, run.err
    assert "budget | --budget=15s: from the laws fitted for this data on this machine" in run.out
    assert "budget | beta2=0.95: as given (the recipe's 0.99)" in run.out and "expected val loss" in run.out
    config = json.loads(next(line for line in run.out.splitlines() if line.startswith("config: "))[8:])
    assert config["budget"] == "15s" and config["beta2"] == 0.95 and config["lr_schedule"] == "time"
    assert 0 < config["max_minutes"] < 15 / 60


@pytest.mark.parametrize(
    "option, said",
    [
        ("--budgets=1e400s,10s", "--budgets='1e400s' is inf seconds, outside what gptlite can plan a run for"),
        ("--budgets=10s,,20s", "--budgets='' is not a budget; give a time"),
        ("--budgets=10s,20s,10sec", "--budgets=10s,20s,10sec names 10 s more than once; give each once"),
        ("--widths=48,72,48,96", "--widths=48,72,48,96 names 48 more than once; give each once"),
    ],
)
def test_the_sweeps_budgets_and_widths_are_checked_and_named_as_its_own_options(
    option, said, char_data, tmp_path, capsys
):
    """The sweep reads its --budgets with train.py's budget parser, and its errors name --budgets; a budget past
    what the laws can take is refused, and a budget or a width given twice, which would run and count in the fit
    twice, too: before anything is written."""
    from gptlite.scaling.sweep import main

    out = tmp_path / "sweep"
    assert main([f"--data_dir={char_data}", f"--out_dir={out}", "--budgets=1s,2s", "--widths=48,72,96", option]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gptlite.scaling: error: {said}") and err.count("\n") == 1, err
    assert not out.exists()


def test_a_second_sweep_into_a_folder_in_use_is_refused_before_it_touches_a_log(char_data, tmp_path, capsys):
    """A sweep holds its folder's lock: a second one into it is refused before it writes anything there, so the
    first one's run logs are its own (the second's train.py once truncated the log of the run the first was
    training, before the run's lock refused it)."""
    from gptlite.files import FolderLock
    from gptlite.scaling.sweep import main

    out = tmp_path / "sweep"
    log = out / "runs" / "w48-1s.log"
    (out / "runs" / "w48-1s").mkdir(parents=True)
    log.write_text("step 0 | the first sweep's run\n")
    first = [FolderLock(out, "the sweep folder"), FolderLock(out / "runs" / "w48-1s", "out_dir")]  # as a sweep holds
    try:
        code = main([f"--data_dir={char_data}", f"--out_dir={out}", "--budgets=1s,2s", "--widths=48,72,96"])
    finally:
        for lock in first:
            lock.release()
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"gptlite.scaling: error: the sweep folder {out} is in use by process "), err
    assert log.read_text() == "step 0 | the first sweep's run\n" and not (out / "runs.jsonl").exists()


def test_the_sweep_learns_of_a_shared_cpu_from_the_runs_record_not_its_log(char_data, tmp_path, monkeypatch):
    """A run whose torch threads followed other processes' work records so in metrics.jsonl (an event beside the log
    line for people), and the sweep reads that record: a log line of the same words alone says nothing to it."""
    from gptlite.device import THREADS_EVENT, CpuThreads
    from gptlite.scaling.sweep import contended

    def other_work_at_the_fourth_step(self):  # as CpuThreads.update says it, without measuring the machine
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls != 4:
            return None
        self.threads = 1
        return "other processes kept 1.0 of 2 cores busy: torch now computes on 1 thread (was 2; ...)"

    monkeypatch.setattr(CpuThreads, "update", other_work_at_the_fourth_step)
    args = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2, max_iters=8, eval_interval=8)
    run = run_train(f"--data_dir={char_data}", f"--out_dir={tmp_path / 'run'}", "--eval_iters=1", **args)
    assert run.code == 0, run.err
    assert "step     4 | other processes kept 1.0 of 2 cores busy" in run.out  # the line for people, as before
    events = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == THREADS_EVENT]
    assert events == [{"step": 4, "event": "cpu_threads", "threads": 1}]
    assert contended(tmp_path / "run")

    quiet = tmp_path / "quiet"  # a run without the event, whatever its log says
    quiet.mkdir()
    (quiet / "metrics.jsonl").write_text('{"step": 8, "tokens": 256, "val_loss": 3.0}\n')
    (tmp_path / "quiet.log").write_text("step 4 | other processes kept 1.0 of 2 cores busy\n")
    assert not contended(quiet)


def test_the_defaults_hold_a_character_and_a_bpe_corpus_laws(tmp_path, monkeypatch):
    """Without a sweep for the data, a vocabulary of characters or bytes gets the laws measured on tiny Shakespeare
    and a BPE vocabulary the laws measured on a BPE corpus: a 50,257-id head makes each step cost far more, so the
    character laws would size a BPE model several times too large for its budget."""
    from gptlite.scaling import laws as laws_module
    from gptlite.scaling.laws import find_laws

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")
    char, char_source = find_laws("0" * 16, 65)
    bpe, bpe_source = find_laws("0" * 16, 50257)
    assert char["data"]["vocab_size"] <= 256 and char["data"]["name"] in char_source
    assert bpe["data"]["vocab_size"] > 256 and bpe["data"]["name"] in bpe_source
    for laws in (char, bpe):
        fitted = [point for point in laws["frontier"] if point["fitted"]]
        assert len(fitted) >= 2
        law = laws["params_per_second"]
        for point in fitted:  # the law passes near the optima it was fitted through (a factor of 2 at most)
            assert 0.5 < power(law, point["seconds"]) / point["params"] < 2
    assert power(bpe["params_per_second"], 270) < power(char["params_per_second"], 270) / 2


def test_weak_laws_give_way_to_the_defaults(tmp_path, monkeypatch):
    """Laws a sweep fitted for this data on this machine are used unless their own checks call them weak (a size
    note, a check run that missed the loss law): then the defaults are, and the line says which laws, how strong,
    and why; a laws file given by name is used however weak, its weakness said."""
    from gptlite.scaling import laws as laws_module
    from gptlite.scaling.laws import find_laws, laws_path, machine_key, strength

    monkeypatch.setattr(laws_module, "CACHE", tmp_path)
    fitted = json.loads(laws_module.DEFAULT_LAWS.read_text())["char"]
    fitted = {**fitted, "data": {**fitted["data"], "name": "mine"}}
    cached = laws_path("0" * 16, machine_key())
    cached.write_text(json.dumps(fitted))
    laws, source = find_laws("0" * 16, 65)
    assert laws == fitted and source == f"the laws fitted for this data on this machine ({cached}): {strength(fitted)}"
    assert "N* ~ t^1.14 (0.48 to 1.14 leaving one run out) through the optima at" in source
    assert "its check at 240 s lay +1.8% from the loss law" in source

    weak = {**fitted, "size_note": "the best run at 10 s trained only 12 steps"}
    cached.write_text(json.dumps(weak))
    laws, source = find_laws("0" * 16, 65)
    assert laws["data"]["name"] == "tiny Shakespeare, char" and source.startswith(
        "the defaults measured for gptlite on tiny Shakespeare, char ("
    )
    assert source.endswith(
        f"; not the laws fitted for this data on this machine ({cached}), which their own checks call weak: the best "
        f"run at 10 s trained only 12 steps (--scaling_laws={cached} uses them anyway)"
    )
    missed = {**fitted, "check": {**fitted["check"], "off": 0.035, "note": "the check lay 3.5% above the law"}}
    cached.write_text(json.dumps(missed))
    assert "which their own checks call weak: the check lay 3.5% above the law" in find_laws("0" * 16, 65)[1]
    laws, source = find_laws("0" * 16, 65, str(cached))
    assert laws == missed and source.endswith("; weak: the check lay 3.5% above the law")


def test_a_budget_without_laws_uses_the_defaults_and_says_so(char_data, tmp_path, monkeypatch):
    from gptlite.scaling import laws as laws_module

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")
    run = run_train(f"--data_dir={char_data}", f"--out_dir={tmp_path / 'run'}", "--budget=20Ktokens")
    assert run.code == 0, run.err
    assert "budget | --budget=20Ktokens: from the defaults measured for gptlite on tiny Shakespeare, char (" in run.out
    assert "no laws were fitted for this data on this machine (`python -m gptlite.scaling" in run.out
    config = json.loads(next(line for line in run.out.splitlines() if line.startswith("config: "))[8:])
    assert config["batch_size"] == windows_per_step(20_000 / 3072) < FULL_WINDOWS  # so few steps: fewer windows
    assert config["lr_schedule"] == "steps" and config["max_iters"] == math.ceil(20_000 / (config["batch_size"] * 512))
    refused = run_train(f"--data_dir={char_data}", f"--out_dir={tmp_path / 'no'}", "--budget=fast")
    assert refused.code == 2 and "--budget='fast' is not a budget" in refused.err


def test_the_probe_times_the_training_loss_and_stops_at_its_time(monkeypatch):
    """The probe's steps compute the loss as train.py does (chunked: no logits returned), and once its measured
    steps have taken `seconds` it stops: here after the warm-up and one measured step of the 10 asked for; then
    forwards as the evaluation scores a batch, per token, without gradients: one to warm up and three timed."""
    from gptlite.model.network import Transformer

    calls = []
    forward = Transformer.forward

    def counted(self, idx, targets=None, reduction="mean", return_logits=True):
        calls.append(return_logits)
        return forward(self, idx, targets, reduction, return_logits)

    monkeypatch.setattr(Transformer, "forward", counted)  # the probe builds the network alone
    probe = Probe(recipe(24, 65, steps=100), "cpu")
    step_s = probe.step_seconds(steps=10, seconds=0.0)
    eval_s = probe.eval_seconds_per_token()
    assert step_s > 0 and eval_s > 0 and calls == [False] * 6


def test_the_probe_takes_the_fastest_of_its_steps(monkeypatch):
    """A burst of other work slows some of the probe's steps; the run's own steps are many, so the fastest timed step
    is the step's time (once the mean of three, of which one slowed tenfold)."""
    from types import SimpleNamespace

    from gptlite.model.network import Transformer
    from gptlite.scaling import derive as derive_module

    clock = SimpleNamespace(now=0.0, took=iter([5.0, 0.9, 0.1, 0.2]))  # the warm-up, then three timed steps
    forward = Transformer.forward

    def timed(self, *args, **kwargs):
        clock.now += next(clock.took)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", timed)
    monkeypatch.setattr(derive_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    probe = Probe(recipe(24, 65, steps=100), "cpu")
    assert probe.step_seconds(steps=3, seconds=10.0) == pytest.approx(0.1)


def test_the_probe_times_its_steps_on_the_threads_the_run_settles_on(char_data, tmp_path, monkeypatch):
    """Another process keeps one of two cores busy: train.py's threads follow it down to one, so the probe's steps
    run on one thread too (two threads spinning beside a busy core once made the probe's step 8x the run's, and the
    recipe chose a batch for a tenth of the steps the run took). torch's own count is back once the recipe is
    derived, and the notes say what the probe saw; on a quiet machine the probe keeps torch's count."""
    import torch

    from gptlite import device
    from gptlite.scaling import derive as derive_module
    from gptlite.scaling import laws as laws_module

    machine = {"now": 100.0, "busy": 1000.0, "others": 1.0}

    def sleep(seconds):  # the other process works on while the probe waits
        machine["now"] += seconds
        machine["busy"] += machine["others"] * seconds

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(device.time, "monotonic", lambda: machine["now"])
    monkeypatch.setattr(device, "cpu_times", lambda: (machine["busy"], 10.0))
    monkeypatch.setattr(derive_module.time, "sleep", sleep)
    monkeypatch.setattr(derive_module.time, "monotonic", lambda: machine["now"])
    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")
    monkeypatch.setattr(derive_module, "process_age", lambda: 4.0)
    threads_seen = []
    monkeypatch.setattr(
        derive_module, "Probe", fake_probe(lambda keys: threads_seen.append(torch.get_num_threads()) or 0.05)
    )
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, notes = derive_module.derive("60s", str(char_data), 65, "cpu")
        assert threads_seen and set(threads_seen) == {1} and torch.get_num_threads() == 2
        said = "probe threads (the run's, once its own follow the other work): other processes kept 1.0 of 2 cores"
        assert any(line.startswith(said + " busy: torch now computes on 1 thread") for line in notes)
        machine["others"] = 0.0
        threads_seen.clear()
        _, notes = derive_module.derive("60s", str(char_data), 65, "cpu")
        assert set(threads_seen) == {2} and not any(line.startswith("probe threads") for line in notes)
    finally:
        torch.set_num_threads(own)


def test_a_time_budget_short_on_one_measurement_is_measured_again_before_refusal(char_data, tmp_path, monkeypatch):
    """A burst of other work during the probe (once: the final evaluation priced at 93 s of a 90-s budget, refused,
    where the run itself would have had time): the measurement is taken once more, and the budget runs on the one
    that leaves more time. Slow both times, it is refused."""
    from gptlite.scaling import derive as derive_module
    from gptlite.scaling import laws as laws_module

    monkeypatch.setattr(laws_module, "CACHE", tmp_path / "empty")
    monkeypatch.setattr(derive_module, "process_age", lambda: 4.0)
    val = derive_module.split_tokens(str(char_data), "val")
    evaluations = iter([93.4, 8.0, 93.4, 93.4])  # seconds of final evaluation each measurement prices

    class BurstProbe:
        def __init__(self, keys, device):
            self.eval_s = next(evaluations)

        def step_seconds(self):
            return 0.05

        def eval_seconds_per_token(self):
            return self.eval_s / (1.2 * val)

    monkeypatch.setattr(derive_module, "Probe", BurstProbe)
    given = {"batch_size": "6", "n_embd": "96"}  # one probe a measurement
    keys, notes = derive_module.derive("90s", str(char_data), 65, "cpu", given=given)
    trained = 90 - 4.0 - 8.0 - derive_module.MARGIN_S - 0.05
    assert keys["max_minutes"] * 60 == pytest.approx(trained)
    with pytest.raises(ValueError, match=r"^--budget=90s leaves -9\.0 s to train once start-up and the final "
                                         r"evaluation \(93\.4 s\) are counted; give a larger budget$"):  # fmt: skip
        derive_module.derive("90s", str(char_data), 65, "cpu", given=given)
