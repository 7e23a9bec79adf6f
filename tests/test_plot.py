"""python -m gptlite.plot draws each kind of figure on an axis of its own: a preference run's DPO loss and an RL
run's policy loss never share the language-model loss's axis, and rewards, pass@k, reward accuracy and margin,
bits per byte and CORE each get theirs."""

import json

from gptlite import plot
from gptlite.plot import PANELS, run_kind

LM = [
    {"step": 1, "tokens": 64, "loss": 4.1},
    {"step": 2, "tokens": 128, "loss": 3.5, "val_loss": 3.6, "val_bpb": 2.1},
]
DPO = [
    {
        "step": 1,
        "tokens": 64,
        "loss": 0.69,
        "rewards_chosen": 0.1,
        "rewards_rejected": 0.0,
        "rewards_accuracy": 0.5,
        "rewards_margin": 0.1,
    },
    {"step": 2, "tokens": 128, "val_loss": 0.6, "val_rewards_accuracy": 0.7, "val_rewards_margin": 0.3},
]
RL = [
    {"step": 1, "tokens": 64, "loss": -0.02, "mean_reward": 0.2, "pass@8": 0.5, "completion_tokens": 30.0},
    {"step": 2, "tokens": 128, "loss": 0.01, "mean_reward": 0.4, "pass@8": 0.75, "val_loss": 2.2},
]


def drawn(rows: list[dict]) -> dict[str, list[str]]:
    kind = run_kind(rows)
    return {p.ylabel: [key for key, _ in p.series(kind, rows)] for p in PANELS if p.series(kind, rows)}


def test_each_run_kind_draws_its_figures_on_their_own_axes():
    assert [run_kind(rows) for rows in (LM, DPO, RL)] == ["lm", "dpo", "rl"]
    assert drawn(LM) == {"loss (nats per token)": ["loss", "val_loss"], "val bits per byte": ["val_bpb"]}
    assert drawn(DPO) == {
        "DPO loss": ["loss", "val_loss"],
        "reward accuracy and margin": [
            "rewards_accuracy",
            "rewards_margin",
            "val_rewards_accuracy",
            "val_rewards_margin",
        ],
    }
    assert drawn(RL) == {
        "loss (nats per token)": ["val_loss"],  # an RL run's val loss is the language model's, on conversations
        "policy loss": ["loss"],
        "reward and pass@k": ["mean_reward", "pass@8"],
    }


def test_runs_of_every_kind_plot_together(tmp_path):
    from matplotlib.image import imread

    for name, rows in (("lm", LM), ("dpo", DPO), ("rl", RL)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "all.png"
    runs = [str(tmp_path / name) for name in ("lm", "dpo", "rl")]
    assert plot.main([*runs, "--x=tokens", "--log", f"--out={out}"]) == 0
    assert imread(out).shape[:2] == (500, 2800)  # six panels: 8 inches for the first, 4 for each other, 100 dpi
