"""What gptlite knows of the machine: the CPU's name and extensions, torch's threads fitted to the cores other
work leaves free, and the one-time note of how long a run will take at the pace of its steps after the first."""

import contextlib
import platform
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from gptlite import device
from gptlite.device import CpuThreads, cpu_extensions, cpu_info, cpu_summary
from gptlite.train import metrics
from gptlite.train.metrics import pace_note
from tests.conftest import ROOT, run_train, shared_file


def test_the_cpu_summary_names_the_model_its_cores_and_the_extensions_its_flags_list():
    name, flags = cpu_info()
    assert name and name in cpu_summary()
    expected = [label for flag, label in device.CPU_EXTENSIONS.items() if flag in flags]
    assert cpu_extensions() == expected
    assert ("/".join(expected) or "no AVX2, AVX-512 or AMX") in cpu_summary()
    assert re.search(r", \d+ cores, ", cpu_summary())


def test_the_extensions_of_an_intel_cpu_with_amx(monkeypatch):
    flags = "fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"
    monkeypatch.setattr(
        device, "cpu_info", lambda: ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", set(flags.split()))
    )
    assert cpu_extensions() == ["AVX2", "AVX-512", "AVX512-BF16", "AMX"]
    assert cpu_summary().endswith("cores, AVX2/AVX-512/AVX512-BF16/AMX")


class FakeClock:
    """The machine's and this process's CPU seconds and the wall clock, advanced by hand: `others` cores of
    other work and `own` of this process's for `seconds`."""

    def __init__(self):
        self.now, self.busy, self.own = 100.0, 1000.0, 10.0

    def advance(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(device.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(device, "cpu_times", lambda: (clock.busy, clock.own))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield clock
    torch.set_num_threads(threads)


def huge_bytes_of(tensor: torch.Tensor) -> int:
    """The bytes /proc/self/smaps counts as anonymous huge pages in the mappings that hold part of `tensor`."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total = 0
    overlaps = False
    for line in open("/proc/self/smaps").read().splitlines():
        first, _, rest = line.partition("-")
        header = rest and all(c in "0123456789abcdef" for c in first) and first
        if header:
            overlaps = int(first, 16) < end and start < int(rest.split()[0], 16)
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def huge_pages_possible() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE), transparent huge pages not switched off."""
    if not sys.platform.startswith("linux"):
        return False
    release = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
    try:
        setting = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return release >= (6, 1) and "[never]" not in setting


def test_an_mps_device_that_is_not_there_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device=mps but MPS .* is not available here; use --device=cpu"):
        device.pick_device("mps")


def test_a_cpu_with_an_index_is_still_taken():
    assert device.pick_device("cpu:0") == "cpu:0"  # torch's spelling, which --device took before


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", "CPU", ""])
def test_a_device_name_gptlite_does_not_run_on_is_a_one_line_error(name):
    with pytest.raises(ValueError, match=f"device={name!r} is not a device gptlite runs on; use auto, cpu, cuda"):
        device.pick_device(name)


def test_huge_pages_back_a_large_tensor_in_place_and_keep_its_contents():
    tensor = torch.randn(5 * device.HUGE_PAGE // 4 + 123)  # 5 MiB and a bit: two or three whole huge pages inside
    before = tensor.clone()
    address = tensor.data_ptr()
    end = address + tensor.numel() * 4
    whole = (end // device.HUGE_PAGE - -(-address // device.HUGE_PAGE)) * device.HUGE_PAGE
    small = torch.randn(1000)
    done = device.huge_pages([tensor, small, tensor[10:]])  # a small tensor, and a view of a tensor already done
    assert tensor.data_ptr() == address and torch.equal(tensor, before)
    if huge_pages_possible():
        assert done >= whole >= 2 * device.HUGE_PAGE  # more where a neighbour less than a huge page away joined
        assert huge_bytes_of(tensor) >= whole
        assert device.huge_pages([tensor]) == whole  # asked again: already done, nothing copied
    else:
        assert done == 0 or done >= whole


def test_tensors_less_than_a_huge_page_apart_are_one_range():
    block = torch.zeros(10 * device.HUGE_PAGE // 4)  # 10 MiB: four tensors in it, two near, one far
    near = [block[:1000], block[2000:3000]]
    address = block.data_ptr()
    ranges = device.storage_ranges([block[:10], *near], device.HUGE_PAGE)
    assert ranges == [(address, address + block.nbytes, [(address, address + block.nbytes)])]  # one storage
    a = torch.zeros(1000)
    b = torch.zeros(1000)
    spans = sorted([(t.data_ptr(), t.data_ptr() + 4000) for t in (a, b)])
    merged = device.storage_ranges([a, b], abs(spans[1][0] - spans[0][0]) + 1)
    assert merged == [(spans[0][0], spans[1][1], spans)]
    apart = device.storage_ranges([a, b], 1)
    assert [r[:2] for r in apart] == spans


def test_torch_computes_on_the_cores_other_work_leaves_free_and_takes_them_back(clock):
    threads = CpuThreads()
    assert threads.active and threads.cores == 2
    clock.advance(5, others=0.05, own=2.0)  # background noise
    assert threads.update() is None and torch.get_num_threads() == 2
    clock.advance(5, others=0.7, own=1.3)  # another process on a core
    note = threads.update()
    assert note.startswith("other processes kept 0.7 of 2 cores busy: torch now computes on 1 thread (was 2")
    assert torch.get_num_threads() == 1
    clock.advance(1, others=0.0)  # too short a window to measure: nothing changes yet
    assert threads.update() is None and torch.get_num_threads() == 1
    clock.advance(5, others=1.0)
    assert threads.update() is None and torch.get_num_threads() == 1
    clock.advance(5, others=0.1)  # the other process ended
    assert "torch now computes on 2 threads (was 1" in threads.update()
    assert torch.get_num_threads() == 2


def test_a_thread_count_the_user_chose_is_kept(clock, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    threads = CpuThreads()
    clock.advance(5, others=1.0)
    assert not threads.active and threads.update() is None and torch.get_num_threads() == 2


def test_the_pace_note_says_how_long_the_steps_left_take_only_when_that_is_long():
    assert pace_note(0.05, 2000, "this cpu (X)", "") is None  # 100 s
    note = pace_note(15.2, 1748, "this cpu (AMD EPYC, 2 cores, AVX2)", ", 6.6 GiB of memory")
    assert note.startswith(
        "15.20 s a step after the first on this cpu (AMD EPYC, 2 cores, AVX2), 6.6 GiB of memory: the 1,748 steps"
    )
    assert "take about 7 h 22 min; --max_minutes=M caps a run" in note


def test_the_pace_leaves_out_the_warm_up_and_a_thread_change_and_is_said_again_when_it_changes_2x():
    """The quick start's case: a first step slow with allocation, steps at another pace until torch's thread count
    follows another process (restart), then the run's own pace; later the other process leaves and the steps take
    a third of the time: a new estimate. A change of less than 2x is no new estimate."""
    from gptlite.train.metrics import PACE_STEPS, PaceEstimate

    estimate = PaceEstimate(warm=1)
    assert estimate.add(1, 30.0) is None  # the warm-up
    assert [estimate.add(step, 0.5) for step in (2, 3)] == [None, None]  # two threads spinning beside a busy core
    estimate.restart()  # the thread count changed after step 3
    paces = [estimate.add(step, 0.06) for step in range(4, 4 + PACE_STEPS)]
    assert paces[:-1] == [None] * (PACE_STEPS - 1) and paces[-1] == pytest.approx(0.06)
    step = 4 + PACE_STEPS
    for seconds in (0.1, 0.04, 0.11):  # within 2x of 0.06 either way (a window's mean): said once is enough
        assert [estimate.add(s, seconds) for s in range(step, step + PACE_STEPS)] == [None] * PACE_STEPS
        step += PACE_STEPS
    assert [estimate.add(s, 0.02) for s in range(step, step + PACE_STEPS)][-1] == pytest.approx(0.02)
    step += PACE_STEPS
    assert [estimate.add(s, 0.045) for s in range(step, step + PACE_STEPS)][-1] == pytest.approx(0.045)
    note = pace_note(0.02, 1000, "this cpu (X)", "", again=True)  # 20 s left: said, as it corrects an earlier note
    assert note.startswith("the pace changed more than 2x: 0.02 s a step after the first on this cpu (X): the 1,000")


@pytest.mark.parametrize(
    "config, said",
    [
        ("shakespeare_char_gpu.toml", "configs/shakespeare_char_cpu.toml is this recipe for a CPU"),
        ("shakespeare_char_gpu_90s.toml", "configs/shakespeare_char_cpu_90s.toml is this recipe for a CPU"),
        ("gpt2_124m.toml", "a smaller model, batch_size, total_batch_size or block_size makes it a CPU's"),
        ("shakespeare_char_cpu.toml", None),
        ("shakespeare_char_cpu_90s.toml", None),
    ],
)
def test_a_gpus_recipe_on_the_cpu_says_so_at_start_up_and_names_the_cpus(config, said):
    """The GPU recipe on a CPU once ran 50-s steps at 6.3 GiB before any word of it: a step of a GPU's size on the
    CPU is said at start-up, with the recipe's CPU sibling where there is one; the CPU recipes say nothing."""
    from gptlite.config import build_config, read_toml
    from gptlite.gpt import GPT
    from gptlite.train.metrics import CPU_STEP_FLOPS, cpu_step_note

    path = Path("configs") / config
    cfg = build_config({**read_toml(ROOT / path), "vocab_size": 65})
    with torch.device("meta"):
        flops = GPT(cfg.model).flops_per_token() * (cfg.total_batch_size or cfg.batch_size * cfg.model.block_size)
    with contextlib.chdir(ROOT):
        note = cpu_step_note(flops, str(path))
    if said is None:
        assert note is None and flops < CPU_STEP_FLOPS
    else:
        assert note.startswith(f"warning: a step here trains {flops:.2g} FLOPs, a GPU's size of step (more than 1e+11)")
        assert note.endswith(f"this run is on the CPU, where each takes many times longer; {said}")


def test_train_says_so_before_its_first_step(tmp_path, monkeypatch):
    """train.py's line, at start-up: here every step counts as a GPU's (CPU_STEP_FLOPS 0), on the GPU recipe made
    tiny."""
    from data.shakespeare.prepare import main as prepare

    assert prepare([f"--input={shared_file('data/tinyshakespeare.txt')}", f"--out_dir={tmp_path / 'data'}"]) == 0
    monkeypatch.setattr(metrics, "CPU_STEP_FLOPS", 0)
    args = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2, max_iters=2, eval_interval=2)
    done = run_train(ROOT / "configs/shakespeare_char_gpu.toml", f"--data_dir={tmp_path / 'data'}",
                     f"--out_dir={tmp_path / 'run'}", "--eval_iters=1", "--device=cpu", **args)  # fmt: skip
    assert done.code == 0, done.err
    lines = done.out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("warning: a step here trains")]
    assert lines[at].endswith(f"{ROOT / 'configs/shakespeare_char_cpu.toml'} is this recipe for a CPU")
    assert at < min(i for i, line in enumerate(lines) if line.startswith("step "))  # before the first step's line


def test_a_long_run_says_its_pace_after_the_first_steps(tmp_path, monkeypatch):
    from data.shakespeare.prepare import main as prepare

    assert prepare([f"--input={shared_file('data/tinyshakespeare.txt')}", f"--out_dir={tmp_path / 'data'}"]) == 0
    monkeypatch.setattr(metrics, "PACE_NOTE_MINUTES", 0)  # every run is "long"
    args = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2, max_iters=8, eval_interval=8)
    done = run_train(f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}", "--eval_iters=1", **args)
    assert done.code == 0, done.err
    notes = [line for line in done.out.splitlines() if " s a step after the first on " in line]
    assert len(notes) == 1 and notes[0].startswith(f"step {1 + metrics.PACE_STEPS:5d} | ")
    assert (
        f"on this cpu ({cpu_summary()}), " in notes[0] and f"the {7 - metrics.PACE_STEPS} steps left take" in notes[0]
    )


def test_the_pace_note_leaves_the_first_step_out(tmp_path, monkeypatch):
    """A first step made 3 s slower, as allocation and warm-up make a first step slow on a CPU: the note gives the
    pace of the steps after it, less than those 3 s spread over them, not the first step's."""
    from data.shakespeare.prepare import main as prepare
    from gptlite.train.objective import Text

    assert prepare([f"--input={shared_file('data/tinyshakespeare.txt')}", f"--out_dir={tmp_path / 'data'}"]) == 0
    monkeypatch.setattr(metrics, "PACE_NOTE_MINUTES", 0)  # every run is "long"
    batches = Text.batches

    def slow_first_step(self, step, minutes):
        if step == 0:
            time.sleep(3.0)
        return batches(self, step, minutes)

    monkeypatch.setattr(Text, "batches", slow_first_step)
    args = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2, max_iters=8, eval_interval=8)
    done = run_train(f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}", "--eval_iters=1", **args)
    assert done.code == 0, done.err
    (note,) = [line for line in done.out.splitlines() if " s a step after the first on " in line]
    assert float(note.split(" | ")[1].split(" s a step")[0]) < 3.0 / metrics.PACE_STEPS, note
