"""A local server that speaks the Hugging Face Hub's HTTP API, as far as ``huggingface_hub``
asks it to: search (``/api/models``), a repo's info with file sizes
(``/api/models/REPO[/revision/REV]``) and files (``/REPO/resolve/REV/PATH``, with ranges),
a gated repo's 401 without a token, a missing repo's 404, and a connection dropped halfway
through a file once. Real files, served from memory; ``HF_ENDPOINT`` points the client at it."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

TOKEN = "hf_local_test_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    downloads: int = 0

    @property
    def sha(self) -> str:
        digest = hashlib.sha1()
        for path in sorted(self.files):
            digest.update(path.encode() + hashlib.sha256(self.files[path]).digest())
        return digest.hexdigest()


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_once: set[str] = field(default_factory=set)  # paths whose first GET is cut halfway
    ranges: list[tuple[str, str]] = field(default_factory=list)  # (path, Range) asked for
    gets: list[str] = field(default_factory=list)

    def add_folder(self, repo_id: str, folder: Path, *, gated: bool = False) -> Repo:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        self.repos[repo_id] = repo = Repo(files, gated)
        return repo


def serve(hub: Hub) -> tuple[ThreadingHTTPServer, str]:
    """The server on a free port of 127.0.0.1, in a daemon thread, and its URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, body: Any, status: int = 200, headers: dict[str, str] | None = None):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            self._json({"error": message}, status, {"X-Error-Code": code,
                                                    "X-Error-Message": message})  # fmt: skip

        def _authorized(self) -> bool:
            return self.headers.get("Authorization", "") == f"Bearer {TOKEN}"

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            path = unquote(url.path)
            if path == "/api/models":
                term = query.get("search", [""])[0].lower()
                found = [(rid, r) for rid, r in hub.repos.items() if term in rid.lower()]
                found.sort(key=lambda item: -item[1].downloads)
                limit = int(query.get("limit", ["1000"])[0])
                return self._json([{"id": rid, "modelId": rid, "downloads": r.downloads,
                                    "likes": 0, "private": False, "tags": []}
                                   for rid, r in found[:limit]])  # fmt: skip
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                repo = hub.repos.get(m.group(1))
                if repo is None:
                    return self._error(404, "RepoNotFound", f"Repository {m.group(1)} not found")
                siblings = [{"rfilename": p, "size": len(b)} for p, b in repo.files.items()]
                return self._json({"id": m.group(1), "modelId": m.group(1), "sha": repo.sha,
                                   "private": False, "gated": "auto" if repo.gated else False,
                                   "siblings": siblings, "tags": [], "downloads": 0})  # fmt: skip
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._file(m.group(1), m.group(3))
            return self._error(404, "EntryNotFound", f"no route {path}")

        def _file(self, repo_id: str, name: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            if repo.gated and not self._authorized():
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
            data = repo.files.get(name)
            if data is None:
                return self._error(404, "EntryNotFound", f"{name} not found in {repo_id}")
            start = 0
            asked = self.headers.get("Range")
            if asked and self.command == "GET":
                hub.ranges.append((name, asked))
                start = int(re.fullmatch(r"bytes=(\d+)-\d*", asked).group(1))  # type: ignore[union-attr]
            body = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", repo.sha)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            hub.gets.append(name)
            if name in hub.drop_once and not start:
                hub.drop_once.discard(name)
                self.wfile.write(body[: len(body) // 2])  # then the connection drops
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
