"""Hangar's procedures runtime: the shared server that runs procedures.

Embedded in the `hangar` binary (hangar_agent::procedures::RUNTIME) and run
as `python3 -c <this file> --host HOST` with PORT set, by an engine of kind
`procedures`. It speaks the part of cog's HTTP protocol Hangar drives
(crates/hangar-agent/src/cog.rs), as Replicate's pipelines runtime does:

- GET /health-check: {"status": "READY" | "BUSY", "setup": {...}}
- PUT /procedures/{id} (Prefer: respond-async) with
  {"id", "input", "context", "webhook", "webhook_events_filter"}: 202, then
  the run's state is POSTed to `webhook` on start, output, logs and
  completed. 409 while a run is in progress (one at a time), 400 naming
  what is missing from `context` or wrong in it.
- POST /procedures/{id}/cancel: the run's process is terminated; its
  completed webhook says `canceled`.
- POST /shutdown: the server exits.

`context` carries `procedure_source_url` (where the gateway running the
procedure serves its source archive, a tar.gz it fetched and checked, for
the run's length), `procedure_source_sha256` (the archive's SHA-256),
`replicate_api_token` (a key of the caller's account) and
`replicate_api_base_url` (the server). The runtime may be on another
machine than the gateway: it downloads the archive, checks its hash,
extracts it with tarfile's `data` filter (no absolute paths, no `..`, no
links out, no devices, no setuid bits) into a cache of its own (a private
temporary directory removed when it exits) under that hash, and runs every
later run of the same archive from there.

The contract a procedure's source meets: its root holds `predict.py`
defining `predict(**input)`, or a `cog.yaml` whose `predict:` line names
another `FILE.py:FUNCTION`. The function is called with the input's fields
as keyword arguments; what it returns is the output (an iterator's items
are streamed as output items one by one); what it prints is the logs; an
exception fails the run with its message. Each run is a fresh process whose
working directory is the source, with REPLICATE_API_TOKEN,
REPLICATE_BASE_URL, OPENAI_API_KEY and OPENAI_BASE_URL set so the official
clients call models of the same Hangar as the caller.
"""

import atexit
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The child: imports the procedure and runs it. Output travels on the fd named by argv[3] as
# JSON lines ({"item": x}, {"output": x} or {"error": "..."}); stdout and
# stderr are the logs.
CHILD = r'''
import importlib.util, inspect, json, os, sys, traceback
out = os.fdopen(int(sys.argv[3]), "w", buffering=1)
def send(obj):
    out.write(json.dumps(obj, default=str) + "\n")
src, inp = sys.argv[1], json.loads(sys.argv[2])
entry = "predict.py:predict"
yaml = os.path.join(src, "cog.yaml")
if os.path.exists(yaml):
    for line in open(yaml, encoding="utf-8"):
        if line.startswith("predict:"):
            entry = line.split(":", 1)[1].strip().strip("\"'")
file, _, name = entry.partition(":")
name = name or "predict"
path = os.path.join(src, file)
if not os.path.realpath(path).startswith(os.path.realpath(src) + os.sep):
    send({"error": f"the entry point `{entry}` is outside the procedure's source"}); sys.exit(0)
if not os.path.exists(path):
    send({"error": f"the procedure's source has no `{file}` (its entry point is `{entry}`)"}); sys.exit(0)
sys.path.insert(0, src)
os.chdir(src)
try:
    spec = importlib.util.spec_from_file_location("procedure_main", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        send({"error": f"`{file}` defines no `{name}`"}); sys.exit(0)
    if inspect.isclass(fn):
        obj = fn()
        if hasattr(obj, "setup"):
            obj.setup()
        fn = obj.predict
    result = fn(**inp)
    if inspect.isgenerator(result) or (hasattr(result, "__next__") and not isinstance(result, (str, bytes, dict, list))):
        items = []
        for item in result:
            sys.stdout.flush(); sys.stderr.flush()
            items.append(item)
            send({"item": item})
        send({"output": items})
    else:
        sys.stdout.flush(); sys.stderr.flush()
        send({"output": result})
except BaseException as e:
    traceback.print_exc()
    sys.stderr.flush()
    send({"error": f"{type(e).__name__}: {e}"})
'''

LOCK = threading.Lock()
RUN = {"current": None}
# The extracted sources, by archive hash: a private directory of this
# process (set in main), and one lock per hash being prepared.
CACHE = {"dir": None}
SOURCE_LOCKS = {}
SHA256 = re.compile(r"[0-9a-f]{64}")
# The gateway is reached directly: a node's HTTP_PROXY is for the outside
# world, and would not reach the gateway's run port.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SourceError(Exception):
    pass


def source_dir(url, sha256, log):
    """The extracted source of the archive `sha256`: from the cache, or
    downloaded from `url`, checked against the hash and extracted first."""
    with LOCK:
        lock = SOURCE_LOCKS.setdefault(sha256, threading.Lock())
    with lock:
        dest = os.path.join(CACHE["dir"], sha256)
        if os.path.isdir(dest):
            log(f"source {sha256[:12]}: from this runtime's cache\n")
            return dest
        tmp = tempfile.mkdtemp(prefix=sha256 + ".partial-", dir=CACHE["dir"])
        try:
            archive, digest, size = os.path.join(tmp, "source.tar.gz"), hashlib.sha256(), 0
            try:
                with DIRECT.open(url, timeout=60) as answer, open(archive, "wb") as f:
                    while chunk := answer.read(1 << 20):
                        digest.update(chunk)
                        f.write(chunk)
                        size += len(chunk)
            except Exception as e:
                raise SourceError(f"the procedure's source could not be fetched from the gateway: {e}")
            if digest.hexdigest() != sha256:
                raise SourceError(f"the procedure's source fetched from the gateway has SHA-256 "
                                  f"{digest.hexdigest()}, not {sha256}")
            tree = os.path.join(tmp, "tree")
            try:
                with tarfile.open(archive, "r:gz") as t:
                    t.extractall(tree, filter="data")
            except (tarfile.TarError, OSError) as e:
                raise SourceError(f"the procedure's source could not be extracted: {e}")
            os.rename(tree, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"source {sha256[:12]}: fetched {size} bytes from the gateway, extracted\n")
        return dest


def now():
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Run:
    def __init__(self, body):
        self.id = body["id"]
        self.input = body.get("input") or {}
        self.context = body.get("context") or {}
        self.webhook = body.get("webhook")
        self.status = "starting"
        self.output = None
        self.items = []
        self.logs = ""
        self.error = None
        self.started_at = None
        self.completed_at = None
        self.proc = None
        self.canceled = False
        self.lock = threading.Lock()

    def state(self):
        output = self.output if self.status in ("succeeded",) else (self.items or None)
        return {
            "id": self.id, "input": self.input, "output": output, "logs": self.logs,
            "error": self.error, "status": self.status, "started_at": self.started_at,
            "completed_at": self.completed_at, "metrics": {},
        }

    def send(self):
        if not self.webhook:
            return
        with self.lock:
            data = json.dumps(self.state(), default=str).encode()
        for _ in range(50):
            try:
                req = urllib.request.Request(self.webhook, data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
                DIRECT.open(req, timeout=10).read()
                return
            except Exception:
                time.sleep(0.1)

    def log(self, text):
        with self.lock:
            self.logs += text
        self.send()

    def run(self):
        base = self.context.get("replicate_api_base_url", "")
        token = self.context.get("replicate_api_token", "")
        env = dict(os.environ)
        env.update({
            "REPLICATE_API_TOKEN": token, "REPLICATE_BASE_URL": base,
            "OPENAI_API_KEY": token, "OPENAI_BASE_URL": base.rstrip("/") + "/v1",
            "PYTHONUNBUFFERED": "1",
        })
        # The clients reach the server directly, whatever proxy the node's
        # environment names for the outside world.
        host = urllib.parse.urlparse(base).hostname
        if host:
            for name in ("NO_PROXY", "no_proxy"):
                env[name] = ",".join(filter(None, [env.get(name), host]))
        r, w = os.pipe()
        os.set_inheritable(w, True)
        self.started_at = now()
        self.status = "processing"
        self.send()
        try:
            src = source_dir(self.context["procedure_source_url"], self.context["procedure_source_sha256"],
                             self.log)
        except SourceError as e:
            self.finish("failed", error=str(e))
            return
        if self.canceled:
            self.finish("canceled")
            return
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, src, json.dumps(self.input), str(w)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=src,
                pass_fds=(w,), start_new_session=True,
            )
        except OSError as e:
            os.close(r); os.close(w)
            self.finish("failed", error=f"the procedure could not start: {e}")
            return
        os.close(w)
        result = {}

        def read_results():
            with os.fdopen(r, "r") as f:
                for line in f:
                    msg = json.loads(line)
                    if "item" in msg:
                        with self.lock:
                            self.items.append(msg["item"])
                        self.send()
                    else:
                        result.update(msg)

        reader = threading.Thread(target=read_results, daemon=True)
        reader.start()
        for line in iter(self.proc.stdout.readline, b""):
            self.log(line.decode("utf-8", "replace"))
        self.proc.wait()
        reader.join()
        if self.canceled:
            self.finish("canceled")
        elif "error" in result:
            self.finish("failed", error=result["error"])
        elif "output" in result:
            self.finish("succeeded", output=result["output"])
        else:
            self.finish("failed", error=f"the procedure's process exited with status {self.proc.returncode}")

    def finish(self, status, output=None, error=None):
        with self.lock:
            self.status, self.output, self.error = status, output, error
            self.completed_at = now()
        self.send()
        with LOCK:
            if RUN["current"] is self:
                RUN["current"] = None

    def cancel(self):
        self.canceled = True
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            def kill_later(p=self.proc):
                time.sleep(5)
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            threading.Thread(target=kill_later, daemon=True).start()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def do_GET(self):
        if self.path == "/health-check":
            with LOCK:
                busy = RUN["current"] is not None
            self.answer(200, {"status": "BUSY" if busy else "READY",
                              "setup": {"status": "succeeded", "logs": ""}})
        else:
            self.answer(404, {"detail": "not found"})

    def do_PUT(self):
        parts = self.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "procedures":
            self.answer(400, {"detail": "this is Hangar's procedures runtime: it runs procedures "
                                        "(PUT /procedures/{id}), not predictions of a model"})
            return
        body = self.body()
        body.setdefault("id", parts[1])
        context = body.get("context") or {}
        url, sha256 = context.get("procedure_source_url"), context.get("procedure_source_sha256")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            self.answer(400, {"detail": "context.procedure_source_url must be the http(s) URL the gateway "
                                        "serves the procedure's source archive at"})
            return
        if not isinstance(sha256, str) or not SHA256.fullmatch(sha256):
            self.answer(400, {"detail": "context.procedure_source_sha256 must be the archive's SHA-256 "
                                        "(64 lowercase hex digits)"})
            return
        with LOCK:
            if RUN["current"] is not None:
                self.answer(409, {"detail": "a procedure is already running"})
                return
            run = Run(body)
            RUN["current"] = run
        self.answer(202, {"id": run.id, "status": "starting"})
        threading.Thread(target=run.run, daemon=True).start()

    def do_POST(self):
        parts = self.path.strip("/").split("/")
        if parts == ["shutdown"]:
            self.answer(200, {})
            with LOCK:
                run = RUN["current"]
            if run is not None:
                run.cancel()
            threading.Thread(target=self.server.shutdown, daemon=True).start()
            return
        if len(parts) == 3 and parts[0] in ("procedures", "predictions") and parts[2] == "cancel":
            with LOCK:
                run = RUN["current"]
            if run is None or run.id != parts[1]:
                self.answer(404, {"detail": f"no run `{parts[1]}`"})
                return
            run.cancel()
            self.answer(200, {})
            return
        self.answer(404, {"detail": "not found"})


def main():
    if not hasattr(tarfile, "data_filter"):
        sys.exit(f"the procedures runtime needs a Python whose tarfile has the `data` extraction filter "
                 f"(3.8.17+, 3.9.17+, 3.10.12+, 3.11.4+, 3.12+); {sys.executable} is {sys.version.split()[0]}")
    CACHE["dir"] = tempfile.mkdtemp(prefix="hangar-procedures-")
    atexit.register(shutil.rmtree, CACHE["dir"], True)
    # A SIGTERM ends the process through its exit handlers (the cache goes).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    host = "127.0.0.1"
    args = sys.argv[1:]
    if "--host" in args:
        host = args[args.index("--host") + 1]
    port = int(os.environ.get("PORT", "5000"))
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.serve_forever()


main()
