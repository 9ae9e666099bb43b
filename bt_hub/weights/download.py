"""The verified, URL-keyed download cache, bounded in time, and Hugging Face Hub files (docs/weights.md)."""

from __future__ import annotations

import http.client
import os
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from tqdm import tqdm

from bt_hub.common.artifacts import READ_ONLY, locked, not_writable
from bt_hub.common.files import CheckpointError, WriteError, atomic_write_text, file_sha256, read_file
from bt_hub.common.reuse import inputs_key

TIMEOUT_ENV = "BT_HUB_DOWNLOAD_TIMEOUT"
RETRIES_ENV = "BT_HUB_DOWNLOAD_RETRIES"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 2
HASH_IN_NAME = re.compile(r"-([a-f0-9]{8,64})\.")
_CHUNK = 1 << 20


class DownloadError(OSError):
    """A file could not be fetched or failed its checks; the message names the URL, the cache path and the fix."""


class _Retryable(Exception):
    """An attempt failed in a way another attempt may not (timeout, dropped connection, 5xx, short body)."""


def cache_path(url: str, file_name: str | None = None, sha256: str | None = None) -> Path:
    """Where ``url`` is (or will be) cached: ``<hub dir>/checkpoints/bt_hub/<key>/<file name>``, the key that of its
    inputs, the URL and the sha256 it must have where one is registered (``inputs_key`` of
    :mod:`bt_hub.common.reuse`): a new registered sha256 for the same URL is a new entry."""
    name = file_name or os.path.basename(urlparse(url).path)
    if not name or name in (".", ".."):
        raise ValueError(f"URL {url} names no file; pass file_name")
    key = inputs_key("download", {"url": url, "sha256": sha256.lower() if sha256 else None})[:16]
    return Path(torch.hub.get_dir()) / "checkpoints" / "bt_hub" / key / name


def expected_hash(file_name: str, sha256: str | None = None) -> tuple[str | None, str]:
    """The hash (or hash prefix) a file must have and where that comes from."""
    if sha256:
        return sha256.lower(), "registered sha256"
    match = HASH_IN_NAME.search(file_name)
    return (match.group(1), "hash prefix in its file name") if match else (None, "")


def _setting(name: str, given: float | None, default: float) -> float:
    if given is not None:
        return float(given)
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds/attempts") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} must be >= 0")
    return value


def _fixes(url: str, path: Path) -> str:
    return (
        f"nothing was cached at {path}; retry, or download {url} yourself and place the file at that path "
        f"(TORCH_HOME, now {os.environ.get('TORCH_HOME', 'unset')}, moves the cache)"
    )


def sha256_record(path: Path) -> Path:
    """The file beside a cached file that records its sha256 when no hash is expected (``<name>.sha256``)."""
    return path.with_name(path.name + ".sha256")


def _record_sha256(path: Path, sha256: str) -> None:
    atomic_write_text(sha256_record(path), f"{sha256}  {path.name}\n")


def recorded_sha256(path: Path) -> str | None:
    """The sha256 recorded beside ``path``, or None when there is no record."""
    record = sha256_record(path)
    if not record.is_file():
        return None
    recorded = record.read_text(encoding="utf-8", errors="replace").split(maxsplit=1)[:1]
    if not recorded or not re.fullmatch(r"[0-9a-f]{64}", recorded[0]):
        raise DownloadError(
            f"{record} does not hold the sha256 of {path.name} (64 hex digits); delete both files to download again"
        )
    return recorded[0]


def check_cached(path: Path, url: str, sha256: str | None, actual: str) -> str:
    """Return ``actual`` (the sha256 of the bytes read from the cached ``path``) if it is the expected one, else raise.

    With no expected hash it must be the one recorded beside the file (recorded now where there is none).
    """
    expected, origin = expected_hash(path.name, sha256)
    if expected is not None:
        if not actual.startswith(expected):
            raise DownloadError(
                f"cached file {path} has sha256 {actual[:16]}..., not the {origin} {expected[:16]} of {url}: "
                "it changed after it was verified; delete it to download it again"
            )
        return actual
    recorded = recorded_sha256(path)
    if recorded is None:
        try:
            _record_sha256(path, actual)
        except WriteError as err:  # a cache on read-only storage (a shared TORCH_HOME) is read, not recorded in
            if err.errno not in READ_ONLY:
                raise
    elif actual != recorded:
        raise DownloadError(
            f"cached file {path} has sha256 {actual[:16]}..., not the {recorded[:16]}... recorded in "
            f"{sha256_record(path).name} beside it when it was first used for {url}: it changed since; "
            "delete it to download it again"
        )
    return actual


def download(url: str, **options: Any) -> Path:
    """The cached, verified local copy of ``url``, downloaded first if it is not cached.

    Args (``options``, keyword-only, as :func:`download_unchecked` takes them):
        file_name: the name to keep in the cache (default: the URL's last path segment).
        sha256: the full sha256 the file must have (else the file name's hash prefix, if any, is checked).
        timeout: seconds to connect and to wait for each piece of data (default ``BT_HUB_DOWNLOAD_TIMEOUT`` or 30).
        retries: further attempts after a timeout, dropped connection, HTTP 5xx or short body
            (default ``BT_HUB_DOWNLOAD_RETRIES`` or 2).

    Raises:
        DownloadError: naming the URL, the cache path and the fix; nothing is left in the cache.
    """
    target, fresh = download_unchecked(url, **options)
    if not fresh:
        check_cached(target, url, options.get("sha256"), file_sha256(target))
    return target


def download_unchecked(
    url: str,
    *,
    file_name: str | None = None,
    sha256: str | None = None,
    progress: bool = True,
    timeout: float | None = None,
    retries: int | None = None,
) -> tuple[Path, bool]:
    """``download`` without hashing a cached file, and whether it was downloaded (and verified) now."""
    target = cache_path(url, file_name, sha256)
    if target.is_file():
        return target, False
    seconds = _setting(TIMEOUT_ENV, timeout, DEFAULT_TIMEOUT_S)
    attempts = 1 + int(_setting(RETRIES_ENV, retries, DEFAULT_RETRIES))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise not_writable(target.parent, err, "TORCH_HOME") if err.errno in READ_ONLY else err from None
    with locked(target.with_name(f".{target.name}.lock"), "TORCH_HOME"):  # one process fetches, the others wait
        if target.is_file():
            return target, False
        return _fetch_verified(url, target, sha256, seconds, attempts, progress), True


def _fetch_verified(url: str, target: Path, sha256: str | None, seconds: float, attempts: int, progress: bool) -> Path:
    """Fetch ``url`` into a staging folder beside ``target``, verify it, rename it into place (retrying)."""
    _remove_stale_staging(target.parent)
    reason = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
        try:
            partial = staging / target.name
            _fetch(url, partial, seconds, progress)
            _verify(partial, url, target, sha256)
            os.replace(partial, target)
            return target
        except _Retryable as err:
            reason = str(err)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
    raise DownloadError(f"download of {url} failed after {tries} ({reason}); {_fixes(url, target)}")


def _remove_stale_staging(folder: Path, idle_s: float = 3600.0) -> None:
    """Delete staging folders of downloads killed mid-way (idle for an hour; a live one writes every few seconds)."""
    for staging in folder.glob(".partial-*"):
        newest = max((p.stat().st_mtime for p in staging.rglob("*")), default=staging.stat().st_mtime)
        if time.time() - newest > idle_s:
            shutil.rmtree(staging, ignore_errors=True)


def _fetch(url: str, partial: Path, timeout: float, progress: bool) -> None:
    """Stream ``url`` into ``partial``; raise _Retryable or DownloadError."""
    request = urllib.request.Request(url, headers={"User-Agent": "bt_hub"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            expected = response.headers.get("Content-Length")
            size = 0
            with (
                open(partial, "wb") as f,
                tqdm(
                    total=int(expected) if expected else None,
                    unit="B",
                    unit_scale=True,
                    desc=partial.name,
                    disable=None if progress else True,
                ) as bar,
            ):
                while block := response.read(_CHUNK):
                    f.write(block)
                    size += len(block)
                    bar.update(len(block))
    except urllib.error.HTTPError as err:
        if err.code >= 500 or err.code in (408, 429):
            raise _Retryable(f"HTTP {err.code} {err.reason}") from None
        target = partial.parent.parent / partial.name  # partial is <target's folder>/.partial-*/<target's name>
        raise DownloadError(f"download of {url} failed: HTTP {err.code} {err.reason}; {_fixes(url, target)}") from None
    except (TimeoutError, ConnectionError, http.client.HTTPException, urllib.error.URLError, OSError) as err:
        raise _Retryable(_describe(err, timeout)) from None
    if expected is not None and size != int(expected):
        raise _Retryable(f"the server sent {size} of {expected} bytes")


def _describe(err: BaseException, timeout: float) -> str:
    inner = err.reason if isinstance(err, urllib.error.URLError) and isinstance(err.reason, BaseException) else err
    if isinstance(inner, TimeoutError):
        return f"no answer within {timeout:g} s; {TIMEOUT_ENV} sets the limit"
    if isinstance(inner, http.client.IncompleteRead):
        return f"the connection closed after {len(inner.partial)} bytes of the body"
    text = str(getattr(inner, "strerror", None) or inner).strip() or type(inner).__name__
    return f"{type(inner).__name__}: {text}"


def _verify(partial: Path, url: str, target: Path, sha256: str | None) -> None:
    """Hash and parse a complete download (not retried: the server would send the same bytes); with no expected
    hash, record its sha256 beside ``target``."""
    expected, origin = expected_hash(target.name, sha256)
    actual = file_sha256(partial)
    if expected is not None and not actual.startswith(expected):
        raise DownloadError(
            f"download of {url} has sha256 {actual[:16]}..., not the {origin} {expected[:16]}, so it was refused; "
            f"nothing was cached at {target}; a retry fetches the same bytes: check that the URL names the file "
            f"you meant (a replaced or forged file fails this check), or place at that path a file whose sha256 "
            f"starts with {expected[:16]}"
        )
    try:
        read_file(partial)
    except CheckpointError as err:
        raise DownloadError(f"download of {url} was refused: it {err.reason or err}; {_fixes(url, target)}") from None
    if expected is None:
        _record_sha256(target, actual)


def hf_download(
    spec: str,
    filename: str,
    *,
    required: bool = True,
    cache_dir: str | os.PathLike | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Path | None:
    """``filename`` of the Hub repo ``org/name[@revision]`` through huggingface_hub's cache, asked once, never retried.

    A failure is one ``DownloadError`` naming ``hf://spec``; ``required=False`` returns None for an absent file.
    """
    from bt_hub.common.optional import require

    purpose = "loading weights from the Hugging Face Hub"
    hf = require("huggingface_hub", purpose)
    errors, constants = require("huggingface_hub.errors", purpose), require("huggingface_hub.constants", purpose)
    repo_id, _, revision = spec.partition("@")
    where = f"hf://{spec}"
    endpoint = constants.ENDPOINT
    unreachable = None  # what went wrong with the one request to the Hub
    cached = re.fullmatch(r"[0-9a-f]{40}", revision) and hf.try_to_load_from_cache(
        repo_id, filename, cache_dir=cache_dir, revision=revision
    )
    try:
        if not (constants.HF_HUB_OFFLINE or local_files_only or (isinstance(cached, str) and not force_download)):
            unreachable = _ask_once(
                hf, errors, hf.hf_hub_url(repo_id, filename, revision=revision or None), token, constants
            )
        path = hf.hf_hub_download(
            repo_id,
            filename,
            revision=revision or None,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only or unreachable is not None,
            token=token,
        )
        return Path(path)
    except errors.LocalEntryNotFoundError as err:
        if not required:
            return None
        said = unreachable or first_line(err.__cause__ or err)
        raise _not_cached(where, filename, cache_dir, local_files_only, constants, said) from None
    except getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError):
        if not required:
            return None
        raise DownloadError(
            f"{where}: the repo has no file {filename} (a bt_hub folder holds model.safetensors and config.json)"
        ) from None
    except errors.RevisionNotFoundError:
        raise DownloadError(f"{where}: the repo {repo_id} at {endpoint} has no revision {revision!r}") from None
    except errors.RepositoryNotFoundError:
        raise DownloadError(
            f"{where}: the Hub at {endpoint} has no repo {repo_id} that you may read (check the name; a private repo "
            "needs a token: HF_TOKEN, `hf auth login` or token=...)"
        ) from None
    except errors.HFValidationError as err:
        raise DownloadError(f"{where}: {repo_id} is not a valid Hub repo id ({first_line(err)})") from None
    except hub_client_errors(errors) as err:  # HTTP and network errors
        raise DownloadError(
            f"{where}: {filename} could not be fetched from {endpoint} ({first_line(err)}); retry later"
        ) from None


def _not_cached(
    where: str, filename: str, cache_dir: Any, local_files_only: bool, constants: Any, said: str
) -> DownloadError:
    """Why ``filename`` is neither in the Hugging Face cache nor fetched: local_files_only, offline, or ``said``."""
    cache = cache_dir or constants.HF_HUB_CACHE
    elsewhere = "pass a cache_dir" if cache_dir else "point HF_HOME at a cache"
    if local_files_only:
        return DownloadError(
            f"{where}: {filename} is not in the Hugging Face cache ({cache}) and local_files_only=True; "
            f"call once without local_files_only to fill the cache, or {elsewhere} that holds it"
        )
    if constants.HF_HUB_OFFLINE:
        var = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
        return DownloadError(
            f"{where}: {filename} is not in the Hugging Face cache ({cache}) and "
            f"{var}={os.environ.get(var)} is set; connect once without {var} to fill the cache, "
            f"or {elsewhere} that holds it"
        )
    endpoint = constants.ENDPOINT
    moved = " (set by HF_ENDPOINT)" if os.environ.get("HF_ENDPOINT") else ""
    return DownloadError(
        f"{where}: {filename} could not be fetched from {endpoint} ({said}) and is not in the Hugging Face "
        f"cache ({cache}); retry once the Hub at {endpoint} can be reached{moved}, or {elsewhere} that holds it"
    )


def at_commit(spec: str, downloaded: Path) -> str:
    """``org/name@<commit>`` of a file ``hf_download`` returned, so the repo's other files come from the same commit."""
    return f"{spec.partition('@')[0]}@{downloaded.parent.name}"


def hub_client_errors(errors: Any) -> tuple[type[BaseException], ...]:
    """OSError and the Hub's HTTP client's error class, whose connection errors are not all OSErrors."""
    return (OSError, *(c for c in errors.HfHubHTTPError.__bases__ if c is not OSError))


def _ask_once(hf, errors, url: str, token: str | bool | None, constants) -> str | None:
    """One metadata request for ``url``, no retries: None when the Hub answered, else what went wrong."""
    try:
        hf.get_hf_file_metadata(url, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.EntryNotFoundError):
        raise
    except hub_client_errors(errors) as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status is not None and status < 500 and status not in (408, 429):
            raise  # the Hub answered: no retry would change it
        if "Timeout" in type(err).__name__:
            return f"no answer within {constants.HF_HUB_ETAG_TIMEOUT:g} s; HF_HUB_ETAG_TIMEOUT sets the limit"
        return first_line(err)  # no connection, no name lookup, HTTP 5xx / 408 / 429
    return None


def first_line(err: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
