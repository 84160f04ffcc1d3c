"""A local stand-in for the few Hugging Face Hub endpoints huggingface_hub's `create_repo`, `upload_folder` and
`hf_hub_download` call, so pushes and downloads are tested for real (huggingface_hub's own client, HTTP, auth
header) and never reach the network. Point a process at it with HF_ENDPOINT=server.url and HF_TOKEN=server.token.

Endpoints (huggingface_hub 2.x, hf_api.py / _commit_api.py):
- POST /api/repos/create                        {"name", "organization", ...} -> {"url"}; 409 if it exists
- POST /api/models/{repo}/preupload/{revision}  {"files": [{"path", "sample", "size"}]} -> every file "regular"
- POST /api/models/{repo}/commit/{revision}     ndjson: a header line, then {"key": "file", "value":
                                                {"path", "content" (base64), "encoding"}} -> {"commitUrl", "commitOid"}
- HEAD/GET /{repo}/resolve/{revision}/{path}     a file of `repos` (404 RepoNotFound / EntryNotFound otherwise)
Anything else is answered 404 and recorded, so a test sees an unexpected call; `requests` lists every call.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

USER = "hf-scale-tester"
TOKEN = "hf_standin_dummy_token"


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: list[tuple[str, str, list[str]]] = []
        """(repo id, commit message, paths) per commit."""
        self.unexpected: list[str] = []
        self.requests: list[str] = []
        """"METHOD path" of every request received."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with the Hub pointed here and switched on."""
        env = {k: v for k, v in base.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update(HF_ENDPOINT=self.url, HF_TOKEN=TOKEN, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
                   HF_HUB_DISABLE_TELEMETRY="1")
        return env

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_HEAD(self):
            hub.requests.append(f"HEAD {self.path}")
            self._file(send_body=False)

        def do_GET(self):
            hub.requests.append(f"GET {self.path}")
            self._file(send_body=True)

        def _file(self, *, send_body: bool) -> None:
            match = re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", self.path.split("?")[0])
            if match is None:
                hub.unexpected.append(f"{self.command} {self.path}")
                self._reply(404, {"error": "not implemented by the stand-in"})
                return
            repo_id, _revision, path = match.groups()
            if repo_id not in hub.repos or path not in hub.repos[repo_id]:
                code = "RepoNotFound" if repo_id not in hub.repos else "EntryNotFound"
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = hub.repos[repo_id][path]
            self.send_response(200)
            self.send_header("X-Repo-Commit", hashlib.sha1(repo_id.encode()).hexdigest())
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if send_body:
                self.wfile.write(data)

        def do_POST(self):
            hub.requests.append(f"POST {self.path}")
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._reply(401, {"error": "Invalid credentials in Authorization header"})
                return
            path = self.path.split("?")[0]
            if path == "/api/repos/create":
                self._create(json.loads(body))
            elif match := re.fullmatch(r"/api/models/(.+)/preupload/([^/]+)", path):
                files = json.loads(body)["files"]
                self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                            for f in files]})
            elif match := re.fullmatch(r"/api/models/(.+)/commit/([^/]+)", path):
                self._commit(match.group(1), body)
            else:
                hub.unexpected.append(f"POST {self.path}")
                self._reply(404, {"error": "not implemented by the stand-in"})

        def _create(self, payload: dict) -> None:
            repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
            if repo_id in hub.repos:
                self._reply(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
                return
            hub.repos[repo_id] = {}
            self._reply(200, {"url": f"{hub.url}/{repo_id}"})

        def _commit(self, repo_id: str, body: bytes) -> None:
            if repo_id not in hub.repos:
                self._reply(404, {"error": "Repository not found"})
                return
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            paths = []
            for line in lines:
                if line["key"] == "file":
                    hub.repos[repo_id][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                    paths.append(line["value"]["path"])
                elif line["key"] != "header":
                    hub.unexpected.append(f"commit entry {line['key']}")
            hub.commits.append((repo_id, header["summary"], paths))
            oid = hashlib.sha1(body).hexdigest()
            self._reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                              "pullRequestUrl": None})

    return Handler
