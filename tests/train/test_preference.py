"""Preference tuning (DPO): the loss, rewards and accuracy against TRL's DPOTrainer, LoRA's reference against the base
model, the preparation of pairs and its bad inputs, the pair loader, and train.py's DPO runs: accuracy on held-out
pairs rises, and a resumed run continues exactly (its reference is the start-of-run model, not the resumed one)."""

import copy
import json
import math
import runpy
import sys

import pytest
import torch
import transformers

from gptlite import GPT
from gptlite.config import TrainConfig
from gptlite.data.loader import PairLoader, find_shards
from gptlite.data.prepare.preference import prepare_preference
from gptlite.tokenizer import load_tokenizer
from gptlite.train.lora import LoRALinear, adapters_off, add_lora, frozen_copy
from gptlite.train.preference import Reference, dpo_loss, pair_stats, sequence_logps
from tests.conftest import ROOT, run_train, tiny_model
from tests.test_hf import hf_llama

transformers.logging.set_verbosity_error()

# (prompt, chosen, rejected) token ids, of different lengths: padding and masks matter
PAIRS = [
    ([3, 4, 5], [6, 7], [8]),
    ([9], [10, 11, 12], [13, 14]),
    ([15, 16, 17, 18], [19], [20, 21, 22, 23]),
]


def pair_rows(pairs):
    """A preference batch as gptlite.data.loader.PairLoader lays it out: chosen rows, then rejected ones,
    right-padded."""
    rows = [(p + c) for p, c, _ in pairs] + [(p + r) for p, _, r in pairs]
    answers = [len(p) for p, _, _ in pairs] * 2
    width = max(map(len, rows)) - 1
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, answers, strict=True)):
        x[i, : len(row) - 1] = torch.tensor(row[:-1])
        y[i, start - 1 : len(row) - 1] = torch.tensor(row[start:])
    return x, y


@pytest.fixture(scope="module")
def policy_and_reference(tmp_path_factory):
    """Two tiny Llamas in transformers' format: a reference and a policy near it."""
    reference = hf_llama()
    policy = copy.deepcopy(reference)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    dirs = {}
    for name, model in (("policy", policy), ("reference", reference)):
        dirs[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(dirs[name])
    return policy, reference, dirs


def trl_metrics(policy, reference, loss_type, beta, tmp_path):
    """TRL's DPOTrainer on PAIRS: its loss and the metrics it logs for the batch."""
    import datasets
    import tokenizers
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    vocab = {f"t{i}": i for i in range(policy.config.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0")
    dataset = datasets.Dataset.from_list([{"prompt": "t3", "chosen": "t4", "rejected": "t5"}] * 2)  # unused
    args = DPOConfig(
        output_dir=str(tmp_path), beta=beta, loss_type=[loss_type], report_to="none", use_cpu=True, bf16=False
    )
    trainer = DPOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    inputs = DataCollatorForPreference(pad_token_id=0)(
        [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in PAIRS]
    )
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs).detach()
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_rewards_and_accuracy_equal_trl(policy_and_reference, tmp_path, loss_type):
    policy, reference, dirs = policy_and_reference
    beta = 0.1
    trl_loss, trl = trl_metrics(policy, reference, loss_type, beta, tmp_path)
    x, y = pair_rows(PAIRS)
    model = GPT.from_pretrained(str(dirs["policy"]), torch.float32).train()
    ref = Reference(model, frozen_copy(GPT.from_pretrained(str(dirs["reference"]), torch.float32)))
    logps, lengths = sequence_logps(model, x, y)
    out = dpo_loss(logps, ref.logps(x, y), lengths, beta, loss_type)
    chosen, rejected, accuracy = pair_stats(out).tolist()
    assert 0 < accuracy < 1  # both outcomes in the batch: the comparison is not trivial
    close = dict(rel=1e-5, abs=1e-6)
    assert logps[:3].mean().item() == pytest.approx(trl["logps/chosen"], **close)
    assert logps[3:].mean().item() == pytest.approx(trl["logps/rejected"], **close)
    assert out.loss.item() == pytest.approx(trl_loss, **close)
    assert chosen == pytest.approx(trl["rewards/chosen"], **close)
    assert rejected == pytest.approx(trl["rewards/rejected"], **close)
    assert chosen - rejected == pytest.approx(trl["rewards/margins"], **close)
    assert accuracy == pytest.approx(trl["rewards/accuracies"], abs=1e-7)


def test_label_smoothing_is_conservative_dpo():
    logps = torch.tensor([-3.0, -5.0, -4.0, -2.0])
    ref = torch.tensor([-4.0, -4.0, -4.0, -4.0])
    beta = 0.5
    eps = 0.2
    d = beta * ((logps[:2] - ref[:2]) - (logps[2:] - ref[2:]))
    expected = (-(1 - eps) * torch.nn.functional.logsigmoid(d) - eps * torch.nn.functional.logsigmoid(-d)).mean()
    out = dpo_loss(logps, ref, torch.ones(4), beta, "sigmoid", eps)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.chosen_rewards, beta * (logps[:2] - ref[:2]))


def test_with_lora_the_reference_is_the_base_model_exactly():
    base = tiny_model()
    model = add_lora(copy.deepcopy(base), rank=4).train()
    for layer in model.modules():
        if isinstance(layer, LoRALinear):
            torch.nn.init.normal_(layer.lora_B, std=0.1)
    idx = torch.randint(0, 97, (3, 16))
    with torch.no_grad():
        with adapters_off(model):
            assert torch.equal(model(idx)[0], base(idx)[0])
        assert not torch.allclose(model(idx)[0], base(idx)[0])  # the adapters are back
    x = idx[:, :-1]
    y = idx[:, 1:]
    assert torch.equal(Reference(model, None).logps(x, y), sequence_logps(base, x, y)[0])
    assert model.training  # the reference's eval mode does not stick


def test_sequence_logps_sum_the_targets_log_probabilities():
    model = tiny_model()
    x, y = pair_rows(PAIRS)
    logits = model(x)[0].log_softmax(-1)
    expected = torch.stack([logits[i, t, y[i, t]] for i, t in zip(*torch.nonzero(y >= 0).T, strict=True)])
    rows = torch.nonzero(y >= 0)[:, 0]
    logps, lengths = sequence_logps(model, x, y)
    torch.testing.assert_close(logps, torch.zeros(6).index_add_(0, rows, expected))
    assert lengths.tolist() == [2, 3, 1, 1, 2, 4]
    logps.sum().backward()  # the chunked per-token loss has gradients
    assert model.lm_head.weight.grad is not None


# ---------------------------------------------------------------------------------------------
# data/prepare.py --preference


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def digits_pairs(n, seed=0):
    """The toy task: a number's digits reversed is the chosen answer, the same digits in another order rejected."""
    import random

    rng = random.Random(seed)
    records = []
    while len(records) < n:
        digits = str(rng.randint(1000, 99999))
        wrong = "".join(rng.sample(digits, len(digits)))
        if wrong != digits[::-1]:
            records.append({"prompt": digits + "=", "chosen": digits[::-1] + ".", "rejected": wrong + "."})
    return records


def test_prepare_writes_pairs_the_loader_reads(tmp_path):
    records = digits_pairs(20)
    prepare_preference([str(write_jsonl(tmp_path / "p.jsonl", records))], "byte", tmp_path / "d", log=lambda *a: None)
    loader = PairLoader(find_shards(tmp_path / "d", "val"), batch_size=2, block_size=32)
    x, y = next(loader.every_window())
    assert x.shape[0] == 4  # two pairs: two chosen rows, then two rejected
    val = [r for i, r in enumerate(records) if (i + 1) % 10 == 0]  # every 10th record is val
    for row, (record, answer) in enumerate([(r, "chosen") for r in val] + [(r, "rejected") for r in val]):
        text = record["prompt"] + record[answer]
        n = len(text)
        assert bytes(x[row, : n - 1].tolist()).decode() == text[:-1]
        targets = y[row, : n - 1]
        assert (targets[: len(record["prompt"]) - 1] == -1).all()
        assert bytes(targets[len(record["prompt"]) - 1 :].tolist()).decode() == record[answer]


def test_messages_are_rendered_with_the_chat_template(tmp_path):
    records = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}],
        }
        for i in range(10)
    ]
    manifest = prepare_preference(
        [str(write_jsonl(tmp_path / "m.jsonl", records))], "byte", tmp_path / "d", log=lambda *a: None
    )
    assert manifest["pairs"]["kept"] == 10
    tokenizer = load_tokenizer(tmp_path / "d" / "tokenizer.json")
    loader = PairLoader(find_shards(tmp_path / "d", "train"), batch_size=1, block_size=64)
    x, y = next(loader.every_window())
    chosen = tokenizer.decode([t for t in y[0].tolist() if t >= 0])
    prompt = tokenizer.decode(x[0, : int((y[0] < 0).long().argmin()) + 1].tolist())
    assert prompt == "<|im_start|>user\nq0<|im_end|>\n<|im_start|>assistant\n"
    assert chosen == "good<|im_end|>"  # the answer up to its end-of-turn marker, as --chat's targets


def test_the_command_reads_parquet_with_other_field_names(tmp_path, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = digits_pairs(20)
    columns = {"question": [r["prompt"] for r in records], "good": [r["chosen"] for r in records]}
    columns["bad"] = [r["rejected"] for r in records]
    pq.write_table(pa.table(columns), tmp_path / "pairs.parquet")
    argv = ["--input", str(tmp_path / "pairs.parquet"), "--preference", "--tokenizer", "byte", "--block_size=32"]
    argv += ["--prompt_field=question", "--chosen_field=good", "--rejected_field=bad", f"--out_dir={tmp_path / 'd'}"]
    monkeypatch.setattr(sys, "argv", ["prepare.py", *argv])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(ROOT / "data" / "prepare.py"), run_name="__main__")
    assert exit.value.code in (0, None)
    assert "20 pairs kept (0 cut to block_size)" in capsys.readouterr().out
    x, y = PairLoader(find_shards(tmp_path / "d", "train"), batch_size=18, block_size=32).next_batch()
    assert x.shape[0] == 36
    argv = [a for a in argv if not a.startswith(("--chosen_field", "--out_dir"))]
    monkeypatch.setattr(sys, "argv", ["prepare.py", *argv, "--chosen_field=answer", f"--out_dir={tmp_path / 'e'}"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(ROOT / "data" / "prepare.py"), run_name="__main__")
    assert exit.value.code == 2
    assert "pairs.parquet has no column 'answer'" in capsys.readouterr().err


def test_a_record_without_an_answer_names_its_line_and_the_option(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a"}])
    with pytest.raises(ValueError, match=r"bad.jsonl line 2 has no field 'chosen' .*pass --chosen_field"):
        prepare_preference([str(bad)], "byte", tmp_path / "d", log=lambda *a: None)


def test_identical_answers_and_long_prompts_are_dropped_counted_and_named(tmp_path):
    records = digits_pairs(20)
    records[3] = {"prompt": "1=", "chosen": "same", "rejected": "same"}
    records[5] = {"prompt": "x" * 40, "chosen": "a", "rejected": "b"}
    lines = []
    manifest = prepare_preference(
        [str(write_jsonl(tmp_path / "p.jsonl", records))], "byte", tmp_path / "d", block_size=32, log=lines.append
    )
    counts = manifest["pairs"]
    assert (counts["kept"], counts["identical"], counts["prompt_too_long"]) == (18, 1, 1)
    summary = lines[0]
    assert "first with identical answers: " in summary and "p.jsonl line 4 (nothing to learn" in summary
    assert "p.jsonl line 6 (raise --block_size or shorten the prompts)" in summary


def test_long_answers_are_cut_to_the_window(tmp_path):
    records = [{"prompt": "p=", "chosen": "c" * (50 + i), "rejected": "r" * 10} for i in range(10)]
    manifest = prepare_preference(
        [str(write_jsonl(tmp_path / "p.jsonl", records))], "byte", tmp_path / "d", block_size=16, log=lambda *a: None
    )
    assert manifest["pairs"]["cut"] == 10
    x, _ = PairLoader(find_shards(tmp_path / "d", "train"), batch_size=1, block_size=16).next_batch()
    assert x.shape[1] <= 16


def test_dpo_options_are_checked():
    from gptlite.train.run_config import check_training_options

    with pytest.raises(ValueError, match=r"dpo_beta=0.0 must be > 0.*dpo_label_smoothing=0.5 must be in \[0, 0.5\)"):
        check_training_options(TrainConfig(dpo_beta=0.0, dpo_label_smoothing=0.5))
    with pytest.raises(ValueError, match=r"dpo_label_smoothing=0.1 applies to dpo_loss=sigmoid only"):
        check_training_options(TrainConfig(dpo_loss="ipo", dpo_label_smoothing=0.1))


# ---------------------------------------------------------------------------------------------
# train.py on preference data


@pytest.fixture(scope="module")
def digits_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    write_jsonl(root / "pairs.jsonl", digits_pairs(400))
    prepare_preference([str(root / "pairs.jsonl")], "byte", root / "data", block_size=32, log=lambda *a: None)
    return root / "data"


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dpo_raises_preference_accuracy_on_held_out_pairs(digits_data, tmp_path):
    run = run_train(
        f"--data_dir={digits_data}",
        f"--out_dir={tmp_path}",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=64",
        "--block_size=32",
        "--batch_size=16",
        "--max_iters=150",
        "--eval_interval=150",
        "--eval_iters=0",
        "--learning_rate=3e-3",
        "--warmup_iters=10",
        "--dpo_beta=0.5",
        "--device=cpu",
    )
    assert run.code == 0, run.err
    val = [r for r in read_metrics(tmp_path) if "val_rewards_accuracy" in r][-1]
    # at the start the model is its reference: every reward 0, no pair right, the loss log 2
    assert val["val_rewards_accuracy"] >= 0.85 and val["val_rewards_margin"] > 0 and val["val_loss"] < 0.4
    train_rows = [r for r in read_metrics(tmp_path) if "rewards_accuracy" in r]
    assert {"rewards_chosen", "rewards_rejected", "rewards_margin"} <= set(train_rows[-1])


@pytest.mark.parametrize("lora", [False, True])
def test_a_dpo_run_resumes_exactly_against_the_start_of_run_reference(digits_data, tmp_path, lora):
    base = tmp_path / "base"
    hf_llama(vocab_size=256).save_pretrained(base)  # the byte tokenizer's ids
    args = [
        f"--init_from={base}",
        f"--data_dir={digits_data}",
        "--block_size=32",
        "--batch_size=4",
        "--learning_rate=1e-2",
        "--warmup_iters=2",
        "--eval_iters=2",
        "--log_interval=1",
        "--lr_decay_iters=8",
        "--device=cpu",
        *(["--lora_rank=4", "--lora_alpha=8"] if lora else []),
    ]
    straight = run_train(*args, f"--out_dir={tmp_path / 'a'}", "--max_iters=8", "--eval_interval=4")
    assert straight.code == 0, straight.err
    run_train(*args, f"--out_dir={tmp_path / 'b'}", "--max_iters=4", "--eval_interval=4")
    resumed = run_train(f"--out_dir={tmp_path / 'b'}", "--resume", "--max_iters=8")
    assert resumed["history"] == [h for h in straight["history"] if h[0] > 4]
    # the first step's model is its reference: every reward 0, the loss log 2. The resumed run's reference is the
    # start-of-run model too, not the resumed one (against which its first step would score log 2 again)
    assert straight["history"][0][1] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(resumed["history"][0][1] - math.log(2)) > 1e-4
