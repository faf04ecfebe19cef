#!/usr/bin/env python3
"""A deliberately odd MCP server for keel's tests, speaking raw JSON-RPC on stdio (no SDK, so
that it can do what a well-behaved SDK never would): it lists the tools named on its command
line, duplicates included, and answers every call with the tool's name.

    python raw_mcp_server.py NAME [NAME...]
"""
import json
import sys

names = sys.argv[1:]
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
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": message["params"]["name"]}]}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
