"""Weight-only int8 quantization: the per-row scheme against its formula, logits close to float32's, the same
greedy text as float32 on a small trained model (but where float32's top two logits tie within int8's rounding),
and the commands' --quantize."""

import pytest
import torch
import torch.nn.functional as F

import sample
from gptlite.checkpoint import load_model
from gptlite.generate import generate
from gptlite.quantize import Int8Linear, quantize_rows
from tests.conftest import DEVICE, randint, run_train, tiny_model
from tests.test_end_to_end import TINY, char_data  # noqa: F401 (fixture)

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
    int8, _ = load_model(out, quantize="int8")
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
def test_compiled_int8_generation_equals_eager():
    model = tiny_model().to(DEVICE).quantize("int8")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    torch._dynamo.reset()
    assert generate(model, prompts, 12, temperature=0, compile=True) == generate(model, prompts, 12, temperature=0)


def test_unknown_quantization_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="quantize='int2' is not supported; use 'int8' or 'int4', or leave it out"):
        load_model(tmp_path / "no such run", quantize="int2")
    with pytest.raises(ValueError, match="quantize='fp8' is not supported"):
        tiny_model().quantize("fp8")
