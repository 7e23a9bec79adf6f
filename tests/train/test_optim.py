"""Muon (gptlite/train/optim.py) against torch.optim.Muon, per-logical-matrix orthogonalisation, which parameters it
gets in every variant, and optimizer="muon" through the train.py command: the schedule, learning_rate=0, exact resume,
the fp16 GradScaler."""

import math

import pytest
import torch

from gptlite.checkpoint import Optimizers, Weights, load_checkpoint
from gptlite.config import build_config
from gptlite.gpt import GPT
from gptlite.train.metrics import read_metrics
from gptlite.train.optim import (
    Muon,
    block_matrices,
    configure_optimizers,
    lr_at,
    lr_scale,
    newton_schulz,
    orthogonalise,
)
from gptlite.train.run_config import resolve_config
from tests.conftest import VARIANTS, run_train, tiny_config
from tests.test_train import config, one_thread, resume, write_corpus  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data"))


def singular_values(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(m.float())


# ---------------------------------------------------------------------------------------------
# the optimizer


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("shape", [(48, 16), (16, 40), (32, 32)], ids=["tall", "wide", "square"])
def test_one_unsplit_matrix_steps_exactly_as_torch_muon(shape):
    torch.manual_seed(0)
    ours, theirs = (torch.nn.Parameter(w) for w in torch.randn(shape).repeat(2, 1, 1))
    hyper = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
    opts = Muon([ours], **hyper), torch.optim.Muon([theirs], **hyper, nesterov=True, adjust_lr_fn="original")
    for _ in range(4):
        ours.grad, theirs.grad = torch.randn(shape).repeat(2, 1, 1)
        for opt in opts:
            opt.step()
        assert torch.equal(ours, theirs)
    assert torch.equal(opts[0].state[ours]["momentum_buffer"], opts[1].state[theirs]["momentum_buffer"])


def test_matrices_of_one_shape_are_orthogonalised_together_as_each_alone():
    torch.manual_seed(0)
    updates = [torch.randn(3 * 16, 16), torch.randn(3 * 16, 16)]  # two layers' qkv: six 16x16 matrices, one batch
    for update, together in zip(updates, orthogonalise(updates, split=3, dtype=torch.float32), strict=True):
        assert torch.equal(together, torch.cat([newton_schulz(m, torch.float32) for m in update.chunk(3)]))


def test_each_logical_matrix_is_orthogonalised_on_its_own():
    torch.manual_seed(0)
    g = torch.randn(3 * 32, 32)  # a fused qkv gradient: q, k, v stacked
    update = orthogonalise([g], split=3)[0]
    assert update.shape == g.shape and update.dtype == torch.bfloat16
    for part, alone in zip(update.chunk(3), g.chunk(3), strict=True):
        assert torch.equal(part, newton_schulz(alone))
        s = singular_values(part)
        assert 0.4 < s.min() and s.max() < 1.2 and 0.7 < s.median()  # orthogonal-ish: near 1, not at 1
    # the fused matrix orthogonalised whole (what torch.optim.Muon does) leaves q, k and v far from orthogonal
    assert all(singular_values(part).min() < 0.1 for part in newton_schulz(g).chunk(3))
    assert lr_scale(g.shape, 3) == 1.0 and lr_scale(g.shape) == 3**0.5
    assert lr_scale((2 * 96, 32), 2) == 3**0.5 and lr_scale((32, 96)) == 1.0  # SwiGLU's W1, W3; an out_proj


def test_muon_refuses_what_is_not_a_matrix():
    with pytest.raises(
        ValueError,
        match=r"Muon takes 2-D parameters whose rows split into 1 equal matrices, got "
        r"shape \(8,\); give other parameters to AdamW",
    ):
        Muon([torch.nn.Parameter(torch.ones(8))])
    with pytest.raises(ValueError, match=r"rows split into 3 equal matrices, got shape \(8, 4\)"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(8, 4))], "split": 3}])


# ---------------------------------------------------------------------------------------------
# which parameters, which groups


def muon_config(**overrides):
    return build_config(
        {"data_dir": "x", "optimizer": "muon", "learning_rate": 1e-3, "muon_lr": 0.03, **vars(tiny_config(**overrides))}
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_only_the_matrices_inside_the_blocks_go_to_muon(name):
    cfg = muon_config(**VARIANTS[name])
    model = GPT(cfg.model)
    adamw, muon = configure_optimizers(model, cfg, "cpu")
    names = {p: n for n, p in model.named_parameters()}
    split = {names[p]: group["split"] for group in muon.param_groups for p in group["params"]}
    fc = 2 if cfg.model.ffn == "swiglu" else 1
    q, kv = cfg.model.n_head * cfg.model.head_width, cfg.model.kv_heads * cfg.model.head_width
    qkv = 3 if q == kv else (q, kv, kv)  # grouped-query attention: q, k and v of their own row counts
    assert split == {
        f"blocks.{i}.{n}": s
        for i in range(cfg.model.n_layer)
        for n, s in (
            ("attn.qkv.weight", qkv),
            ("attn.out_proj.weight", 1),
            ("ffn.fc.weight", fc),
            ("ffn.out_proj.weight", 1),
        )
    }
    matrices, vectors = ({names[p] for p in group["params"]} for group in adamw.param_groups)
    assert matrices == {"tok_emb.weight"} | ({"pos_emb.table.weight"} if cfg.model.pos_emb == "learned" else set()) | (
        set() if cfg.model.tie_embeddings else {"lm_head.weight"}
    )
    assert vectors == {n for n, p in model.named_parameters() if p.dim() == 1}  # norms, biases, sinusoidal gain
    assert len(names) == len(split) + len(matrices) + len(vectors)  # every parameter once (the head is tok_emb)
    assert [(g["weight_decay"], g["lr_ratio"]) for g in adamw.param_groups] == [(0.1, 1.0), (0.0, 1.0)]
    assert {(g["weight_decay"], g["momentum"], g["lr_ratio"]) for g in muon.param_groups} == {(0.0, 0.95, 30.0)}
    assert block_matrices(model).keys() == {p for g in muon.param_groups for p in g["params"]}


def test_adamw_alone_is_one_optimizer_as_before():
    cfg = build_config({"data_dir": "x", **vars(tiny_config())})
    (adamw,) = configure_optimizers(GPT(cfg.model), cfg, "cpu")
    assert isinstance(adamw, torch.optim.AdamW) and len(adamw.param_groups) == 2


def test_a_muon_step_orthogonalises_q_k_v_and_swiglus_halves_apart():
    cfg = build_config({"data_dir": "x", "optimizer": "muon", "muon_momentum": 0, **vars(tiny_config())})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, muon = configure_optimizers(model, cfg, "cpu")
    model(*torch.randint(0, 97, (2, 4, 32)))[1].backward()
    for group in muon.param_groups:
        group["lr"] = 1.0
    assert muon.ns_dtype == torch.float32  # on the CPU (bfloat16 on CUDA)
    muon.step()  # momentum 0: the update is the gradient's
    for name, parts in (("blocks.0.attn.qkv.weight", 3), ("blocks.1.ffn.fc.weight", 2)):
        p = dict(model.named_parameters())[name]
        steps, grads = (before[name] - p.detach()).chunk(parts), p.grad.chunk(parts)
        wholes = newton_schulz(p.grad, torch.float32).chunk(parts)
        for step, grad, whole in zip(steps, grads, wholes, strict=True):
            expected = lr_scale(grad.shape) * newton_schulz(grad, torch.float32)  # lr_scale: 1 for (C, C), 2 for (F, C)
            torch.testing.assert_close(step, expected, atol=1e-6, rtol=1e-5)
            assert not torch.allclose(step, lr_scale(grad.shape) * whole, atol=1e-2)  # not the fused matrix's part


# ---------------------------------------------------------------------------------------------
# through train.py


def test_the_schedule_scales_muons_learning_rate_too(data, tmp_path, monkeypatch):
    seen, real_step = [], Muon.step

    def recording_step(self, *args, **kwargs):
        seen.append([g["lr"] for g in self.param_groups])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Muon, "step", recording_step)
    args = config(data, tmp_path, optimizer="muon", muon_lr=0.05, max_iters=8, eval_interval=8, lr_decay_iters=8)
    run_train(*args)
    cfg = resolve_config(args)
    expected = [lr_at(step, cfg) * 0.05 / cfg.learning_rate for step in range(8)]
    assert [lrs[0] for lrs in seen] == pytest.approx(expected) and all(len(set(lrs)) == 1 for lrs in seen)
    assert seen[2][0] == pytest.approx(0.05) and seen[-1][0] < 0.05  # the peak after warmup, then the decay


def test_learning_rate_0_leaves_every_weight_unchanged_with_muon(data, tmp_path):
    args = config(
        data,
        tmp_path,
        optimizer="muon",
        learning_rate=0,
        weight_decay=0,
        muon_weight_decay=0.1,
        max_iters=3,
        eval_interval=3,
    )
    run_train(*args)
    cfg = resolve_config(args)
    torch.manual_seed(cfg.seed)
    initial = GPT(cfg.model).state_dict()
    saved = load_checkpoint(tmp_path)
    assert all(torch.equal(saved["model"][k], v) for k, v in initial.items())  # bit for bit
    assert any(k.endswith("qkv.weight") and "momentum_buffer" in v for k, v in saved["optimizer"]["state"].items())


@pytest.mark.parametrize("name", ["learned", "gpt2", "llama"])
def test_muon_trains_and_resumes_exactly(data, tmp_path, name):
    kw = {
        **VARIANTS[name],
        "optimizer": "muon",
        "muon_weight_decay": 0.01,
        "dropout": 0.1,
        "eval_interval": 3,
        "lr_decay_iters": 6,
    }
    straight = run_train(*config(data, tmp_path / "straight", max_iters=6, **kw))
    run_train(*config(data, tmp_path / "resumed", max_iters=3, **kw))
    resumed = run_train(*resume(tmp_path / "resumed", "--max_iters=6"))
    assert resumed["history"] == straight["history"][3:]  # bit for bit
    assert straight["history"][-1][1] < straight["history"][0][1]
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_resume_refuses_another_optimizer_and_takes_changed_hyperparameters(data, tmp_path):
    run_train(*config(data, tmp_path, optimizer="muon", max_iters=2, eval_interval=2))
    with pytest.raises(
        ValueError,
        match=r"cannot change the optimizer on --resume from .*: optimizer=adamw "
        r"\(checkpoint has muon, whose state it holds\); drop --optimizer",
    ):
        resolve_config(resume(tmp_path, "--optimizer=adamw"))
    cfg = resolve_config(resume(tmp_path, "--muon_lr=0.01", "--muon_weight_decay=0.5", "--beta2=0.9"))
    model = GPT(cfg.model)
    adamw, muon = optimizers = configure_optimizers(model, cfg, "cpu")
    ckpt = load_checkpoint(tmp_path)
    Weights(model, None, tmp_path).load_state_dict(ckpt)
    Optimizers(model, optimizers).load_state_dict(ckpt)
    # the state comes from the checkpoint, the hyperparameters from this run's config
    qkv = model.blocks[0].attn.qkv.weight
    assert torch.equal(
        muon.state[qkv]["momentum_buffer"], ckpt["optimizer"]["state"]["blocks.0.attn.qkv.weight"]["momentum_buffer"]
    )
    assert {(g["lr_ratio"], g["weight_decay"]) for g in muon.param_groups} == {(0.01 / cfg.learning_rate, 0.5)}
    assert adamw.param_groups[0]["betas"] == (0.9, 0.9)


def test_a_checkpoint_from_before_lr_ratio_resumes(data, tmp_path):
    run_train(*config(data, tmp_path, max_iters=2, eval_interval=2))
    ckpt = load_checkpoint(tmp_path)
    for group in ckpt["optimizer"]["param_groups"]:
        del group["lr_ratio"]
    cfg = resolve_config(resume(tmp_path))
    model = GPT(cfg.model)
    (adamw,) = configure_optimizers(model, cfg, "cpu")
    Weights(model, None, tmp_path).load_state_dict(ckpt)
    Optimizers(model, [adamw]).load_state_dict(ckpt)
    assert [g["lr_ratio"] for g in adamw.param_groups] == [1.0, 1.0]
    assert adamw.state[model.tok_emb.weight]["step"] == 2


def test_fp16_unscales_both_optimizers_and_an_overflow_skips_both(data, tmp_path, monkeypatch):
    """Both optimizers' gradients are unscaled before the norm is taken and clipped; the GradScaler checks each
    optimizer's gradients on its own, so an inf in AdamW's alone must still stop Muon's step."""
    run_train(*config(data, tmp_path / "fp32", optimizer="muon", max_iters=1, eval_interval=1))
    calls, steps = {"adamw": 0, "muon": 0}, [0]
    real_unscale, real_adamw, real_muon = torch.amp.GradScaler.unscale_, torch.optim.AdamW.step, Muon.step

    def unscale(self, optimizer):  # called once per optimizer and step, AdamW's first, before the norm is taken
        if isinstance(optimizer, torch.optim.AdamW):
            steps[0] += 1
            if steps[0] == 2:  # step 2: an overflow in the token embedding's gradient only (AdamW's)
                optimizer.param_groups[0]["params"][0].grad[0, 0] = float("inf")  # tok_emb.weight
        return real_unscale(self, optimizer)

    def counting(name, real):
        def step(self, *args, **kwargs):
            calls[name] += 1
            return real(self, *args, **kwargs)

        return step

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale)
    monkeypatch.setattr(torch.optim.AdamW, "step", counting("adamw", real_adamw))
    monkeypatch.setattr(Muon, "step", counting("muon", real_muon))
    out = tmp_path / "fp16"
    summary = run_train(*config(data, out, optimizer="muon", dtype="float16", max_iters=3, eval_interval=3))
    assert calls == {"adamw": 2, "muon": 2} and summary["skipped_steps"] == 0  # the scaler's skip is no fault
    assert load_checkpoint(out)["scaler"]["scale"] == 2.0**15  # lowered once from 2**16
    fp32, fp16 = (
        [r["grad_norm"] for r in read_metrics(run / "metrics.jsonl") if "grad_norm" in r]
        for run in (tmp_path / "fp32", out)
    )
    assert fp16[0] == pytest.approx(fp32[0], rel=1e-2) and math.isinf(fp16[1])  # unscaled, as in float32
