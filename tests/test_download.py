"""The download cache against loopback servers.

Keyed by URL, verified before it is kept, bounded in time, clear when it fails.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from loopback import LoopbackFiles

from bt_hub import cli
from bt_hub.common.files import WriteError
from bt_hub.method.model import build_backbone
from bt_hub.weights import BarlowTwinsWeights, DownloadError, cache_path, download, load_backbone
from bt_hub.weights.download import sha256_record

REPO_ROOT = Path(__file__).resolve().parents[1]


def _weights_bytes(seed: int) -> tuple[bytes, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    state = build_backbone("resnet18").state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue(), state


def _hash_named(data: bytes, stem: str = "resnet18") -> str:
    return f"/{stem}-{hashlib.sha256(data).hexdigest()[:8]}.pth"


def _equal(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def _leftovers(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.name.startswith(".partial-") or p.suffix in (".partial", ".tmp")
    )


@pytest.fixture(scope="module")
def weights_a_b():
    return _weights_bytes(1), _weights_bytes(2)


def test_same_file_name_under_two_urls_are_two_cache_entries(torch_home, weights_a_b):
    """Guards: the cache was keyed by file name, so .../b/resnet18.pth silently returned .../a's weights."""
    (data_a, state_a), (data_b, state_b) = weights_a_b
    server = LoopbackFiles({"/a/resnet18.pth": data_a, "/b/resnet18.pth": data_b})
    try:
        first = load_backbone(f"{server.url}/a/resnet18.pth", progress=False)
        second = load_backbone(f"{server.url}/b/resnet18.pth", progress=False)
    finally:
        server.stop()
    assert _equal(first, state_a) and _equal(second, state_b)
    assert cache_path(f"{server.url}/a/resnet18.pth") != cache_path(f"{server.url}/b/resnet18.pth")
    assert cache_path(f"{server.url}/a/resnet18.pth").name == "resnet18.pth"  # the readable name is kept


def test_hash_named_cached_file_is_checked_again_on_every_load(torch_home, weights_a_b):
    """Guards: replacing the bytes of a cached name-<sha8>.pth went unnoticed."""
    (data_a, state_a), (data_b, _) = weights_a_b
    name = _hash_named(data_a)
    server = LoopbackFiles({name: data_a})
    url = f"{server.url}{name}"
    try:
        assert _equal(load_backbone(url, progress=False), state_a)
    finally:
        server.stop()
    cached = cache_path(url)
    cached.write_bytes(data_b)
    with pytest.raises(DownloadError) as err:
        load_backbone(url, progress=False)
    text = str(err.value)
    assert f"cached file {cached} has sha256" in text and f"not the hash prefix in its file name {name[10:18]}" in text
    assert "delete it to download it again" in text and "\n" not in text


def test_truncated_body_is_never_cached_and_the_attempt_is_retried(torch_home, weights_a_b):
    """Guards: a server that sent half the body left a truncated file that every later load reused."""
    (data_a, _), _ = weights_a_b
    server = LoopbackFiles({"/half/resnet18.pth": ("half", data_a)})
    url = f"{server.url}/half/resnet18.pth"
    try:
        with pytest.raises(DownloadError) as err:
            download(url, progress=False, timeout=5, retries=1)
    finally:
        server.stop()
    text = str(err.value)
    assert text.startswith(f"download of {url} failed after 2 attempts (")
    assert f"nothing was cached at {cache_path(url)}" in text and "place the file at that path" in text
    assert server.hits["/half/resnet18.pth"] == 2
    assert not cache_path(url).exists() and _leftovers(torch_home) == []


def test_a_failed_attempt_is_retried_and_then_cached_and_a_killed_downloads_leftovers_are_removed(
    torch_home, weights_a_b
):
    (data_a, _), _ = weights_a_b
    server = LoopbackFiles({"/busy/resnet18.pth": ("flaky", data_a)})
    url = f"{server.url}/busy/resnet18.pth"
    killed, live = cache_path(url).parent / ".partial-killed", cache_path(url).parent / ".partial-live"
    for staging in (killed, live):
        staging.mkdir(parents=True)
        (staging / "resnet18.pth").write_bytes(b"half a file")
    os.utime(killed / "resnet18.pth", (time.time() - 7200, time.time() - 7200))
    try:
        path = download(url, progress=False, retries=1)
    finally:
        server.stop()
    assert server.hits["/busy/resnet18.pth"] == 2 and path.read_bytes() == data_a
    assert not killed.exists() and live.exists()  # a download running elsewhere keeps its folder


def test_a_download_without_an_expected_hash_records_its_sha256_and_a_later_change_is_refused(torch_home, weights_a_b):
    """Guards: a cached file with no hash to check was read whatever it had become since its download."""
    (data_a, state_a), (data_b, _) = weights_a_b
    server = LoopbackFiles({"/plain/resnet18.pth": data_a})
    url = f"{server.url}/plain/resnet18.pth"
    try:
        path = download(url, progress=False)
        record = path.with_name("resnet18.pth.sha256")
        sha = hashlib.sha256(data_a).hexdigest()
        assert record.read_text() == f"{sha}  resnet18.pth\n"
        path.write_bytes(data_b)
        with pytest.raises(DownloadError) as err:
            load_backbone(url, progress=False)
        assert str(err.value) == (
            f"cached file {path} has sha256 {hashlib.sha256(data_b).hexdigest()[:16]}..., not the {sha[:16]}... "
            f"recorded in resnet18.pth.sha256 beside it when it was first used for {url}: it changed since; "
            "delete it to download it again"
        )
        path.unlink()
        assert _equal(load_backbone(url, progress=False), state_a)  # the advice works: downloaded and verified again
    finally:
        server.stop()
    assert server.hits["/plain/resnet18.pth"] == 2 and record.read_text() == f"{sha}  resnet18.pth\n"


def test_server_that_never_answers_is_bounded_by_the_timeout(torch_home, monkeypatch):
    """Guards: a server that accepted the connection and never answered hung the command forever."""
    monkeypatch.setenv("BT_HUB_DOWNLOAD_TIMEOUT", "0.5")
    monkeypatch.setenv("BT_HUB_DOWNLOAD_RETRIES", "1")
    server = LoopbackFiles({"/slow/resnet18.pth": ("hang", None)})
    url = f"{server.url}/slow/resnet18.pth"
    outcome: list[BaseException] = []
    worker = threading.Thread(
        target=lambda: outcome.append(_raised(lambda: download(url, progress=False))), daemon=True
    )
    start = time.monotonic()
    worker.start()
    worker.join(30)  # a guard so a regression fails instead of hanging the suite
    server.stop()
    assert not worker.is_alive(), "download still hanging after 30 s"
    assert isinstance(outcome[0], DownloadError)
    assert "no answer within 0.5 s; BT_HUB_DOWNLOAD_TIMEOUT sets the limit" in str(outcome[0])
    assert time.monotonic() - start < 30
    assert not cache_path(url).exists() and _leftovers(torch_home) == []


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as err:  # noqa: BLE001 - handed to the test thread
        return err
    return None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_errors_and_refused_connections_name_the_url_the_cache_path_and_the_fix(torch_home):
    """Guards: a bare 'HTTP Error 404' / URLError named neither the URL nor the cache path."""
    server = LoopbackFiles({})
    missing = f"{server.url}/missing/resnet18.pth"
    try:
        with pytest.raises(DownloadError) as err:
            download(missing, progress=False)
    finally:
        server.stop()
    assert str(err.value) == (
        f"download of {missing} failed: HTTP 404 Not Found; nothing was cached at {cache_path(missing)}; "
        "retry, or download "
        f"{missing} yourself and place the file at that path (TORCH_HOME, now {torch_home}, moves the cache)"
    )
    assert server.hits["/missing/resnet18.pth"] == 1  # a 404 is not retried
    refused = f"http://127.0.0.1:{_closed_port()}/resnet18.pth"
    with pytest.raises(DownloadError) as err:
        download(refused, progress=False, retries=0)
    assert str(err.value).startswith(f"download of {refused} failed after 1 attempt (ConnectionRefusedError: ")
    assert f"nothing was cached at {cache_path(refused)}" in str(err.value)


HF_SCRIPT = """
from bt_hub.weights import load_backbone
for spec in ("hf://nobody/nothing", "nobody/nothing"):
    try:
        load_backbone(spec)
    except Exception as err:
        print(type(err).__name__, "|", err)
"""


def test_hub_failures_offline_name_the_spec(tmp_path):
    """Guards: hf://nobody/nothing offline said 'An error happened while trying to locate the file on the Hub'."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    offline = subprocess.run([sys.executable, "-c", HF_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    lines = offline.stdout.strip().splitlines()
    assert lines[0] == (
        "DownloadError | hf://nobody/nothing: model.safetensors is not in the Hugging Face cache "
        f"({tmp_path / 'hf' / 'hub'}) "
        "and HF_HUB_OFFLINE=1 is set; connect once without HF_HUB_OFFLINE to fill the cache, "
        "or point HF_HOME at a cache that holds it"
    ), offline.stderr[-2000:]
    assert lines[1] == (
        f"DownloadError | weights nobody/nothing: no such file or folder ({REPO_ROOT / 'nobody' / 'nothing'}), "
        f"and as a Hugging Face Hub id: {lines[0].split(' | ', 1)[1]}"
    )


BARE_SCRIPT = """
import sys
from bt_hub.weights import load_backbone
for spec in sys.argv[1:]:
    if spec == "--pause":
        print("paused", flush=True)
        sys.stdin.readline()
        continue
    try:
        print("loaded", spec, load_backbone(spec).weights_info["architecture"], flush=True)
    except Exception as err:
        print(type(err).__name__, "|", err, flush=True)
"""


def test_a_bare_org_name_that_is_no_folder_asks_the_hub_once_and_names_both_readings(tmp_path):
    """Guards: `--weights runs/nonexistent` spent ~23 s in huggingface_hub's retries, then advised unsetting an unset
    HF_HUB_OFFLINE."""
    pytest.importorskip("huggingface_hub")
    from loopback import LoopbackHub

    from bt_hub.weights import save_pretrained

    torch.manual_seed(0)
    folder = save_pretrained(build_backbone("resnet18", small_image_stem=True), tmp_path / "folder")
    files = {name: (folder / name).read_bytes() for name in ("model.safetensors", "config.json")}
    hub = LoopbackHub({"bt/r18": {"main": ("c" * 40, files)}})

    class FailingHub(hub.server.RequestHandlerClass):
        """Org "busy" answers HTTP 503; org "drop" closes the connection without an answer."""

        def _resolve(self, with_body: bool) -> None:
            org = self.path.split("/")[1]
            if org not in ("busy", "drop"):
                return super()._resolve(with_body)
            hub.requests.append((self.command, self.path))
            if org == "busy":
                return self._send(503, {}, b"busy", with_body)
            self.close_connection = True
            return None

    hub.server.RequestHandlerClass = FailingHub
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    specs = ["bt/r18", "busy/r18", "drop/r18", "./busy/r18", "busy/r18/x", "--pause", "org/name", "bt/r18"]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        script = subprocess.Popen(
            [sys.executable, "-c", BARE_SCRIPT, *specs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=work,
        )
        try:
            lines = [script.stdout.readline().strip() for _ in range(6)]
            hub.stop()  # from now on its port refuses connections
            script.stdin.write("\n")
            script.stdin.flush()
            lines += script.communicate(timeout=300)[0].strip().splitlines()
        finally:
            script.kill()
            hub.stop()
    said = log.read_text()
    assert lines[0] == "loaded bt/r18 resnet18", said[-3000:]
    for line, org, error in zip(lines[1:3], ("busy", "drop"), ("503 Service Unavailable", "Server disconnected")):
        assert line.startswith(
            f"DownloadError | weights {org}/r18: no such file or folder ({work / org / 'r18'}), and as a Hugging Face "
            f"Hub id: hf://{org}/r18: model.safetensors could not be fetched from {hub.url} ("
        ), line
        assert error in line and line.endswith(
            f"and is not in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}); retry once the Hub at {hub.url} can "
            "be reached (set by HF_ENDPOINT), or point HF_HOME at a cache that holds it"
        ), line
    assert lines[3:6] == [
        f"CheckpointError | weights ./busy/r18: no such file or folder ({work / 'busy' / 'r18'})",
        f"CheckpointError | weights busy/r18/x: no such file or folder ({work / 'busy' / 'r18' / 'x'})",
        "paused",
    ]
    failed = [request for request in hub.requests if request[1].startswith(("/busy/", "/drop/"))]
    assert failed == [
        ("HEAD", "/busy/r18/resolve/main/model.safetensors"),
        ("HEAD", "/drop/r18/resolve/main/model.safetensors"),
    ]  # one request each, no retries; the path-like spellings asked nothing
    assert lines[6].startswith(
        f"DownloadError | weights org/name: no such file or folder ({work / 'org' / 'name'}), and as a Hugging Face "
        f"Hub id: hf://org/name: model.safetensors could not be fetched from {hub.url} (ConnectError: "
    ), said[-3000:]
    assert "Connection refused" in lines[6] and "HF_HUB_OFFLINE" not in lines[6]
    assert lines[7] == "loaded bt/r18 resnet18"  # an unreachable Hub still leaves the cached copy usable
    assert "Retrying" not in said  # huggingface_hub's retry loop never ran


def test_an_html_page_served_instead_of_weights_is_refused_and_not_cached(torch_home):
    page = b"<!DOCTYPE html>\n<html><body>Please sign in</body></html>\n"
    server = LoopbackFiles({"/login/resnet18.pth": ("html", page)})
    url = f"{server.url}/login/resnet18.pth"
    try:
        with pytest.raises(DownloadError) as err:
            download(url, progress=False)
    finally:
        server.stop()
    assert str(err.value).startswith(
        f"download of {url} was refused: it is not a torch checkpoint "
        "(looks like HTML, perhaps an error or login page saved in its place); "
        f"nothing was cached at {cache_path(url)}"
    )
    assert not cache_path(url).exists() and _leftovers(torch_home) == []


def test_weights_download_fills_the_verified_cache_and_weights_verify_names_the_entry_a_file_is(
    torch_home, weights_a_b, monkeypatch, capsys
):
    """Guards: the cache could be filled ahead of an offline run only by loading the weights, and nothing said which
    registered weights a file is."""
    (data_a, _), (data_b, _) = weights_a_b
    member, sha = BarlowTwinsWeights.IN1K_LJNG, hashlib.sha256(data_a).hexdigest()
    server = LoopbackFiles({"/ljng/resnet50.pth": data_a})
    monkeypatch.setattr(member.value, "url", f"{server.url}/ljng/resnet50.pth")
    try:
        assert cli.main(["weights", "download", "barlowtwins-in1k-ljng"]) == 0
    finally:
        server.stop()
    cached = member.cache_path()
    said = (
        f"barlowtwins-in1k-ljng: {cached} (sha256 {sha}; none is published: {cached.name}.sha256 holds the first one)"
    )
    assert cached.read_bytes() == data_a and capsys.readouterr().out.strip() == said
    assert cli.main(["weights", "download", "barlowtwins-in1k-ljng"]) == 0  # no server: the cached copy, checked
    assert capsys.readouterr().out.strip() == said
    copy = torch_home.parent / "copy.pth"
    copy.write_bytes(data_a)
    assert cli.main(["weights", "verify", str(copy)]) == 0
    assert (
        capsys.readouterr().out.strip()
        == f"{copy}: sha256 {sha} is barlowtwins-in1k-ljng (recorded in {cached}.sha256)"
    )
    copy.write_bytes(data_b)
    assert cli.main(["weights", "verify", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bt-hub weights verify: error: {copy} (sha256 {hashlib.sha256(data_b).hexdigest()}) is none")
    assert (
        "it matches no sha256 of barlowtwins-in1k-ljng; barlowtwins-in1k, barlowtwins-in1k-full have no sha256" in err
    )
    cached.write_bytes(data_b)
    assert cli.main(["weights", "download", "barlowtwins-in1k-ljng"]) == 2
    assert "it changed since; delete it to download it again" in capsys.readouterr().err


def test_weights_download_checks_a_published_sha256_and_keeps_nothing_that_fails_it(
    torch_home, weights_a_b, monkeypatch, capsys
):
    (data_a, _), (data_b, _) = weights_a_b
    member, sha = BarlowTwinsWeights.IN1K_EP1000, hashlib.sha256(data_a).hexdigest()
    server = LoopbackFiles({"/good.pth": data_a, "/forged.pth": data_b})
    monkeypatch.setattr(member.value, "sha256", sha)
    try:
        monkeypatch.setattr(member.value, "url", f"{server.url}/forged.pth")
        assert cli.main(["weights", "download", "DEFAULT"]) == 2
        assert "so it was refused; nothing was cached at" in capsys.readouterr().err
        assert not member.cache_path().exists()
        monkeypatch.setattr(member.value, "url", f"{server.url}/good.pth")
        assert cli.main(["weights", "download", "DEFAULT"]) == 0
    finally:
        server.stop()
    assert capsys.readouterr().out.strip().endswith(f"(sha256 {sha}; registered sha256)")
    assert cli.main(["weights", "verify", str(member.cache_path())]) == 0
    assert capsys.readouterr().out.strip().endswith("is barlowtwins-in1k (its published sha256)")


def test_two_processes_asking_for_one_url_at_once_download_it_once(torch_home, weights_a_b):
    # Guards: each caller fetched the file into its own staging folder, the last rename winning (twice the bytes).
    (data_a, _), _ = weights_a_b
    server = LoopbackFiles({"/once/resnet18.pth": ("flaky", data_a)})  # 503, then the file 0.5 s later
    url = f"{server.url}/once/resnet18.pth"
    paths = []
    try:
        callers = [threading.Thread(target=lambda: paths.append(download(url, progress=False))) for _ in range(2)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
    finally:
        server.stop()
    assert server.hits["/once/resnet18.pth"] == 2  # the 503 and one download: the second caller waited, then read
    assert paths == [cache_path(url)] * 2 and cache_path(url).read_bytes() == data_a


def test_a_new_registered_sha256_for_the_same_url_is_a_new_cache_entry(torch_home, weights_a_b):
    # guards: the cache was keyed by the URL alone, so weights re-registered with a new sha256 at the same URL found
    # the old file and were refused as "changed after it was verified" (an input of the download changed)
    (data_a, _), (data_b, _) = weights_a_b
    sha_a, sha_b = hashlib.sha256(data_a).hexdigest(), hashlib.sha256(data_b).hexdigest()
    server = LoopbackFiles({"/w/resnet18.pth": data_a})
    url = f"{server.url}/w/resnet18.pth"
    try:
        first = download(url, sha256=sha_a, progress=False)
        server.routes["/w/resnet18.pth"] = data_b  # the file replaced upstream, and registered anew
        second = download(url, sha256=sha_b, progress=False)
    finally:
        server.stop()
    assert first != second and (first.read_bytes(), second.read_bytes()) == (data_a, data_b)
    assert second == cache_path(url, sha256=sha_b) and server.hits["/w/resnet18.pth"] == 2


def test_a_cached_file_on_read_only_storage_is_read_without_recording_its_sha256(torch_home, weights_a_b, monkeypatch):
    # Guards: a shared TORCH_HOME mounted read-only failed on the sha256 record bt_hub writes beside a file it uses
    (data_a, _), _ = weights_a_b
    server = LoopbackFiles({"/shared/resnet18.pth": data_a})
    url = f"{server.url}/shared/resnet18.pth"
    try:
        path = download(url, progress=False)
    finally:
        server.stop()
    sha256_record(path).unlink()  # as a cache filled by an older bt_hub, then mounted read-only
    download_module = sys.modules[sha256_record.__module__]
    monkeypatch.setattr(download_module, "atomic_write_text", lambda p, text: _raise_read_only(p))
    assert download(url, progress=False) == path and not sha256_record(path).exists()


def _raise_read_only(path):
    error = WriteError(f"could not write {path}")
    error.errno = errno.EROFS
    raise error
