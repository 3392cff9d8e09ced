"""A request's output stream (kvflow/entrypoints/request_stream.py) and the server's watcher that
aborts it when the client leaves (`OpenAIServer._watch_client`): a reader must always wake."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvflow.entrypoints.openai import server as server_module
from kvflow.entrypoints.openai.server import OpenAIServer
from kvflow.entrypoints.request_stream import RequestStream


class Owner:
    def __init__(self, fail: bool = False) -> None:
        self.aborted: list[str] = []
        self.fail = fail

    def abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        self.aborted.append(request_id)
        if self.fail:
            raise RuntimeError("the engine core link is down")


class Client:
    """Starlette's Request as the watcher uses it: gone after `polls_left` polls, or broken."""

    def __init__(self, polls_left: int = 10**9, broken: bool = False) -> None:
        self.polls_left, self.broken, self.polls = polls_left, broken, 0

    async def is_disconnected(self) -> bool:
        self.polls += 1
        if self.broken:
            raise OSError("the connection state could not be read")
        self.polls_left -= 1
        return self.polls_left < 0


@pytest.mark.parametrize("fail", [False, True])
def test_abort_wakes_a_waiting_reader_even_when_the_owner_fails(fail):
    async def run() -> tuple[object, list[str]]:
        owner = Owner(fail)
        stream = RequestStream("r", owner, asyncio.get_running_loop())
        reader = asyncio.create_task(stream.next())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            stream.abort()
        stream.abort()  # idempotent: the owner hears once
        return await asyncio.wait_for(reader, 2.0), owner.aborted

    assert asyncio.run(run()) == (None, ["r"])


@pytest.mark.parametrize("client", [Client(polls_left=2), Client(broken=True)], ids=["leaves", "unreadable"])
def test_watcher_aborts_the_stream_when_the_client_is_gone(monkeypatch, client):
    monkeypatch.setattr(server_module, "DISCONNECT_POLL_S", 0.001)

    async def run() -> tuple[object, bool, list[str]]:
        owner = Owner()
        stream = RequestStream("r", owner, asyncio.get_running_loop())
        gone = asyncio.Event()
        watcher = asyncio.create_task(OpenAIServer._watch_client(client, stream, gone))
        out = await asyncio.wait_for(stream.next(), 2.0)  # woken by the watcher's abort
        await asyncio.wait_for(watcher, 2.0)
        return out, gone.is_set(), owner.aborted

    assert asyncio.run(run()) == (None, True, ["r"])


def test_watcher_leaves_a_finished_stream_alone(monkeypatch):
    monkeypatch.setattr(server_module, "DISCONNECT_POLL_S", 0.001)

    async def run() -> tuple[bool, list[str], int]:
        owner, client = Owner(), Client(polls_left=0)  # would count as gone at its first poll
        stream = RequestStream("r", owner, asyncio.get_running_loop())
        stream.finished = True  # the engine delivered the last output
        gone = asyncio.Event()
        await asyncio.wait_for(OpenAIServer._watch_client(client, stream, gone), 2.0)
        return gone.is_set(), owner.aborted, client.polls

    assert asyncio.run(run()) == (False, [], 0)
