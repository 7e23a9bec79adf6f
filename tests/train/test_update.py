"""The update decided on the device (gptlite.train.update): fused AdamW's skip of a non-finite step against no step at
all, the figures read one step late against the same figures read at once, and the choice between the two ways."""

import math

import pytest
import torch

from gptlite.train.optim import WeightAverage
from gptlite.train.update import DeviceUpdate, HostUpdate, make_update, skips_on_device, step_stats
from tests.conftest import DEVICE


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(DEVICE)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def backward(model: torch.nn.Module, seed: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's gradients: (the loss, the gradient norm), both NaN where `poison`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g).to(DEVICE)
    y = torch.randn(32, 4, generator=g).to(DEVICE)
    loss = (model(x) - y).square().mean()
    if poison:
        loss = loss * math.nan
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss.detach(), norm


def stats_of(loss: torch.Tensor, norm: torch.Tensor, minutes: float = 0.5, stop: bool = False) -> torch.Tensor:
    votes = torch.tensor([float(stop), 0.0, minutes], device=loss.device)
    return step_stats(loss, norm, {"reward": loss * 2}, votes)


@pytest.mark.device
def test_fused_adamw_skips_a_step_whose_found_inf_is_set_as_if_it_had_not_been_taken():
    """What DeviceUpdate relies on: fused AdamW given found_inf = 1 leaves the weights, both moments and the step
    count as they were, so that the next update is the one it would have been had the bad step never happened."""
    model, opt = model_and_optimizer()
    reference, ref_opt = model_and_optimizer()
    for seed in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            backward(m, seed)
            o.step()
            o.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, 99, poison=True)
    opt.found_inf = torch.ones((), device=DEVICE)
    opt.step()
    del opt.found_inf
    opt.zero_grad()
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    for seed in (3, 4):  # the next steps match a run that never saw the bad one
        for m, o in ((model, opt), (reference, ref_opt)):
            backward(m, seed)
            o.found_inf = torch.zeros((), device=DEVICE)
            o.step()
            del o.found_inf
            o.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for p, q in zip(opt.state.values(), ref_opt.state.values(), strict=True):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
        assert float(p["step"]) == float(q["step"]) == 5


@pytest.mark.device
def test_device_update_reads_each_step_one_step_late_and_matches_the_host_update():
    """Five steps, the third non-finite: the device's way gives the same weights, average and records as the host's,
    each record one call later, the last one on flush."""
    host_model, host_opt = model_and_optimizer()
    device_model, device_opt = model_and_optimizer()
    host_ema, device_ema = WeightAverage(host_model, 0.9), WeightAverage(device_model, 0.9)
    host = HostUpdate([host_opt], torch.amp.GradScaler(DEVICE.split(":")[0], enabled=False), host_ema)
    device = DeviceUpdate([device_opt], device_ema)
    host_records, device_records, returned = [], [], []
    for step in range(1, 6):
        poison = step == 3
        for model, update, records in ((host_model, host, host_records), (device_model, device, device_records)):
            loss, norm = backward(model, step, poison)
            got = update.apply(step, 0.1 * step, None, ["reward"], stats_of(loss, norm, minutes=step / 10))
            records += got
            if update is device:
                returned.append([r.step for r in got])
            model.zero_grad(set_to_none=True)
    assert device.pending
    device_records += device.flush()
    assert not device.pending and device.flush() == []
    assert returned == [[], [1], [2], [3], [4]]
    assert [r.step for r in device_records] == [1, 2, 3, 4, 5]
    for h, d in zip(host_records, device_records, strict=True):
        assert (h.step, h.lr, h.finite, h.stop, h.timed_out) == (d.step, d.lr, d.finite, d.stop, d.timed_out)
        assert h.minutes == pytest.approx(d.minutes)
        if h.finite:
            assert h.loss == d.loss and h.figures == d.figures and h.figures["reward"] == pytest.approx(2 * h.loss)
    assert [r.finite for r in device_records] == [True, True, False, True, True]
    # the non-finite step was skipped on the device: the weights are the host's, which never took it; the average
    # took the unchanged weights in once more (the host's skipped its update)
    for p, q in zip(host_model.parameters(), device_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert device_ema.updates == host_ema.updates + 1


@pytest.mark.device
def test_a_stop_vote_and_a_time_out_travel_with_their_step():
    model, opt = model_and_optimizer()
    device = DeviceUpdate([opt], None)
    loss, norm = backward(model, 1)
    assert device.apply(1, 0.1, "no batches", ["reward"], stats_of(loss, norm, stop=True)) == []
    (record,) = device.flush()
    assert record.stop and not record.timed_out and record.no_update == "no batches" and record.step == 1


def test_the_update_is_decided_on_the_device_only_on_a_gpu_with_fused_adamw_and_no_loss_scaler():
    model, opt = model_and_optimizer()
    off = torch.amp.GradScaler("cpu", enabled=False)
    muon_like = torch.optim.SGD(model.parameters(), lr=0.1)
    assert skips_on_device([opt], off, "cuda")
    assert not skips_on_device([opt], off, "cpu")  # nothing to gain where the host never runs ahead
    assert not skips_on_device([opt, muon_like], off, "cuda")  # an optimizer without found_inf
    unfused = torch.optim.AdamW(model.parameters(), fused=False)
    assert not skips_on_device([unfused], off, "cuda")
    assert isinstance(make_update([opt], off, None, "cpu"), HostUpdate)
    assert isinstance(make_update([opt], off, None, "cuda"), DeviceUpdate)
