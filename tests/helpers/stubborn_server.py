"""Stand-in for llama-server in tests/test_server_lifecycle.py: answers /health and /props (with the -m path) on
--port, and ignores SIGTERM, as llama-server did with a request in flight (issue 38, fault 5)."""

import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

signal.signal(signal.SIGTERM, signal.SIG_IGN)
args = sys.argv[1:]
model, port = args[args.index("-m") + 1], int(args[args.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({"status": "ok", "model_path": model}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
