#!/usr/bin/env python3
"""A deliberately odd MCP server for keel's tests, speaking raw JSON-RPC on stdio (no SDK, so
that it can do what a well-behaved SDK never would): it lists the tools named on its command
line, duplicates included, and answers every call with the tool's name.

    python raw_mcp_server.py [--garbage-calls] NAME [NAME...]

With --garbage-calls it answers a call with a line that is not JSON-RPC, then with nothing.
"""
import json
import sys

garbage = "--garbage-calls" in sys.argv
names = [name for name in sys.argv[1:] if name != "--garbage-calls"]
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    method = message.get("method")
    if method == "initialize":
        result = {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "raw", "version": "1"},
        }
    elif method == "tools/list":
        result = {"tools": [{"name": name, "inputSchema": {"type": "object"}} for name in names]}
    elif method == "tools/call" and garbage:
        print('{"jsonrpc": "2.0", "id": oops', flush=True)
        print('{"not": "json-rpc"}', flush=True)
        continue
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": message["params"]["name"]}]}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
