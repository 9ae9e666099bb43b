"""The protocols held to the field's reference code: known answers that the reference functions returned.

tests/fixtures/reference/ holds, per protocol, the inputs (``<name>.npz``) and what the reference
function returned on them (``<name>.json``, with its repository and commit), as
benchmarks/reference_fixtures.py wrote them from checkouts of DINO, VISSL and the official Barlow
Twins code; no reference code is in this repository. RankMe is held to the paper's formula computed
in this file by NumPy's float64 SVD. These are the protocols' contract: a change that moves any of
these numbers changes the protocol.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from bt_hub.eval.classifier import evaluate_loader, make_classifier, make_loader, train_classifier
from bt_hub.eval.heads import score_heads, train_heads
from bt_hub.eval.knn import knn_classify, knn_search
from bt_hub.eval.linear import FrozenBackboneClassifier
from bt_hub.eval.rankme import RankmeConfig, score_cell
from bt_hub.eval.svm_grid import evaluate_svms, l2_normalize, svm_grid
from bt_hub.method.knn import hit_rates, knn_hits
from bt_hub.method.model import BarlowTwins, build_projector
from bt_hub.method.optim import LARS, param_groups, set_learning_rates

FIXTURES = Path(__file__).parent / "fixtures" / "reference"


def _fixture(name: str) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(FIXTURES / f"{name}.npz") as inputs:
        arrays = {k: inputs[k] for k in inputs.files}
    return arrays, json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture
def one_thread():
    """The reduction order the fixtures were written with (torch on one thread); small ops run faster too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- kNN: DINO's knn_classifier


def _predictions(sims, idx, train_y, k, temperature, classes):
    """Each query's class, found as the fixture found DINO's: the label with which the query alone scores 100."""
    found = []
    for i in range(len(sims)):
        query = sims[i : i + 1], idx[i : i + 1]
        found.append(
            next(
                c
                for c in range(classes)
                if hit_rates(knn_hits(*query, train_y, torch.tensor([c]), k, temperature, classes))["top1"]
            )
        )
    return found


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_knn_equals_dinos_knn_classifier_at_k_20_and_200(backend, one_thread):
    data, reference = _fixture("knn")
    train_y, test_y = torch.from_numpy(data["train_y"]), torch.from_numpy(data["test_y"])
    classes = reference["num_classes"]
    temperature = reference["temperature"]
    sims, idx = knn_search(data["train_x"], data["test_x"], 200, backend=backend)
    for k, expected in reference["results"].items():
        k = int(k)
        got = knn_classify(data["train_x"], train_y, data["test_x"], test_y, k, temperature, classes, backend=backend)
        assert (got["top1"], got["top5"]) == (expected["top1"], expected["top5"]), k
        predictions = _predictions(sims, idx, train_y, k, temperature, classes)
        assert predictions == expected["predictions"], k


# ----------------------------------------------------------------------------- VOC07 SVMs: VISSL's SVMTrainer


def test_voc07_svms_choose_vissls_cost_per_class_and_score_its_test_ap():
    data, reference = _fixture("svm")
    expected = reference["results"]
    cv_ap, weights, biases, best = svm_grid(
        l2_normalize(data["train_x"]), data["train_y"], expected["costs"], n_jobs=1, seed=0
    )
    assert best == expected["chosen_cost"]
    ap, _ = evaluate_svms(weights, biases, l2_normalize(data["test_x"]), data["test_y"])
    np.testing.assert_allclose(ap, expected["test_ap"], rtol=0, atol=1e-9)
    # Where liblinear converges (costs <= 10 on these inputs, with a margin) the cross-validated APs are VISSL's
    # too; from 20 up some fits stop at max_iter 2000 and their AP depends on the shuffle seed (VISSL draws it
    # from numpy's global generator, bt_hub passes --seed), up to ~2e-3 apart for two seeds.
    converged = np.array(expected["costs"]) <= 10
    np.testing.assert_allclose(cv_ap[:, converged], np.array(expected["crossval_ap"])[:, converged], rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------- ten LARS steps: official main.py

EPS = 2.0**-23  # float32's relative spacing: one ulp of a number in [1, 2)
# Tolerances, in float32 ulps, of ten steps from initialisation against the official step (fixtures written on
# one thread, the test run on one thread). What they rest on, measured on this model and random batches:
# - With the same kernels on both sides (one thread each, or two each), the dense and the Gram form alike stay
#   within 0.06-0.07 ulps of |p| of the official parameters after 13 steps and 0.11 after 30, and the fixture's
#   loss within 1 ulp and displacement norms within 4 ulps. Per step, the Gram form's gradient rounds no worse
#   than the dense one: 1-18 ulps from float64, against 2-23 for the dense form and 2-18 for the official
#   formula in float32, all growing as the two views correlate (the invariance term cancels as C_ii -> 1).
# - What can move the trajectory is a change of kernels, as another CPU brings. The same dense step on two
#   threads against one: on the fixture's batches 0.07 ulps of |p| after ten steps (the loss within 1 ulp, the
#   displacement norms within 15 ulps, either form); on another seeded sequence of batches it jumped from 0.01
#   to 56 ulps of |p| within five steps and reached 135 after 10 and 1,073 after 60, where the Gram form against
#   the dense one on the same kernels stayed at 0.02, 0.05 and 0.85.
# So the Gram form can promise what the dense one does, 64 ulps of each displacement (4x the kernel-change case
# on these batches), over ten steps from initialisation; neither promises a bound for long runs, where one
# rounding difference can be amplified by orders of magnitude.
LOSS_ULPS = {"dense": 8, "gram": 8}
DISPLACEMENT_ULPS = {"dense": 64, "gram": 64}


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_ten_lars_steps_follow_the_official_step(method, one_thread):
    data, reference = _fixture("lars")
    settings, expected = reference["settings"], reference["results"]
    model = BarlowTwins("resnet18", settings["projector"], loss_method=method)
    model.backbone = nn.Sequential(nn.Linear(24, 2048), nn.ReLU())  # the fixture's stand-in for ResNet-50
    model.projector = build_projector(2048, settings["projector"])
    init = {k.removeprefix("init/"): torch.from_numpy(v.astype(np.float32)) for k, v in data.items() if "/" in k}
    model.load_state_dict(init, strict=False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = param_groups(
        model, settings["learning_rate_weights"], settings["learning_rate_biases"], settings["weight_decay"]
    )
    optimizer = LARS(groups, weight_decay=settings["weight_decay"])
    for i, step in enumerate(settings["steps"]):
        rates = set_learning_rates(
            optimizer, step, settings["total_steps"], settings["warmup_steps"], settings["batch_size"]
        )
        np.testing.assert_allclose(rates, expected["lrs"][i], rtol=1e-15)
        y_a, y_b = (torch.from_numpy(v) for v in data["views"][i])
        loss = model(y_a, y_b).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert float(loss.detach()) == pytest.approx(expected["losses"][i], rel=LOSS_ULPS[method] * EPS, abs=0), step
        with torch.no_grad():
            moved = {n: float((p.double() - start[n].double()).norm()) for n, p in model.named_parameters()}
            norms = {n: float(p.double().norm()) for n, p in model.named_parameters()}
        assert moved == pytest.approx(expected["moved"][i], rel=DISPLACEMENT_ULPS[method] * EPS, abs=0), step
        assert norms == pytest.approx(expected["norms"][i], rel=EPS, abs=0), step


# ----------------------------------------------------------------------------- linear head: official evaluate.py


def _linear_data():
    data, reference = _fixture("linear")
    train = TensorDataset(torch.from_numpy(data["train_x"]), torch.from_numpy(data["train_y"]))
    test = TensorDataset(torch.from_numpy(data["test_x"]), torch.from_numpy(data["test_y"]))
    return data, reference["results"], train, test


def test_the_paper_classifier_starts_where_evaluate_py_starts():
    data, _, _, _ = _linear_data()
    torch.manual_seed(0)
    fc = make_classifier(64, 10)
    assert torch.equal(fc.weight, torch.from_numpy(data["initial_fc_weight"]))
    assert torch.equal(fc.bias, torch.from_numpy(data["initial_fc_bias"]))


# The fixture was written on an AVX-512 CPU, where this loop reproduces evaluate.py bit for bit. The gradient of
# the head is a sum over the batch whose order follows the CPU's matrix kernels, so on another CPU (AVX2-only,
# AMX) the weights round differently in their last bits: measured on an AVX2-only EPYC, 1.25 ulps of the largest
# weight (7.5e-8) after the epoch, the loss 0.14 ulps apart, the accuracies equal. The tolerances leave a
# margin of about 4x over that and stay far below what any change to the loop (its LR, momentum, schedule,
# weight decay or order of batches) moves, which is 1e-4 and more.
HEAD_ULPS = 4  # of the largest trained weight (float32 ulps of a number in [1, 2), scaled by it)
LOSS_ULPS_LINEAR = 1


def test_the_linear_probe_loop_trains_evaluate_pys_first_epoch():
    data, expected, train, test = _linear_data()
    fc = nn.Linear(64, 10)
    fc.load_state_dict({name: torch.from_numpy(data[f"initial_fc_{name}"]) for name in ("weight", "bias")})
    model = FrozenBackboneClassifier(nn.Identity(), fc)
    cpu = torch.device("cpu")
    loader = make_loader(train, 64, shuffle=True, seed=0, num_workers=0, device=cpu)
    losses = []
    train_classifier(
        model,
        [{"params": list(fc.parameters()), "lr": 0.3}],
        loader,
        epochs=1,
        momentum=0.9,
        weight_decay=1e-6,
        schedule="cosine",
        milestones=[],
        gamma=0.1,
        device=cpu,
        desc="linear",
        on_epoch=lambda epoch, loss: losses.append(loss),
    )
    for name in ("weight", "bias"):
        trained = data[f"trained_fc_{name}"]
        atol = HEAD_ULPS * EPS * float(np.abs(trained).max())
        np.testing.assert_allclose(getattr(fc, name).detach().numpy(), trained, rtol=0, atol=atol, err_msg=name)
    assert losses == [pytest.approx(np.mean(expected["losses"]), rel=LOSS_ULPS_LINEAR * EPS, abs=0)]
    scored = evaluate_loader(model, make_loader(test, 64, shuffle=False, seed=0, num_workers=0, device=cpu), cpu)
    assert scored == {"top1": expected["acc1"], "top5": expected["acc5"]}


def test_the_cached_linear_heads_train_evaluate_pys_first_epoch():
    data, expected, train, test = _linear_data()
    heads = train_heads(
        data["train_x"], torch.from_numpy(data["train_y"]), 10, lrs=[0.3], weight_decays=[1e-6], epochs=1, batch_size=64
    )
    np.testing.assert_allclose(heads.weight[0].numpy(), data["trained_fc_weight"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(heads.bias[0].numpy(), data["trained_fc_bias"], rtol=0, atol=1e-6)
    scored = score_heads(heads, data["test_x"], torch.from_numpy(data["test_y"]))[0]
    assert (scored["top1"], scored["top5"]) == (expected["acc1"], expected["acc5"])


# ----------------------------------------------------------------------------- RankMe: the paper's formula in NumPy


def _numpy_rankme(features: np.ndarray) -> float:
    """Garrido et al.'s RankMe by NumPy's float64 SVD: exp(-sum p log p), p = sigma / sum(sigma) + 1e-7."""
    sigma = np.linalg.svd(features.astype(np.float64), compute_uv=False)
    p = sigma / sigma.sum() + 1e-7
    return float(np.exp(-(p * np.log(p)).sum()))


def test_rankme_equals_a_float64_numpy_computation_on_the_same_features():
    # guards: a RankMe off the paper's formula (centred features, no epsilon, float32 singular values); the tolerance
    # is 1e-9 where the matrix has full rank and 1e-4 where its rank is below min(N, D): the Gram matrix's rounding
    # leaves ~5e-8 of the largest singular value where the SVD finds 0 (measured in bt_hub/method/rankme.py)
    rng = np.random.default_rng(0)
    full = {
        "ReLU features, N > D": np.maximum(rng.standard_normal((5000, 64)) @ rng.standard_normal((64, 256)), 0) + 0.01,
        "N < D, far from centred": rng.standard_normal((40, 512)) + 3.0,
    }
    deficient = {"rank 8 of 96": rng.standard_normal((300, 8)) @ rng.standard_normal((8, 96))}
    for rtol, cases in ((1e-9, full), (1e-4, deficient)):
        for name, x in cases.items():
            features = x.astype(np.float32)
            cell = SimpleNamespace(features=lambda split, f=features: (f, np.zeros(len(f), dtype=np.int64)))
            scored = score_cell(cell, RankmeConfig(weights="planted", out=None), seed=0)
            assert scored.metrics["rankme"] == pytest.approx(_numpy_rankme(features), rel=rtol, abs=0), name
            assert scored.notes["outputs"]["rankme"]["max_value"] == min(features.shape), name
