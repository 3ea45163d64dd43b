"""chatgate_sdk: an async Python client for chatgate's WebSocket chat protocol (``chatgate.v1``).

Imports only ``websockets`` (no torch, no engine)::

    from chatgate_sdk import Client

    async with Client("ws://127.0.0.1:8000/v1/ws", api_key) as client:
        async for delta in client.chat([{"role": "user", "content": "Hi!"}], temperature=0.7, max_tokens=64):
            print(delta, end="", flush=True)

See docs/sdk.md.
"""

from chatgate_sdk.client import Client
from chatgate_sdk.errors import AuthError, ChatgateError, ConnectionLost, InvalidRequest, QuotaExceeded, ServerError
from chatgate_sdk.stream import ChatResult, ChatStream

__all__ = [
    "AuthError", "ChatResult", "ChatStream", "ChatgateError", "Client", "ConnectionLost", "InvalidRequest",
    "QuotaExceeded", "ServerError",
]  # fmt: skip
__version__ = "0.1.0"
