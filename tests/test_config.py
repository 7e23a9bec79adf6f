"""Config: dataclass validation, type conversion, TOML + --key=value precedence, and no torch import."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from gptlite.cli import config_help, parse_args
from gptlite.config import (
    GPTConfig,
    TrainConfig,
    build_config,
    config_to_dict,
    convert,
    default_ffn_hidden,
    read_toml,
)

# ---------------------------------------------------------------------------------------------
# GPTConfig


def test_defaults_are_valid():
    cfg = GPTConfig()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (12, 12, 768, 1024)
    TrainConfig()


def test_n_embd_not_divisible_by_n_head():
    message = r"n_embd=100 is not divisible by n_head=12; choose n_embd as a multiple of n_head \(e\.g\. n_embd=96\)"
    with pytest.raises(ValueError, match=message):
        GPTConfig(n_embd=100, n_head=12)


@pytest.mark.parametrize(
    "field,value,choices",
    [
        ("pos_emb", "alibi", "learned, sinusoidal, rope"),
        ("norm", "batchnorm", "layernorm, rmsnorm"),
        ("ffn", "relu", "swiglu, gelu"),
    ],
)
def test_variant_choices(field, value, choices):
    with pytest.raises(ValueError, match=rf"{field}='{value}' must be one of {choices}"):
        GPTConfig(**{field: value})


def test_rope_needs_an_even_head_width_and_positive_numbers():
    GPTConfig(n_embd=48, n_head=4, pos_emb="rope")  # head width 12
    with pytest.raises(ValueError, match=r"head width n_embd / n_head = 9 must be even for pos_emb='rope'"):
        GPTConfig(n_embd=36, n_head=4, pos_emb="rope")
    GPTConfig(n_embd=36, n_head=4)  # other positions do not mind
    for field in ("rope_theta", "norm_eps"):
        with pytest.raises(ValueError, match=rf"{field}=0 must be a positive number"):
            GPTConfig(**{field: 0})
    with pytest.raises(ValueError, match=r"rope_theta=.* must be a positive number"):
        build_config({"rope_theta": "-1e4"})
    assert build_config({"rope_theta": "5e5", "norm_eps": "1e-6"}).model.rope_theta == 500000.0


def test_sinusoidal_needs_even_n_embd():
    GPTConfig(n_embd=66, n_head=2, pos_emb="sinusoidal")
    with pytest.raises(ValueError, match=r"n_embd=63 must be even for pos_emb='sinusoidal'"):
        GPTConfig(n_embd=63, n_head=3, pos_emb="sinusoidal")


@pytest.mark.parametrize("name", ["vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_hidden"])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_sizes(name, value):
    with pytest.raises(ValueError, match=rf"invalid GPTConfig: .*{name}={value} must be a positive integer"):
        GPTConfig(**{name: value})


@pytest.mark.parametrize("value", [2.5, "12", True])
def test_sizes_must_be_ints(value):
    with pytest.raises(ValueError, match=r"n_layer=.* must be a positive integer"):
        GPTConfig(n_layer=value)


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5])
def test_bad_dropout(dropout):
    with pytest.raises(ValueError, match=rf"dropout={dropout} must be in \[0, 1\)"):
        GPTConfig(dropout=dropout)


def test_problems_reported_together():
    with pytest.raises(ValueError) as e:
        GPTConfig(vocab_size=0, n_layer=-1, dropout=2.0, pos_emb="alibi")
    msg = str(e.value)
    for part in ["vocab_size=0", "n_layer=-1", "dropout=2.0", "pos_emb='alibi'"]:
        assert part in msg
    assert msg.startswith("invalid GPTConfig: ") and msg.count(";") >= 3


def test_a_bad_field_type_is_one_complaint():
    with pytest.raises(ValueError) as e:
        GPTConfig(n_embd="32")
    assert str(e.value) == "invalid GPTConfig: n_embd='32' must be a positive integer"
    with pytest.raises(ValueError, match="bias='yes' must be true or false"):
        GPTConfig(bias="yes")


def test_default_ffn_hidden():
    assert GPTConfig().ffn_hidden == 2048  # 8/3 * 768 = 2048, already a multiple of 64
    assert GPTConfig(ffn="gelu").ffn_hidden == 3072  # GPT-2's 4x
    assert GPTConfig(n_embd=64, n_head=4).ffn_hidden == 192  # 170.7 -> 192
    assert GPTConfig(n_embd=100, n_head=4).ffn_hidden == 320  # 266.7 -> 320
    assert GPTConfig(n_embd=96, n_head=4, ffn_hidden=100).ffn_hidden == 100  # an explicit width is kept
    for n_embd in [8, 48, 64, 100, 384, 768, 1024, 1600, 4096]:
        h = default_ffn_hidden(n_embd)
        assert h % 64 == 0 and 8 * n_embd / 3 <= h < 8 * n_embd / 3 + 64


def test_swiglu_parameter_count_matches_4x_gelu_mlp():
    n_embd = 768
    h = GPTConfig(n_embd=n_embd).ffn_hidden
    swiglu = 3 * n_embd * h  # gate, up and down projections
    gelu = 2 * n_embd * (4 * n_embd)  # up and down of a 4x MLP
    assert abs(swiglu - gelu) / gelu < 0.03
    for n_embd in [256, 384, 512, 1024]:
        h = default_ffn_hidden(n_embd)
        assert abs(3 * n_embd * h - 8 * n_embd**2) / (8 * n_embd**2) < 0.06


# ---------------------------------------------------------------------------------------------
# TrainConfig


def test_train_config_validation():
    with pytest.raises(ValueError, match=r"invalid training config: batch_size=0 must be > 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"learning_rate=0.001, min_lr=0.01: need 0 <= min_lr <= learning_rate"):
        TrainConfig(learning_rate=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match=r"dtype='fp8' must be one of auto, float32, bfloat16, float16"):
        TrainConfig(dtype="fp8")
    with pytest.raises(ValueError, match=r"warmup_iters=-1 must be >= 0.*grad_clip=-1.0 must be >= 0"):
        TrainConfig(warmup_iters=-1, grad_clip=-1.0)


def test_each_way_of_training_checks_its_own_options():
    """LoRA's, DPO's and RL's rules sit beside those ways of training (gptlite.train.lora, .preference, .rl), which
    gptlite.config does not import; the run is resolved through them, all problems together as TrainConfig's own."""
    from gptlite.train.run_config import check_training_options, resolve_config
    from tests.test_gptlite import import_graph

    assert not {name for name in import_graph()["gptlite.config"] if name.startswith("gptlite.train")}
    cfg = TrainConfig(rl=True, dpo_beta=0.0, lora_rank=0)  # the config alone knows no objective
    expected = (
        "invalid training config: lora_rank=0 must be >= 1 (leave it out to train every weight); lora_rank needs "
        "--init_from: LoRA adapts a pretrained model, whose weights stay frozen; dpo_beta=0.0 must be > 0 (e.g. 0.1); "
        "rl=true needs --rl_prompts=FILE.jsonl (prompts with answers) and --reward=gsm8k|exact|module:function"
    )
    with pytest.raises(ValueError) as e:
        check_training_options(cfg)
    assert str(e.value) == expected
    with pytest.raises(ValueError) as e:  # train.py's path: nothing read, nothing written
        resolve_config(["--vocab_size=64", "--rl", "--dpo_beta=0", "--lora_rank=0"])
    assert str(e.value) == expected
    assert check_training_options(TrainConfig()) == TrainConfig()


@pytest.mark.parametrize("key, value, message", [
    ("optimizer", "sgd", r"optimizer='sgd' must be one of adamw, muon"),
    ("muon_lr", "-0.02", r"muon_lr=-0.02 must be >= 0"),
    ("muon_momentum", "1", r"muon_momentum=1.0 must be in \[0, 1\) \(e\.g\. 0\.95\)"),
    ("muon_weight_decay", "-1", r"muon_weight_decay=-1.0 must be >= 0"),
])  # fmt: skip
def test_optimizer_options(key, value, message):
    muon = {} if key == "optimizer" else {"optimizer": "muon"}  # Muon's options are read by Muon alone
    with pytest.raises(ValueError, match=rf"^invalid training config: {message}$"):
        build_config({key: value, **muon})
    cfg = build_config({"optimizer": "muon", "muon_lr": "0.05", "muon_momentum": "0", "fsdp": "true"})
    assert (cfg.optimizer, cfg.muon_lr, cfg.muon_momentum) == ("muon", 0.05, 0.0)  # FSDP too: Muon gathers
    assert TrainConfig().optimizer == "adamw"


# ---------------------------------------------------------------------------------------------
# conversion and build_config


def test_build_config_converts_types():
    cfg = build_config(
        {
            "learning_rate": "1",
            "min_lr": "0",
            "max_iters": "1e3",
            "batch_size": "1_024",
            "n_layer": 4.0,
            "dropout": "0.25",
            "compile": "true",
            "wandb_log": "yes",
            "resume": "0",
            "bias": "False",
            "ffn_hidden": "none",
            "out_dir": 7,
        }
    )
    assert cfg.learning_rate == 1.0 and type(cfg.learning_rate) is float
    assert cfg.min_lr == 0.0 and type(cfg.min_lr) is float
    assert cfg.max_iters == 1000 and type(cfg.max_iters) is int
    assert cfg.batch_size == 1024
    assert cfg.model.n_layer == 4 and type(cfg.model.n_layer) is int
    assert cfg.model.dropout == 0.25
    assert cfg.compile is True and cfg.wandb_log is True and cfg.resume is False and cfg.model.bias is False
    assert cfg.model.ffn_hidden == default_ffn_hidden(cfg.model.n_embd)
    assert cfg.out_dir == "7"


@pytest.mark.parametrize(
    "value, typ, expected",
    [
        ("1", float, 1.0),
        (3, float, 3.0),
        ("1e3", int, 1000),
        ("-2", int, -2),
        ("on", bool, True),
        ("OFF", bool, False),
        ("12345678901234567", int, 12345678901234567),
        (2**60 + 1, int, 2**60 + 1),
        (4.0, int, 4),
        (True, bool, True),
        ("None", int | None, None),
        (None, int | None, None),
        ("64", int | None, 64),
        ("x", str, "x"),
    ],
)
def test_convert(value, typ, expected):
    out = convert("k", value, typ)
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("max_iters", "abc", r"max_iters='abc' is not an integer"),
        ("max_iters", "2.5", r"max_iters='2.5' is not an integer"),
        ("max_iters", 2.5, r"max_iters=2.5 is not an integer"),
        ("max_iters", True, r"max_iters=True is not an integer"),
        ("learning_rate", "fast", r"learning_rate='fast' is not a number"),
        ("learning_rate", False, r"learning_rate=False is not a number"),
        ("compile", "maybe", r"compile='maybe' is not a boolean; use true or false"),
        ("n_layer", "none", r"n_layer='none' is not an integer"),
        ("n_layer", None, r"n_layer=None is not allowed; give a int"),
    ],
)
def test_bad_values(key, value, message):
    with pytest.raises(ValueError, match=message):
        build_config({key: value})


@pytest.mark.parametrize(
    "key,pointer",
    [
        ("gradient_accumulation_steps", "--total_batch_size=N"),
        ("eval_only", "--learning_rate=0 --max_iters=1"),
        ("always_save_checkpoint", "--keep_last=N plus best.pt"),
        ("decay_lr", "set --min_lr to the --learning_rate"),
        ("backend", "nccl with CUDA GPUs, gloo otherwise"),
        ("dataset", "--data_dir=DIR"),
    ],
)
def test_nanogpts_keys_point_to_gptlites(key, pointer):
    with pytest.raises(ValueError, match=rf"'{key}' is nanoGPT's key: .*{re.escape(pointer)}"):
        build_config({key: "1"})


def test_learning_rate_0_is_an_evaluation_only_run():
    cfg = TrainConfig(learning_rate=0.0)  # min_lr keeps its default, which learning_rate=0 ignores
    assert cfg.learning_rate == 0 and cfg.min_lr > 0
    with pytest.raises(ValueError, match=r"learning_rate=-1.0, min_lr=6e-05: need 0 <= min_lr <= learning_rate"):
        TrainConfig(learning_rate=-1.0)


def test_unknown_key_did_you_mean():
    with pytest.raises(ValueError, match=r"unknown config key 'learnig_rate'; did you mean 'learning_rate'\?"):
        build_config({"learnig_rate": "1e-3"})
    with pytest.raises(ValueError, match=r"unknown config key 'n_embed'; did you mean 'n_embd'\?"):
        build_config({"n_embed": "64"})
    with pytest.raises(ValueError, match=r"unknown config key 'zzzzzz'; run with --help to list the keys"):
        build_config({"zzzzzz": "1"})


def test_all_problems_reported_together():
    with pytest.raises(ValueError) as e:
        build_config({"learnig_rate": "1", "max_iters": "x", "compile": "maybe"})
    msg = str(e.value)
    assert "'learnig_rate'" in msg and "max_iters='x'" in msg and "compile='maybe'" in msg
    # model and training problems found after conversion are reported together as well
    with pytest.raises(ValueError) as e:
        build_config({"n_embd": "100", "n_head": "12", "batch_size": "0", "dtype": "fp8"})
    msg = str(e.value)
    assert "n_embd=100 is not divisible by n_head=12" in msg
    assert "batch_size=0 must be > 0" in msg and "dtype='fp8'" in msg
    with pytest.raises(ValueError, match=r"^invalid GPTConfig: pos_emb='x'"):
        build_config({"pos_emb": "x"})


def test_string_field_may_be_the_word_none():
    cfg = build_config({"wandb_run_name": "none", "out_dir": "None"})
    assert cfg.wandb_run_name == "none" and cfg.out_dir == "None"
    assert build_config(config_to_dict(cfg)) == cfg


def test_config_to_dict_round_trip():
    cfg = build_config(
        {
            "n_layer": "2",
            "n_embd": "64",
            "n_head": "4",
            "pos_emb": "sinusoidal",
            "learning_rate": "3e-4",
            "compile": "true",
            "data_dir": "data/x",
            "ffn_hidden": "96",
        }
    )
    d = config_to_dict(cfg)
    assert d["n_layer"] == 2 and d["learning_rate"] == 3e-4 and d["ffn_hidden"] == 96 and "model" not in d
    assert set(d) == {f.name for f in dataclasses.fields(GPTConfig)} | {
        f.name for f in dataclasses.fields(TrainConfig) if f.name != "model"
    }
    assert build_config(d) == cfg
    assert build_config(json.loads(json.dumps(d))) == cfg  # as stored in a checkpoint
    assert build_config({k: str(v) for k, v in d.items()}) == cfg  # as typed on a command line
    assert build_config(config_to_dict(TrainConfig())) == TrainConfig()


def test_config_help_lists_every_key():
    text = config_help()
    assert "--n_embd=768" in text and "--learning_rate=0.0006" in text and "--model" not in text


# ---------------------------------------------------------------------------------------------
# parse_args, TOML, precedence


def test_parse_args():
    assert parse_args([]) == (None, {})
    path, overrides = parse_args(["configs/x.toml", "--lr-decay-iters=10", "--compile", "--out_dir=a=b", "--data_dir="])
    assert path == "configs/x.toml"
    assert overrides == {"lr_decay_iters": "10", "compile": "true", "out_dir": "a=b", "data_dir": ""}
    message = r"unexpected argument 'n_layer=4'; use a CONFIG\.toml file and --key=value overrides"
    with pytest.raises(ValueError, match=message):
        parse_args(["n_layer=4"])
    with pytest.raises(ValueError, match=r"unexpected argument 'b\.toml'"):
        parse_args(["a.toml", "b.toml"])


def load(argv: list[str]):
    """What train.py does: defaults < TOML < --key=value."""
    path, overrides = parse_args(argv)
    values = read_toml(path) if path else {}
    return build_config({**values, **overrides})


def test_toml_flat_and_model_table_with_precedence(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(
        "# a small run — comments may hold any UTF-8\n"
        "batch_size = 8\n"
        "learning_rate = 1\n"  # a TOML int for a float field
        "max_iters = 100\n"
        "compile = true\n"
        'out_dir = "out-small"\n'
        "\n[model]\n"
        "n_layer = 2\n"
        "n_head = 4\n"
        "n_embd = 64\n"
        'pos_emb = "sinusoidal"\n',
        encoding="utf-8",
    )
    values = read_toml(path)
    assert values["n_layer"] == 2 and values["batch_size"] == 8 and "model" not in values

    cfg = load([str(path)])
    assert cfg.batch_size == 8 and cfg.max_iters == 100 and cfg.compile is True and cfg.out_dir == "out-small"
    assert cfg.learning_rate == 1.0 and type(cfg.learning_rate) is float
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.pos_emb) == (2, 4, 64, "sinusoidal")
    assert cfg.warmup_iters == TrainConfig().warmup_iters  # untouched keys keep their defaults

    cfg = load([str(path), "--max_iters=7", "--n_layer=3", "--compile=false", "--seed=1"])
    assert cfg.max_iters == 7 and cfg.model.n_layer == 3 and cfg.compile is False and cfg.seed == 1  # overrides win
    assert cfg.batch_size == 8 and cfg.model.n_embd == 64  # TOML beats defaults

    cfg = load(["--n_layer=3"])
    assert cfg.model.n_layer == 3 and cfg.batch_size == TrainConfig().batch_size


def test_toml_type_errors_and_unknown_keys(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('batch_size = "many"\nnlayer = 4\n[model]\nn_embd = 1.5\n')
    with pytest.raises(ValueError) as e:
        load([str(path)])
    msg = str(e.value)
    assert "batch_size='many' is not an integer" in msg
    assert "unknown config key 'nlayer'; did you mean 'n_layer'?" in msg
    assert "n_embd=1.5 is not an integer" in msg


def test_toml_model_must_be_a_table(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('model = "gpt2"\n')
    with pytest.raises(ValueError, match=r"m\.toml: 'model' must be a table"):
        read_toml(path)


def test_invalid_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("batch_size = = 3\n")
    with pytest.raises(ValueError, match=r"config file .*broken\.toml is not valid TOML"):
        read_toml(path)


def test_missing_toml(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config file .*absent\.toml does not exist; see configs/ for presets"):
        read_toml(tmp_path / "absent.toml")


def test_importing_config_does_not_import_torch():
    code = "import sys, gptlite.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(layer_types="conv,lstm"),
            r"layer_types names 'lstm'; the kinds are full_attention, conv, linear_attention, mamba",
        ),
        (dict(layer_types="conv"), r"layer_types='conv' names 1 layers; n_layer=2"),
        (dict(layer_types="conv,full_attention", value_embeds=True), r"value_embeds .* needs every layer .* to attend"),
        (dict(conv_kernel=1), r"conv_kernel=1 must be an integer >= 2"),
        (dict(mamba_conv_kernel=1), r"mamba_conv_kernel=1 must be an integer >= 2"),
        (dict(mamba_heads=6, mamba_groups=4), r"mamba_groups=4 must divide mamba_heads=6"),
        (dict(mamba_state=0), r"mamba_state=0 must be a positive integer"),
        (dict(mamba_dt_min=0.5, mamba_dt_max=0.1), r"mamba_dt_min=0.5, mamba_dt_max=0.1 must be numbers with 0 <="),
    ],
)
def test_layer_types_errors_name_the_value_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(n_layer=2, **overrides)
