"""Streams and the journal agree: a request is journaled before its first token leaves the
server, a stream that completed is final in the journal before `[DONE]`, a client that went
away is recorded as aborted, and what a killed server had in flight is closed as aborted on
the next start, never run again for nobody. One `tokenflow serve`, killed with SIGKILL
while a stream is open; the 20-kill run under load is benchmarks/stream_kills.py."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.store.recovery import ORPHANED
from tests.serving import killed_if_left, serve_on, stopped

# each request is known by its prompt (token ids, as the journal stores them): the reply's
# id names the completion, not the engine's request
SHORT = [11, 12, 13]
LEFT = [21, 22, 23, 24]
HELD = [31, 32, 33, 34, 35]


def body(prompt: list[int], max_tokens: int) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def journal(db: Path) -> dict[str, tuple[str, str | None, int]]:
    """prompt ("1,2,3") -> (state, finish reason, resume attempts), read as another process
    would."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
        rows = connection.execute("SELECT prompt_token_ids, state, finish_reason, "
                                  "resume_attempts FROM request_journal").fetchall()
    return {prompt: (state, reason, attempts) for prompt, state, reason, attempts in rows}


def key(prompt: list[int]) -> str:
    return ",".join(map(str, prompt))


def chunks(response: httpx.Response) -> Iterator[dict[str, object] | str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


@pytest.mark.slow  # kills serve at each point of a stream
@pytest.mark.soak
def test_kills_at_each_point_of_a_stream(tmp_path: Path) -> None:
    db = tmp_path / "serve.db"
    name = ("--server-name", "box-a")  # the restart is the same server, whatever its port
    with killed_if_left(serve_on(db, *name)) as server:
        assert server.stdout is not None
        url = re.search(r"http://[^,\s]+", server.stdout.readline())
        assert url
        with httpx.Client(base_url=url.group(0), timeout=60) as http:
            # a stream read to its end: final in the journal before [DONE] arrives
            with http.stream("POST", "/v1/completions", json=body(SHORT, 4)) as done:
                seen = list(chunks(done))
            assert seen[-1] == "[DONE]"
            assert journal(db)[key(SHORT)][:2] == ("FINISHED", "length")

            # a client that goes away after its first token: recorded as aborted
            with http.stream("POST", "/v1/completions", json=body(LEFT, 2000)) as left:
                next(chunks(left))
            gone = key(LEFT)
            with httpx.Client(base_url=url.group(0), timeout=60) as other:
                for _ in range(200):  # the abort lands at the next step: wait for it
                    if journal(db)[gone][0] != "DECODING":
                        break
                    other.get("/health")
            assert journal(db)[gone][:2] == ("FINISHED", "aborted")

            # a stream open when the server is killed: journaled before its first token
            with http.stream("POST", "/v1/completions", json=body(HELD, 2000)) as open_stream:
                next(chunks(open_stream))
                held = key(HELD)
                assert journal(db)[held][0] in ("PREFILLING", "DECODING")
                server.kill()
                server.wait(timeout=60)
    # the next start closes it as aborted: its client is gone, nothing is run again
    with killed_if_left(serve_on(db, *name)) as restarted:
        assert restarted.stdout is not None and "http://" in restarted.stdout.readline()
        said = stopped(restarted)
    assert f"closed 1 request(s) the last process on {db} left unfinished" in said
    after = journal(db)
    assert after[held] == ("FINISHED", ORPHANED, 0)
    assert all(attempts == 0 for _, _, attempts in after.values())
    assert len(after) == 3
