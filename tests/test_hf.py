"""Hugging Face Hub: real huggingface_hub client against a loopback Hub, offline cache, pinned revisions, push, timm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

pytest.importorskip("huggingface_hub")

from loopback import LoopbackHub  # noqa: E402

from bt_hub import cli  # noqa: E402
from bt_hub.common.files import file_sha256  # noqa: E402
from bt_hub.method.model import BarlowTwins, build_backbone  # noqa: E402
from bt_hub.weights import CheckpointError, PushError, from_pretrained, push_to_hub, save_pretrained  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _run(script: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


LOAD_SCRIPT = """
import torch
from bt_hub.weights import from_pretrained, load_backbone
main = from_pretrained("bt/barlowtwins-resnet50")
pinned = load_backbone("hf://bt/barlowtwins-resnet50@v1")
torch.save({"main": main.state_dict(), "pinned": pinned.state_dict()}, %r)
print(main.weights_info["file"])
"""


def test_weights_load_through_the_real_client_then_offline_with_a_pinned_revision(tmp_path):
    torch.manual_seed(0)
    resnet50 = {k: v for k, v in torchvision.models.resnet50().state_dict().items() if not k.startswith("fc.")}
    resnet18 = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.startswith("fc.")}
    folders = {}
    for name, state in (("main", resnet50), ("v1", resnet18)):
        backbone = torchvision.models.__dict__["resnet50" if name == "main" else "resnet18"]()
        backbone.fc = torch.nn.Identity()
        backbone.load_state_dict(state)
        folders[name] = _folder_files(save_pretrained(backbone, tmp_path / name, name="bt/barlowtwins-resnet50"))
    hub = LoopbackHub(
        {"bt/barlowtwins-resnet50": {"main": ("a" * 40, folders["main"]), "v1": ("b" * 40, folders["v1"])}}
    )
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
    }
    try:
        online = _run(LOAD_SCRIPT % str(tmp_path / "online.pt"), env)
    finally:
        hub.stop()
    assert "/snapshots/" + "a" * 40 + "/model.safetensors" in online
    assert ("GET", "/bt/barlowtwins-resnet50/resolve/v1/model.safetensors") in hub.requests
    offline = _run(LOAD_SCRIPT % str(tmp_path / "offline.pt"), {**env, "HF_HUB_OFFLINE": "1"})
    assert offline == online
    for run in ("online", "offline"):
        loaded = torch.load(tmp_path / f"{run}.pt", weights_only=True)
        for revision, expected in (("main", resnet50), ("pinned", resnet18)):
            assert set(loaded[revision]) == set(expected)
            assert all(torch.equal(loaded[revision][k], v) for k, v in expected.items()), (run, revision)


def test_push_to_hub_uploads_exactly_the_save_pretrained_folder(tmp_path, monkeypatch):
    import huggingface_hub

    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps(
            {
                "protocol": "linear",
                "preset": "paper",
                "dataset": "imagenet",
                "metrics": {"top1": 73.5, "top5": 91.0},
                "weights_sha256": "0" * 64,
            }
        )
    )
    uploads = []

    def record_upload(self, *, repo_id, folder_path, **kwargs):
        uploads.append({"repo_id": repo_id, "files": _folder_files(Path(folder_path)), **kwargs})
        return "commit-info"

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", record_upload)
    hub = LoopbackHub({})
    try:
        info = push_to_hub(model, "bt/pushed", private=True, token="hf_test", other_results=[results], endpoint=hub.url)
    finally:
        hub.stop()
    assert info == "commit-info"
    assert ("POST", "/api/repos/create") in hub.requests
    expected = _folder_files(save_pretrained(model, tmp_path / "pushed", other_results=[results], name="bt/pushed"))
    assert len(uploads) == 1 and uploads[0]["repo_id"] == "bt/pushed"
    assert sorted(uploads[0]["files"]) == ["README.md", "config.json", "model.safetensors", "projector.safetensors"]
    assert uploads[0]["files"] == expected


def test_model_card_and_config_carry_metadata_recipe_and_results(tmp_path):
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    run_config = {"dataset": "/home/me/imagenet", "epochs": 1000, "recipe": {"batch_size": 2048, "optimizer": "LARS"}}
    weights = save_pretrained(model, tmp_path / "weights") / "model.safetensors"
    ours = {"name": "model.safetensors", "fingerprint": file_sha256(weights)}
    results = [
        {
            "protocol": "linear",
            "preset": "paper",
            "dataset": "imagenet",
            "weights": ours,
            "metrics": {"top1": 73.5, "top5": 91.0},
        },
        {"protocol": "voc07-svm", "dataset": "voc2007", "weights": ours, "metrics": {"mAP": 86.2}},
    ]
    folder = save_pretrained(weights.parent, tmp_path / "card", config=run_config, results=results, name="bt/card")
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(folder / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "bt_hub" and data["license"] == "apache-2.0"
    assert {"self-supervised-learning", "image-feature-extraction"} <= set(data["tags"])  # provenance unknown
    assert data["datasets"] == ["imagenet"]
    metrics = {(r.task_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    network = "[resnet18, 7x7 stem, unknown image size]"
    assert metrics == {
        (f"linear {network} (preset paper)", "top1"): 73.5,
        (f"linear {network} (preset paper)", "top5"): 91.0,
        (f"voc07-svm {network}", "mAP"): 86.2,
    }
    assert 'from_pretrained("bt/card")' in card.text
    assert "| training length | 1000 epochs planned (the steps done are not recorded) |" in card.text
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "resnet18" and config["projector"] == "16-16" and config["epochs"] == 1000
    assert config["num_classes"] == 0 and config["pretrained_cfg"]["classifier"] == "fc"
    assert config["dataset"] == "imagenet"  # Guards: the run's absolute data path (a home folder) was published
    assert not [p.name for p in folder.iterdir() if b"/home/me" in p.read_bytes()]


def test_from_pretrained_is_strict_and_round_trips_backbone_and_projector(tmp_path):
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    folder = save_pretrained(model, tmp_path / "folder")
    backbone = from_pretrained(folder)
    assert all(torch.equal(backbone.state_dict()[k], v) for k, v in model.backbone.state_dict().items())
    from bt_hub.weights import barlow_twins

    whole = barlow_twins(weights=str(folder))
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in model.state_dict().items())
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state["layer4.1.bn2.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"model.safetensors does not fit resnet18: 1 keys are missing, first \['layer4.1.bn2.weight'\]",
    ):
        from_pretrained(folder)


def test_saved_folder_loads_in_timm_local_dir_with_the_same_features(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    with torch.no_grad():  # non-trivial BN statistics and residual BNs, so the comparison means something
        for module in model.backbone.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    folder = save_pretrained(model, tmp_path / "timm")
    ours = from_pretrained(folder).eval()
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=0).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected, got = ours(images), theirs(images)
    assert got.shape == (2, 512) and expected.abs().max() > 0
    assert torch.allclose(got, expected, atol=1e-5)


# ------------------------------------------------------------------ from_pretrained: PyTorchModelHubMixin's options

OPTIONS_SCRIPT = """
import json, sys, urllib.error, urllib.request
import torch
from bt_hub.weights import DownloadError, from_pretrained

url, tmp = sys.argv[1], sys.argv[2]


def mark(name):
    try:
        urllib.request.urlopen(f"{url}/marker/{name}")
    except urllib.error.HTTPError:
        pass


out, states = {}, {}
states["revision"] = from_pretrained("bt/rev", revision="v1", cache_dir=f"{tmp}/cache_rev").state_dict()
out["cache_dir_file"] = str(from_pretrained("bt/cache", cache_dir=f"{tmp}/cache_dir").weights_info["file"])
from_pretrained("bt/tok", cache_dir=f"{tmp}/cache_tok", token="hf_secret")
for force in (False, False, True):
    from_pretrained("bt/force", cache_dir=f"{tmp}/cache_force", force_download=force)
try:
    from_pretrained("bt/local", cache_dir=f"{tmp}/cache_local", local_files_only=True)
except DownloadError as err:
    out["local_error"] = str(err)
mark("local-first")
from_pretrained("bt/local", cache_dir=f"{tmp}/cache_local")
mark("local-downloaded")
states["local"] = from_pretrained("bt/local", cache_dir=f"{tmp}/cache_local", local_files_only=True).state_dict()
mark("local-end")
torch.save(states, f"{tmp}/states.pt")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hub_options(tmp_path_factory):
    """A child process calls from_pretrained with each Hub option against a loopback Hub; requests and headers kept."""
    tmp = tmp_path_factory.mktemp("hub_options")
    torch.manual_seed(0)
    main, v1 = build_backbone("resnet18"), build_backbone("resnet18")
    files = {name: _folder_files(save_pretrained(m, tmp / name)) for name, m in (("main", main), ("v1", v1))}
    repos = {f"bt/{r}": {"main": ("a" * 40, files["main"])} for r in ("cache", "tok", "force", "local")}
    repos["bt/rev"] = {"main": ("a" * 40, files["main"]), "v1": ("b" * 40, files["v1"])}
    hub = LoopbackHub(repos)
    auth: list[tuple[str, str | None]] = []

    class Recording(hub.server.RequestHandlerClass):
        def _resolve(self, with_body: bool) -> None:
            auth.append((self.path, self.headers.get("Authorization")))
            super()._resolve(with_body)

    hub.server.RequestHandlerClass = Recording
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="0")
    env["PYTHONPATH"] = str(REPO_ROOT)
    try:
        result = subprocess.run(
            [sys.executable, "-c", OPTIONS_SCRIPT, hub.url, str(tmp)], capture_output=True, text=True, env=env
        )
    finally:
        hub.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    states = torch.load(tmp / "states.pt", weights_only=True)
    return {"out": json.loads(result.stdout), "states": states, "hub": hub, "auth": auth, "tmp": tmp, "v1": v1}


def test_from_pretrained_revision_loads_that_revision(hub_options):
    assert ("GET", "/bt/rev/resolve/v1/model.safetensors") in hub_options["hub"].requests
    loaded, expected = hub_options["states"]["revision"], hub_options["v1"].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_from_pretrained_cache_dir_keeps_the_files_there(hub_options):
    tmp = hub_options["tmp"]
    assert hub_options["out"]["cache_dir_file"].startswith(str(tmp / "cache_dir") + os.sep)
    assert not (tmp / "hf_home" / "hub" / "models--bt--cache").exists()


def test_from_pretrained_token_is_sent_to_the_hub(hub_options):
    sent = {header for path, header in hub_options["auth"] if path.startswith("/bt/tok/")}
    assert sent == {"Bearer hf_secret"}
    assert {header for path, header in hub_options["auth"] if path.startswith("/bt/force/")} == {None}


def test_from_pretrained_force_download_fetches_a_cached_file_again(hub_options):
    gets = [r for r in hub_options["hub"].requests if r == ("GET", "/bt/force/resolve/main/model.safetensors")]
    assert len(gets) == 2  # the first call and the forced one; the second call read the cache


def test_from_pretrained_local_files_only_never_asks_the_hub(hub_options):
    paths = [path for _, path in hub_options["hub"].requests]
    first, downloaded, end = (paths.index(f"/marker/local-{m}") for m in ("first", "downloaded", "end"))
    assert not any(p.startswith("/bt/local/") for p in paths[:first] + paths[downloaded:end])
    assert any(p.startswith("/bt/local/") for p in paths[first:downloaded])
    assert hub_options["out"]["local_error"] == (
        f"hf://bt/local: model.safetensors is not in the Hugging Face cache ({hub_options['tmp'] / 'cache_local'}) "
        "and local_files_only=True; call once without local_files_only to fill the cache, or pass a cache_dir "
        "that holds it"
    )
    assert hub_options["states"]["local"].keys() == hub_options["states"]["revision"].keys()


def test_from_pretrained_of_a_missing_path_or_an_unknown_name_fails_without_a_hub_lookup(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="registered names: barlowtwins-in1k"):
        from_pretrained("no-such-weights")  # a name without org/ is the resolver's, as in load_backbone


# ------------------------------------------------------------------ push without a Hub


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_push_without_a_reachable_hub_is_one_sentence_naming_endpoint_repo_and_fix(tmp_path, monkeypatch, capsys):
    """Guards against the 72-line connection traceback of bt-hub push without a network."""
    import huggingface_hub.constants

    endpoint = _closed_port_url()
    folder = save_pretrained(build_backbone("resnet18"), tmp_path / "hf")
    with pytest.raises(PushError) as raised:
        push_to_hub(folder, "bt/pushed", token="hf_test", endpoint=endpoint)
    message = str(raised.value)
    assert message.startswith(f"could not reach the Hugging Face Hub at {endpoint} to push bt/pushed (")
    assert "Connection refused" in message and "\n" not in message
    assert message.endswith("check the network connection, or HF_ENDPOINT if you use a mirror; nothing was uploaded")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    assert cli.main(["push", "--weights", str(folder), "--repo-id", "bt/pushed", "--token", "hf_test"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"bt-hub push: error: could not reach the Hugging Face Hub at {endpoint} to push bt/pushed")


def test_every_flag_of_bt_hub_push_reaches_push_to_hub_under_its_own_name(tmp_path, monkeypatch):
    import bt_hub.weights.hf as hf

    results = tmp_path / "results.json"
    results.write_text("{}")
    calls = []
    monkeypatch.setattr(hf, "push_to_hub", lambda *args, **kwargs: calls.append((args, kwargs)))
    argv = ["push", "--weights", "w.pth", "--repo-id", "bt/pushed", "--private", "--token", "hf_x", "--revision", "dev"]
    argv += ["--results", str(results), "--other-results", str(results), "--license", "mit", "--commit-message", "m"]
    assert cli.main(argv) == 0
    assert calls == [
        (
            ("w.pth", "bt/pushed"),
            {
                "private": True,
                "token": "hf_x",
                "revision": "dev",
                "results": [str(results)],
                "other_results": [str(results)],
                "license": "mit",
                "commit_message": "m",
            },
        )
    ]


# ------------------------------------------------------------------ a silent or absent Hub

SILENT_HUB_SCRIPT = """
import sys, time
from bt_hub.weights import DownloadError, from_pretrained, load_backbone
calls = {"hf://org/name": lambda: load_backbone("hf://org/name"), "revision": lambda: from_pretrained("me/x", "v1")}
for name in sys.argv[1:]:
    start = time.monotonic()
    try:
        calls[name]()
    except DownloadError as err:
        print(f"{time.monotonic() - start:.1f} | {err}", flush=True)
"""


def _hub_calls(endpoint: str, tmp_path: Path, *calls: str) -> tuple[list[tuple[float, str]], str]:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    env = {k: v for k, v in env.items() if k not in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-c", SILENT_HUB_SCRIPT, *calls], capture_output=True, text=True, env=env, timeout=90
    )
    rows = [line.split(" | ", 1) for line in done.stdout.strip().splitlines()]
    return [(float(seconds), message) for seconds, message in rows], done.stderr


def test_a_hub_that_accepts_and_never_answers_fails_in_one_sentence_within_the_etag_timeout(tmp_path):
    """Guards: hf://org/name against a silent Hub had not finished after 170 s (six retries of 60 s)."""
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        calls, stderr = _hub_calls(endpoint, tmp_path, "hf://org/name")
    assert len(calls) == 1, stderr[-3000:]
    seconds, message = calls[0]
    assert seconds < 15, seconds
    assert message == (
        f"hf://org/name: model.safetensors could not be fetched from {endpoint} (no answer within 10 s; "
        f"HF_HUB_ETAG_TIMEOUT sets the limit) and is not in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}); "
        f"retry once the Hub at {endpoint} can be reached (set by HF_ENDPOINT), or point HF_HOME at a cache "
        "that holds it"
    )
    assert "Retrying" not in stderr and "thrown while requesting" not in stderr


def test_an_unreachable_hub_fails_at_once_without_retry_noise(tmp_path):
    """Guards: offline, hf://org/name took 27 s and printed 11 'Retrying in Ns' lines; a revision took 23 s."""
    endpoint = _closed_port_url()
    calls, stderr = _hub_calls(endpoint, tmp_path, "hf://org/name", "revision")
    assert len(calls) == 2, stderr[-3000:]
    for (seconds, message), spec in zip(calls, ("org/name", "me/x@v1")):
        assert seconds < 5, (seconds, message)
        assert message.startswith(f"hf://{spec}: model.safetensors could not be fetched from {endpoint} (ConnectError:")
        assert "Connection refused" in message and message.endswith("or point HF_HOME at a cache that holds it")
    assert stderr == ""
