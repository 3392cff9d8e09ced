"""Where the router sends a request: cache-aware choice between identical instances.

Each instance's prefix cache only pays if requests that share a prefix land on the same
instance. The router cannot see the instances' caches, so it keeps, per instance, an
approximate record of what it *sent* there (`PrefixIndex`), as SGLang's cache-aware router does
with its radix trees: the prompt (text, or token ids) is cut into fixed chunks whose chained
hashes stand for the tree's paths, so the longest run of known hashes from the start is the
longest prefix that instance has probably cached. The record is bounded (least recently used
chunks go first), like the cache it approximates.

`CacheAwarePolicy.choose` (SGLang's rule, in short):
  1. If the instances' loads (requests in flight through this router) are out of balance, both
     by more than `balance_abs` and by a factor over `balance_rel`, take the least loaded one.
  2. Otherwise take the instance with the longest match; if that match covers at least
     `cache_threshold` of the prompt, it wins (ties: the less loaded).
  3. Else no instance holds much of it: take the least loaded (ties: the smallest record, which
     has the most room).
Then the prompt is recorded on the chosen instance. `RoundRobinPolicy` is the baseline.

Blocks are shared only within a namespace: an instance keys a LoRA adapter's K/V and a
`cache_salt`'s apart from the base model's, so the chain of hashes starts from the request's
`model` and `cache_salt` (`prompt_namespace`). A client that names the base model and one that
leaves `model` out are told apart too: the router does not know which name is the base, and the
cost is only a missed affinity.

An instance may refuse a request it computed nothing for (`refusal_code`: its waiting queue is
full, or it is draining); the router then chooses again among the instances not yet tried. A
prefill instance is chosen only once its GET /kv_transfer names its block server (`producer_info`).
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence
from urllib.parse import urlsplit

TEXT_CHUNK = 32  # characters per hashed chunk of a text prompt
TOKEN_CHUNK = 16  # token ids per hashed chunk (a KV block's worth)
MAX_CHUNKS = 1 << 16  # per instance


# The 503 codes of a `kvflow serve` that refused a request before computing anything of it
# (errors.py's EngineOverloadedError handler, lifecycle.py's DrainMiddleware).
REFUSALS = ("overloaded", "draining")


def instance_url(url: str, flag: str) -> str:
    """`url` without its trailing slash, or a ValueError naming `flag` and the form it wants.

    A bare `host:port` is refused rather than guessed at (http or https?), as the OpenAI client
    refuses such a base URL: accepted, every poll of it would fail and it would stay down.
    """
    parts = urlsplit(url.strip())
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:  # not a number, or out of range
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        raise ValueError(f"{flag} {url!r}: expected a URL of the form http://host:port (or https://host:port), "
                         "e.g. http://127.0.0.1:8001")
    return url.strip().rstrip("/")


def refusal_code(status: int, body: bytes) -> str | None:
    """`overloaded` or `draining` when an instance's answer is a refusal that computed nothing (a
    503 with that OpenAI error code), so another instance may take the request; None for any
    other answer, which is the client's to see."""
    if status != 503:
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, TypeError, KeyError):
        return None
    return code if code in REFUSALS else None


def producer_info(status: int, body: bytes) -> tuple[str | None, str | None]:
    """A prefill instance's answer to GET /kv_transfer, read: (its KV block address, why it has
    none if it never will). A producer whose block server has no address yet, or an answer that
    may pass (a 5xx), gives (None, None): asked again on the next health poll."""
    try:
        info = json.loads(body)
    except ValueError:
        info = None
    info = info if isinstance(info, dict) else {}
    if status == 200 and info.get("kv_addr"):
        return str(info["kv_addr"]), None
    if status == 404:  # kv_transfer_disabled: started without --kv-transfer-config (or not kvflow serve)
        error = info.get("error") if isinstance(info.get("error"), dict) else {}
        return None, f"its /kv_transfer answers 404 {error.get('code') or '(no such route)'}"
    if status == 200 and info.get("kv_role") not in (None, "kv_producer"):
        return None, f"its kv_role is {info['kv_role']}"
    return None, None


def prompt_namespace(body: dict[str, Any]) -> str:
    """Whose blocks the prompt can share: its model (base or adapter) and cache_salt."""
    model, salt = body.get("model"), body.get("cache_salt")
    return "" if model is None and salt is None else f"{model}\x00{salt}"


def prompt_key(path: str, body: dict[str, Any]) -> str | list[int]:
    """What identifies a request's prompt: its text, its token ids, or its chat messages in order
    (an embedding request's `input`, or its `messages`)."""
    if path.endswith("chat/completions") or (path.endswith("embeddings") and body.get("messages") is not None):
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # OpenAI content parts
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''}\x00{content or ''}\x01")
        return "".join(parts)
    prompt = body.get("input", "") if path.endswith("embeddings") else body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):  # a batch: its first prompt
        prompt = prompt[0]
    if isinstance(prompt, list):
        return [int(t) for t in prompt if isinstance(t, int)]
    return str(prompt)


def chunk_hashes(key: str | list[int], namespace: str = "") -> list[int]:
    """Chained hashes of the key's full chunks: hash i stands for the prefix key[: (i + 1) * chunk]
    within `namespace` (`prompt_namespace`), where the chain starts."""
    size = TOKEN_CHUNK if isinstance(key, list) else TEXT_CHUNK
    out, h = [], hash(namespace) if namespace else 0
    for start in range(0, len(key) - size + 1, size):
        piece = key[start:start + size]
        h = hash((h, tuple(piece) if isinstance(piece, list) else piece))
        out.append(h)
    return out


class PrefixIndex:
    """An approximate prefix tree of what was sent to one instance (see the module docstring)."""

    def __init__(self, max_chunks: int = MAX_CHUNKS) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading chunks of the prompt this instance was sent before."""
        n = 0
        for h in hashes:
            if h not in self._chunks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)

    def remove(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._chunks.pop(h, None)

    def clear(self) -> None:
        self._chunks.clear()


@dataclass
class Instance:
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests_total: int = 0
    failures_total: int = 0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    kv_addr: str | None = None  # a prefill instance's KV block server (from its GET /kv_transfer)
    problem: str | None = None  # why this prefill instance is up but not used (not a KV producer)

    def mark_down(self) -> None:
        """Its cache is gone with it: forget what it was sent, and where its blocks were served
        (a restart may serve them on another port)."""
        self.healthy = False
        self.index.clear()
        self.kv_addr = None


@dataclass
class Choice:
    instance: Instance
    matched_chunks: int
    total_chunks: int
    reason: str  # "cache", "balance", "load" or "round_robin"
    # Chunks this choice recorded that the instance was not sent before: taken back if it refuses.
    added: tuple[int, ...] = ()


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.5) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel

    def choose(self, instances: list[Instance], key: str | list[int], namespace: str = "") -> Choice:
        hashes = chunk_hashes(key, namespace)
        loads = [i.in_flight for i in instances]
        lo, hi = min(loads), max(loads)
        least = min(instances, key=lambda i: (i.in_flight, len(i.index)))
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            choice = Choice(least, least.index.match(hashes), len(hashes), "balance")
        else:
            matches = [(i.index.match(hashes), -i.in_flight, n) for n, i in enumerate(instances)]
            best_match, _, best = max(matches)
            if hashes and best_match / len(hashes) >= self.cache_threshold:
                choice = Choice(instances[best], best_match, len(hashes), "cache")
            else:
                choice = Choice(least, least.index.match(hashes), len(hashes), "load")
        choice.instance.index.insert(hashes)
        choice.added = tuple(hashes[choice.matched_chunks:])
        return choice


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, instances: list[Instance], key: str | list[int], namespace: str = "") -> Choice:
        return Choice(instances[next(self._turn) % len(instances)], 0, 0, "round_robin")


POLICIES = {"cache_aware": CacheAwarePolicy, "round_robin": RoundRobinPolicy}
