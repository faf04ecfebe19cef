#!/usr/bin/env python3
"""A forwarding proxy for HTTPS (the CONNECT method), for the proxy tests.

Usage: connect_proxy.py <log file>
Prints the port it listens on (127.0.0.1); appends each CONNECT target (`host:port`) to the log
file, then tunnels bytes both ways. Any other request is logged (`GET http://...`) and refused
with 405. Standard library only.
"""
import socket
import socketserver
import sys
import threading

LOG = sys.argv[1]


def pipe(source, target):
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        request = self.rfile.readline().decode("latin-1").split()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        if len(request) < 2 or request[0] != "CONNECT":
            # Logged too: a test asserting that nothing came through the proxy sees any request.
            with open(LOG, "a") as log:
                log.write(" ".join(request[:2]) + "\n")
            self.wfile.write(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
            return
        with open(LOG, "a") as log:
            log.write(request[1] + "\n")
        host, port = request[1].rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        self.wfile.flush()
        back = threading.Thread(target=pipe, args=(upstream, self.connection), daemon=True)
        back.start()
        pipe(self.connection, upstream)
        back.join()


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


server = Server(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
