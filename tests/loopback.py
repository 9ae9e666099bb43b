"""HTTP servers on 127.0.0.1 for the tests: a file server with scripted misbehaviour, and a Hugging Face Hub."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading


class LoopbackFiles:
    """Serves ``routes[path]`` on 127.0.0.1: bytes, or a behaviour of a broken or slow server.

    A route is ``bytes`` (200 with Content-Length), ``("half", bytes)`` (announces the whole
    length, sends half, closes), ``("hang", None)`` (accepts, never answers), ``("status", code)``,
    ``("flaky", bytes)`` (HTTP 503 on the first request, then the bytes) or ``("html", bytes)``
    (200 with Content-Type text/html). Requests are counted per path.
    """

    def __init__(self, routes: dict[str, object]) -> None:
        self.routes = routes
        self.hits: dict[str, int] = {}
        self.release = threading.Event()
        files = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(
                self, code: int, body: bytes, length: int | None = None, content_type: str = "application/octet-stream"
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                files.hits[self.path] = files.hits.get(self.path, 0) + 1
                route = files.routes.get(self.path)
                kind, payload = route if isinstance(route, tuple) else ("file", route)
                if route is None:
                    return self._send(404, b"not found")
                if kind == "hang":
                    files.release.wait(60)
                    return None
                if kind == "half":
                    self._send(200, payload[: len(payload) // 2], length=len(payload))
                    self.close_connection = True
                    return None
                if kind == "status":
                    return self._send(payload, b"error")
                if kind == "flaky" and files.hits[self.path] == 1:
                    return self._send(503, b"busy")
                if kind == "html":
                    return self._send(200, payload, content_type="text/html")
                return self._send(200, payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class LoopbackHub:
    """Serves ``/{org}/{name}/resolve/{revision}/{filename}`` with the headers huggingface_hub reads.

    ``repos[repo_id][revision]`` is ``(commit sha, {filename: bytes})``; a commit sha also
    resolves. ``POST /api/repos/create`` answers as the Hub does. Requests are recorded.
    """

    def __init__(self, repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, headers: dict[str, str], body: bytes, with_body: bool) -> None:
                self.send_response(code)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def _resolve(self, with_body: bool) -> None:
                hub.requests.append((self.command, self.path))
                match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path.split("?")[0])
                if not match or match.group(1) not in hub.repos:
                    return self._send(404, {"X-Error-Code": "RepoNotFound"}, b"{}", with_body)
                repo, revision, filename = match.groups()
                found = hub.repos[repo].get(revision) or next(
                    (entry for entry in hub.repos[repo].values() if entry[0] == revision), None
                )
                if found is None:
                    return self._send(404, {"X-Error-Code": "RevisionNotFound"}, b"{}", with_body)
                commit, files = found
                if filename not in files:
                    return self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b"{}", with_body)
                body = files[filename]
                etag = hashlib.sha256(body).hexdigest()
                self._send(
                    200,
                    {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"},
                    body,
                    with_body,
                )

            def do_HEAD(self) -> None:
                self._resolve(with_body=False)

            def do_GET(self) -> None:
                self._resolve(with_body=True)

            def do_POST(self) -> None:
                hub.requests.append((self.command, self.path))
                length = int(self.headers.get("Content-Length", 0))
                payload = json.loads(self.rfile.read(length) or b"{}")
                if self.path.startswith("/api/repos/create"):
                    repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
                    body = json.dumps({"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id}).encode()
                    return self._send(200, {"Content-Type": "application/json"}, body, True)
                self._send(404, {}, b"{}", True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
