"""Training meets careless input (issue 55's training cases): each is a one-line error naming the value and the fix,
refused before anything is written, or a figure that is not made up; nothing a user saved is lost.

- options that do nothing in the run's mode or with its optimizer (--dpo_* on text, --rl_* without --rl, Muon's
  options under AdamW) are refused, as is a switch that cannot act (unet_skips with one layer) or an infinite softcap;
- a resume on other data (text into a DPO run, other pairs, another prompts file of the same length) is refused
  before anything is restored, by the data's fingerprint in the checkpoint;
- DPO at a block_size that cuts every answer away is refused, not trained to a loss of ln 2 and no gradient;
- a reward that exits (SystemExit) is the reward's fault, said in a line; a step a reward skipped writes its event,
  not a row of zeros; an answer that is null or a list is refused; a pair with an empty answer is refused;
- the messages name what is wrong: ema_decay alone, "pairs" for pairs, "no checkpoint yet" when there is none."""

import re

import pytest

from gptlite.checkpoint import load_checkpoint
from gptlite.config import build_config
from gptlite.data.prepare.preference import prepare_preference
from gptlite.tokenizer import ByteTokenizer
from gptlite.train.rl import load_reward, read_prompts
from gptlite.train.run_config import check_training_options
from tests.conftest import FullDisk, run_train
from tests.train.test_preference import digits_pairs as pairs
from tests.train.test_preference import write_jsonl

TINY = dict(n_layer=1, n_head=2, n_embd=32, batch_size=4, eval_iters=1, log_interval=1, device="cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Pairs prepared at block_size 32 (two different sets) and a text folder, all in the byte tokenizer."""
    from gptlite.data.prepare import prepare

    root = tmp_path_factory.mktemp("careless")
    for name, seed in (("pairs", 0), ("other_pairs", 1)):
        source = write_jsonl(root / f"{name}.jsonl", pairs(80, seed))
        prepare_preference([str(source)], "byte", root / name, block_size=32, log=lambda *a: None)
    (root / "text.txt").write_text("to be or not to be, that is the question. " * 400)
    prepare([str(root / "text.txt")], "byte", root / "text", log=lambda *a: None)
    return root


def train(*args, **options):
    return run_train(*args, **{**TINY, **options})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"muon_ns": "polar_express"}, r"muon_ns=polar_express configure Muon, and optimizer=adamw trains without it; "
                                       r"add --optimizer=muon or leave them out"),
        ({"normuon": "true", "muon_lr": "0.05"}, r"muon_lr=0.05, normuon=True configure Muon, and optimizer=adamw"),
        ({"rl_samples": "4"}, r"rl_samples=4 configure reinforcement learning \(--rl\), which this run does not do; "
                              r"add --rl or leave them out"),
        ({"logit_softcap": "inf"}, r"logit_softcap=inf must be a finite number >= 0"),
        ({"unet_skips": "true", "n_layer": "1"}, r"unet_skips=true joins .* n_layer=1 has no such pair"),
        ({"ema_decay": "1.5"}, r"^invalid training config: ema_decay=1.5 must be in \[0, 1\) \(0 = no average"),
    ],
)  # fmt: skip
def test_options_that_would_do_nothing_or_cannot_act_are_refused(values, message):
    with pytest.raises(ValueError, match=message) as e:
        check_training_options(build_config({"vocab_size": 256, **values}))  # as train.py resolves its run
    assert "\n" not in str(e.value) and "normuon_beta2=0.95" not in str(e.value)


def test_dpo_options_on_text_data_are_refused_before_the_run_folder_is_made(folders, tmp_path):
    done = train(data_dir=folders / "text", out_dir=tmp_path / "run", block_size=32, dpo_beta=0.3, max_iters=2)
    assert done.code == 2 and not (tmp_path / "run").exists()
    assert done.err.strip().endswith(
        f"dpo_beta=0.3 configure DPO on preference pairs, and {folders / 'text'} holds text; leave them out, or give "
        "a data folder prepared with data/prepare.py --preference"
    )


def test_dpo_at_a_block_that_cuts_every_answer_away_is_refused(folders, tmp_path):
    done = train(data_dir=folders / "pairs", out_dir=tmp_path / "run", block_size=4, max_iters=2)
    assert done.code == 2 and not (tmp_path / "run").exists()
    assert "block_size=4 cuts every one of the 72 preference pairs' answers in " in done.err
    assert "nothing would train: give --block_size=6 or more, or prepare the data again with --block_size=4" in done.err


def test_a_dpo_batch_larger_than_the_data_speaks_of_pairs(folders, tmp_path):
    done = train(data_dir=folders / "pairs", out_dir=tmp_path / "run", block_size=32, batch_size=1000, max_iters=2)
    assert done.code == 2 and "72 preference pairs in 1 shard(s)" in done.err and "conversations" not in done.err


def test_a_resume_on_other_data_is_refused_before_anything_is_restored(folders, tmp_path):
    run = tmp_path / "dpo"
    first = train(data_dir=folders / "pairs", out_dir=run, block_size=32, max_iters=2, eval_interval=2)
    assert first.code == 0, first.err
    saved = load_checkpoint(run)
    assert saved["data"]["kind"] == "pairs" and len(saved["data"]["data"]) == 16
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    text = train(data_dir=folders / "text", out_dir=run, block_size=32, max_iters=4, resume=True)
    assert text.code == 2 and "Traceback" not in text.err
    assert (
        f"cannot --resume the run in {run} on other data: the run trained on pairs and {folders / 'text'} holds text; "
        f"resume with its own (--data_dir={folders / 'pairs'}), or start a new run in another --out_dir"
    ) in text.err
    other = train(data_dir=folders / "other_pairs", out_dir=run, block_size=32, max_iters=4, resume=True)
    assert other.code == 2 and f"{folders / 'other_pairs'} holds other shards than the run trained on" in other.err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing written
    again = train(data_dir=folders / "pairs", out_dir=run, block_size=32, max_iters=4, eval_interval=2, resume=True)
    assert again.code == 0 and again.step == 4, again.err


def test_rl_answers_must_be_text_or_a_number(tmp_path):
    tokenizer = ByteTokenizer()
    for answer, shown in ((None, "null"), (["4", "5"], '["4", "5"]'), (True, "true")):
        path = write_jsonl(
            tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4"}, {"prompt": "1+1=", "answer": answer}]
        )
        with pytest.raises(
            ValueError, match=r"record 2 of .*p.jsonl: its 'answer' is (.+), and the built-in reward"
        ) as e:
            read_prompts(path, tokenizer)
        assert e.value.args[0].split("is ", 1)[1].startswith(shown)
    numbers = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "a", "answer": 3}])
    assert [p.record["answer"] for p in read_prompts(numbers, tokenizer)] == [3]


def test_a_reward_that_exits_is_the_rewards_fault_in_one_line(tmp_path, monkeypatch):
    from gptlite.train.rl import RewardError

    (tmp_path / "quits.py").write_text("def reward(p, c, r):\n    raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"reward function quits:reward raised SystemExit: 3 on record 1 of x.jsonl"):
        load_reward("quits:reward")("p", "c", {}, "record 1 of x.jsonl")


def test_an_empty_answer_in_a_pair_is_refused_naming_its_record(tmp_path):
    records = pairs(5)
    records[3]["chosen"] = ""
    source = write_jsonl(tmp_path / "pairs.jsonl", records)
    with pytest.raises(ValueError, match=r"pairs.jsonl line 4: field 'chosen' is empty; a pair needs") as e:
        prepare_preference([str(source)], "byte", tmp_path / "d", log=lambda *a: None)
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    # over an earlier preparation, --overwrite with the bad record leaves the earlier one whole
    good = write_jsonl(tmp_path / "good.jsonl", pairs(40))
    prepare_preference([str(good)], "byte", tmp_path / "d", log=lambda *a: None)
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}
    with pytest.raises(ValueError, match=r"field 'chosen' is empty"):
        prepare_preference([str(source)], "byte", tmp_path / "d", overwrite=True, log=lambda *a: None)
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == before


def test_a_full_disk_at_the_first_save_says_no_checkpoint_was_saved_yet(folders, tmp_path, monkeypatch):
    from gptlite import checkpoint

    real_init = checkpoint._HashingWriter.__init__
    monkeypatch.setattr(checkpoint._HashingWriter, "__init__", lambda self, f: real_init(self, FullDisk(f, 20_000)))
    done = train(data_dir=folders / "text", out_dir=tmp_path / "run", block_size=32, max_iters=2, eval_interval=2)
    assert done.code == 2
    assert f"no checkpoint of this run was saved yet in {tmp_path / 'run'}: fix that, then continue with --resume" in (
        done.err
    )
    assert "latest good checkpoint" not in done.err


def test_init_from_a_folder_that_holds_no_model_names_both_kinds_of_model(folders, tmp_path):
    done = train(data_dir=folders / "text", out_dir=tmp_path / "run", init_from=folders / "text", max_iters=2)
    assert done.code == 2 and not (tmp_path / "run").exists()
    assert done.err.strip().endswith(
        f"{folders / 'text' / 'config.json'} does not exist: {folders / 'text'} is neither a gptlite run folder (no "
        "ckpt_NNNNNN.pt) nor a Hugging Face checkpoint directory (config.json and its weights); name a run's "
        "--out_dir or such a directory"
    )


def stopped_before_its_first_save(folders, run, monkeypatch) -> None:
    """A run in `run` (1 layer, 32 wide) that stopped before its first checkpoint: its first save met a full disk."""
    from gptlite import checkpoint

    real_init = checkpoint._HashingWriter.__init__
    with monkeypatch.context() as patched:
        patched.setattr(checkpoint._HashingWriter, "__init__", lambda self, f: real_init(self, FullDisk(f, 20_000)))
        done = train(data_dir=folders / "text", out_dir=run, block_size=32, max_iters=2, eval_interval=2)
    assert done.code == 2 and not list(run.glob("ckpt_*.pt"))


def test_a_resume_before_the_first_checkpoint_goes_on_with_the_runs_own_config(folders, tmp_path, monkeypatch):
    """--resume of a run that saved no checkpoint yet: the run recorded its config as it started (run.json), and the
    resume takes it, as a checkpoint's, rather than train.py's defaults (once an 86M model of 12 layers); an option
    given on the command line still wins, and a shape change is refused as on any resume."""
    from gptlite.train.run_config import resolve_config

    run = tmp_path / "run"
    stopped_before_its_first_save(folders, run, monkeypatch)
    cfg = resolve_config([f"--out_dir={run}", "--resume", "--max_iters=3"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size) == (1, 32, 32)
    assert cfg.data_dir == str(folders / "text") and cfg.max_iters == 3
    with pytest.raises(
        ValueError, match=rf"^cannot change the model shape on --resume from {run}: n_embd=64 \(run.json has 32\)"
    ):
        resolve_config([f"--out_dir={run}", "--resume", "--n_embd=64"])
    done = run_train(f"--out_dir={run}", "--resume", "--max_iters=2", "--eval_interval=2")
    assert done.code == 0, done.err
    assert f"no checkpoint in {run}; starting from scratch" in done.out and '"n_embd": 32' in done.out


def test_a_budget_on_a_resume_is_refused_or_the_runs_own(folders, tmp_path):
    """A budget derives a new run's recipe (its model's size among the rest), which a resume cannot change: another
    budget (or laws) on --resume is refused in one line, never silently left out; the run's own budget is said to
    be its own. --scaling_laws without --budget, which nothing would read, is refused too."""
    run = tmp_path / "run"
    assert train(data_dir=folders / "text", out_dir=run, block_size=32, max_iters=2, eval_interval=2).code == 0
    done = run_train(f"--out_dir={run}", "--resume", "--budget=30s", "--max_iters=3")
    assert done.code == 2 and len(done.err.strip().splitlines()) == 1
    assert done.err.strip().endswith(
        f"cannot apply --budget=30s on --resume from {run}: a budget derives a new run's recipe (the model's size "
        "among the rest), and the run goes on with its own (the keys it was given, no --budget); drop it, or start "
        "a new run in another --out_dir"
    )
    done = run_train(f"--out_dir={run}", "--resume", f"--scaling_laws={tmp_path / 'laws.json'}")
    assert done.code == 2 and f"cannot apply --scaling_laws={tmp_path / 'laws.json'} on --resume" in done.err
    done = train(data_dir=folders / "text", out_dir=tmp_path / "other", scaling_laws=tmp_path / "broken.json")
    assert done.code == 2 and done.err.strip().endswith(
        f"--scaling_laws={tmp_path / 'broken.json'} is read only to derive a recipe for --budget; add --budget=... "
        "(e.g. 90s), or leave --scaling_laws out"
    )
    assert not (tmp_path / "other").exists()


def test_a_resume_with_the_runs_own_budget_says_it_goes_on_with_its_recipe(folders, tmp_path):
    from gptlite.checkpoint import record_run
    from gptlite.config import config_to_dict
    from gptlite.train.run_config import resolve_config

    run = tmp_path / "run"
    run.mkdir()
    recorded = resolve_config([f"--data_dir={folders / 'text'}", "--n_layer=1", "--n_embd=32", "--n_head=2"])
    record_run(run, {**config_to_dict(recorded), "budget": "30s"}, "train.py --budget=30s")
    notes = []
    cfg = resolve_config([f"--out_dir={run}", "--resume", "--budget=30s"], notes=notes)
    assert cfg.budget == "30s" and cfg.model.n_embd == 32
    assert notes == ["--budget=30s: the run's own; it goes on with the recipe derived when it began"]


def test_a_model_read_from_a_run_that_saved_no_checkpoint_says_so(folders, tmp_path, monkeypatch, capsys):
    """sample.py (and --init_from) on a run that stopped before its first save: the run saved no checkpoint yet,
    rather than that a Hugging Face config.json is missing."""
    import sample

    run = tmp_path / "run"
    stopped_before_its_first_save(folders, run, monkeypatch)
    capsys.readouterr()
    assert sample.main([f"--model={run}", "--device=cpu"]) == 2
    said = f"the run in {run} has saved no checkpoint yet (it stopped, or is still running, before its first save); "
    said += f"continue it with python train.py --out_dir={run} --resume, or name another model"
    assert capsys.readouterr().err == f"sample.py: error: {said}\n"
    done = train(data_dir=folders / "text", out_dir=tmp_path / "next", init_from=run, max_iters=2)
    assert done.code == 2 and done.err.strip().endswith(said)


def test_train_help_names_run_folders_for_init_from():
    done = run_train("--help")
    line = next(line for line in done.out.splitlines() if line.lstrip().startswith("--init_from"))
    assert "a gptlite run folder (its newest checkpoint), a Hugging Face directory" in line


@pytest.mark.parametrize(
    "edit, message",
    [
        (("n_layer", "one"), r"n_layer='one' is not an integer"),
        (("n_layerz", 1), r"unknown config key 'n_layerz'; did you mean 'n_layer'\?"),
        (("n_head", 3), r"n_embd=32 is not divisible by n_head=3"),
    ],
)
def test_a_hand_edited_run_json_is_named_as_the_origin(folders, tmp_path, monkeypatch, edit, message):
    """Issue 84: a bad key or value in run.json was reported as if the command line had given it."""
    import json

    run = tmp_path / "run"
    stopped_before_its_first_save(folders, run, monkeypatch)
    record = json.loads((run / "run.json").read_text())
    record["config"][edit[0]] = edit[1]
    (run / "run.json").write_text(json.dumps(record))
    done = run_train(f"--out_dir={run}", "--resume", "--max_iters=2")
    assert done.code == 2
    assert re.match(rf"^{run / 'run.json'}, the config the run recorded as it started: .*{message}", done.error)
    assert done.error.endswith("or delete run.json and give the run's settings again")


def test_init_from_on_a_resume_is_refused_naming_what_the_run_began_from(folders, tmp_path):
    """Issue 84: --init_from on --resume was ignored without a word (and a Hugging Face directory's tokenizer was
    blamed on the data)."""
    from tests.test_hf import hf_llama

    run = tmp_path / "run"
    hf_dir = tmp_path / "hf"
    assert train(data_dir=folders / "text", out_dir=run, block_size=32, max_iters=2, eval_interval=2).code == 0
    hf_llama().save_pretrained(hf_dir)
    done = run_train(f"--out_dir={run}", "--resume", f"--init_from={hf_dir}", "--max_iters=3")
    assert done.code == 2 and done.error == (
        f"cannot apply --init_from={hf_dir} on --resume from {run}: the run goes on from its own weights (checkpoint "
        "has no init_from: it trained from scratch); drop --init_from to resume, or start a new run from those "
        "weights in another --out_dir"
    )
    assert [p.name for p in run.glob("ckpt_*.pt")] == ["ckpt_000002.pt"]  # nothing written


def test_resume_on_other_data_whose_ids_the_model_lacks_says_the_vocab_is_the_runs(folders, tmp_path):
    """Issue 84: the error suggested --vocab_size, which a resume refuses."""
    import numpy as np

    from gptlite.data.shards import write_shard

    run, gpt2 = tmp_path / "run", tmp_path / "gpt2"
    assert train(data_dir=folders / "text", out_dir=run, block_size=32, max_iters=2, eval_interval=2).code == 0
    gpt2.mkdir()
    for split in ("train", "val"):
        write_shard(gpt2 / f"{split}_000000.bin", np.arange(2000) % 50257, 50304)
    done = run_train(f"--out_dir={run}", "--resume", f"--data_dir={gpt2}", "--max_iters=3")
    assert done.code == 2 and "--vocab_size" not in done.error
    assert done.error.endswith(
        f"on --resume vocab_size=256 is the run's own (its checkpoint's, or run.json's, in {run}): resume on the "
        "data it trained on, or train on this data in another --out_dir"
    )


def test_options_a_resume_cannot_honour_are_refused_in_one_line(folders, tmp_path):
    """--seed on a resume from a checkpoint (its random streams and data order go on), --overwrite with --resume."""
    run = tmp_path / "run"
    assert train(data_dir=folders / "text", out_dir=run, block_size=32, max_iters=2, eval_interval=2).code == 0
    done = run_train(f"--out_dir={run}", "--resume", "--seed=7", "--max_iters=3")
    assert done.code == 2 and done.error == (
        f"cannot apply --seed=7 on --resume from {run}: the run's random streams and data order go on from its "
        "checkpoint (checkpoint has seed=1337); drop --seed, or start a new run in another --out_dir"
    )
    assert run_train(f"--out_dir={run}", "--resume", "--seed=1337", "--max_iters=3").code == 0  # its own: fine
    done = run_train(f"--out_dir={run}", "--resume", "--overwrite", "--max_iters=4")
    assert done.code == 2 and done.error.startswith(
        "--overwrite and --resume contradict: --overwrite moves the earlier"
    )
    assert [p.name for p in sorted(run.glob("ckpt_*.pt"))] == ["ckpt_000002.pt", "ckpt_000003.pt"]
