#!/usr/bin/env python3
"""An MCP client for keel's end-to-end tests, written with the official Python SDK (`mcp`).

    python mcp_client.py --url http://127.0.0.1:PORT/mcp [--token T] CALLS_JSON
    python mcp_client.py CALLS_JSON -- keel mcp <agent> ...        (stdio: launches the command)

CALLS_JSON is a list of [tool, arguments] or [tool, arguments, seconds]: with seconds, the call
is abandoned after that long (the SDK then sends `notifications/cancelled`). Prints JSON lines:
the server's info, its tools, then for each call its result (or `{"abandoned": true}`) and the
progress messages received during it.
"""
import argparse
import asyncio
import json
import sys

from mcp import Client, StdioServerParameters


async def main(args, command):
    if args.url:
        from mcp.client.streamable_http import streamable_http_client
        import httpx2

        headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
        target = streamable_http_client(args.url, http_client=httpx2.AsyncClient(headers=headers, timeout=60))
    else:
        target = StdioServerParameters(command=command[0], args=command[1:])
    async with Client(target, mode="legacy", read_timeout_seconds=60) as client:
        info = client.server_info
        print(json.dumps({"server": info.model_dump(exclude_none=True) if info else None}), flush=True)
        tools = await client.list_tools()
        print(json.dumps({"tools": [tool.model_dump(exclude_none=True, by_alias=True) for tool in tools.tools]}), flush=True)
        for name, arguments, *abandon_after in json.loads(args.calls):
            progress = []

            async def on_progress(value, total, message):
                progress.append(message)

            call = client.call_tool(name, arguments, progress_callback=on_progress)
            if abandon_after:
                try:
                    await asyncio.wait_for(call, abandon_after[0])
                except asyncio.TimeoutError:
                    print(json.dumps({"abandoned": True, "progress": progress}), flush=True)
                    # Give the server a moment to act on the cancellation before the next call.
                    await asyncio.sleep(1)
                    continue
            result = await call if not abandon_after else None
            if result is None:
                continue
            print(json.dumps({"result": result.model_dump(exclude_none=True, by_alias=True), "progress": progress}), flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    command = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url")
    parser.add_argument("--token")
    parser.add_argument("calls")
    args = parser.parse_args(argv)
    if not args.url and not command:
        parser.error("give --url or -- COMMAND")
    asyncio.run(main(args, command))
