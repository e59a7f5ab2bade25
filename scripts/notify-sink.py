#!/usr/bin/env python3
"""A local HTTP endpoint for notification benchmarks: acknowledges every POST (HTTP/1.1, kept alive)
and counts the records it received. With GATE_FILE, it answers 503 (down) until that file exists.
Usage: notify-sink.py PORT COUNT_FILE [GATE_FILE]

The count goes to COUNT_FILE twice a second and at SIGTERM, not at every POST: the sink shares the
benchmark's cores with the server, and a file rewritten per POST was a third of its CPU."""
import http.server, os, signal, sys, threading

count = 0
written = -1
lock = threading.Lock()


def write_count():
    global written
    with lock:
        if count != written:
            with open(sys.argv[2], "w") as f:
                f.write(str(count))
            written = count


def flush_every_half_second():
    while True:
        threading.Event().wait(0.5)
        write_count()


def stop(*_):
    write_count()
    os._exit(0)


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
        with lock:
            count += body.count(b'"seq":')
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


signal.signal(signal.SIGTERM, stop)
threading.Thread(target=flush_every_half_second, daemon=True).start()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
