"""bt_hub.eval.knn: faiss and torch search and DINO's weighted vote against brute force; the CLI end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bt_hub import cli
from bt_hub.eval.knn import knn_classify, knn_search, resolve_backend
from bt_hub.method.knn import hit_rates, knn_hits


def brute_force_knn(train_x, train_y, test_x, test_y, k, temperature, num_classes):
    """DINO's eval_knn.knn_classifier, written out in plain torch (all queries at once)."""
    sim = F.normalize(test_x, dim=1) @ F.normalize(train_x, dim=1).T
    top, idx = sim.topk(k, dim=1)
    one_hot = F.one_hot(train_y[idx], num_classes).float()
    probs = (one_hot * (top / temperature).exp().unsqueeze(-1)).sum(1)
    predictions = probs.argsort(dim=1, descending=True)
    correct = predictions.eq(test_y.view(-1, 1))
    top5 = correct[:, : min(5, k)].sum().item()  # DINO: top-5 over min(5, k) predictions
    return {"top1": 100.0 * correct[:, :1].sum().item() / len(test_y), "top5": 100.0 * top5 / len(test_y)}


def _random_problem(n=300, q=80, dim=16, classes=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g)
    train_y = torch.randint(0, classes, (n,), generator=g)
    test_y = torch.randint(0, classes, (q,), generator=g)
    train_x = centres[train_y] + 1.5 * torch.randn(n, dim, generator=g)
    test_x = centres[test_y] + 1.5 * torch.randn(q, dim, generator=g)
    return train_x, train_y, test_x, test_y


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_search_in_train_chunks_equals_brute_force_neighbours(backend):
    train_x, _, test_x, _ = _random_problem()
    sims, idx = knn_search(train_x, test_x, 20, query_batch=17, train_chunk=64, backend=backend)
    ref_sim, ref_idx = (F.normalize(test_x, dim=1) @ F.normalize(train_x, dim=1).T).topk(20, dim=1)
    assert torch.equal(idx, ref_idx)  # random continuous features: no ties
    torch.testing.assert_close(sims, ref_sim, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 20, 200])
def test_faiss_knn_accuracy_equals_brute_force_torch(k):
    train_x, train_y, test_x, test_y = _random_problem()
    ours = knn_classify(
        train_x, train_y, test_x, test_y, k=k, temperature=0.07, num_classes=7, query_batch=32, train_chunk=100
    )
    ref = brute_force_knn(train_x, train_y, test_x, test_y, k, 0.07, 7)
    assert ours == pytest.approx(ref)
    assert 20 < ours["top1"] < 100  # a real problem, not a trivial one


def test_memmapped_float16_features_give_the_same_neighbours(tmp_path):
    train_x, train_y, test_x, test_y = _random_problem()
    path = tmp_path / "train.npy"
    np.save(path, train_x.numpy().astype(np.float16))
    half = np.load(path, mmap_mode="r")
    ours = knn_classify(half, train_y, test_x, test_y, k=20, num_classes=7, train_chunk=50)
    ref = brute_force_knn(torch.from_numpy(np.asarray(half, dtype=np.float32)), train_y, test_x, test_y, 20, 0.07, 7)
    assert ours == pytest.approx(ref)


def test_separable_features_are_classified_perfectly_and_shuffled_labels_are_not():
    train_x, train_y, test_x, test_y = _random_problem(classes=5)
    train_x, test_x = (
        F.one_hot(train_y, 5).float() + 0.01 * train_x[:, :5],
        F.one_hot(test_y, 5).float() + 0.01 * test_x[:, :5],
    )
    assert knn_classify(train_x, train_y, test_x, test_y, k=20)["top1"] == 100.0
    shuffled = train_y[torch.randperm(len(train_y), generator=torch.Generator().manual_seed(1))]
    assert knn_classify(train_x, shuffled, test_x, test_y, k=20)["top1"] < 50.0


def test_vote_weights_are_exp_similarity_over_temperature():
    # two neighbours of class 0 at sim 0.5 outweigh... only when T is large; one of class 1 at 0.9 wins at T=0.07
    sims = torch.tensor([[0.9, 0.5, 0.5]])
    idx = torch.tensor([[0, 1, 2]])
    train_y = torch.tensor([1, 0, 0])
    assert hit_rates(knn_hits(sims, idx, train_y, torch.tensor([1]), 3, 0.07, 2))["top1"] == 100.0
    assert hit_rates(knn_hits(sims, idx, train_y, torch.tensor([1]), 3, 100.0, 2))["top1"] == 0.0


def test_k_larger_than_the_training_set_is_rejected():
    with pytest.raises(ValueError, match="k must be in"):
        knn_search(torch.randn(5, 3), torch.randn(2, 3), 6)


def test_auto_backend_is_faiss_on_the_cpu_and_torch_on_cuda_and_unknown_ones_are_refused():
    assert (resolve_backend("auto", "cpu"), resolve_backend("auto", "cuda:0"), resolve_backend("torch", "cpu")) == (
        "faiss",
        "torch",
        "torch",
    )
    with pytest.raises(ValueError, match="kNN backend 'annoy' is unknown"):
        knn_search(torch.randn(5, 3), torch.randn(2, 3), 2, backend="annoy")


def test_cli_knn_end_to_end_writes_results_json(small_stem_weights, tmp_path):
    weights = small_stem_weights
    out = tmp_path / "out"
    argv = [
        "eval",
        "knn",
        "--weights",
        str(weights),
        "--data",
        "synthetic:60",
        "--out",
        str(out),
        "--image-size",
        "16",
        "--batch-size",
        "32",
        "--k",
        "5",
        "20",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    assert cli.main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["protocol"] == "knn" and result["hyperparameters"]["k"] == [5, 20]
    assert set(result["metrics"]) == {"top1", "top5", "top1_k5", "top5_k5", "top1_k20", "top5_k20"}
    assert result["metrics"]["top1"] == result["metrics"]["top1_k5"]
    assert result["metrics"]["top1"] > 30.0  # 10 classes: random features of a random network still beat chance (10%)
    assert len(result["weights"]["fingerprint"]) == 64 and len(result["dataset"]["fingerprint"]) == 64
    assert result["notes"]["backend"] == "faiss"
    assert "ours: knn" in (out / "results.md").read_text()
    assert len(list((tmp_path / "cache").glob("*.meta.json"))) == 2  # train and test features cached


def test_cli_knn_rejects_bad_k_in_one_line(tmp_path, capsys):
    assert cli.main(["eval", "knn", "--weights", "x.pth", "--k", "0"]) == 2
    assert "--k must list positive integers" in capsys.readouterr().err
