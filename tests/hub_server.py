"""A real HTTP server on 127.0.0.1 that follows the Hugging Face Hub's upload protocol as huggingface_hub
speaks it, for tests (`HF_ENDPOINT=http://127.0.0.1:<port>`, `HF_HUB_DISABLE_XET=1`).

What `HfApi.create_repo` and `HfApi.upload_folder` (through `create_commit`) call, without Xet storage:

- `POST /api/repos/create` {name, organization, visibility (1.x: private), type}: 200 with the repo's URL,
  409 if it exists.
- `POST /api/validate-yaml` {content, repoType}: a README.md's metadata header is checked before a commit.
- `POST /api/models/<repo>/preupload/<rev>` {files: [{path, sample, size}]}: each file's upload mode, "lfs"
  (weights and other binaries, or anything over 10 MB) or "regular", and the oid of the file already there.
- `POST /<repo>.git/info/lfs/objects/batch` (git-lfs batch API, "basic" transfer): an upload and a verify
  action per object not stored yet; `PUT` of the bytes to the upload URL (sha256 checked), `POST` verify.
- `GET /api/models/<repo>/tree/<rev>?recursive=...`: the files (for `delete_patterns`); `GET
  /api/models/<repo>/revision/<rev>`: the repo's head (a commit with nothing new asks for it).
- `POST /api/models/<repo>/commit/<rev>`: NDJSON, a header line then `file` (base64), `lfsFile` (an oid
  uploaded before) and `deletedFile` / `deletedFolder` lines; applied at once, 200 with the commit's id.

Every request needs `Authorization: Bearer <token>` (401 otherwise), but the LFS upload URL, which is
presigned (as S3's are: the client sends no token there). `script.delay` holds commits up,
`script.hold_first_commit_until` the first one until a condition holds; `free_port_url()` is an endpoint where
nothing listens, `silent_endpoint()` one that accepts connections and never answers. Every request is
recorded as it arrives and, once answered, with its headers and body (where a test looks for the token).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml

USER = "recipe-tester"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".model")
LFS_MIN_BYTES = 10 * 1024 * 1024
HOLD_LIMIT_S = 300.0


@dataclass
class Seen:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    status: int


@dataclass
class Commit:
    repo_id: str
    oid: str
    summary: str
    files: dict[str, bytes]  # the repo's files after the commit


@dataclass
class Repo:
    repo_id: str
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)


@dataclass
class Script:
    """How the server misbehaves; change the fields at any time."""

    delay: float = 0.0  # seconds before answering a commit
    # The first commit is held until this says so (checked every 50 ms, for at most HOLD_LIMIT_S).
    hold_first_commit_until: Callable[[], bool] | None = None


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    """The Hub's upload endpoints on 127.0.0.1:<free port>, serving from a thread."""

    def __init__(self) -> None:
        self.token = "hf_" + secrets.token_urlsafe(30)
        self.script = Script()
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[Seen] = []  # answered
        self.arrivals: list[str] = []  # "METHOD path" of every request, answered or not
        self._lock = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self, "GET")

            def do_POST(self) -> None:
                server._handle(self, "POST")

            def do_PUT(self) -> None:
                server._handle(self, "PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def commits(self, repo_id: str) -> list[Commit]:
        with self._lock:
            return list(self.repos[repo_id].commits) if repo_id in self.repos else []

    def files(self, repo_id: str) -> dict[str, bytes]:
        with self._lock:
            return dict(self.repos[repo_id].files) if repo_id in self.repos else {}

    def wait_for_commits(self, repo_id: str, n: int, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        with self._lock:
            while len(self.repos[repo_id].commits if repo_id in self.repos else []) < n:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- serving -----------------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        with self._lock:
            self.arrivals.append(f"{method} {h.path}")
        path, query = urllib.parse.urlsplit(h.path)[2:4]
        # The LFS upload URL is presigned, as S3's are: the client sends no token there.
        presigned = method == "PUT" and path.startswith("/lfs-upload/")
        if presigned and query != f"signature={self._signature(path)}":
            status, reply = 403, {"error": "bad signature"}
        elif not presigned and h.headers.get("Authorization") != f"Bearer {self.token}":
            status, reply = 401, {"error": "Invalid credentials in Authorization header"}
        else:
            try:
                status, reply = self._route(method, path, query, body)
            except Exception as e:  # a request the fake does not understand is a test failure, said plainly
                status, reply = 500, {"error": f"fake Hub: {type(e).__name__}: {e}"}
        with self._lock:
            headers = {k.lower(): v for k, v in h.headers.items()}
            self.requests.append(Seen(method, h.path, headers, body, status))
            self._lock.notify_all()
        data = json.dumps(reply).encode()
        with contextlib.suppress(OSError):
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)

    def _route(self, method: str, path: str, query: str, body: bytes) -> tuple[int, Any]:
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(json.loads(body))
        if method == "POST" and path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(body))
        if method == "PUT" and (m := re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)):
            if hashlib.sha256(body).hexdigest() != m[1]:
                return 400, {"error": "sha256 mismatch"}
            with self._lock:
                self.lfs_objects[m[1]] = body
            return 200, {}
        if method == "POST" and (m := re.fullmatch(r"/lfs-verify/([0-9a-f]{64})", path)):
            request = json.loads(body)
            with self._lock:
                stored = self.lfs_objects.get(m[1])
            ok = stored is not None and request["oid"] == m[1] and request["size"] == len(stored)
            return (200, {}) if ok else (404, {"error": "object not uploaded"})
        if method == "POST" and (m := re.fullmatch(r"/(.+)\.git/info/lfs/objects/batch", path)):
            return self._lfs_batch(m[1], json.loads(body))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|tree|revision)/([^/]+)(/.*)?", path)
        if m is None:
            return 404, {"error": f"fake Hub: no route for {method} {path}"}
        repo_id, action = m[1], m[2]
        with self._lock:
            repo = self.repos.get(repo_id)
        if repo is None:
            return 404, {"error": "Repository not found"}
        if method == "POST" and action == "preupload":
            return self._preupload(repo, json.loads(body))
        if method == "POST" and action == "commit":
            return self._commit(repo, body)
        if method == "GET" and action == "tree":
            return self._tree(repo, (m[4] or "").strip("/"), "recursive=true" in query.lower())
        if method == "GET" and action == "revision":
            return self._info(repo)
        return 404, {"error": f"fake Hub: no route for {method} {path}"}

    def _signature(self, path: str) -> str:
        return hashlib.sha256((self.token + path).encode()).hexdigest()[:32]

    def _create_repo(self, request: dict) -> tuple[int, Any]:
        repo_id = f"{request.get('organization') or USER}/{request['name']}"
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": url}
            # huggingface_hub 2.x says `visibility`, 1.x `private`.
            private = request.get("visibility") == "private" or request.get("private") is True
            self.repos[repo_id] = Repo(repo_id, private)
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    @staticmethod
    def _validate_yaml(request: dict) -> tuple[int, Any]:
        content = request["content"]
        if content.startswith("---\n"):
            header = content[4:].split("\n---\n", 1)[0]
            try:
                if not isinstance(yaml.safe_load(header), dict):
                    return 400, {"error": "metadata is not a mapping"}
            except yaml.YAMLError as e:
                return 400, {"error": f"invalid metadata: {e}"}
        return 200, {"errors": [], "warnings": []}

    def _preupload(self, repo: Repo, request: dict) -> tuple[int, Any]:
        files = []
        for f in request["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_BYTES
            with self._lock:
                existing = repo.files.get(f["path"])
            oid = None
            if existing is not None:
                oid = hashlib.sha256(existing).hexdigest() if lfs else git_blob_oid(existing)
            mode = "lfs" if lfs else "regular"
            files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return 200, {"files": files, "commitOid": None}

    def _lfs_batch(self, repo_id: str, request: dict) -> tuple[int, Any]:
        if request.get("operation") != "upload" or "basic" not in request.get("transfers", ["basic"]):
            return 422, {"message": "fake Hub: only basic uploads"}
        objects = []
        for obj in request["objects"]:
            with self._lock:
                stored = obj["oid"] in self.lfs_objects
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            upload = f"/lfs-upload/{obj['oid']}"
            if not stored:
                entry["actions"] = {
                    "upload": {"href": f"{self.endpoint}{upload}?signature={self._signature(upload)}"},
                    "verify": {"href": f"{self.endpoint}/lfs-verify/{obj['oid']}"},
                }
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def _info(self, repo: Repo) -> tuple[int, Any]:
        with self._lock:
            sha = repo.commits[-1].oid if repo.commits else "0" * 40
            siblings = [{"rfilename": p} for p in sorted(repo.files)]
        return 200, {
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": sha,
            "private": repo.private,
            "siblings": siblings,
        }

    def _tree(self, repo: Repo, under: str, recursive: bool) -> tuple[int, Any]:
        with self._lock:
            files = dict(repo.files)
        prefix = under + "/" if under else ""
        entries, folders = [], set()
        for path, data in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            if not recursive and "/" in rest:
                folders.add(prefix + rest.split("/", 1)[0])
                continue
            entries.append({"type": "file", "path": path, "size": len(data), "oid": git_blob_oid(data)})
        entries += [{"type": "directory", "path": p, "oid": "0" * 40, "size": 0} for p in sorted(folders)]
        return 200, entries

    def _commit(self, repo: Repo, body: bytes) -> tuple[int, Any]:
        if self.script.delay:
            time.sleep(self.script.delay)
        release = self.script.hold_first_commit_until
        if release is not None and not repo.commits:
            end = time.monotonic() + HOLD_LIMIT_S  # a test whose condition never comes fails, never hangs
            while not release() and time.monotonic() < end:
                time.sleep(0.05)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = lines[0]
        if header["key"] != "header":
            return 400, {"error": "the first line must be the header"}
        with self._lock:
            files = dict(repo.files)
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file":
                    assert value["encoding"] == "base64"
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    if value["oid"] not in self.lfs_objects:
                        return 400, {"error": f"LFS object {value['oid']} was not uploaded"}
                    files[value["path"]] = self.lfs_objects[value["oid"]]
                elif line["key"] == "deletedFile":
                    files.pop(value["path"], None)
                elif line["key"] == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: d for p, d in files.items() if not p.startswith(prefix)}
                else:
                    return 400, {"error": f"unknown commit line {line['key']!r}"}
            oid = hashlib.sha1(f"{repo.repo_id}{len(repo.commits)}".encode()).hexdigest()
            repo.files = files
            repo.commits.append(Commit(repo.repo_id, oid, header["value"]["summary"], dict(files)))
            self._lock.notify_all()
        return 200, {"commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{oid}", "commitOid": oid}


@contextlib.contextmanager
def silent_endpoint():
    """An endpoint that takes every connection (the kernel completes the handshake for the listening socket)
    and never answers a byte: a Hub that stalls. Yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(128)  # never accepted: requests are sent, and wait
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def free_port_url() -> str:
    """An endpoint on a local port where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def hub_server():
    server = HubServer()
    yield server
    server.close()
