"""LARS against a hand-written step, the parameter groups, and the schedule's endpoints."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bt_hub.method.optim import LARS, lr_at_step, param_groups, scaled_lr, set_learning_rates, trust_ratio


def _hand_lars_step(p, g, mu, lr, wd, momentum=0.9, eta=0.001, adapt=True):
    """The reference update written out with numbers: u = g + wd p; u *= η‖p‖/‖u‖; μ = mμ + u; p -= lr μ."""
    if adapt:
        u = g + wd * p
        pn, un = math.sqrt(float((p * p).sum())), math.sqrt(float((u * u).sum()))
        q = eta * pn / un if pn > 0 and un > 0 else 1.0
        u = u * q
    else:
        u = g
    mu = momentum * mu + u
    return p - lr * mu, mu


def test_one_lars_step_matches_hand_computation():
    w = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)  # ‖w‖ = 5
    b = torch.tensor([1.0, -2.0], dtype=torch.float64)
    gw = torch.tensor([[0.6, 0.0], [0.0, 0.8]], dtype=torch.float64)
    gb = torch.tensor([0.5, 0.25], dtype=torch.float64)
    pw, pb = nn.Parameter(w.clone()), nn.Parameter(b.clone())
    opt = LARS([{"params": [pw], "weight_decay": 0.1}, {"params": [pb], "weight_decay": 0.1}], lr=0.5)
    for _ in range(2):
        pw.grad, pb.grad = gw.clone(), gb.clone()
        opt.step()
    # the hand step, twice (momentum buffer carried over)
    ew, mw = _hand_lars_step(w, gw, torch.zeros_like(w), 0.5, 0.1)
    ew, mw = _hand_lars_step(ew, gw, mw, 0.5, 0.1)
    eb, mb = _hand_lars_step(b, gb, torch.zeros_like(b), 0.5, 0.1, adapt=False)
    eb, mb = _hand_lars_step(eb, gb, mb, 0.5, 0.1, adapt=False)
    torch.testing.assert_close(pw.detach(), ew, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pb.detach(), eb, rtol=1e-12, atol=1e-12)
    # first step by hand in plain numbers: u = g + 0.1 w = [[0.9, 0.4], [0, 0.8]], ‖u‖ = sqrt(1.61)
    q = 0.001 * 5 / math.sqrt(1.61)
    first = w - 0.5 * q * torch.tensor([[0.9, 0.4], [0.0, 0.8]], dtype=torch.float64)
    second_mu = 0.9 * q * torch.tensor([[0.9, 0.4], [0.0, 0.8]], dtype=torch.float64)
    u2 = gw + 0.1 * first
    q2 = 0.001 * float(first.norm()) / float(u2.norm())
    torch.testing.assert_close(pw.detach(), first - 0.5 * (second_mu + q2 * u2), rtol=1e-12, atol=1e-12)


def test_biases_and_batchnorm_get_no_weight_decay_and_no_adaptation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    groups = param_groups(model, lr_weights=0.2, lr_biases=0.0048, weight_decay=0.5)
    assert [p.ndim for p in groups[0]["params"]] == [2]
    assert sorted(p.ndim for p in groups[1]["params"]) == [1, 1, 1]
    assert groups[1]["weight_decay"] == 0.0 and groups[0]["weight_decay"] == 0.5
    before = [p.detach().clone() for p in groups[1]["params"]]
    # even with weight decay on the bias group, 1-D params are updated by plain momentum SGD
    opt = LARS([{"params": groups[1]["params"], "weight_decay": 10.0}], lr=0.1)
    for p in groups[1]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    for p, b in zip(groups[1]["params"], before):
        torch.testing.assert_close(p.detach(), b - 0.1)  # no decay term, no trust ratio


def test_trust_ratio_is_one_when_a_norm_is_zero():
    assert float(trust_ratio(torch.tensor(0.0), torch.tensor(2.0), 0.001)) == 1.0
    assert float(trust_ratio(torch.tensor(3.0), torch.tensor(0.0), 0.001)) == 1.0
    assert float(trust_ratio(torch.tensor(3.0), torch.tensor(2.0), 0.001)) == pytest.approx(0.0015)


def test_schedule_warms_up_from_zero_and_ends_at_one_thousandth():
    base = scaled_lr(0.2, 2048)
    assert base == pytest.approx(1.6)
    total, warm = 1000, 10
    assert lr_at_step(0, total, warm, base) == 0.0
    assert lr_at_step(5, total, warm, base) == pytest.approx(0.8)
    assert lr_at_step(warm, total, warm, base) == pytest.approx(base)
    assert lr_at_step(total, total, warm, base) == pytest.approx(base * 0.001)
    mid = warm + (total - warm) // 2
    assert lr_at_step(mid, total, warm, base) == pytest.approx(base * (1 + 0.001) / 2, rel=1e-3)
    rates = [lr_at_step(s, total, warm, base) for s in range(warm, total + 1)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_set_learning_rates_scales_each_group_by_batch_over_256():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = LARS(param_groups(model, 0.2, 0.0048))
    rates = set_learning_rates(opt, step=10, total_steps=100, warmup_steps=10, batch_size=512)
    assert rates == pytest.approx([0.4, 0.0096])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.4, 0.0096])


def _reference_lars_step(params, groups):
    """The reference code's LARS loop: one tensor at a time, the update in new tensors."""
    for p, g, mu, group in zip(params, groups["grads"], groups["mu"], groups["group"]):
        update = g
        if p.ndim != 1:
            update = update.add(p, alpha=group["weight_decay"])
            update = update.mul(trust_ratio(torch.norm(p), torch.norm(update), group["eta"]))
        mu.mul_(group["momentum"]).add_(update)
        p.add_(mu, alpha=-group["lr"])


def test_lars_updates_a_network_bit_for_bit_as_the_reference_loop_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 5), nn.Linear(5, 4))
    with torch.no_grad():
        model[4].weight.zero_()  # a zero norm: trust ratio 1
    reference = [p.detach().clone() for p in model.parameters()]
    groups = param_groups(model, 0.2, 0.0048, 1e-3)
    opt = LARS(groups, weight_decay=1e-3)
    for g in opt.param_groups:
        g["lr"] = 0.7
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    hand = {"mu": [torch.zeros_like(p) for p in reference], "group": [group_of[id(p)] for p in model.parameters()]}
    for _ in range(3):
        grads = [torch.randn_like(p) for p in reference]
        hand["grads"] = grads
        _reference_lars_step(reference, hand)
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        for p, r in zip(model.parameters(), reference):
            assert torch.equal(p.detach(), r)
