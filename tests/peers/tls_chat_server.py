#!/usr/bin/env python3
"""An OpenAI-compatible chat server over TLS, for the CA-bundle and proxy tests.

Usage: tls_chat_server.py <cert.pem> <key.pem>
Prints the port it listens on (127.0.0.1), then answers every POST with one streamed chat
completion, "Hello over TLS.". Standard library only.
"""
import http.server
import json
import ssl
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        chunk = {
            "id": "chatcmpl-tls", "object": "chat.completion.chunk", "model": "tls",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hello over TLS."}, "finish_reason": "stop"}],
        }
        body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
