"""gptlite's compiled CPU kernels (gptlite.inference.cpu.native): the operators against PyTorch's results, each
instruction set's build, and every way the library can fail to be there, which must leave decoding on PyTorch's
kernels."""

import contextlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptlite.inference.cpu import native
from tests.conftest import ROOT
from tests.hf.test_families import FAMILIES as HF_FAMILIES


@pytest.fixture(scope="module")
def ops():
    """The operators, built for this CPU: CI's machine has a C++ compiler, so load() must succeed there."""
    assert native.load(), native._state.get("why")
    return torch.ops.gptlite


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("N, K", [(1, 16), (5, 48), (203, 192), (64, 768)])
def test_the_kernels_are_the_naive_sum(ops, rows, N, K):
    """One row (four accumulators, or four weight rows side by side) and tiles of up to eight rows with a
    remainder; output widths of one row, fewer rows than threads and a count no thread split divides; with and
    without a bias; int8 with one scale per row and one per group of 16 or 32 inputs, or one group the row long. Each
    within float32's error bound for its sum's length and magnitude (native.linear_error_bound), which holds for any
    order of additions, whichever instruction set the kernels were built for."""
    generator = torch.Generator().manual_seed(rows * 1000 + N)
    x = torch.randn(rows, K, generator=generator)
    weight = torch.randn(N, K, generator=generator)
    codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    scales = [torch.rand(N, generator=generator)]  # (N,)
    scales += [torch.rand(N, K // group, generator=generator) for group in (16, 32, K) if K % group == 0]  # (N, G)
    for bias in (None, torch.randn(N, generator=generator)):
        native.assert_linear_close(ops.float_linear(x, weight, bias), x, weight, None, bias, "float_linear")
        for scale in scales:
            got = ops.int8_linear(x, codes, scale, bias)
            native.assert_linear_close(got, x, codes, scale, bias, f"int8_linear, scales {tuple(scale.shape)}")


def test_the_kernels_split_the_rows_between_any_number_of_threads(ops):
    threads = torch.get_num_threads()
    x = torch.randn(3, 64)
    weight = torch.randn(1001, 64)
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            native.assert_linear_close(ops.float_linear(x, weight, None), x, weight, what=f"{count} threads")
    finally:
        torch.set_num_threads(threads)


def test_the_kernels_take_any_leading_shape_and_strided_rows(ops):
    """x (..., K) gives (..., N), as F.linear does, whatever x's strides: a decode step's (B, 1, K) rows go in as
    they are."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 32, generator=generator)
    codes = torch.randint(-127, 128, (24, 32), dtype=torch.int8, generator=generator)
    scale = torch.rand(24, generator=generator)
    for x in (torch.randn(2, 3, 32, generator=generator), torch.randn(32, 5, generator=generator).T):
        native.assert_linear_close(ops.float_linear(x, weight, None), x, weight, what=f"float32, x {tuple(x.shape)}")
        native.assert_linear_close(ops.int8_linear(x, codes, scale, None), x, codes, scale, what="int8")


def test_operands_the_kernels_do_not_take_are_refused_by_name(ops):
    x = torch.randn(2, 40)
    with pytest.raises(RuntimeError, match="K = 40 is not a multiple of 16"):
        ops.float_linear(x, torch.randn(8, 40), None)
    with pytest.raises(RuntimeError, match="x has 32 columns, weight 48"):
        ops.float_linear(torch.randn(2, 32), torch.randn(8, 48), None)
    with pytest.raises(RuntimeError, match=r"x must be a \(\.\.\., K\) float32"):
        ops.float_linear(torch.randn(2, 32, dtype=torch.float64), torch.randn(8, 32), None)
    with pytest.raises(RuntimeError, match="weight must be int8"):
        ops.int8_linear(torch.randn(2, 32), torch.randn(8, 32), torch.ones(8), None)
    with pytest.raises(RuntimeError, match="scale must be a contiguous"):
        ops.int8_linear(torch.randn(2, 32), torch.zeros(8, 32, dtype=torch.int8), torch.ones(7), None)
    with pytest.raises(RuntimeError, match="each a multiple of 16 wide, not G = 4 for K = 32"):
        ops.int8_linear(torch.randn(2, 32), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 4), None)
    with pytest.raises(RuntimeError, match="not G = 3 for K = 32"):
        ops.int8_linear(torch.randn(2, 32), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 3), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous"):
        ops.float_linear(torch.randn(2, 32), torch.randn(8, 32), torch.ones(7))
    assert native.fits(768) and not native.fits(40)
    assert native.why_not(40) == "its input width 40 is not a multiple of 16" and native.why_not(768) == ""


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 17])
@pytest.mark.parametrize("N, K", [(1, 32), (37, 96), (203, 192)])
def test_the_integer_kernels_are_the_exact_sums_of_the_quantized_rows(ops, rows, N, K):
    """int8_dot_linear and int4_dot_linear against the exact product of the activations quantized per block of 32
    (`native.quantized_blocks`, as torch rounds them) and the codes, each block's integer sum exact and the blocks
    combined within float32's error (native.assert_int_linear_close): one row (four weight rows side by side, and
    the rows left over), tiles of up to eight rows with a remainder, more rows than a tile (a prompt), one block, an
    odd number of blocks, output widths no split divides; int8 with a scale per row and per block, int4 in groups of
    one block and of the whole row; with and without a bias. Each row's result alone is its result in the batch."""
    generator = torch.Generator().manual_seed(rows * 1000 + N)
    x = torch.randn(rows, K, generator=generator) * 4
    codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    int4 = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=generator)
    nibbles = native.pack_nibbles(int4)
    assert torch.equal(native.unpack_nibbles(nibbles), int4)
    for bias in (None, torch.randn(N, generator=generator)):
        for scale in (torch.rand(N, generator=generator), torch.rand(N, K // 32, generator=generator)):
            got = native.int8_dot_linear(x, codes, scale, bias)
            native.assert_int_linear_close(got, x, codes, scale, bias, f"int8_dot_linear, scales {tuple(scale.shape)}")
            alone = torch.cat([native.int8_dot_linear(x[i : i + 1], codes, scale, bias) for i in range(rows)])
            assert torch.equal(alone, got)
        for scale in (torch.rand(N, K // 32, generator=generator), torch.rand(N, 1, generator=generator)):
            got = native.int4_dot_linear(x, nibbles, scale, bias)
            weight = int4.to(torch.int8) - 8
            native.assert_int_linear_close(got, x, weight, scale, bias, f"int4_dot_linear, scales {tuple(scale.shape)}")
            alone = torch.cat([native.int4_dot_linear(x[i : i + 1], nibbles, scale, bias) for i in range(rows)])
            assert torch.equal(alone, got)


def test_the_integer_kernels_quantize_the_activations_as_torch_does(ops):
    """Activations that are whole multiples of their block's scale (codes times d, the largest 127 d) are quantized
    to exactly those codes, zeros and a block of zeros included: the product is then the codes' exact integer sum
    times the scales, equal to float64's up to one rounding of each block's term."""
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (3, 64), generator=generator).float()
    codes[:, ::32] = 127  # each block's largest: its scale d exactly
    codes[1, 32:] = 0  # a block of zeros: scale 0, codes 0
    d = torch.tensor([[0.5, 0.25], [2.0, 1.0], [0.125, 4.0]])
    x = (codes.view(3, 2, 32) * d[:, :, None]).view(3, 64)
    got_codes, got_d = native.quantized_blocks(x)
    assert torch.equal(got_codes, torch.where(d.repeat_interleave(32, dim=1) == 0, 0, codes))
    weight = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=generator)
    want = x.double() @ weight.double().t()  # (3, 5), exact integers times powers of two
    got = native.int8_dot_linear(x, weight, torch.ones(5), None)
    torch.testing.assert_close(got.double(), want, rtol=2**-22, atol=0)


def test_the_integer_kernels_refuse_what_they_cannot_take_by_name(ops):
    with pytest.raises(RuntimeError, match="int8_dot_linear: K = 48 is not a multiple of 32"):
        ops.int8_dot_linear(torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8), None)
    with pytest.raises(RuntimeError, match="int8_dot_linear: weight must be int8"):
        ops.int8_dot_linear(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8), None)
    with pytest.raises(RuntimeError, match=r"a scale \(N, G\) must cut a row's 64 inputs into G groups of a multip"):
        ops.int8_dot_linear(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 4), None)
    with pytest.raises(RuntimeError, match=r"int4_dot_linear: weight must be a contiguous \(N, K / 2\) uint8"):
        ops.int4_dot_linear(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), None)
    with pytest.raises(RuntimeError, match=r"int4_dot_linear: scale must be \(N, G\), one per group"):
        ops.int4_dot_linear(torch.randn(2, 64), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8), None)
    with pytest.raises(RuntimeError, match=r"int4_dot_linear: x must be a \(\.\.\., K\) float32"):
        ops.int4_dot_linear(torch.randn(2, 64).double(), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2), None)


def test_the_library_reports_its_own_limits(ops, monkeypatch):
    """The widths and row counts come from the loaded library's `constants` operator, not a copy of matvec.cpp's
    numbers; UNLOADED_LIMITS, what answers where no library is loaded, agrees with the library built from this
    source."""
    reported = ops.constants()
    assert reported == {"multiple": 16, "tile": 8, "block": 32}
    assert native.limits() == native.library_limits() == native.Limits(**reported) == native.UNLOADED_LIMITS
    assert native.multiple() == 16 and native.max_rows() == 8
    monkeypatch.setattr(
        native, "_state", {"loaded": True, "why": "", "limits": native.Limits(multiple=32, tile=4, block=64)}
    )
    assert native.max_rows() == 4 and not native.fits(48) and native.fits(64)
    assert native.block() == 64
    assert native.why_not(48) == "its input width 48 is not a multiple of 32"
    monkeypatch.setattr(native, "_state", {})  # nothing loaded yet: the fallback answers
    assert native.limits() == native.UNLOADED_LIMITS


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's instruction sets")
@pytest.mark.parametrize("arch", [["-march=x86-64-v3"], ["-march=x86-64"]], ids=["avx2", "sse2"])
def test_each_x86_instruction_set_builds_and_passes_the_check(arch, tmp_path):
    """The AVX2 path (an AMD Zen 3) and the generic one (GCC's vectors on SSE2) build and compute the same results
    as PyTorch on any x86 CPU, whichever kind runs the tests: the check runs in a child process."""
    cxx = native.compiler()
    assert cxx, "CI's machine has a C++ compiler"
    path = tmp_path / "matvec.so"
    assert native.build(cxx, path, arch) == ""
    assert native.check_in_child(path) == ""


@pytest.mark.slow
def test_a_compiler_without_openmp_builds_kernels_that_give_the_same_results(ops, monkeypatch, tmp_path, capsys):
    """A compiler that rejects -fopenmp (Apple's clang does; here a wrapper around this machine's, named by CXX): the
    build says so in one line and goes on without OpenMP, and the library passes the check and gives exactly the
    results of the library built with it (the one loaded here) on one thread, the one it runs on: the same sums in
    the same order."""
    wrapper = tmp_path / "no-openmp-c++"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for arg in "$@"; do\n'
        '  if [ "$arg" = -fopenmp ]; then echo "clang: error: unsupported option \'-fopenmp\'" >&2; exit 1; fi\n'
        "done\n"
        f'exec {shlex.quote(native.compiler())} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    cxx = native.compiler()
    path = native.library_path(cxx)
    assert native.ready(cxx, path) == ""  # built, and checked against PyTorch in a child process
    said = [line for line in capsys.readouterr().err.splitlines() if "OpenMP" in line]
    assert said == [
        f"gptlite: {cxx} takes no -fopenmp: the CPU decode kernels are built without OpenMP and run on one thread"
    ]
    outputs = tmp_path / "outputs.pt"
    script = "import sys; from tests.inference.cpu import test_native; test_native.save_kernel_outputs(*sys.argv[1:])"
    subprocess.run([sys.executable, "-c", script, str(path), str(outputs)], cwd=ROOT, check=True)
    theirs = torch.load(outputs, weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a thread's share of a weight decides the order of its sums
    try:
        ours = kernel_outputs()
    finally:
        torch.set_num_threads(threads)
    assert theirs.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name


def kernel_outputs() -> dict[str, torch.Tensor]:
    """Each operator's results on seeded operands, by name: the linear kernels at one row and at a batch, float32 and
    int8, and a rotary block's step of rows at one slot and at their own, with the keys and values it wrote."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(203, 192, generator=generator)
    codes = torch.randint(-127, 128, (203, 192), dtype=torch.int8, generator=generator)
    scale = torch.rand(203, generator=generator)
    outputs = {}
    for rows in (1, 3, 9):
        x = torch.randn(rows, 192, generator=generator)
        outputs[f"float_linear, {rows} rows"] = native.float_linear(x, weight)
        outputs[f"int8_linear, {rows} rows"] = native.int8_linear(x, codes, scale)
    x, weights, cache = native.block_operands(generator, 3, 6, 2, 16, 48, "rmsnorm", "silu_gate", False)
    angles, head_norms = native.rotary_operands(generator, 3, 16, 16)
    weights = weights._replace(head_norms=head_norms)
    options = native.BlockOptions("rmsnorm", 1e-5, "silu_gate", 6, 0.25, 1.0)
    own = cache._replace(slot=35, span=36, visible=None, slots=torch.tensor([35, 2, 17]))
    for name, slots in (("one slot", cache), ("own slots", own)):
        outputs[f"block_step, {name}"] = native.block_step(x, weights, slots, options, angles)
        outputs[f"block_step's keys, {name}"] = slots.keys.clone()
        outputs[f"block_step's values, {name}"] = slots.values.clone()
    return outputs


def save_kernel_outputs(library: str, path: str) -> None:
    """`kernel_outputs` of the library at `library`, loaded into this (child) process, saved to `path`."""
    torch.ops.load_library(library)
    native.register_shapes()
    torch.save(kernel_outputs(), path)


def test_a_library_that_crashes_is_refused_and_the_caller_goes_on(tmp_path):
    """A library that dies as it loads (here by an illegal instruction: what one built for another CPU does) takes
    down the child process that checks it, never the caller."""
    source = tmp_path / "crash.c"
    source.write_text("__attribute__((constructor)) static void crash(void) { __builtin_trap(); }\n")
    library = tmp_path / "crash.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    why = native.check_in_child(library)
    assert why.startswith(f"checking {library} failed (") and why.count("\n") == 0


def test_a_cxx_with_flags_is_refused_naming_it_and_the_fix(monkeypatch):
    monkeypatch.setenv("CXX", "c++ -O0")
    assert native.load_or_say_why() == (
        "CXX='c++ -O0' is not one program: gptlite runs $CXX alone, without flags; set CXX to the compiler's path"
    )


def test_without_a_compiler_or_when_disabled_the_reason_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert (
        native.load_or_say_why()
        == f"no C++ compiler: {tmp_path / 'no-such-compiler'} was not found; install one (g++) or set CXX"
    )
    monkeypatch.setenv("GPTLITE_NATIVE", "0")
    assert native.load_or_say_why() == "GPTLITE_NATIVE=0"
    monkeypatch.setattr(native, "_state", {})  # a fresh process: the reason is said once, as a warning
    with pytest.warns(
        UserWarning, match=r"^gptlite: the compiled CPU kernels are not used \(GPTLITE_NATIVE=0\); decod"
    ):
        assert native.load() is False
    assert native.load() is False  # said once


def test_a_failed_build_names_the_compilers_first_error(monkeypatch, tmp_path):
    broken = tmp_path / "matvec.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    why = native.build(native.compiler(), tmp_path / "out" / "matvec.so")
    assert why.startswith(f"{native.compiler()} failed on matvec.cpp: ") and "error" in why
    assert not (tmp_path / "out" / "matvec.so").exists()  # nothing half-written is left to load


def test_the_library_is_named_by_its_source_compiler_torch_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTLITE_NATIVE_CACHE", str(tmp_path))
    here = native.library_path("c++")
    assert here.parent == tmp_path and here == native.library_path("c++")
    assert native.library_path("clang++") != here
    monkeypatch.setattr(native, "cpu_features", lambda: "flags : sse2")  # a cache shared with another CPU
    assert native.library_path("c++") != here


def test_decoding_with_the_compiled_kernels_equals_the_models_own_layers(ops, monkeypatch):
    """Forced onto the compiled kernels, float32 decoding (cpu_decode) and int8 (quantize) give the logits of the
    model's own layers and of the dequantized weights."""
    import gptlite.inference.cpu.decode
    from gptlite import GPT, GPTConfig
    from gptlite.inference.cpu.decode import packed_for_cpu
    from gptlite.inference.cpu.linears import NativeLinear

    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "native")
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=True)).eval()
    idx = torch.randint(0, 96, (3, 10))
    with torch.no_grad():
        for rows in (1, 3):
            view = packed_for_cpu(model, rows)
            assert isinstance(view.lm_head, NativeLinear) and isinstance(view.blocks[0].block.ffn.fc, NativeLinear)
            torch.testing.assert_close(view(idx[:rows])[0], model(idx[:rows])[0], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "native")
    with torch.no_grad():
        model.quantize("int8")
        x = torch.randn(4, 32)
        for layer in (model.lm_head, model.blocks[1].attn.qkv):
            want = F.linear(x, layer.dequantized(), layer.bias)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
            assert layer.way(4) == "native"


def test_a_prompt_of_many_rows_takes_pytorchs_gemm_not_the_compiled_kernel(ops):
    """The compiled kernels read each weight again for every 8 rows: float32 layers of more than native.max_rows()
    rows run F.linear, int8 ones the dequantized way (each bit for bit), fewer rows the compiled kernel."""
    from gptlite.inference.cpu.linears import NativeLinear
    from gptlite.inference.quantize import NATIVE_MAX_ROWS as INT8_MAX_ROWS
    from gptlite.inference.quantize import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    layer = NativeLinear(linear)
    many = torch.randn(1, native.max_rows() + 1, 64)
    assert torch.equal(layer(many), F.linear(many, linear.weight, linear.bias))
    few = many[:, : native.max_rows()]
    assert torch.equal(layer(few), ops.float_linear(few, linear.weight, linear.bias))
    int8 = Int8Linear.from_linear(linear)
    many = torch.randn(INT8_MAX_ROWS + 1, 64)
    assert torch.equal(int8.multiply(many, "native", linear.bias), int8.multiply(many, "dequantize", linear.bias))
    few = many[:INT8_MAX_ROWS]
    want = ops.int8_linear(few, int8.weight, int8.scale, linear.bias)
    assert torch.equal(int8.multiply(few, "native", linear.bias), want)


@pytest.mark.parametrize("H, KV, D", [(4, 4, 64), (6, 2, 20), (2, 1, 8)])
def test_cached_attention_writes_the_slot_and_attends_as_sdpa(ops, H, KV, D):
    """The token's keys and values land in its slot of the caches (nothing else changes), and its heads' output is
    SDPA's over the slots up to it, grouped heads sharing a key/value head, with and without a mask hiding some."""
    generator = torch.Generator().manual_seed(H * 100 + D)
    B = 3
    L = 50
    slot = 33
    qkv = torch.randn(B, 1, (H + 2 * KV) * D, generator=generator)
    k_cache = torch.randn(B, KV, L, D, generator=generator)
    v_cache = torch.randn(B, KV, L, D, generator=generator)
    visible = torch.rand(B, L, generator=generator) < 0.6
    visible[:, slot] = True
    for shown in (None, visible):
        want, keys, values = native.attention_reference(qkv, k_cache, v_cache, slot, shown, 0.2, H)
        want64 = native.attention_reference(qkv.double(), k_cache.double(), v_cache.double(), slot, shown, 0.2, H)[0]
        got_keys = k_cache.clone()
        got_values = v_cache.clone()
        got = ops.cached_attention(qkv, got_keys, got_values, slot, slot + 1, shown, 0.2, H)
        native.assert_as_close_as_float32(got, want, want64, "cached_attention")
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


@pytest.mark.parametrize("H, KV, D", [(4, 4, 64), (6, 2, 20), (2, 1, 8)])
@pytest.mark.parametrize("rotated, rows_angles", [("all", 3), ("all", 1), ("half", 3)])
@pytest.mark.parametrize("normed", ["head", "all", None])
def test_cached_attention_normalizes_and_rotates_q_and_k(ops, H, KV, D, rotated, rows_angles, normed):
    """With q/k norms (each head's RMSNorm times its weight, Qwen3's, or one RMSNorm over all of q and one over all
    of k, OLMo 2's) and RoPE's angles (every coordinate, or the leading half; each row at its own angles, or one row's
    for all), the heads' output and the keys written are those of the math through PyTorch
    (`native.attention_reference`), within float32's error; the values land as they are."""
    generator = torch.Generator().manual_seed(H * 100 + D + rows_angles)
    B = 3
    L = 50
    slot = 33
    R = D if rotated == "all" else D // 2
    qkv = torch.randn(B, 1, (H + 2 * KV) * D, generator=generator)
    caches = torch.randn(2, B, KV, L, D, generator=generator)
    visible = torch.rand(B, L, generator=generator) < 0.6
    visible[:, slot] = True
    angles, head_norms = native.rotary_operands(generator, rows_angles, R, D, (H, KV) if normed == "all" else None)
    head_norms = head_norms if normed else None
    operands = (qkv, *caches, slot, visible, 0.2, H, angles, head_norms)
    want, keys, values = native.attention_reference(*operands)
    want64, keys64, _ = native.attention_reference(*native.as_float64(operands))
    k_cache, v_cache = caches.clone()
    cache = native.CacheSlot(k_cache, v_cache, slot, slot + 1, visible)
    got = native.cached_attention(qkv, cache, n_head=H, scale=0.2, angles=angles, head_norms=head_norms)
    native.assert_as_close_as_float32(got, want, want64, "cached_attention")
    native.assert_as_close_as_float32(k_cache, keys, keys64, "cached_attention's keys")
    assert torch.equal(v_cache, values)


@pytest.mark.parametrize("H, KV, D", [(4, 4, 64), (6, 2, 20)])
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("window", [0, 5])
def test_cached_attention_of_rows_at_their_own_slots(ops, H, KV, D, rotated, window):
    """Rows at lengths of their own (the server's, a request each; `CacheSlot.slots`): each row's keys and values land
    in its own slot, nothing else changes, and its heads attend over its slots up to that one only (the last `window`
    of them, where it has one), as SDPA does over them (rotated and normalized too, each row at its own angles)."""
    generator = torch.Generator().manual_seed(H * 10 + D + rotated)
    B = 4
    L = 50
    slots = torch.tensor([33, 0, 7, 49])
    qkv = torch.randn(B, 1, (H + 2 * KV) * D, generator=generator)
    caches = torch.randn(2, B, KV, L, D, generator=generator)
    angles, head_norms = native.rotary_operands(generator, B, D, D) if rotated else (None, None)
    operands = (qkv, *caches, slots, None, 0.2, H, angles, head_norms, window)
    want, keys, values = native.attention_reference(*operands)
    want64, keys64, _ = native.attention_reference(*native.as_float64(operands))
    k_cache, v_cache = caches.clone()
    cache = native.CacheSlot(k_cache, v_cache, 49, 50, None, slots)
    got = native.cached_attention(qkv, cache, n_head=H, scale=0.2, angles=angles, head_norms=head_norms, window=window)
    native.assert_as_close_as_float32(got, want, want64, "cached_attention, rows at their own slots")
    native.assert_as_close_as_float32(k_cache, keys, keys64, "cached_attention's keys, rows at their own slots")
    assert torch.equal(v_cache, values)


def test_rows_at_their_own_slots_each_attend_as_alone(ops):
    """A row among others at their own slots computes what it does alone at its slot: its neighbours' lengths never
    reach it."""
    generator = torch.Generator().manual_seed(3)
    H = 4
    D = 16
    slots = torch.tensor([20, 3, 11])
    qkv = torch.randn(3, 1, 3 * H * D, generator=generator)
    caches = torch.randn(2, 3, H, 30, D, generator=generator)
    together = native.cached_attention(
        qkv, native.CacheSlot(*caches.clone(), 20, 21, None, slots), n_head=H, scale=0.25
    )
    for b, slot in enumerate(slots.tolist()):
        keys, values = caches[:, b : b + 1].clone()
        alone = native.cached_attention(
            qkv[b : b + 1], native.CacheSlot(keys, values, slot, slot + 1, None), n_head=H, scale=0.25
        )
        assert torch.equal(together[b : b + 1], alone)


@pytest.mark.parametrize("window", [1, 5, 33, 34, 100])
@pytest.mark.parametrize("masked", [True, False])
def test_cached_attention_within_a_window_sees_its_last_slots_only(ops, window, masked):
    """A sliding window of `window` slots (Gemma 3's local layers): the heads attend over the slots
    [slot - window + 1, slot] only, within float32's error of SDPA with the window's mask, the slot itself always
    among them (a window of 1 sees only the token's own key), a window past the first slot as no window at all;
    with a mask hiding some slots too, and the token's keys and values written as without a window."""
    generator = torch.Generator().manual_seed(window)
    B = 2
    H = 4
    KV = 2
    D = 16
    L = 40
    slot = 33
    qkv = torch.randn(B, 1, (H + 2 * KV) * D, generator=generator)
    caches = torch.randn(2, B, KV, L, D, generator=generator)
    visible = torch.rand(B, L, generator=generator) < 0.6
    visible[:, slot] = True
    shown = visible if masked else None
    angles, head_norms = native.rotary_operands(generator, B, D, D)
    operands = (qkv, *caches, slot, shown, 0.2, H, angles, head_norms, window)
    want, keys, values = native.attention_reference(*operands)
    want64 = native.attention_reference(*native.as_float64(operands))[0]
    k_cache, v_cache = caches.clone()
    cache = native.CacheSlot(k_cache, v_cache, slot, slot + 1, shown)
    got = native.cached_attention(qkv, cache, n_head=H, scale=0.2, angles=angles, head_norms=head_norms, window=window)
    native.assert_as_close_as_float32(got, want, want64, f"cached_attention, a window of {window}")
    assert torch.equal(v_cache, values)
    unwindowed = native.attention_reference(*operands[:-1])[0]
    assert window > slot or not torch.allclose(want, unwindowed)  # the window changes what a short one sees


def test_cached_attention_refuses_what_it_cannot_take_by_name(ops):
    k_cache = torch.zeros(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=r"qkv must be a contiguous \(1, 1, 128\) float32"):
        ops.cached_attention(torch.zeros(1, 1, 96), k_cache, k_cache.clone(), 0, 1, None, 1.0, 4)
    with pytest.raises(RuntimeError, match="slot 8 and span 9 in a cache of 8"):
        ops.cached_attention(torch.zeros(1, 1, 128), k_cache, k_cache.clone(), 8, 9, None, 1.0, 4)
    with pytest.raises(RuntimeError, match="3 query heads for 2 key/value heads"):
        ops.cached_attention(torch.zeros(1, 1, 112), k_cache, k_cache.clone(), 0, 1, None, 1.0, 3)
    qkv = torch.zeros(1, 1, 128)
    with pytest.raises(RuntimeError, match="row 0's slot 5 is outside the span 4"):
        ops.cached_attention(qkv, k_cache, k_cache.clone(), 3, 4, None, 1.0, 4, slots=torch.tensor([5]))
    with pytest.raises(RuntimeError, match=r"slots must be a contiguous \(1,\) int64 CPU tensor"):
        ops.cached_attention(qkv, k_cache, k_cache.clone(), 3, 4, None, 1.0, 4, slots=torch.tensor([1, 2]))


@pytest.mark.parametrize(
    "overrides",
    [
        {"pos_emb": "learned", "norm": "layernorm", "ffn": "gelu", "bias": True},  # GPT-2's
        {"n_kv_head": 2},  # grouped-query attention
    ],
    ids=["gpt2", "gqa"],
)
def test_native_attention_decodes_what_the_models_own_attention_does(ops, overrides):
    """The CPU decode view's NativeAttention layers give the model's own logits step after step, for one row and
    for rows of different lengths (left padding, masked), and through beam search's reordered cache."""
    from gptlite.inference.cpu.blocks import NativeAttention
    from tests.conftest import tiny_model

    model = tiny_model(**overrides)
    for rows in ([[5, 6, 7, 8, 9]], [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]):
        view = decodes_as_the_model(model, rows)
        assert all(isinstance(block.attn, NativeAttention) for block in view.blocks)


@pytest.mark.parametrize("rows, KV, int8", [(1, 4, False), (3, 2, False), (2, 4, True)])
@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize(
    "norm, activation",
    [
        ("layernorm", "gelu_tanh"),
        ("layernorm", "relu_squared"),
        ("rmsnorm", "silu_gate"),
        ("rmsnorm", "gelu_gate"),
    ],
)
def test_block_step_is_the_blocks_math_through_pytorch(ops, norm, activation, biased, rows, KV, int8):
    """A block's decode step in one call equals the block's math through PyTorch's own operators (the norms,
    F.linear, SDPA over the cache, the activation, the residual additions scaled), each norm and activation the step
    knows, with and without biases, one row and three with some slots hidden, grouped heads, float32 weights and int8
    ones with a scale per row; the token's keys and values land in their slot. Each within float32's error there: a
    few times that of the block's math through PyTorch in float32, both against it in float64."""
    generator = torch.Generator().manual_seed(len(norm) + len(activation) + rows)
    x, weights, cache = native.block_operands(generator, rows, 4, KV, 16, 80, norm, activation, biased, int8)
    options = native.BlockOptions(norm, 1e-5, activation, 4, 0.3, 0.7)
    native.assert_block_step_close(x, weights, cache, options, f"{norm}, {activation}")


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("norm, activation", [("layernorm", "gelu_tanh"), ("rmsnorm", "silu_gate")])
def test_block_step_multiplies_int8_inputs_by_int8_and_int4_weights(ops, norm, activation, kind, rows):
    """A block's step whose matrices multiply their inputs quantized to int8 (int8_dot_linear's, int4_dot_linear's
    way), int8 weights with a scale per row or int4 ones with a scale per block, against the block's math through
    PyTorch with the inputs quantized by `native.quantized_blocks` (`native.block_reference`)."""
    generator = torch.Generator().manual_seed(len(norm) + len(kind) + rows)
    x, weights, cache = native.block_operands(generator, rows, 4, 2, 16, 64, norm, activation, True)
    weights = native.integer_matrices(generator, weights, kind)
    options = native.BlockOptions(norm, 1e-5, activation, 4, 0.3, 0.7)
    native.assert_block_step_close(x, weights, cache, options, f"{norm}, {activation}, {kind}")


def test_block_step_refuses_what_it_cannot_take_by_name(ops):
    """The operator names what it refuses: each operand changed from `native.block_step_arguments`' (the typed
    wrapper's), in the operator's schema order."""
    generator = torch.Generator().manual_seed(0)
    x, weights, cache = native.block_operands(generator, 1, 4, 4, 16, 64, "layernorm", "gelu_tanh", True)
    options = native.BlockOptions("layernorm", 1e-5, "gelu_tanh", 4, 0.3, 1.0)
    given = native.block_step_arguments(x, weights, cache, options)
    names = ("x", "norms", "weights", "scales", "biases", "k_cache", "v_cache", "slot", "span", "visible", "scale")
    names += ("n_head", "norm", "eps", "activation", "residual_scale", "cos", "sin", "q_norm", "k_norm", "head_eps")
    names += ("position", "window", "slots", "input_bits")
    assert len(given) == len(names)
    given = dict(zip(names, given, strict=True))
    weights = given["weights"]
    scales = given["scales"]
    biases = given["biases"]

    def step(**changed):
        ops.block_step(*{**given, **changed}.values())

    codes = weights[0].to(torch.int8)
    with pytest.raises(RuntimeError, match="norm must be layernorm, rmsnorm or rmsnorm_unit_offset, not batchnorm"):
        step(norm="batchnorm")
    with pytest.raises(RuntimeError, match="position must be pre, post or both, not middle"):
        step(position="middle")
    with pytest.raises(RuntimeError, match="8 norm tensors, 4 weights, 4 scales and 4 biases, not 4, 4, 4 and 4"):
        step(position="both")
    with pytest.raises(RuntimeError, match=r"the feed-forward post-norm's bias must be a contiguous \(64,\) float32"):
        step(position="both", norms=[*given["norms"], *given["norms"][:3], torch.ones(3)])
    with pytest.raises(RuntimeError, match="gptlite cached_attention: window -1 must be >= 0"):
        step(window=-1)
    with pytest.raises(RuntimeError, match="activation must be gelu_tanh, relu_squared, silu_gate or gelu_gate, not t"):
        step(activation="tanh")
    with pytest.raises(RuntimeError, match=r"the fc weight must be a contiguous \(64, 64\) CPU tensor"):
        step(weights=[weights[0], weights[1], weights[2].t().contiguous().t(), weights[3]])
    with pytest.raises(RuntimeError, match=r"the qkv bias must be a contiguous \(192,\) float32"):
        step(biases=[biases[0][:100], *biases[1:]])
    with pytest.raises(RuntimeError, match="4 norm tensors, 4 weights, 4 scales and 4 biases, not 4, 3, 4 and 4"):
        step(weights=weights[:3])
    with pytest.raises(RuntimeError, match="the qkv weight must be float32, or int8 with a scale per row"):
        step(weights=[codes, *weights[1:]])
    with pytest.raises(RuntimeError, match="the qkv weight is float32 and takes no scale"):
        step(scales=[torch.ones(192), *scales[1:]])
    with pytest.raises(RuntimeError, match=r"the qkv weight's scale must be a contiguous \(192,\) float32"):
        step(weights=[codes, *weights[1:]], scales=[torch.ones(192, 6), *scales[1:]])
    with pytest.raises(RuntimeError, match="gptlite cached_attention: slot 40 and span 41 in a cache of 40"):
        step(slot=40, span=41)
    angle = torch.zeros(1, 16)
    with pytest.raises(RuntimeError, match="cos and sin go together"):
        step(cos=angle)
    with pytest.raises(RuntimeError, match=r"cos must be a \(1 or 1, R\) float32 CPU tensor, R even and at most the "):
        step(cos=torch.zeros(1, 15), sin=torch.zeros(1, 15))
    with pytest.raises(RuntimeError, match=r"sin must be a \(1 or 1, R\) float32 CPU tensor"):
        step(cos=angle, sin=angle.double())
    with pytest.raises(RuntimeError, match="q_norm and k_norm go together"):
        step(q_norm=torch.ones(16))
    with pytest.raises(RuntimeError, match=r"gptlite cached_attention: k_norm must be a contiguous \(16,\) float32"):
        step(q_norm=torch.ones(16), k_norm=torch.ones(12))
    # a weight over all heads (OLMo 2's) is all of them or one head's; 4 heads of 16: 64 numbers or 16
    with pytest.raises(RuntimeError, match=r"gptlite cached_attention: q_norm must be a contiguous \(16,\) float32"):
        step(q_norm=torch.ones(32), k_norm=torch.ones(64))
    with pytest.raises(RuntimeError, match=r"4 input_bits \(or none\), not 3"):
        step(input_bits=[32, 32, 32])
    with pytest.raises(RuntimeError, match=r"a matrix's input_bits are 32 \(float32\) or 8 \(int8\), not 16"):
        step(input_bits=[16, 32, 32, 32])
    with pytest.raises(RuntimeError, match=r"the qkv weight with int8 inputs must be contiguous \(192, 64\) int8 cod"):
        step(input_bits=[8, 32, 32, 32])


@pytest.mark.parametrize("V", [1, 5, 16, 50257, 50304])
def test_argmax_is_torch_max_first_largest(ops, V):
    """Greedy decoding's pick: each row's first largest, as torch.max's indices, on widths that are and are not a
    multiple of a vector; ties, a NaN (the largest, its first), every number -inf, the largest in the last lanes, and
    rows that are not contiguous."""
    from gptlite.inference.sampling import greedy

    generator = torch.Generator().manual_seed(V)
    logits = torch.randn(6, V, generator=generator)
    logits[1] = logits[1, 0]  # all tied: the first
    logits[2, V // 2 :] = float("nan")
    logits[2, V - 1] = float("nan")
    logits[3] = float("-inf")
    logits[4, V - 1] = 100.0  # the very end, past the last whole vector
    logits[5, V // 3] = float("inf")
    want = logits.max(dim=-1).indices
    assert torch.equal(ops.argmax(logits), want)
    assert torch.equal(greedy(logits), want)
    wide = torch.randn(3, 2 * V, generator=generator)[:, ::2]  # every other number of each row
    assert torch.equal(ops.argmax(wide), wide.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match=r"logits must be a \(B, V > 0\) float32 CPU tensor"):
        ops.argmax(logits.double())


BLOCK_MODELS = {
    "gpt2": {"pos_emb": "learned", "norm": "layernorm", "ffn": "gelu", "bias": True},
    "default": {},
    "llama-like, gqa": {"norm": "rmsnorm", "ffn": "swiglu", "n_kv_head": 2, "pos_emb": "sinusoidal"},
    "relu2, parameter-free norms": {"norm": "rmsnorm", "norm_weight": False, "ffn": "relu2"},
    "geglu, granite's scales": {"ffn": "geglu", "residual_scale": 0.5, "attn_scale": 0.1},
    "llama: rope, gqa": {"norm": "rmsnorm", "ffn": "swiglu", "n_kv_head": 2, "pos_emb": "rope"},
    "qwen3: rope, q/k norms": {"norm": "rmsnorm", "ffn": "swiglu", "n_kv_head": 2, "pos_emb": "rope", "qk_norm": True},
    "phi-4-mini: partial rope": {"norm": "rmsnorm", "ffn": "swiglu", "pos_emb": "rope", "rope_dims": 4},
    "llama 3.1: rope scaling": {
        "norm": "rmsnorm",
        "ffn": "swiglu",
        "pos_emb": "rope",
        "rope_scaling": "llama3",
        "rope_original_context": 8,
        "rope_factor": 4.0,
    },
    "phi-3: longrope": {
        "pos_emb": "rope",
        "rope_scaling": "longrope",
        "rope_original_context": 32,
        "rope_short_factor": "1.0,1.5,2.0,3.0",
        "rope_attention_factor": 1.2,
    },
    "nanochat: reversed rope, parameter-free q/k norms": {
        "norm": "rmsnorm",
        "norm_weight": False,
        "ffn": "relu2",
        "pos_emb": "rope",
        "rope_reverse": True,
        "qk_norm": True,
    },
    "smollm3: nope layers": {"pos_emb": "rope", "nope_layers": "1", "n_kv_head": 2},
    "olmo 2: norms after the branch, q/k norms over all heads": {
        "norm": "rmsnorm",
        "ffn": "swiglu",
        "pos_emb": "rope",
        "n_kv_head": 2,
        "qk_norm": True,
        "qk_norm_scope": "all",
        "norm_position": "post",
    },
    "gemma 3: norms on both sides, unit offset, geglu, a window of 4": {
        "norm": "rmsnorm",
        "ffn": "geglu",
        "pos_emb": "rope",
        "n_kv_head": 1,
        "head_dim": 16,
        "qk_norm": True,
        "norm_position": "both",
        "norm_unit_offset": True,
        "embed_scale": 32**0.5,
        "attn_scale": 0.2,
        "sliding_window": 4,
        "window_layers": "0",
        "rope_local_theta": 100.0,
        "logit_softcap": 5.0,
    },
    "granite: its four scales": {
        "norm": "rmsnorm",
        "ffn": "swiglu",
        "pos_emb": "rope",
        "n_kv_head": 2,
        "embed_scale": 3.0,
        "residual_scale": 0.5,
        "attn_scale": 0.2,
        "logits_scaling": 2.5,
    },
    "biases everywhere, rmsnorm": {"norm": "rmsnorm", "bias": True, "pos_emb": "rope", "ffn": "relu2"},
}


@pytest.mark.parametrize("overrides", list(BLOCK_MODELS.values()), ids=list(BLOCK_MODELS))
def test_native_blocks_decode_what_the_models_own_blocks_do(ops, monkeypatch, overrides):
    """Where every matrix of a block takes the compiled kernel, the CPU decode view's blocks are NativeBlocks, and
    they give the model's own logits step after step: one row, rows of different lengths (left padding, masked),
    beam search's reordered cache, and more rows than the step takes (Block's way)."""
    import gptlite.inference.cpu.decode
    from tests.conftest import tiny_model

    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "native")
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    decodes_as_its_own_blocks(tiny_model(**overrides))


def test_native_blocks_decode_an_int8_model_as_its_own_blocks_do(ops, monkeypatch):
    """An int8 model whose matrices take the compiled kernel: its blocks' steps run in one call too, int8 weights
    and all, and give the quantized model's own logits."""
    from tests.conftest import tiny_model

    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "native")
    for name in ("gpt2", "llama-like, gqa", "llama: rope, gqa", "qwen3: rope, q/k norms"):
        decodes_as_its_own_blocks(tiny_model(**BLOCK_MODELS[name]).quantize("int8"))
    gemma = "gemma 3: norms on both sides, unit offset, geglu, a window of 4"
    for name in ("olmo 2: norms after the branch, q/k norms over all heads", gemma):
        decodes_as_its_own_blocks(tiny_model(**BLOCK_MODELS[name]).quantize("int8"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_native_blocks_decode_an_int8_dot_model_as_its_own_blocks_do(ops, monkeypatch, mode):
    """A model quantized to int8 or int4 whose matrices multiply int8 activations (GPTLITE_QUANT_KERNEL=int8_dot): its
    rotary blocks' steps run in one call, int8 inputs and all, and decode the quantized model's own greedy tokens, one
    row and a ragged batch, each row's tokens the same alone and in the batch."""
    from tests.conftest import tiny_model

    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "int8_dot")
    for name in ("gpt2", "llama: rope, gqa", "qwen3: rope, q/k norms"):
        model = tiny_model(n_embd=64, **BLOCK_MODELS[name]).quantize(mode)
        decodes_the_models_greedy_tokens(model)


def decodes_the_models_greedy_tokens(model) -> None:
    """Asserts that `model`'s CPU decode view has NativeBlocks and decodes the model's own greedy tokens for ten steps
    of one row and of three rows of different lengths, and the three rows' tokens alone."""
    from gptlite.inference.cpu.blocks import NativeBlock
    from gptlite.inference.cpu.decode import packed_for_cpu
    from gptlite.inference.kvcache import decode_step, new_cache, prefill

    def greedy(net, rows: list[list[int]]) -> list[list[int]]:
        cache = new_cache(net, len(rows), 30)
        logits = prefill(net, cache, rows)
        tokens = []
        for _ in range(10):
            token = logits.argmax(-1, keepdim=True)  # (B, 1)
            tokens.append(token)
            cache.prepare(1)
            logits = decode_step(net, token, cache)
        return torch.cat(tokens, dim=1).tolist()

    with torch.no_grad():
        rows = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
        view = packed_for_cpu(model, len(rows))
        assert all(isinstance(block, NativeBlock) for block in view.blocks)
        batch = greedy(view, rows)
        assert batch == greedy(model, rows)
        assert [greedy(packed_for_cpu(model, 1), [row])[0] for row in rows] == batch


def decodes_as_its_own_blocks(model) -> None:
    """Asserts that `model`'s CPU decode view has NativeBlocks that decode as the model does, 1, 3 and
    native.max_rows() + 1 rows."""
    from gptlite.inference.cpu.blocks import NativeBlock

    nine = [[i + 1, i + 2, 3] for i in range(native.max_rows() + 1)]
    for rows in ([[5, 6, 7, 8, 9]], [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]], nine):
        view = decodes_as_the_model(model, rows)
        assert all(type(block).__name__ == "NativeBlock" for block in view.blocks)
        assert all(isinstance(block, NativeBlock) for block in view.blocks)


def decodes_as_the_model(model, rows: list[list[int]], steps: int = 10):
    """Asserts that `model`'s CPU decode view gives the model's own logits over `steps` decode steps of `rows`
    (prompts of different lengths are left-padded and masked; three rows are reordered as beam search does, each
    taking over another's contents) and writes the same keys; returns the view."""
    from gptlite.inference.cpu.decode import packed_for_cpu
    from gptlite.inference.kvcache import decode_step, new_cache, prefill

    with torch.no_grad():
        view = packed_for_cpu(model, len(rows))
        ours = new_cache(view, len(rows), max(len(row) for row in rows) + steps)
        theirs = new_cache(model, len(rows), max(len(row) for row in rows) + steps)
        got = prefill(view, ours, rows)
        want = prefill(model, theirs, rows)
        for step in range(steps):
            token = want.argmax(-1, keepdim=True)  # (B, 1)
            if step == 5 and len(rows) == 3:
                order = torch.tensor([2, 0, 0])
                ours.reorder(order)
                theirs.reorder(order)
            ours.prepare(1)
            theirs.prepare(1)
            got = decode_step(view, token, ours)
            want = decode_step(model, token, theirs)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.k[1], theirs.k[1])
    return view


@pytest.fixture(scope="module", params=list(HF_FAMILIES))
def family_model(request, tmp_path_factory):
    """(name, gptlite's model) of each family's tiny random transformers model (tests/hf/test_families.py's, Gemma 3's
    with a window of 8 positions), saved by transformers and loaded by GPT.from_pretrained, in float32."""
    from gptlite import GPT
    from tests.test_hf import randomized

    cls, config = HF_FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    randomized(cls(config)).save_pretrained(directory)
    return request.param, GPT.from_pretrained(str(directory), torch.float32)


# families whose blocks the one-call step does not compute yet, and why: they decode through the blocks' own forward
STEP_LACKS = {"ministral3": "its query scale that grows with the position (query_scale_beta)"}


def test_every_familys_blocks_decode_in_one_call_as_its_own_forward(ops, monkeypatch, family_model):
    """Each family's blocks (tests/hf/test_families.py's tiny random models: pre-norm, OLMo 2's post-norm with its q/k
    norms over all heads, Gemma 3's norms on both sides with its window, Granite's scales, SmolLM3's NoPE layers,
    nanochat's relu², Qwen2's biases, ...) are NativeBlocks where every matrix takes the compiled kernel (the blocks
    of STEP_LACKS' families stay their own), and decode
    as the model's own PyTorch path does: its logits within 1e-5 step after step, 1 row and 2 of different lengths,
    past Gemma 3's window of 8; and greedy tokens equal to those of the model's forward over the whole context."""
    import gptlite.inference.cpu.decode
    from gptlite.inference.cpu.blocks import NativeBlock
    from tests.inference.cpu.test_decode import greedy_by_forward

    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "native")
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    name, model = family_model
    # attention layers take the step; layers with a state of their own (LFM2's convolutions, Mamba-2) their forward
    one_call = [name not in STEP_LACKS and kind == "full_attention" for kind in model.config.layer_kinds]
    for rows in ([[5, 6, 7, 8, 9]], [[5, 6, 7, 8, 9], [11, 12, 13]]):
        view = decodes_as_the_model(model, rows, steps=24)
        assert [isinstance(block, NativeBlock) for block in view.blocks] == one_call, name
    prompts = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 14, 15]])
    for rows in (prompts[:1], prompts):
        assert torch.equal(model.generate(rows, 20, temperature=0), greedy_by_forward(model, rows, 20)), name


def test_blocks_the_step_does_not_compute_keep_their_own_way(ops, monkeypatch):
    """A block whose attention the kernels do not compute (value embeddings), a block kind or norm they do not know
    (a subclass), norms of two epsilons, a matrix that takes another kernel (float32, int8, int4), a hook on a module
    of the block, or a model in training mode: its blocks stay Block (and its attention, where it can,
    NativeAttention). Every kind of block the families use is the step's."""
    import gptlite.inference.cpu.decode
    from gptlite.inference.cpu.blocks import NativeBlock, one_call_variant
    from gptlite.inference.cpu.decode import packed_for_cpu
    from tests.conftest import tiny_model

    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "native")
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)

    def kinds(model) -> list[str]:
        return [type(block).__name__ for block in packed_for_cpu(model, 1).blocks]

    assert one_call_variant(tiny_model().blocks[0]) is NativeBlock
    assert kinds(tiny_model()) == ["NativeBlock", "NativeBlock"]
    for overrides in (
        {"pos_emb": "rope", "qk_norm": True, "qk_norm_scope": "all"},
        {"norm_position": "post"},
        {"norm_position": "both", "norm": "rmsnorm", "norm_unit_offset": True},
    ):
        assert one_call_variant(tiny_model(**overrides).blocks[0]) is NativeBlock, overrides
    assert one_call_variant(tiny_model(value_embeds=True).blocks[0]) is None
    assert "NativeBlock" not in kinds(tiny_model(value_embeds=True))

    class OtherBlock(type(tiny_model().blocks[0])):
        """A subclass, which may compute something else."""

    subclassed = tiny_model()
    subclassed.blocks[0].__class__ = OtherBlock
    assert one_call_variant(subclassed.blocks[0]) is None
    assert kinds(subclassed) == ["OtherBlock", "NativeBlock"]
    two_epsilons = tiny_model(norm_position="both", norm="rmsnorm")
    two_epsilons.blocks[0].ffn_post_norm.eps = 1e-3
    assert one_call_variant(two_epsilons.blocks[0]) is None
    model = tiny_model()
    handle = model.blocks[1].ffn.fc.register_forward_hook(lambda module, args, out: None)
    assert kinds(model) == ["NativeBlock", "Block"]
    handle.remove()
    assert kinds(model) == ["NativeBlock", "NativeBlock"]
    assert kinds(tiny_model().train()) == ["Block", "Block"]
    assert kinds(tiny_model().quantize("int8")) == ["Block", "Block"]  # layers this small: the dequantized way
    assert kinds(tiny_model().quantize("int4")) == ["Block", "Block"]
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "linear")
    view = packed_for_cpu(tiny_model(), 1)
    assert [type(block).__name__ for block in view.blocks] == ["Block", "Block"]
    assert type(view.blocks[0].attn).__name__ == "NativeAttention"


def test_layers_native_attention_does_not_compute_keep_the_models_own(ops):
    """Value embeddings are the model's attention's to compute: their layers stay CausalSelfAttention in the view.
    Rotary layers (whole, partial, nanochat's reversed, Gemma 3's global and local, within its window), Qwen3's q/k
    norms over each head and OLMo 2's over all heads are the kernels'."""
    from gptlite.inference.cpu.blocks import NativeAttention, one_call_variant
    from gptlite.inference.cpu.decode import packed_for_cpu
    from tests.conftest import tiny_model

    assert one_call_variant(tiny_model().blocks[0].attn) is NativeAttention
    assert one_call_variant(tiny_model().blocks[0].ffn) is None
    for overrides in (
        {"pos_emb": "rope"},
        {"pos_emb": "rope", "rope_dims": 4},
        {"pos_emb": "rope", "rope_reverse": True},
        {"qk_norm": True},
        {"pos_emb": "rope", "sliding_window": 4, "window_layers": "0", "rope_local_theta": 100.0},
        {"qk_norm": True, "qk_norm_scope": "all"},
        {"sliding_window": 4, "window_layers": "0"},
    ):
        for block in tiny_model(**overrides).blocks:  # layer 0 local, where there is a window; layer 1 global
            assert one_call_variant(block.attn) is NativeAttention, overrides
    for overrides in ({"value_embeds": True},):
        model = tiny_model(**overrides)
        view = packed_for_cpu(model, 1)
        kept = [type(block.attn).__name__ for block in view.blocks]
        assert kept[0] == "CausalSelfAttention", overrides


def test_the_compiled_kernel_is_the_default_another_must_beat():
    from gptlite.inference.cpu.decode import default_kernel

    assert default_kernel(("slab", "packed", "linear", "native"), 1) == "native"
    assert default_kernel(("packed", "linear", "native"), 8) == "native"
    assert default_kernel(("slab", "packed", "linear"), 1) == "slab"  # without it: what led on the AVX2 machine
    assert default_kernel(("packed", "linear"), 8) == "packed"


def test_the_float32_tolerances_catch_one_wrong_term(ops, monkeypatch):
    """The bounds follow the sums' length and magnitude, loose enough for any CPU's order of additions, and still
    far below what one input read from the wrong index moves a result: a linear layer's and a block's step."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 768, generator=generator)
    weight = torch.randn(64, 768, generator=generator)
    native.assert_linear_close(ops.float_linear(x, weight, None), x, weight)
    wrong = weight.clone()
    wrong[:, 100] = weight[:, 101]  # the next input's weight
    with pytest.raises(AssertionError, match=r"the product: \d+ of 192 numbers are off; at \("):
        native.assert_linear_close(ops.float_linear(x, wrong, None), x, weight)

    step = native.block_step

    def wrong_index(x, weights, cache, options, angles=None):
        fc = weights.fc.weight.clone()
        fc[:, 5] = fc[:, 6]  # the feed-forward's weight of the next input
        return step(x, weights._replace(fc=weights.fc._replace(weight=fc)), cache, options, angles)

    options = native.BlockOptions("rmsnorm", 1e-5, "silu_gate", 4, 0.3, 0.7)
    x, weights, cache = native.block_operands(generator, 3, 4, 2, 16, 80, "rmsnorm", "silu_gate", False)
    native.assert_block_step_close(x, weights, cache, options, "as it is")
    monkeypatch.setattr(native, "block_step", wrong_index)
    x, weights, cache = native.block_operands(generator, 3, 4, 2, 16, 80, "rmsnorm", "silu_gate", False)
    with pytest.raises(AssertionError, match=r"block_step \(a bug\): \d+ of 192 numbers are off"):
        native.assert_block_step_close(x, weights, cache, options, "a bug")


@pytest.mark.parametrize("setting", ["0", "false", "False", "off", "no"])
def test_gptlite_native_false_in_any_spelling_turns_the_kernels_off(monkeypatch, setting):
    monkeypatch.setenv("GPTLITE_NATIVE", setting)
    assert native.load_or_say_why() == f"GPTLITE_NATIVE={setting}"


def test_gptlite_native_true_or_unknown(monkeypatch, tmp_path):
    """A true value leaves the kernels on (here: on to the missing compiler); an unknown one is named with the values
    the variable takes, and the kernels stay off."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    for setting in ("1", "true", "on", "yes"):
        monkeypatch.setenv("GPTLITE_NATIVE", setting)
        assert native.load_or_say_why().startswith("no C++ compiler: "), setting
    monkeypatch.setenv("GPTLITE_NATIVE", "maybe")
    assert native.load_or_say_why() == (
        "GPTLITE_NATIVE='maybe' is not a boolean; use one of true, 1, yes, on, false, 0, no, off"
    )


def test_a_build_says_how_long_it_may_take_and_that_it_still_runs(monkeypatch, tmp_path, capsys):
    """The first build's notes on stderr, each a line of its own: what it compiles and for how long it may, then the
    time so far while the compiler runs."""
    slow = tmp_path / "slow-c++"
    slow.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\nsleep 2.5\n: > "$out"\n')
    slow.chmod(0o755)
    monkeypatch.setattr(native, "PROGRESS_SECONDS", 1)
    assert native.build(str(slow), tmp_path / "cache" / "matvec.so") == ""
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("gptlite: compiling the CPU decode kernels for this CPU into ")
    assert "(once: about a minute on a small machine, and decoding waits for it)" in lines[0]
    assert len(lines) >= 3 and all(
        re.fullmatch(r"gptlite: still compiling the CPU decode kernels \(\d+ s\)", line) for line in lines[1:]
    )
    assert (tmp_path / "cache" / "matvec.so").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["matvec.so"]  # no scratch folder left


def test_a_compiler_that_writes_nothing_or_says_nothing_is_named(tmp_path):
    true = shutil.which("true")
    false = shutil.which("false")
    assert native.build(true, tmp_path / "matvec.so") == (
        f"{true} exited 0 on matvec.cpp but wrote no library; set CXX to a working C++ compiler, or GPTLITE_NATIVE=0"
    )
    assert native.build(false, tmp_path / "matvec.so") == (
        f"{false} failed on matvec.cpp with exit status 1 and no message; set CXX to a working C++ compiler, or "
        "GPTLITE_NATIVE=0"
    )
    assert not (tmp_path / "matvec.so").exists() and list(tmp_path.iterdir()) == []


def test_a_library_its_marker_does_not_vouch_for_is_checked_again(built, monkeypatch, tmp_path):
    """A marker of the old kind, or one written on another CPU, proves nothing of the bytes beside it: the library is
    checked again in a child process, and a library that passes gets a marker that vouches for it here."""
    monkeypatch.setenv("GPTLITE_NATIVE_CACHE", str(tmp_path))
    cxx = native.compiler()
    path = native.library_path(cxx)
    shutil.copyfile(built, path)
    checked = []
    check = native.check_in_child
    monkeypatch.setattr(native, "check_in_child", lambda p: checked.append(p) or check(p))
    marker = path.with_suffix(".checked")
    for old in ("the check passed\n", native.marker_text(path).replace("cpu ", "cpu 0")):
        marker.write_text(old)
        assert native.ready(cxx, path) == "" and checked.pop() == path
        assert marker.read_text() == native.marker_text(path) != old
    assert native.ready(cxx, path) == "" and checked == []  # a marker that vouches for it: no check


@pytest.mark.slow
def test_a_truncated_library_is_built_again(built, monkeypatch, tmp_path, capsys):
    """A library cut short (a copy that ran out of space) fails its check in the child and is built anew."""
    monkeypatch.setenv("GPTLITE_NATIVE_CACHE", str(tmp_path))
    cxx = native.compiler()
    path = native.library_path(cxx)
    path.write_bytes(built.read_bytes()[: built.stat().st_size // 2])
    path.with_suffix(".checked").write_text("the check passed\n")
    assert native.ready(cxx, path) == ""
    assert path.with_suffix(".checked").read_text() == native.marker_text(path)
    err = capsys.readouterr().err
    assert re.search(rf"^gptlite: checking {re.escape(str(path))} failed \(.+\); building it again$", err, re.M)


# ---------------------------------------------------------------------------------------------
# sample.py where the kernels cannot be used: it decodes with PyTorch's and says why in one line


@pytest.fixture(scope="module")
def built(ops) -> Path:
    """The library this test run built for this CPU (the `ops` fixture's)."""
    return native.library_path(native.compiler())


@pytest.fixture(scope="module")
def char_run(tmp_path_factory) -> Path:
    """A tiny random character model's run folder."""
    from gptlite.checkpoint import save_checkpoint
    from gptlite.config import build_config, config_to_dict
    from gptlite.tokenizer import CharTokenizer
    from tests.conftest import tiny_model

    run = tmp_path_factory.mktemp("run")
    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(run / "ckpt.pt", {"config": config_to_dict(cfg), "model": tiny_model().state_dict()})
    CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n\u00e9").save(run / "tokenizer.json")
    return run


def sample(run: Path, **env: str) -> tuple[int, list[str]]:
    """`python sample.py` on `run`, greedy, with the environment changed by `env`: its exit code and the lines of its
    stdout and stderr as a terminal shows them, in the order written."""
    command = [sys.executable, str(ROOT / "sample.py"), f"--model={run}", "--start=ROMEO:", "--max_new_tokens=12"]
    command += ["--temperature=0", "--device=cpu"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    return done.returncode, done.stdout.splitlines()


@pytest.fixture(scope="module")
def pytorchs_text(char_run) -> str:
    """What sample.py writes with PyTorch's kernels (GPTLITE_NATIVE=0)."""
    code, lines = sample(char_run, GPTLITE_NATIVE="0")
    assert code == 0, lines
    return next(line for line in lines if line.startswith("ROMEO:"))


def assert_falls_back(code: int, lines: list[str], text: str, cause: str) -> None:
    """sample.py finished (exit 0) with PyTorch's kernels: the streamed text whole on its line, the kernels' notes
    each on a line of its own before it, one of them saying why they are not used, `cause` in its words."""
    assert code == 0, lines
    streamed = [i for i, line in enumerate(lines) if line.startswith("ROMEO:")]
    assert len(streamed) == 1 and lines[streamed[0]] == text, lines
    notes = [line for line in lines if line.startswith("sample.py: note: gptlite: the compiled CPU kernels are not")]
    assert len(notes) == 1 and cause in notes[0], lines
    assert notes[0].endswith("; decoding runs PyTorch's"), lines
    assert all(i < streamed[0] for i, line in enumerate(lines) if "gptlite:" in line), lines


@pytest.mark.slow
def test_sample_goes_on_past_a_truncated_or_foreign_library(built, char_run, pytorchs_text, monkeypatch, tmp_path):
    """Libraries whose marker (a marker of the old kind, or one made for another file) cannot vouch for them are
    checked in a child process, never loaded into sample.py: one cut short (a Bus error where loaded) and one that
    dies as it loads (an illegal instruction, as one built for another CPU does). The compiler (false) cannot build
    them again, so decoding takes PyTorch's kernels and the line says why."""
    false = shutil.which("false")
    monkeypatch.setenv("GPTLITE_NATIVE_CACHE", str(tmp_path))
    path = native.library_path(false)
    marker = path.with_suffix(".checked")
    path.write_bytes(built.read_bytes()[: built.stat().st_size // 2])
    marker.write_text("the check passed\n")
    code, lines = sample(char_run, CXX=false, GPTLITE_NATIVE_CACHE=str(tmp_path))
    assert_falls_back(code, lines, pytorchs_text, f"{false} failed on matvec.cpp")
    assert any(line.startswith(f"gptlite: checking {path} failed (") for line in lines), lines
    crash = tmp_path / "crash.c"
    crash.write_text("__attribute__((constructor)) static void crash(void) { __builtin_trap(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(crash), "-o", str(path)], check=True)
    marker.write_text(native.marker_text(built))
    code, lines = sample(char_run, CXX=false, GPTLITE_NATIVE_CACHE=str(tmp_path))
    assert_falls_back(code, lines, pytorchs_text, f"{false} failed on matvec.cpp")
    assert any(line.startswith(f"gptlite: checking {path} failed (killed by SIG") for line in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize("name", ["true", "false"])
def test_sample_goes_on_past_a_compiler_that_lies(char_run, pytorchs_text, tmp_path, name):
    """A compiler that exits 0 and writes nothing, or fails without a word."""
    cxx = shutil.which(name)
    code, lines = sample(char_run, CXX=cxx, GPTLITE_NATIVE_CACHE=str(tmp_path))
    said = {
        "true": "exited 0 on matvec.cpp but wrote no library",
        "false": "failed on matvec.cpp with exit status 1 and no message",
    }
    assert_falls_back(code, lines, pytorchs_text, f"{cxx} {said[name]}")
    assert list(tmp_path.iterdir()) == []  # no scratch folder left


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` with `options` (root only: a test that needs one is skipped elsewhere)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
def test_sample_goes_on_past_a_read_only_cache(char_run, pytorchs_text, tmp_path):
    """A build cache that exists and cannot be written (a container's read-only ~/.cache): a read-only mount, which
    stops root too, or a folder without write permission for anyone else."""
    cache = tmp_path / "read-only"
    with contextlib.ExitStack() as stack:
        if os.geteuid() == 0:
            stack.enter_context(tmpfs(cache, "ro,size=64k"))
            cause = f"cannot write the build cache {cache}: Read-only file system; set GPTLITE_NATIVE_CACHE to a "
        else:
            cache.mkdir(mode=0o555)
            cause = f"cannot write the build cache {cache}: Permission denied; set GPTLITE_NATIVE_CACHE to a "
        code, lines = sample(char_run, GPTLITE_NATIVE_CACHE=str(cache))
    assert_falls_back(code, lines, pytorchs_text, cause + "writable folder")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs, which only root may")
def test_sample_goes_on_past_a_full_cache(char_run, pytorchs_text, tmp_path):
    with tmpfs(tmp_path / "full", "size=64k") as cache:
        code, lines = sample(char_run, GPTLITE_NATIVE_CACHE=str(cache))
        assert_falls_back(code, lines, pytorchs_text, "no space left for the build (")
        assert "No space left on device); free space in " in next(line for line in lines if "no space" in line)
        assert list(cache.iterdir()) == []  # no scratch folder left


def test_the_test_run_keeps_its_caches_out_of_the_users():
    """conftest points the run's caches (the compiled kernels, the kernel choices) at a folder of its own, for this
    process and the ones it starts: a test run leaves ~/.cache/gptlite as it found it."""
    from gptlite.inference.cpu.choices import choices_file
    from tests.conftest import RUN_CACHE

    code = "from gptlite.inference.cpu import native, choices; print(native.cache_dir()); print(choices.choices_file())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    for path in (native.cache_dir(), choices_file(), *map(Path, child.stdout.splitlines())):
        assert path.is_relative_to(RUN_CACHE) and not path.is_relative_to(Path.home() / ".cache"), path
