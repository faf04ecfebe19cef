#!/usr/bin/env python3
"""An MCP server for keel's end-to-end tests, written with the official Python SDK (`mcp`).

    python mcp_server.py stdio
    python mcp_server.py http PORT        # Streamable HTTP at http://127.0.0.1:PORT/mcp

Tools:
- `charge(order, amount)`: appends one line per call to $KEEL_TEST_CALLS (the order, and the
  `keel/idempotencyKey` the call carried in `_meta`), so a test can count the calls the server
  really got; returns a structured receipt.
- `slow(seconds)`: sleeps, then answers.
- `die()`: the server kills itself with SIGKILL while the call is in flight.
- `huge(megabytes)`: answers with that much text.
- `fail(message)`: raises: an `isError: true` result.
- `grow()`: adds the tool `extra` and sends `notifications/tools/list_changed`.
- `ask_user()`: asks the client for input (elicitation) and answers with the client's action.
"""
import asyncio
import os
import signal
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer(name="keel-test-python", version="1.0")


@server.tool()
def charge(order: str, amount: int, ctx: Context) -> dict:
    """Charge an order (a side effect that must happen once)."""
    params = ctx.request_context.params or {}
    key = (params.get("_meta") or {}).get("keel/idempotencyKey", "")
    with open(os.environ["KEEL_TEST_CALLS"], "a", encoding="utf-8") as calls:
        calls.write(f"{order} {key}\n")
    return {"order": order, "charged": amount, "status": "ok"}


@server.tool()
async def slow(seconds: float) -> str:
    """Wait, then answer."""
    await asyncio.sleep(seconds)
    return f"waited {seconds}s"


@server.tool()
def die() -> str:
    """Kill this server mid-call."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@server.tool()
def huge(megabytes: int) -> str:
    """Answer with that many megabytes of text."""
    return "x" * (megabytes * 1024 * 1024)


@server.tool()
def fail(message: str) -> str:
    """Always fails, saying why."""
    raise ToolError(message)


def extra() -> str:
    """A tool added while the server runs."""
    return "extra tool here"


@server.tool()
async def grow(ctx: Context) -> str:
    """Add the tool `extra`, and tell the client its tool list changed."""
    server.add_tool(extra)
    await ctx.session.send_tool_list_changed()
    return "grew"


@server.tool()
async def ask_user(ctx: Context) -> str:
    """Ask the client's user for their name."""
    from pydantic import BaseModel

    class Name(BaseModel):
        name: str

    answer = await ctx.elicit("What is your name?", Name)
    return f"the client answered: {answer.action}"


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "stdio"
    if mode == "stdio":
        server.run("stdio")
    elif mode == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
