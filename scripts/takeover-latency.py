#!/usr/bin/env python3
"""How soon a restarted `keel serve` takes over the run a SIGKILLed one left behind.

Serves an agent whose tool takes 2 s, starts a turn, kills the server (SIGKILL) while the tool
runs, starts a new server on the same SQLite file, and measures from that start: when it listens,
when the interrupted tool starts again (the run was taken over), and when the run is done. The
lease is an hour long, so only the proof that the old process is gone can explain a fast
takeover.

Usage: scripts/takeover-latency.py [path/to/keel] [trials]   (default: target/release/keel, 5)
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

KEEL = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "target/release/keel")
TRIALS = int(sys.argv[2]) if len(sys.argv) > 2 else 5

AGENT = """model: mock
mock:
  script:
    - tool_calls: [{ name: slow, input: {} }]
    - text: 'Done: {{last_tool_output}}'
"""
TOOL = """description = "slow"
command = ["sh", "-c", "echo start >> started.txt; sleep 2; echo slept"]
"""


def serve(directory):
    env = dict(os.environ, KEEL_LOG="error", KEEL_RUN_LEASE="1h")
    process = subprocess.Popen(
        [KEEL, "serve", ".", "--port", "0", "--store", "sqlite:keel.db"],
        cwd=directory, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    for line in process.stderr:
        line = line.decode()
        if "http://" in line:
            return process, line[line.index("http://"):].split()[0]
    raise SystemExit("keel serve did not start")


def starts(directory):
    path = os.path.join(directory, "started.txt")
    return len(open(path).read().split()) if os.path.exists(path) else 0


def trial():
    with tempfile.TemporaryDirectory() as directory:
        os.makedirs(os.path.join(directory, "tools"))
        open(os.path.join(directory, "agent.yaml"), "w").write(AGENT)
        open(os.path.join(directory, "tools", "slow.toml"), "w").write(TOOL)
        server, base = serve(directory)
        body = json.dumps({"sessionId": "s", "input": "go"}).encode()
        request = urllib.request.Request(base + "/chat", data=body, headers={"content-type": "application/json"})
        urllib.request.urlopen(request)
        while starts(directory) < 1:
            time.sleep(0.01)
        server.send_signal(signal.SIGKILL)
        server.wait()
        started = time.time()
        server, base = serve(directory)
        listening = time.time() - started
        while starts(directory) < 2:
            time.sleep(0.002)
        taken_over = time.time() - started
        while len(json.load(urllib.request.urlopen(base + "/chat/s"))["messages"]) < 4:
            time.sleep(0.02)
        done = time.time() - started
        server.send_signal(signal.SIGKILL)
        server.wait()
        return listening, taken_over, done


for _ in range(TRIALS):
    print("listening %.3f s, interrupted tool started again %.3f s, run done %.3f s after the restart" % trial())
