"""Checkpoint files: atomic checksummed saves, keep-last-K plus best, falling back past damaged files (also
after a real kill -9 in the middle of a write), RNG states, and state dicts free of wrapper prefixes."""

import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlite.checkpoint import (
    DataPosition,
    LossScale,
    Optimizers,
    Progress,
    RandomStreams,
    RunRecord,
    TrainingState,
    Weights,
    load_checkpoint,
    model_from_checkpoint,
    repair_run_folder,
    rng_state,
    save_checkpoint,
    save_run_checkpoint,
    set_rng_state,
    step_files,
    verify_checkpoint,
    weight_average,
)
from gptlite.checkpoint.training_state import ENTRIES
from gptlite.config import build_config
from gptlite.tokenizer import CharTokenizer
from gptlite.train.optim import configure_optimizers
from tests.conftest import DEVICE, ROOT, FullDisk, randint, tiny_config, tiny_model


def fake_checkpoint(step: int, size: int = 1000) -> dict:
    return {"step": step, "config": {"n_layer": 1}, "model": {"w": torch.full((size,), float(step))}}


def names(run_dir) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


def test_save_writes_a_sha256sum_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "ckpt_000007.pt"
    save_checkpoint(path, fake_checkpoint(7))
    assert names(tmp_path) == ["ckpt_000007.pt", "ckpt_000007.pt.sha256"]
    result = subprocess.run(["sha256sum", "-c", "ckpt_000007.pt.sha256"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and "ckpt_000007.pt: OK" in result.stdout
    assert load_checkpoint(path)["step"] == 7


def test_run_directory_keeps_the_newest_k_and_the_best(tmp_path):
    for step, best in [(10, True), (20, False), (30, False), (40, False)]:
        save_run_checkpoint(tmp_path, fake_checkpoint(step), keep_last=2, best=best)
    # the newest two, plus step 10 because best.pt points at it
    assert [p.name for p in step_files(tmp_path)] == ["ckpt_000040.pt", "ckpt_000030.pt", "ckpt_000010.pt"]
    assert os.readlink(tmp_path / "ckpt.pt") == "ckpt_000040.pt"
    assert os.readlink(tmp_path / "best.pt") == "ckpt_000010.pt"
    assert not (tmp_path / "ckpt_000020.pt.sha256").exists()
    assert load_checkpoint(tmp_path)["step"] == 40
    assert load_checkpoint(tmp_path / "best.pt")["step"] == 10
    assert load_checkpoint(tmp_path / "ckpt.pt")["step"] == 40  # the symlink is checked against its target's sha256
    save_run_checkpoint(tmp_path, fake_checkpoint(50), keep_last=2, best=True)
    assert [p.name for p in step_files(tmp_path)] == ["ckpt_000050.pt", "ckpt_000040.pt"]  # the old best goes


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "empty"])
def test_a_damaged_newest_file_is_rejected_and_the_directory_falls_back(tmp_path, damage):
    for step in (1, 2):
        save_run_checkpoint(tmp_path, fake_checkpoint(step), keep_last=3)
    newest = tmp_path / "ckpt_000002.pt"
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip a byte":
        data[len(data) // 2] ^= 0xFF  # inside the tensor bytes: torch.load alone would not notice
    else:
        data = b""
    newest.write_bytes(bytes(data))
    message = rf"checkpoint .*ckpt_000002\.pt is damaged: its {len(data)} bytes do not match the sha256 in ckpt_000002"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match=r"ckpt_000002\.pt is damaged.*; loaded .*ckpt_000001\.pt instead"):
        assert load_checkpoint(tmp_path)["step"] == 1
    messages = []
    assert load_checkpoint(tmp_path, on_fallback=messages.append)["step"] == 1 and len(messages) == 1


def test_when_every_checkpoint_is_damaged_the_error_lists_them(tmp_path):
    for step in (1, 2):
        save_run_checkpoint(tmp_path, fake_checkpoint(step))
        (tmp_path / f"ckpt_{step:06d}.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"ckpt_000002\.pt is damaged.*ckpt_000001\.pt is damaged.*no intact"):
        load_checkpoint(tmp_path)


def test_missing_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*ckpt\.pt does not exist \(nor any ckpt_NNNNNN\.pt in"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nope\.pt does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    # a plain ckpt.pt without a checksum (an older gptlite's run directory) is loaded unchecked
    torch.save(fake_checkpoint(3), tmp_path / "ckpt.pt")
    assert "though it has no checksum file ckpt.pt.sha256" in verify_checkpoint(tmp_path / "ckpt.pt")
    with pytest.warns(UserWarning, match="is whole"):
        assert load_checkpoint(tmp_path)["step"] == 3


def test_a_resume_moves_damaged_later_files_aside_and_drops_a_best_link_to_them(tmp_path):
    for step, best in [(1, False), (2, False), (3, True)]:
        save_run_checkpoint(tmp_path, fake_checkpoint(step), keep_last=3, best=best)
    (tmp_path / "ckpt_000003.pt").write_bytes(b"cut short")
    (line,) = repair_run_folder(tmp_path, 2)
    assert line.startswith(f"moved {tmp_path / 'ckpt_000003.pt'} aside to ckpt_000003.pt.damaged: it is newer")
    assert names(tmp_path) == [
        "ckpt.pt",
        "ckpt_000001.pt",
        "ckpt_000001.pt.sha256",
        "ckpt_000002.pt",
        "ckpt_000002.pt.sha256",
        "ckpt_000003.pt.damaged",
        "ckpt_000003.pt.sha256.damaged",
    ]
    assert (tmp_path / "ckpt_000003.pt.damaged").read_bytes() == b"cut short"  # nothing of it is lost
    assert os.readlink(tmp_path / "ckpt.pt") == "ckpt_000002.pt"
    assert repair_run_folder(tmp_path, 1) == [] and load_checkpoint(tmp_path)["step"] == 2  # intact files stay
    # a second damaged file of the same name does not overwrite the first one set aside
    save_run_checkpoint(tmp_path, fake_checkpoint(3), keep_last=5)
    (tmp_path / "ckpt_000003.pt").write_bytes(b"cut short again")
    assert "aside to ckpt_000003.pt.damaged-2" in repair_run_folder(tmp_path, 2)[0]
    assert (tmp_path / "ckpt_000003.pt.damaged").read_bytes() == b"cut short"


def sidecar_damage(checksum, damage: str) -> None:
    """Damage a checksum file the ways a user's tools do (the checkpoint it describes untouched)."""
    line = checksum.read_bytes()
    if damage == "emptied":
        checksum.write_bytes(b"")
    elif damage == "edited":
        checksum.write_bytes(b"0" * 64 + line[64:])
    elif damage == "crlf":
        checksum.write_bytes(line.replace(b"\n", b"\r\n"))
    else:
        checksum.unlink()


@pytest.mark.parametrize("damage", ["emptied", "edited", "crlf", "deleted"])
def test_a_checksum_file_in_error_never_outranks_a_whole_checkpoint(tmp_path, damage):
    """The checkpoint is checked by what it is (its records' CRC-32s) and kept; a resume rewrites the checksum file."""
    for step in (1, 2):
        save_run_checkpoint(tmp_path, fake_checkpoint(step), keep_last=3)
    newest = tmp_path / "ckpt_000002.pt"
    checksum = tmp_path / "ckpt_000002.pt.sha256"
    good = checksum.read_bytes()
    sidecar_damage(checksum, damage)
    notes = []
    assert load_checkpoint(tmp_path, on_fallback=notes.append)["step"] == 2
    (note,) = notes
    assert note.startswith(f"checkpoint {newest} is whole (every record holds its CRC-32) though ")
    with pytest.warns(UserWarning, match=r"ckpt_000002\.pt is whole .* the checkpoint is kept"):
        assert load_checkpoint(newest)["step"] == 2
    (line,) = repair_run_folder(tmp_path, 2)
    assert line.startswith(f"{newest} is whole though ") and line.endswith(
        ": resumed from it, and rewrote ckpt_000002.pt.sha256"
    )
    assert checksum.read_bytes() == good and verify_checkpoint(newest) is None
    assert [p.name for p in step_files(tmp_path)] == ["ckpt_000002.pt", "ckpt_000001.pt"]


def test_a_damaged_checkpoint_beside_a_checksum_file_in_error_is_still_damaged(tmp_path):
    save_run_checkpoint(tmp_path, fake_checkpoint(1), keep_last=3)
    path = tmp_path / "ckpt_000001.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor bytes
    path.write_bytes(bytes(data))
    (tmp_path / "ckpt_000001.pt.sha256").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=r"ckpt_000001\.pt is damaged: ckpt_000001\.pt\.sha256 is not the line .*, and "
        r"its record .* fails the CRC-32 saved with it",
    ):
        load_checkpoint(path)


def test_a_run_folder_loads_the_run_that_ckpt_pt_names(tmp_path):
    """Step files newer than ckpt.pt's (another run's, copied in) are not loaded, whatever their number."""
    save_run_checkpoint(tmp_path, fake_checkpoint(500), keep_last=3)
    os.replace(tmp_path / "ckpt.pt", tmp_path / "old_link")
    save_run_checkpoint(tmp_path, {**fake_checkpoint(100), "config": {"n_layer": 2}}, keep_last=3)
    assert os.readlink(tmp_path / "ckpt.pt") == "ckpt_000100.pt"
    assert load_checkpoint(tmp_path)["step"] == 100
    (tmp_path / "ckpt_000100.pt").write_bytes(b"damaged")  # and a fallback goes to older files only
    with pytest.raises(ValueError, match="no intact checkpoint|is damaged"):
        load_checkpoint(tmp_path)


def test_a_full_disk_during_a_save_leaves_no_temp_file_and_the_last_checkpoint_whole(tmp_path, monkeypatch):
    from gptlite import checkpoint

    save_run_checkpoint(tmp_path, fake_checkpoint(1, size=200_000))
    real_init = checkpoint._HashingWriter.__init__
    monkeypatch.setattr(checkpoint._HashingWriter, "__init__", lambda self, f: real_init(self, FullDisk(f, 100_000)))
    with pytest.raises(
        OSError, match=r"^could not save checkpoint .*ckpt_000002\.pt: no space left on device; free space"
    ):
        save_run_checkpoint(tmp_path, fake_checkpoint(2, size=200_000))
    assert names(tmp_path) == ["ckpt.pt", "ckpt_000001.pt", "ckpt_000001.pt.sha256"]
    assert load_checkpoint(tmp_path)["step"] == 1


KILL_DURING_WRITE = """
import os, signal, sys
import torch
from gptlite import checkpoint

real_write = checkpoint._HashingWriter.write
def write_then_die(self, data):
    n = real_write(self, data)
    if self.f.tell() > 200_000:  # part of the tensor bytes are on disk
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return n
checkpoint._HashingWriter.write = write_then_die
checkpoint.save_run_checkpoint(sys.argv[1], {"step": 3, "config": {}, "model": {"w": torch.ones(200_000)}})
"""


def test_kill_9_in_the_middle_of_a_write_leaves_the_latest_checkpoint_intact(tmp_path):
    for step in (1, 2):
        save_run_checkpoint(tmp_path, fake_checkpoint(step, size=200_000))
    result = subprocess.run(
        [sys.executable, "-c", KILL_DURING_WRITE, str(tmp_path)], cwd=ROOT, capture_output=True, timeout=120
    )
    assert result.returncode == -9, result.stderr  # really killed, mid-write
    assert (tmp_path / "ckpt_000003.pt.tmp").stat().st_size > 200_000  # the half-written file
    assert not (tmp_path / "ckpt_000003.pt").exists() and not (tmp_path / "ckpt_000003.pt.sha256").exists()
    assert os.readlink(tmp_path / "ckpt.pt") == "ckpt_000002.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to fall back from: the newest file is whole
        ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 2 and torch.equal(ckpt["model"]["w"], torch.full((200_000,), 2.0))
    # the next save clears what the crash left, including a checksum whose file never arrived
    (tmp_path / "ckpt_000009.pt.sha256").write_text("0" * 64 + "  ckpt_000009.pt\n")
    save_run_checkpoint(tmp_path, fake_checkpoint(3))
    assert names(tmp_path) == [
        "ckpt.pt",
        "ckpt_000001.pt",
        "ckpt_000001.pt.sha256",
        "ckpt_000002.pt",
        "ckpt_000002.pt.sha256",
        "ckpt_000003.pt",
        "ckpt_000003.pt.sha256",
    ]


@pytest.mark.device
def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    """Python's, numpy's, torch's CPU generator and, on CUDA, the device's generator."""
    torch.zeros(1, device=DEVICE)  # on CUDA, initialises the device, whose generator rng_state then saves
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_checkpoint(tmp_path / "r.pt", {"config": {}, "model": {}, "rng": [rng_state()]})
    expected = (random.random(), np.random.rand(), torch.rand(3), torch.rand(3, device=DEVICE))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_checkpoint(tmp_path / "r.pt")["rng"][0])  # weights_only loading accepts the states
    got = (random.random(), np.random.rand(), torch.rand(3), torch.rand(3, device=DEVICE))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


@pytest.mark.device
def test_a_model_on_the_device_round_trips_through_a_checkpoint(tmp_path):
    """Saved from the device, loaded on the CPU (sample.py's map_location) and moved back: the same logits,
    the head still tied."""
    model = tiny_model()
    config = dict(vars(tiny_config()), data_dir="x")
    save_checkpoint(tmp_path / "c.pt", {"config": config, "model": model.state_dict()})
    ckpt = load_checkpoint(tmp_path / "c.pt")
    assert all(t.device.type == "cpu" for t in ckpt["model"].values())
    rebuilt = model_from_checkpoint(ckpt).to(DEVICE).eval()
    assert rebuilt.lm_head.weight is rebuilt.tok_emb.weight
    idx = randint(97, (2, 9))
    assert torch.equal(rebuilt(idx)[0], model(idx)[0])


def test_weights_that_do_not_fit_the_config_are_refused_in_one_line(tmp_path):
    """A sinusoidal-position checkpoint from before pos_emb.gain existed would load into a model that computes
    something else; it and any other mismatch of names are refused, by sample.py too."""
    model = tiny_model(pos_emb="sinusoidal")
    config = dict(vars(tiny_config(pos_emb="sinusoidal")), data_dir="x")
    old = {k: v for k, v in model.state_dict().items() if k != "pos_emb.gain"}
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config, "model": old})
    CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n\u00e9").save(tmp_path / "tokenizer.json")  # 97 ids
    with pytest.raises(
        ValueError,
        match=r"weights do not fit the model its config describes \(missing: pos_emb\.gain; "
        r"unexpected: none\).*must be retrained",
    ):
        model_from_checkpoint(load_checkpoint(tmp_path))
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), f"--out_dir={tmp_path}", "--device=cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "missing: pos_emb.gain" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(ValueError, match=r"missing: none; unexpected: extra\.weight"):
        model_from_checkpoint({"config": config, "model": {**model.state_dict(), "extra.weight": torch.ones(1)}})


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch._dynamo's imports
def test_state_dicts_of_compiled_and_ddp_wrapped_models_have_plain_keys(tmp_path):
    """train.py saves through the training state's parts (torch.distributed.checkpoint's full state dicts): no
    `_orig_mod.` or `module.` prefixes, whatever wraps the model, so the file loads into a plain GPT anywhere."""
    model = tiny_model()
    optimizers = configure_optimizers(model, build_config({"data_dir": "x", "vocab_size": 97}), "cpu")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = DDP(torch.compile(model))  # compiling is lazy: nothing is compiled here
        model_state = Weights(wrapped, None, tmp_path).state_dict()["model"]
        optimizer_state = Optimizers(wrapped, optimizers).state_dict()["optimizer"]
    finally:
        dist.destroy_process_group()
    assert set(model_state) == set(model.state_dict())
    assert not any(k.startswith(("_orig_mod", "module.")) for k in [*model_state, *optimizer_state["state"]])
    config = dict(vars(tiny_config()), data_dir="x")
    save_checkpoint(tmp_path / "c.pt", {"config": config, "model": model_state, "optimizer": optimizer_state})
    rebuilt = model_from_checkpoint(load_checkpoint(tmp_path / "c.pt"))
    assert all(
        torch.equal(a, b) for a, b in zip(rebuilt.state_dict().values(), model.state_dict().values(), strict=True)
    )


class Position:
    """An objective's data position alone (DataPosition's side of gptlite.train.objective.Objective)."""

    def __init__(self, index: int):
        self.index = index

    def state(self) -> dict:
        return {"index": self.index}

    def restore(self, state: dict) -> None:
        self.index = state["index"]


def training_state(model, cfg, position, tmp_path, ema_decay=0.5):
    optimizers = configure_optimizers(model, cfg, "cpu")
    return TrainingState(
        weights=Weights(model, None, tmp_path),
        optimizers=Optimizers(model, optimizers),
        scale=LossScale(torch.amp.GradScaler("cpu", enabled=False)),
        position=DataPosition(position, {"kind": "text", "data": "abc"}, tmp_path, "data"),
        average=weight_average(model, ema_decay),
        progress=Progress(),
        streams=RandomStreams(0, 1, print),
        record=RunRecord(cfg, "train.py", tmp_path),
    )


def test_the_training_state_saves_its_parts_in_the_format_and_restores_them(tmp_path):
    cfg = build_config({"data_dir": "data", "vocab_size": 97, "n_layer": 2, "n_head": 4, "n_embd": 32})
    model = tiny_model().train()
    state = training_state(model, cfg, Position(7), tmp_path)
    loss = model(randint(97, (2, 8)), randint(97, (2, 8)))[1]
    loss.backward()
    for opt in state.optimizers.optimizers:
        opt.step()
    state.average.update()
    state.progress.step = 3
    state.progress.val_loss = 2.5
    state.finish(lambda line: None)  # the run ends as the average: the trained weights are kept beside it
    state.save(tmp_path, keep_last=2, master=True, log=lambda line: None)
    ckpt = load_checkpoint(tmp_path)
    assert list(ckpt) == [name for name in ENTRIES if name != "lora"]  # every entry once, in the format's order
    assert (ckpt["step"], ckpt["best_val_loss"], ckpt["val_loss"], ckpt["loader"]) == (3, 2.5, 2.5, {"index": 7})
    assert state.progress.best_val_loss == 2.5  # the save was the best so far

    restored = training_state(tiny_model(seed=1).train(), cfg, Position(0), tmp_path)
    restored.load_state_dict(ckpt)
    assert restored.progress.step == 3 and restored.position.objective.index == 7
    for name, weight in restored.weights.model.state_dict().items():  # the trained weights, not their average
        assert torch.equal(weight, ckpt["trained_model"][name]), name
    assert restored.average.state_dict()["ema"]["updates"] == 1
    again = restored.state_dict()
    assert again["optimizer"]["state"].keys() == ckpt["optimizer"]["state"].keys()


def test_a_part_with_an_entry_outside_the_format_is_refused(tmp_path):
    class Unknown:
        def state_dict(self):
            return {"surprise": 1}

        def load_state_dict(self, state):
            pass

    cfg = build_config({"data_dir": "data", "vocab_size": 97, "n_layer": 2, "n_head": 4, "n_embd": 32})
    state = training_state(tiny_model(), cfg, Position(0), tmp_path, ema_decay=0.0)
    state.average = Unknown()
    with pytest.raises(AssertionError, match=r"entries without a place in the checkpoint's format: \['surprise'\]"):
        state.state_dict()
