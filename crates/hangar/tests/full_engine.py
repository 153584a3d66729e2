"""An OpenAI-compatible engine for the capacity failover tests
(serve_failover.rs):

    python full_engine.py PORT MARKER

The first instance started (the one that creates the file MARKER) is out
of capacity: it answers every POST with 429, as an engine whose own queue
is full does. Any later instance answers a chat completion. GET /health
answers 200; other paths 404 (so the capability probe finds no sleep API).
"""

import http.server
import json
import os
import sys

PORT, MARKER = int(sys.argv[1]), sys.argv[2]
try:
    os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL))
    FULL = True
except FileExistsError:
    FULL = False

COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "t",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}
REFUSAL = {"error": {"message": "out of capacity", "type": "rate_limit_error"}}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/health":
            self.answer(200, {"status": "ok"})
        else:
            self.answer(404, {"error": {"message": "no such route"}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if FULL:
            self.answer(429, REFUSAL)
        else:
            self.answer(200, COMPLETION)

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
