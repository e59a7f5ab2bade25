#!/usr/bin/env python3
"""A local HTTP endpoint for notification benchmarks: acknowledges every POST (HTTP/1.1, kept alive)
and counts the records it received. With GATE_FILE, it answers 503 (down) until that file exists.
Usage: notify-sink.py PORT COUNT_FILE [GATE_FILE]"""
import http.server, os, sys

count = 0

class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        global count
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if len(sys.argv) > 3 and not os.path.exists(sys.argv[3]):
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        count += body.count(b'"seq":')
        with open(sys.argv[2], "w") as f:
            f.write(str(count))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
