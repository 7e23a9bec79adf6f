"""Weight-only int8 quantization: the per-row scheme against its formula, logits close to float32's, the same
greedy text as float32 on a small trained model (but where float32's top two logits tie within int8's rounding),
and the commands' --quantize."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sample
from gptlite import GPT, GPTConfig
from gptlite.checkpoint import load_model, open_model
from gptlite.cli import ModelOptions
from gptlite.inference.cpu import native
from gptlite.inference.generate import generate
from gptlite.inference.quantize import (
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    quantize_groups,
    quantize_int8_groups,
    quantize_rows,
)
from tests.conftest import DEVICE, ROOT, randint, run_train, tiny_config, tiny_model
from tests.test_train_end_to_end import TINY, char_data  # noqa: F401 (fixture)

pytestmark = pytest.mark.device


def test_rows_are_int8_with_one_scale_each():
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.linspace(0.01, 3, 64)[:, None]  # rows of very different sizes
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and int(q.abs().max()) == 127
    assert torch.equal(q.abs().amax(dim=1), torch.full((64,), 127, dtype=torch.int8))  # each row uses its full range
    assert torch.all((w - scale[:, None] * q).abs() <= scale[:, None] / 2 + 1e-7)  # round to nearest
    zero_q, zero_scale = quantize_rows(torch.zeros(3, 4))
    assert not zero_q.any() and torch.isfinite(zero_scale).all()


def test_int8_linear_is_the_linear_of_its_dequantized_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 64)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(5, 3, 48)
    dequantized = layer.scale[:, None] * layer.weight.float()  # (N, K)
    torch.testing.assert_close(layer(x), F.linear(x, dequantized, linear.bias), rtol=1e-5, atol=1e-6)


def test_vocabulary_tables_are_int8_in_groups_of_32_with_float16_scales():
    """q8_0's rule: one scale per 32 weights, max|W| / 127 rounded to float16, the codes rounded against it; a
    dimension far larger than the rest (as an embedding's few are) coarsens its own group only."""
    torch.manual_seed(0)
    w = torch.randn(40, 96) * 0.02
    w[:, 5] *= 30  # an outlier dimension
    q, scale = quantize_int8_groups(w, 32)
    assert q.dtype == torch.int8 and scale.shape == (40, 3)
    assert torch.equal(scale, scale.half().float())  # float16 numbers, as q8_0 stores them
    codes = q.view(40, 3, 32).float()
    assert torch.equal(codes.abs().amax(dim=2), torch.full((40, 3), 127.0))  # each group uses its full range
    dequantized = scale[:, :, None] * codes  # (N, G, g)
    assert torch.all((w.view(40, 3, 32) - dequantized).abs() <= scale[:, :, None] / 2 + 1e-7)  # round to nearest
    row_q, row_scale = quantize_rows(w)
    row_error = (w - row_scale[:, None] * row_q).abs()[:, 32:].mean()
    group_error = (w - dequantized.view(40, 96)).abs()[:, 32:].mean()
    assert group_error < row_error / 10, (group_error, row_error)  # the groups without the outlier keep their steps
    zero_q, zero_scale = quantize_int8_groups(torch.zeros(3, 32), 32)
    assert not zero_q.any() and not zero_scale.any()


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_an_int8_group_layer_is_the_linear_of_its_dequantized_weight_every_way(rows, monkeypatch):
    """Each way this CPU has (the compiled kernel, at most NATIVE_MAX_ROWS rows, then chunks; the dequantized
    weight in chunks of 8 rows, the last one short, and whole), with a bias; the lookup of a table's rows is its
    dequantized rows."""
    monkeypatch.setattr("gptlite.inference.quantize.CHUNK_WEIGHTS", 8 * 96 + 5)
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 203)
    layer = Int8GroupLinear.from_linear(linear)
    assert layer.scale.shape == (203, 3) and layer.group_size == 32
    dequantized = (layer.weight.float().view(203, 3, 32) * layer.scale[:, :, None]).view(203, 96)
    torch.testing.assert_close(layer.dequantized(), dequantized, rtol=0, atol=0)
    x = torch.randn(rows, 96)
    ways = layer.available_ways(layer.in_features)
    assert ways == ("native", "int8_dot", "chunks", "dequantize")  # CI's machine builds the compiled kernel
    for way in ways:
        # int8_dot multiplies the activations quantized per block of 32: their dequantized copy's product
        inputs = native.dequantized_blocks(x).float() if way == "int8_dot" else x
        want = F.linear(inputs.double(), dequantized.double(), linear.bias.double()).float()
        torch.testing.assert_close(layer.multiply(x, way, layer.bias), want, rtol=1e-4, atol=1e-4)
    idx = torch.tensor([[0, 5], [202, 5]])
    torch.testing.assert_close(layer.rows(idx), dequantized[idx], rtol=0, atol=0)


def test_quantized_model_keeps_logits_close_and_the_head_tied(variant):
    model = tiny_model(**variant).to(DEVICE).eval()
    idx = randint(97, (2, 20)).to(DEVICE)
    with torch.no_grad():
        reference = model(idx)[0]
        quantized = model.quantize("int8")
        logits = quantized(idx)[0]
    assert quantized is model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    if model.config.tie_embeddings:
        assert model.tok_emb.head[0] is model.lm_head  # the embedding reads the head's int8 table
    else:
        assert model.tok_emb.table is not model.lm_head  # an untied embedding has an int8 table of its own
        assert isinstance(model.tok_emb.table, Int8GroupLinear)
    assert isinstance(model.lm_head, Int8GroupLinear)  # the vocabulary's tables: groups of 32
    assert type(model.blocks[0].attn.out_proj) is Int8Linear  # the blocks' matrices: one scale per row
    torch.testing.assert_close(
        model.tok_emb(idx),
        model.lm_head.dequantized()[idx] if model.config.tie_embeddings else model.tok_emb.table.dequantized()[idx],
    )
    assert all(
        p.dim() < 2 or "pos_emb" in n for n, p in model.named_parameters()
    )  # what stays float: vectors, positions
    error = (logits - reference).abs().max() / reference.abs().max()
    assert error < 0.02, error


def test_a_trained_char_model_greedy_text_is_the_same_in_int8_but_at_near_ties(char_data, tmp_path):  # noqa: F811
    """100 greedy tokens of a small trained char model in int8: the float32 text, or the same text up to a step whose
    top two float32 logits lie within int8's rounding of each other (a near-tie any rounding may flip, as one more
    training step or another loss kernel does). Context 128: the text never leaves the first window."""
    out = tmp_path / "run"
    run_train(
        f"--data_dir={char_data}",
        f"--out_dir={out}",
        "--max_iters=150",
        "--eval_interval=150",
        *(f"--{k}={v}" for k, v in TINY.items()),
        "--block_size=128",
    )
    fp32, tokenizer = load_model(out)
    int8, _ = open_model(ModelOptions(model=str(out), device="cpu", quantize="int8"), "sample.py")
    prompt = [tokenizer.encode("ROMEO:")]
    a = generate(fp32.to(DEVICE), prompt, 100, temperature=0)
    b = generate(int8.to(DEVICE), prompt, 100, temperature=0)
    if a != b:
        first = next(
            i for i, (x, y) in enumerate(zip(a[0], b[0], strict=False)) if x != y
        )  # > len(prompt): a new token
        context = torch.tensor([a[0][:first]], device=DEVICE)  # the tokens both decoded so far
        with torch.no_grad():
            want, got = fp32(context)[0][0, -1], int8(context)[0][0, -1]  # (V,) each: the step that parted
        top2 = want.topk(2).values
        error = (got - want).abs().max()
        assert error < 0.02 * want.abs().max(), error  # int8 is close ...
        assert top2[0] - top2[1] <= 2 * error, (tokenizer.decode(a[0]), tokenizer.decode(b[0]), top2, error)  # a tie
    code = sample.main(
        [
            f"--out_dir={out}",
            f"--device={DEVICE}",
            "--quantize=int8",
            "--start=ROMEO:",
            "--num_samples=1",
            "--max_new_tokens=100",
            "--temperature=0",
        ]
    )
    assert code == 0


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
@pytest.mark.parametrize("mode", ["int8", "int4", "int8-native"])
def test_compiled_quantized_generation_equals_eager(mode, monkeypatch):
    """int8-native: every int8 layer on gptlite's compiled kernel, which torch.compile calls as an opaque operator
    (its output's shape registered with torch.library)."""
    if mode != "int8" and DEVICE != "cpu":
        pytest.skip("a CPU kernel")  # the GPU's run of the suite; CI's CPU runs every case
    if mode == "int8-native":
        monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "native")
        mode = "int8"
    model = tiny_model(n_embd=64).to(DEVICE).quantize(mode)  # 64 wide: the int4 kernel takes the blocks' shapes
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    torch._dynamo.reset()
    assert generate(model, prompts, 12, temperature=0, compile=True) == generate(model, prompts, 12, temperature=0)


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_sample_py_compiles_a_quantized_model_whose_layers_are_measured(mode, tmp_path):
    """sample.py --quantize --compile on a model whose feed-forward layers are large enough to measure (1024x256:
    choices.PACK_MIN_WEIGHTS): the ways are read from the choices file (kept beforehand, in a cache of the test's
    own) when the model is prepared, before the compile, never inside the compiled step, where torch.compile cannot
    trace file I/O."""
    from gptlite.checkpoint import save_checkpoint
    from gptlite.config import build_config, config_to_dict
    from gptlite.inference.cpu.choices import PACK_MIN_WEIGHTS, machine_key
    from gptlite.tokenizer import CharTokenizer

    if DEVICE != "cpu":
        pytest.skip("the CPU's kernel choices")
    shape = {"vocab_size": 97, "block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 256, "ffn": "gelu"}
    model = GPT(tiny_config(**shape))
    assert model.blocks[0].ffn.fc.weight.numel() >= PACK_MIN_WEIGHTS
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(build_config(shape)), "model": model.state_dict()})
    CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n\u00e9").save(tmp_path / "tokenizer.json")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("GPTLITE_QUANT_KERNEL", None)
    # the choices the command reads, kept as an earlier measurement would have kept them (the same machine key: the
    # same CPU, torch and thread count, which the suite fixes with OMP_NUM_THREADS)
    layers = [m for m in model.quantize(mode).modules() if isinstance(m, (Int8Linear, Int4Linear))]
    measured = [m for m in layers if m.out_features * m.in_features >= PACK_MIN_WEIGHTS]
    assert measured and all(len(m.ways_in(torch.float32)) > 1 for m in measured)
    # the way kept for one row (float32 activations: PyTorch's, dequantize for int8), and for a batch among the ways
    # that multiply float32 activations too
    kept_way = {"int8": "dequantize", "int4": "float32"}[mode]
    kept = {}
    for m in measured:
        shape = f"{m.kind} {m.out_features}x{m.in_features}"
        ways = m.ways_in(torch.float32)
        batch_ways = [way for way in ways if way != "int8_dot"]
        kept[f"{shape}, 1 rows, float32 activations among {', '.join(ways)}"] = kept_way
        kept[f"{shape}, 8 rows, float32 activations among {', '.join(batch_ways)}"] = kept_way
    choices = tmp_path / "cache" / "gptlite" / "cpu_linear.json"
    choices.parent.mkdir(parents=True)
    choices.write_text(json.dumps({machine_key(): kept}))
    command = [sys.executable, str(ROOT / "sample.py"), f"--model={tmp_path}", f"--quantize={mode}", "--compile"]
    options = ["--start=ROMEO:", "--max_new_tokens=8", "--temperature=0", "--device=cpu"]
    result = subprocess.run([*command, *options], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:")
    assert json.loads(choices.read_text()) == {machine_key(): kept}  # read, not measured again


def test_unknown_quantization_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="quantize='int2' is not supported; use 'int8' or 'int4', or leave it out"):
        open_model(ModelOptions(model=str(tmp_path / "no such run"), quantize="int2"), "sample.py")
    with pytest.raises(ValueError, match="quantize='fp8' is not supported"):
        tiny_model().quantize("fp8")


# ---------------------------------------------------------------------------------------------
# int4 (q4_0's rule) and the kernels each way


def test_int4_groups_follow_q4_0s_rule():
    """d = the group's weight of largest magnitude / -8 (sign kept, rounded to bfloat16), q = round(w / d) + 8 in
    [0, 15]: that weight gets code 0, the others lie within half a step of their weight (but those of the other
    sign past 7.5 steps, clamped to code 15)."""
    torch.manual_seed(0)
    w = torch.randn(16, 96) * torch.linspace(0.01, 2, 16)[:, None]
    q, d = quantize_groups(w, 32)
    assert q.shape == (16, 96) and d.shape == (16, 3) and int(q.min()) >= 0 and int(q.max()) <= 15
    groups = w.view(16, 3, 32)
    largest = groups.gather(2, groups.abs().argmax(2, keepdim=True)).squeeze(2)  # (16, 3), signed
    assert torch.equal(d, (largest / -8).to(torch.bfloat16).float())
    assert torch.equal(q.view(16, 3, 32).gather(2, groups.abs().argmax(2, keepdim=True)), torch.zeros(16, 3, 1).int())
    dequantized = d.repeat_interleave(32, dim=1) * (q - 8)
    steps = d.abs().repeat_interleave(32, dim=1)
    slack = steps * 2**-7  # the scale's rounding to bfloat16
    inside = q < 15  # code 15 is +7 steps: weights past +7.5 steps (at most +8) clamp there, as in q4_0
    assert torch.all(((w - dequantized).abs() <= steps / 2 + slack)[inside])
    assert torch.all(((w - dequantized).abs() <= steps + slack)[~inside])
    zero_q, zero_d = quantize_groups(torch.zeros(16, 32), 32)
    assert torch.equal(zero_q, torch.full((16, 32), 8, dtype=torch.int32)) and not zero_d.any()


@pytest.mark.parametrize("way", ["float32", "bfloat16"])
def test_int4_linear_is_the_linear_of_its_dequantized_weight_each_way(way):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    layer = Int4Linear.from_weight(linear.weight, linear.bias, 32)
    q, d = quantize_groups(linear.weight, 32)
    weight = d.repeat_interleave(32, dim=1) * (q - 8)  # (N, K): the formula, not the layer's own reading
    assert torch.equal(layer.dequantized(), weight)
    x = torch.randn(5, 3, 128)
    want = F.linear(x, weight, linear.bias)
    got = layer.multiply(x.reshape(-1, 128), way).float().view(5, 3, 64) + linear.bias
    tolerance = 1e-5 if way == "float32" else 2e-2  # bfloat16 activations and outputs: 8 bits of mantissa
    assert (got - want).abs().max() <= tolerance * want.abs().max()
    last = x[:, -1]  # (5, 128): each row's last position, a strided view, as a batch's prefill hands the head
    assert not last.is_contiguous()
    got_last = layer.multiply(last, way).float() + linear.bias
    assert (got_last - want[:, -1]).abs().max() <= tolerance * want.abs().max()


@pytest.mark.parametrize("way", ["float32", "bfloat16", "dequantize", "native"])
def test_int8_linear_is_the_linear_of_its_dequantized_weight_each_way(way):
    """Every way, gptlite's compiled kernel (native) included: CI's machine has a compiler, so it is built there."""
    assert way != "native" or native.load()  # loaded here: the test passes run alone, not only after another
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 64)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(7, 48)
    want = F.linear(x, layer.dequantized(), linear.bias)
    got = layer.multiply(x, way, layer.bias).float()  # the bias added by the kernel (native) or after it
    tolerance = 2e-2 if way == "bfloat16" else 1e-5
    assert (got - want).abs().max() <= tolerance * want.abs().max()


def test_each_way_is_measured_once_per_shape_and_kept(monkeypatch, tmp_path):
    """A layer large enough to measure asks the choices file, measures on a miss and keeps the answer, choosing only
    among the ways that compute in the activations' dtype (a faster bfloat16 way never serves float32 activations);
    a small one takes its default; GPTLITE_QUANT_KERNEL forces a way, and an unknown one is refused in one line."""
    import gptlite.inference.cpu.choices as cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GPTLITE_QUANT_KERNEL", raising=False)
    monkeypatch.setattr(cpu, "_choices", {})
    monkeypatch.setattr(cpu, "cpu_times", lambda: None)  # the load unknown: every measurement is kept
    measured = []

    def fake_measure(shape, bucket, names, dtype):
        measured.append((shape, bucket, dtype))
        return {"bfloat16": 0.5, "float32": 1.0, "dequantize": 2.0, "native": 3.0, "int8_dot": 4.0}

    monkeypatch.setattr(Int8Linear, "measure", staticmethod(fake_measure))
    monkeypatch.setattr(Int4Linear, "measure", staticmethod(fake_measure))
    big = Int8Linear(torch.zeros(512, 512, dtype=torch.int8), torch.ones(512), None)
    assert big.way(1) == "float32" and big.way(1) == "float32" and big.way(9) == "float32"
    assert measured == [((512, 512), 1, torch.float32), ((512, 512), 8, torch.float32)]  # once per bucket
    assert big.way(1, torch.bfloat16) == "bfloat16" and len(measured) == 3  # bfloat16 activations: their own choice
    among = ", ".join(big.ways_in(torch.float32))
    assert among == "native, int8_dot, float32, dequantize"  # CI's machine builds the compiled kernel
    kept = json.loads(cpu.choices_file().read_text())[cpu.machine_key()]
    assert kept == {
        f"int8 512x512, 1 rows, float32 activations among {among}": "float32",
        # a batch among the ways that multiply what one row's does (float32 activations, not int8 ones)
        "int8 512x512, 8 rows, float32 activations among native, float32, dequantize": "float32",
        "int8 512x512, 1 rows, bfloat16 activations among bfloat16, dequantize": "bfloat16",
    }
    again = Int8Linear(torch.zeros(512, 512, dtype=torch.int8), torch.ones(512), None)
    assert again.way(1) == "float32" and len(measured) == 3  # the kept choice: no new measurement
    assert Int8Linear(torch.zeros(32, 64, dtype=torch.int8), torch.ones(32), None).way(1) == "dequantize"  # small
    int4 = Int4Linear.from_weight(torch.randn(512, 512), None, 32)  # at float32, PyTorch's kernel or int8_dot
    assert int4.way(1) == "float32" and len(measured) == 4
    assert int4.way(1, torch.bfloat16) == "bfloat16" and len(measured) == 4  # one way: nothing to measure
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "float32")
    assert Int4Linear.from_weight(torch.randn(512, 512), None, 32).way(1) == "float32"
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"GPTLITE_QUANT_KERNEL='fast': choose float32, bfloat16, dequantize, nati"):
        Int4Linear.from_weight(torch.randn(512, 512), None, 32).way(1)
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "bfloat16")  # asked for: bfloat16 activations on a float32 model
    assert Int4Linear.from_weight(torch.randn(512, 512), None, 32).way(1) == "bfloat16"
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "native")  # int8's compiled way: int4 layers keep their own
    assert Int4Linear.from_weight(torch.randn(512, 512), None, 32).way(1) == "float32"
    assert Int8Linear(torch.zeros(512, 512, dtype=torch.int8), torch.ones(512), None).way(1) == "native"
    with pytest.raises(ValueError, match=r"GPTLITE_QUANT_KERNEL=native cannot run a 512x200 int8 layer here \(its inp"):
        Int8Linear(torch.zeros(512, 200, dtype=torch.int8), torch.ones(512), None).way(1)
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "bfloat16")  # PyTorch's int8 kernel crashes on this width
    with pytest.raises(ValueError, match=r"=bfloat16 cannot run a 512x200 int8 layer here \(PyTorch's int8 kernel cr"):
        Int8Linear(torch.zeros(512, 200, dtype=torch.int8), torch.ones(512), None).way(8)
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "int8_dot")  # int8 activations, for int8 and int4 layers alike
    assert Int4Linear.from_weight(torch.randn(512, 512), None, 32).way(1) == "int8_dot"
    assert Int8Linear(torch.zeros(512, 512, dtype=torch.int8), torch.ones(512), None).way(8) == "int8_dot"
    with pytest.raises(ValueError, match=r"=int8_dot cannot run a 512x48 int8 layer here \(its input width 48 is not"):
        Int8Linear(torch.zeros(512, 48, dtype=torch.int8), torch.ones(512), None).way(1)


# made-up measurements (as on the Intel Xeon with AMX): one row's fastest way is bfloat16 activations, then the
# compiled kernel; a batch's is PyTorch's float32 kernel (or the chunks of a grouped table)
MADE_UP_TIMES = {
    1: {"bfloat16": 1.0, "native": 1.2, "float32": 3.0, "dequantize": 3.0, "chunks": 3.0},
    8: {"float32": 1.0, "chunks": 1.0, "dequantize": 1.5, "native": 3.0, "bfloat16": 3.0},
}


# one row's fastest way is int8 activations (int8_dot); a batch's is PyTorch's float32 kernel
INT8_DOT_TIMES = {
    1: {"int8_dot": 0.5, "bfloat16": 1.0, "native": 1.2, "float32": 3.0, "dequantize": 3.0, "chunks": 3.0},
    8: {"float32": 1.0, "chunks": 1.0, "dequantize": 1.5, "native": 3.0, "bfloat16": 3.0, "int8_dot": 4.0},
}


def made_up_measurements(monkeypatch, tmp_path, times: dict[int, dict[str, float]] = MADE_UP_TIMES) -> None:
    """Every quantized layer measured (none too small), each measurement `times` for its row bucket, kept in a
    choices file of the test's own: which ways the layers take is the same on every CPU."""
    import gptlite.inference.cpu.choices as cpu
    import gptlite.inference.quantize

    def fake_measure(shape, bucket, *names_and_dtype):
        return times[bucket]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GPTLITE_QUANT_KERNEL", raising=False)
    monkeypatch.setattr(cpu, "_choices", {})
    # nor what an earlier test's made-up measurement left for this process where the machine was busy
    monkeypatch.setattr(cpu, "_unkept", {})
    monkeypatch.setattr(gptlite.inference.quantize, "PACK_MIN_WEIGHTS", 0)
    for cls in (Int8Linear, Int4Linear):
        monkeypatch.setattr(cls, "measure", staticmethod(fake_measure))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_greedy_tokens_are_the_same_alone_in_a_batch_and_without_the_compiled_kernels(mode, monkeypatch, tmp_path):
    """The measured ways decide the speed, never the numbers: where one row measured fastest with bfloat16
    activations and a batch with float32 ones, a prompt's greedy tokens alone equal its tokens in a ragged batch of
    several, and equal them again where gptlite's compiled kernels are not loaded (GPTLITE_NATIVE=0)."""
    import gptlite.inference.cpu.native

    if DEVICE != "cpu":
        pytest.skip("the CPU's kernel choices")
    made_up_measurements(monkeypatch, tmp_path)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]

    def quantized() -> GPT:
        return tiny_model(n_embd=64).quantize(mode)  # 64 wide: int4 takes the blocks' matrices

    model = quantized()
    alone = [generate(model, [prompt], 20, temperature=0)[0] for prompt in prompts]
    assert generate(model, prompts, 20, temperature=0) == alone
    ways = {layer.way(1) for layer in model.modules() if isinstance(layer, (Int8Linear, Int4Linear))}
    assert "bfloat16" not in ways  # measured fastest, but not the model's activation dtype
    tokens = torch.tensor([[1], [4], [10], [11]])
    with torch.no_grad():  # one token's logits alone (one row) and in a batch (4 rows): float32 rounding apart
        one = model(tokens[:1])[0][0]
        batch = model(tokens)[0][0]
    torch.testing.assert_close(one, batch, rtol=1e-4, atol=1e-4 * batch.abs().max().item())
    monkeypatch.setattr(gptlite.inference.cpu.native, "load", lambda: False)  # as with GPTLITE_NATIVE=0
    model = quantized()
    assert [generate(model, [prompt], 20, temperature=0)[0] for prompt in prompts] == alone
    assert generate(model, prompts, 20, temperature=0) == alone


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_row_multiplies_int8_activations_alone_and_batched_where_one_row_chose_them(mode, monkeypatch, tmp_path):
    """One activation kind per layer, whatever the row count: where one row measured fastest with its activations
    quantized to int8 (int8_dot) and a batch with float32 ones, the batch takes int8_dot too (only how fast it
    multiplies is measured for it), so that a prompt's greedy tokens alone equal its tokens in a ragged batch, and
    a token's logits alone equal its logits in a batch bit for bit (a row's int8 blocks do not depend on the others)."""
    if DEVICE != "cpu":
        pytest.skip("the CPU's kernel choices")
    made_up_measurements(monkeypatch, tmp_path, INT8_DOT_TIMES)
    model = tiny_model(n_embd=64).quantize(mode)  # 64 wide: whole blocks of 32, and int4 takes the blocks' matrices
    layers = [layer for layer in model.modules() if isinstance(layer, (Int8Linear, Int4Linear))]
    assert {layer.way(1) for layer in layers} == {layer.way(8) for layer in layers} == {"int8_dot"}
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]
    alone = [generate(model, [prompt], 20, temperature=0)[0] for prompt in prompts]
    assert generate(model, prompts, 20, temperature=0) == alone
    tokens = torch.tensor([[1], [4], [10], [11]])
    with torch.no_grad():
        assert torch.equal(model(tokens[:1])[0][0], model(tokens)[0][0])


@pytest.mark.parametrize("rows", [1, 3, 20])
@pytest.mark.parametrize("kind", ["int8", "int8 grouped", "int4 in groups of 32", "int4 in groups of 64"])
def test_int8_dot_is_the_linear_of_the_quantized_activations_and_the_dequantized_weight(kind, rows):
    """int8_dot quantizes each row's activations per block of 32 (native.quantized_blocks' rule) and multiplies
    them by the layer's weight exactly as dequantized, at one row, a few and more than the float32 kernel's tile (a
    prompt), an output width no thread split divides; each row's result alone is its result in the batch, bit for
    bit."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(128, 80 if kind.startswith("int4") else 203)
    if kind == "int8":
        layer = Int8Linear.from_linear(linear)
    elif kind == "int8 grouped":
        layer = Int8GroupLinear.from_linear(linear)
    else:
        layer = Int4Linear.from_weight(linear.weight, linear.bias, int(kind.split()[-1]))
    assert "int8_dot" in layer.available_ways(128)  # CI's machine builds the compiled kernels
    x = torch.randn(rows, 128) * 2
    want = F.linear(native.dequantized_blocks(x), layer.dequantized().double(), linear.bias.double())
    got = layer.multiply(x, "int8_dot", layer.bias)
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4 * want.abs().max().item())
    alone = torch.cat([layer.multiply(x[i : i + 1], "int8_dot", layer.bias) for i in range(rows)])
    assert torch.equal(alone, got)


def test_an_int4_layer_multiplies_pytorchs_kernel_from_its_own_codes():
    """The int4 codes are kept once, in the compiled kernel's layout; PyTorch's packed layout is made from them for
    its ways, and both read the same weight."""
    torch.manual_seed(0)
    layer = Int4Linear.from_weight(torch.randn(64, 128), None, 32)
    assert {name for name, _ in layer.named_buffers()} == {"nibbles", "scale"}
    x = torch.randn(3, 128)
    identity = torch.eye(128)
    assert torch.equal(layer.multiply(identity, "float32").t(), layer.dequantized())
    want = F.linear(x.double(), layer.dequantized().double())
    torch.testing.assert_close(layer.multiply(x, "float32").double(), want, rtol=1e-5, atol=1e-5)


def test_the_real_measurement_times_every_way():
    times = Int8Linear.measure((64, 64), 1)
    assert set(times) == {"native", "int8_dot", "bfloat16", "float32", "dequantize"}
    assert all(0 < t < 1 for t in times.values())
    assert set(Int8Linear.measure((64, 40), 8)) == {"dequantize"}  # 40 wide: neither native's nor PyTorch's int8


@pytest.mark.parametrize("way", ["float32", "bfloat16"])
def test_an_int4_model_keeps_logits_close_and_decodes_on_its_kv_cache_as_a_full_recompute(way, monkeypatch):
    """int4 where the kernel takes the shape (the tiny model's blocks), int8 elsewhere (its 97-row head, its
    embedding); the KV cache's greedy tokens equal a full recompute's on the same quantized model."""
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", way)
    model = tiny_model(n_embd=64).cpu().eval()  # int4's kernel is a CPU one
    idx = randint(97, (2, 20)).cpu()
    with torch.no_grad():
        reference = model(idx)[0]
        model.quantize("int4")
        logits = model(idx)[0]
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"Int4Linear", "Int8GroupLinear", "Int8Embedding"} <= kinds and "Linear" not in kinds
    assert isinstance(model.lm_head, Int8GroupLinear)  # 97 rows: not a multiple of 16, int8 in groups of 32
    error = (logits - reference).abs().max() / reference.abs().max()
    assert error < 0.15, error
    prompt = [[1, 2, 3, 4, 5]]
    ids = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(ids)[0][:, -1:].argmax(-1)], dim=1)
    assert generate(model, prompt, 12, temperature=0) == ids.tolist()


def test_int4_says_in_one_line_which_layers_stayed_int8_and_why():
    """int4's kernel takes output widths that are multiples of 16 and input widths that are multiples of the group:
    the layers it cannot take stay int8, and a warning line says which and why; the model's own record of what was
    done (`quantized_as`, `layer_types`, which evaluate's JSON writes) counts them."""
    from gptlite.inference.quantize import layer_types, quantized_as

    with pytest.warns(UserWarning) as caught:
        narrow = tiny_model(n_embd=40).cpu().quantize("int4")  # 40 inputs: no layer is a multiple of 32 wide
    said = [str(w.message) for w in caught if "int4 needs" in str(w.message)]
    assert len(said) == 1
    assert said[0].startswith(
        "gptlite: int4 needs output widths that are multiples of 16 and input widths that are multiples of its group "
        "size 32; 9 of 9 layers are int8 (blocks.*.attn.qkv 120x40, blocks.*.attn.out_proj 40x40, "
    )
    assert said[0].endswith(", lm_head 97x40)")
    assert layer_types(narrow) == {"int8": 9} and quantized_as(narrow) == "int8"
    with pytest.warns(UserWarning, match=r"; 1 of 9 layers are int8 \(lm_head 97x64\)$"):
        mixed = tiny_model(n_embd=64).cpu().quantize("int4")  # the blocks take int4; the 97-row head cannot
    assert layer_types(mixed) == {"int4": 8, "int8": 1} and quantized_as(mixed) == "int4+int8"
    int8 = tiny_model(n_embd=40).cpu().quantize("int8")
    assert layer_types(int8) == {"int8": 9} and quantized_as(int8) == "int8" and quantized_as(tiny_model()) == ""


def test_quantizing_a_model_that_fits_in_the_cpus_cache_says_it_decodes_slower(monkeypatch):
    """No timing: a model whose float32 matrices fit in the CPU's last-level cache has no memory traffic for
    quantization to save, and quantizing it says so in one line; a model larger than the cache is quantized
    silently."""
    import warnings

    import gptlite.inference.quantize

    cache = gptlite.inference.quantize.last_level_cache_bytes()  # this CPU's own
    assert cache is None or cache >= 1 << 20  # Linux lists at least a MiB for any CPU this runs on
    model = tiny_model().cpu()
    matrices = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(gptlite.inference.quantize, "last_level_cache_bytes", lambda: 32 << 20)
    with pytest.warns(UserWarning, match=r"^gptlite: int8 decodes this model slower than float32 on this CPU: its fl"):
        model.quantize("int8")
    monkeypatch.setattr(gptlite.inference.quantize, "last_level_cache_bytes", lambda: matrices - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        tiny_model().cpu().quantize("int8")


def test_int4_needs_the_cpu_and_a_group_size_it_takes():
    with pytest.raises(
        ValueError, match=r"quantize='int4' with group_size=48: use one of 32, 64, 128 \(32 is q4_0's\)"
    ):
        tiny_model().quantize("int4", group_size=48)
    with torch.device("meta"):  # a device other than the CPU, on any machine
        model = GPT(tiny_config())
    with pytest.raises(ValueError, match="quantize='int4' runs on the CPU"):
        model.quantize("int4")


def gpt2_tokenizer():
    from gptlite.tokenizer import tokenizer_from_spec
    from tests.conftest import shared_file

    return tokenizer_from_spec(str(shared_file("tokenizers/gpt2.tiktoken")))


def exported(mode: str, kind: str, tmp_path) -> tuple[GPT, dict, dict]:
    """A one-block model of GPT-2's switches (vocabulary 50,304, 64 wide) quantized as `mode` and exported as a
    GGUF file of `kind`: (the model, the file's tensors by name as the gguf package reads them back, the model's
    dequantized float state dict)."""
    import gguf

    from gptlite.hf.gguf import export_gguf
    from gptlite.inference.quantize import dequantized_state_dict

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50304, block_size=32, n_layer=1, n_head=2, n_embd=64, ffn="gelu", bias=True)
    model = GPT(config).eval()
    model.quantize(mode)
    out = export_gguf(model, tmp_path / "m.gguf", gpt2_tokenizer(), kind)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    return model, tensors, dequantized_state_dict(model)


def test_an_int4_model_exports_to_q4_0_bit_for_bit(tmp_path):
    """A group-32 int4 model's GGUF file holds its q4_0 blocks: llama.cpp's file read back by the gguf package's own
    reader and dequantizer gives exactly the weights the model multiplies by."""
    import gguf
    import numpy as np

    from gptlite.hf.gguf import export_gguf

    model, tensors, state = exported("int4", "q4_0", tmp_path)
    pairs = {"blk.0.attn_output.weight": "blocks.0.attn.out_proj.weight", "output.weight": "lm_head.weight"}
    pairs["blk.0.ffn_down.weight"] = "blocks.0.ffn.out_proj.weight"
    for theirs, ours in pairs.items():
        tensor = tensors.get(theirs) or tensors["token_embd.weight"]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0, theirs
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(state[ours].shape)
        assert np.array_equal(values, state[ours].numpy()), theirs
    with pytest.raises(ValueError, match="a model quantized as q4_0 exports only as q4_0, not --type=q8_0"):
        export_gguf(model, tmp_path / "other.gguf", gpt2_tokenizer(), "q8_0")


def test_an_int8_model_exports_its_vocabulary_table_to_q8_0_bit_for_bit(tmp_path):
    """The tied embedding / head in groups of 32 with float16 scales is q8_0's own blocks: the file's token_embd,
    read back by the gguf package's reader and dequantizer, is exactly the table the model multiplies by; the blocks'
    matrices (one scale per row) are rounded again into q8_0's blocks, within one of their steps and the 6% that
    q8_0's float16 scale may add."""
    import gguf
    import numpy as np

    model, tensors, state = exported("int8", "q8_0", tmp_path)

    def read(name: str, shape) -> np.ndarray:
        tensor = tensors[name]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0, name
        return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)

    table = state["lm_head.weight"].numpy()
    assert np.array_equal(read("token_embd.weight", table.shape), table)
    matrix = model.blocks[0].attn.out_proj
    error = np.abs(read("blk.0.attn_output.weight", (64, 64)) - matrix.dequantized().numpy())
    assert np.all(error <= matrix.scale.numpy()[:, None] * 0.6)


def test_evaluate_scores_a_quantized_model(char_data, tmp_path):  # noqa: F811
    from gptlite.evaluate.command import main as evaluate

    out = tmp_path / "run"
    run_train(f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=20", *(f"--{k}={v}" for k, v in TINY.items()))
    losses = {}
    for mode in ("", "int8", "int4"):
        report = tmp_path / f"{mode or 'float'}.json"
        args = [f"--model={out}", "--device=cpu", f"--json={report}", *([f"--quantize={mode}"] if mode else [])]
        assert evaluate(args) == 0
        results = json.loads(report.read_text())
        assert results["quantize"] == {"int4": "int4+int8"}.get(mode, mode)  # what was done: the head stayed int8
        assert results["quantized_layers"] == {"": {}, "int8": {"int8": 9}, "int4": {"int4": 8, "int8": 1}}[mode]
        losses[mode] = results["val"]["loss"]
    assert losses["int8"] != losses[""] and abs(losses["int8"] - losses[""]) < 0.05 * losses[""]
    assert losses["int4"] != losses[""] and abs(losses["int4"] - losses[""]) < 0.2 * losses[""]
