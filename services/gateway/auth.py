"""API keys at the edge: who may call what, how often, and how much at once.

An ASGI middleware in front of the whole app, so a route added later is covered by the
default rule (admin) until it is given its own in ``RULES``:

- a key is presented as ``Authorization: Bearer <key>`` (or ``X-API-Key: <key>``) and
  looked up by its SHA-256; keys are never stored in clear (``tandem security api-key``
  prints a new one once, with the line to configure);
- no key or an unknown one → ``401``; a key without the route's scope → ``403``
  naming the scope; ``admin`` holds every scope;
- per key: a rate of requests (``429`` + ``Retry-After``), concurrent SSE streams, and
  training runs not yet finished (``429`` naming the limit): ``Limits``, one per gateway
  process, which the NATS job service shares, so the rate and the runs of a key are the
  same whichever door it uses; all three are kept in KV, so they are the same whichever
  replica serves it.

With no keys configured (``TANDEM_API_KEYS`` empty: the local stack, the demo) the
middleware is not installed and the API is open; the request-shape limits (body size,
prompt length, images) hold either way.

One module past 600 lines: a key's identity (``ApiKey``, ``Keyring``), what it is refused
with (``Denied``: status, detail, Retry-After) and the per-key budgets that raise it
(``Limits``, most of the module) are one contract, shared by the HTTP middleware and the
job service; split, ``Limits`` would import its refusal and its budgets' fields back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from tandem.common import log, metrics
from tandem.common.bus import Bus, TypedKV, describe
from tandem.common.errors import TooManyRuns
from tandem.common.events import RateMark, SseHold, SseHolds
from tandem.common.jobs import OPEN, Caller
from tandem.common.settings import Settings
from tandem.common.streams import KV_RATES, KV_SSE
from tandem.common.subjects import token

_log = log.get("tandem.gateway.auth")
AUTH = metrics.Counter("tandem_gateway_auth", "Gateway authentication outcomes", ["outcome"])

KEY_PREFIX = "tdm_"


class Scope(StrEnum):
    generate = "generate"
    train = "train"
    admin = "admin"


class ApiKey(BaseModel):
    """One configured key: its name (for logs and limits), hash, scopes and limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Who holds it; shows in logs, never the key itself.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key, hex.")
    scopes: tuple[Scope, ...] = Field(min_length=1)
    rate: float | None = Field(None, gt=0, description="Requests/s; default rate_limit.")
    burst: int | None = Field(None, ge=1, description="Bucket size; default rate_burst.")
    max_streams: int | None = Field(None, ge=1, description="Open SSE streams.")
    max_runs: int | None = Field(None, ge=1, description="Training runs not finished.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return token(v, "key name")

    def allows(self, scope: Scope) -> bool:
        return scope in self.scopes or Scope.admin in self.scopes


_KEYS = TypeAdapter(list[ApiKey])


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh key: 256 random bits. Its hash is all the gateway keeps."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_keys(text: str) -> list[ApiKey]:
    """Keys from a JSON list, or ``@path`` to a JSON file; ValueError naming what is wrong."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read API keys file {path}: {exc.strerror}") from None
    try:
        keys = _KEYS.validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        # The list itself (a single entry pasted as it is printed): no location to name.
        where = ".".join(str(p) for p in first["loc"]) or "the whole value"
        hint = (" (a JSON list of keys: wrap one entry as [ ... ])"
                if not first["loc"] and first["type"] == "list_type" else "")
        raise ValueError(f"API keys: {where}: {first['msg']}{hint} "
                         f"({exc.error_count()} problems)") from None
    seen: set[str] = set()
    for k in keys:
        if k.name in seen or k.sha256 in seen:
            raise ValueError(f"API keys: {k.name!r} is listed twice (or shares a hash)")
        seen |= {k.name, k.sha256}
    return keys


class AuthSettings(Settings):
    """``TANDEM_*`` settings of the gateway's authentication, limits and HTTPS."""

    api_keys: str = Field(
        "", description="API keys: a JSON list of {name, sha256, scopes[, rate, burst, "
        "max_streams, max_runs]} or @path to a JSON file. Empty: no authentication "
        "(local development only).")
    rate_limit: float = Field(20.0, gt=0, description="Requests per second per key.")
    rate_burst: int = Field(40, ge=1, description="Requests a key may make at once.")
    max_streams_per_key: int = Field(
        8, ge=1, description="Event streams (SSE) a key may hold open at once, through "
        "every gateway replica together.")
    stream_lease: float = Field(
        30.0, gt=0, description="Seconds a replica's count of a key's open event streams "
        "stands unrenewed: a killed replica's streams stop counting after it (renewed "
        "every third of it).")
    max_runs_per_key: int = Field(
        2, ge=1, description="Training runs of a key that may be unfinished at once.")
    http_tls_cert: str | None = Field(
        None, description="Certificate chain (PEM) for HTTPS; with http_tls_key.")
    http_tls_key: str | None = Field(None, description="Private key (PEM) for HTTPS.")

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: str) -> str:
        parse_keys(v)  # a bad key list stops the gateway at start, naming the problem
        return v

    @field_validator("http_tls_cert", "http_tls_key")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"{v} is not a readable file")
        return v

    @property
    def tls(self) -> bool:
        return bool(self.http_tls_cert and self.http_tls_key)


# ------------------------------------------------------------------------------- the rules

PUBLIC = "public"
ANY_KEY = "any key"

# (methods or None for all, path regex, what it needs), first match wins; else admin.
RULES: list[tuple[frozenset[str] | None, re.Pattern[str], str]] = [
    (frozenset({"GET", "HEAD"}),
     re.compile(r"/healthz|/openapi\.json|/docs(/.*)?|/redoc"), PUBLIC),
    # the dashboard's page and assets hold no data; what it shows (/v1/dashboard) is admin's
    (frozenset({"GET", "HEAD"}), re.compile(r"/|/dashboard/static/.*"), PUBLIC),
    (frozenset({"GET", "HEAD"}), re.compile(r"/v1/models"), ANY_KEY),
    (None, re.compile(r"/v1/generations(/.*)?"), Scope.generate),
    (None, re.compile(r"/v1/training-runs(/.*)?"), Scope.train),
]
SSE = re.compile(r"/v1/generations/[^/]+/events")
RUN_SUBMIT = re.compile(r"/v1/training-runs/?")


def needs(method: str, path: str) -> str:
    for methods, pattern, need in RULES:
        if (methods is None or method in methods) and pattern.fullmatch(path):
            return need
    return Scope.admin


class Keyring:
    """The configured keys, and the one check both doors make: who is this, and may it?

    ``check`` answers the caller for a presented key and a needed scope, or raises
    ``Denied`` (401 without a known key, 403 without the scope) with the message the
    client reads. The HTTP Guard and the NATS job service both call it.
    """

    def __init__(self, keys: list[ApiKey]) -> None:
        self.by_hash = {k.sha256: k for k in keys}
        self.by_name = {k.name: k for k in keys}

    def __bool__(self) -> bool:
        return bool(self.by_hash)

    def key(self, presented: str, need: str, what: str) -> ApiKey:
        key = self.by_hash.get(hash_key(presented)) if presented else None
        if key is None:
            AUTH.labels("unauthenticated").inc()
            why = "an unknown API key" if presented else "no API key"
            raise Denied(401, why)
        if need != ANY_KEY and not key.allows(Scope(need)):
            AUTH.labels("forbidden").inc()
            raise Denied(403, f"key {key.name!r} lacks scope '{need}' for {what} "
                         f"(it has {', '.join(key.scopes)})")
        return key

    def named(self, name: str) -> ApiKey | None:
        """The key a caller holds (by its name), None for the open caller."""
        return self.by_name.get(name) if name else None

    def check(self, presented: str, need: str, what: str) -> Caller:
        """The caller of a request that presents ``presented`` and needs ``need``;
        without any keys configured, the open caller."""
        if not self:
            return OPEN
        key = self.key(presented, need, what)
        return Caller(key.name, key.allows(Scope.admin))


class Denied(Exception):
    """A request without a known key (401), the scope it needs (403), or over one of its
    key's limits (429, with the seconds to wait in ``retry_after``)."""

    def __init__(self, status: int, message: str, retry_after: int = 0) -> None:
        self.status = status
        self.message = message
        self.retry_after = retry_after
        super().__init__(message)


def bearer(value: str) -> str:
    """The key in an ``Authorization: Bearer <key>`` value (or the value itself)."""
    value = value.strip()
    return value[7:].strip() if value[:7].lower() == "bearer " else value


# ------------------------------------------------------------------------------ the limits


def gcra(tat: float, now: float, rate: float, burst: int) -> tuple[float, float]:
    """One request at ``now`` against a key's theoretical arrival time ``tat`` (GCRA: a
    token bucket of ``burst`` refilled at ``rate``/s, kept as one number): ``(new tat,
    0)`` if it is let through, else ``(tat, seconds until one would be)``."""
    interval = 1.0 / rate
    tat = max(tat, now)
    allowed_at = tat - burst * interval + interval
    if now < allowed_at:
        return tat, allowed_at - now
    return tat + interval, 0.0


@dataclass
class KeyState:
    streams: int = 0  # this process's open event streams of the key
    sse_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sse_mark: tuple[SseHolds, int] | None = None  # the key's last known holds, revision
    run_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rate_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    mark: tuple[RateMark, int] | None = None  # the key's last known mark and revision
    # Requests waiting for the rate: each its future (seconds until it would be let
    # through; 0 when it is). Whoever holds ``rate_lock`` decides all of them at once.
    asking: list[asyncio.Future[float]] = field(default_factory=list)


class Limits:
    """Every key's limits, one object per gateway process that both doors share.

    The HTTP Guard and the NATS job service take from the same budget per key
    (``admit``), and a training run submitted by either door counts against the same
    unfinished runs of its key (``run_limit``), so neither door is a way around the
    other's limits. SSE streams (``stream``) exist over HTTP only. The open caller (no
    keys configured) has no limits. Each refusal is ``Denied(429)`` with its
    ``retry_after`` and a message naming the limit.

    The rate and the unfinished runs are the fleet's, so no replica and no restart adds
    to them: the rate is a mark per key in KV ``rates`` (``RateMark``, GCRA), moved by
    compare-and-set (one write for the requests of a key decided together in this
    process, ``admit``, from the last mark it saw; a read only when another replica
    moved it since; none to refuse, as the mark only moves forward); the unfinished
    runs are counted in KV ``runs`` as each run is submitted (``runs.submit_run``).
    The open SSE streams are the fleet's too: each replica counts its own under its id
    in the key's entry of KV ``sse`` (``SseHolds``), by compare-and-set as a stream opens
    (refused when every replica's count together is at the limit) and closes, and renews
    its counts every third of ``stream_lease``; a killed replica's count stops counting
    when its lease runs out.
    """

    def __init__(self, keys: Keyring, settings: AuthSettings,
                 rates: TypedKV[RateMark], sse: TypedKV[SseHolds]) -> None:
        self.keys = keys
        self.s = settings
        self.rates = rates
        self.sse = sse
        self.replica = uuid.uuid4().hex[:16]  # this process, in KV ``sse``
        self.state: dict[str, KeyState] = {}
        self._renewer: asyncio.Task[None] | None = None

    @classmethod
    async def on(cls, bus: Bus, keys: Keyring, settings: AuthSettings) -> Limits:
        """The limits of ``keys`` kept in ``bus``'s KV ``rates`` and ``sse``."""
        return cls(keys, settings, await bus.typed(KV_RATES, RateMark),
                   await bus.typed(KV_SSE, SseHolds))

    def close(self) -> None:
        """Stop renewing this replica's counts of open streams (the process stops)."""
        if self._renewer is not None:
            self._renewer.cancel()

    def _state(self, key: ApiKey) -> KeyState:
        st = self.state.get(key.name)
        if st is None:
            st = self.state[key.name] = KeyState()
        return st

    async def admit(self, caller: Caller) -> None:
        """Take one request from the caller's rate, or raise ``Denied(429)`` (``503`` if
        KV ``rates`` cannot be reached: no request goes through unaccounted).

        A key's requests in this process are decided in groups: the one that gets the
        key's turn decides every request that waits by then, in arrival order, with one
        compare-and-set that takes as many as the rate lets through. So one key's rate
        through one replica is not bounded by the KV round trip (one write per request,
        in turn, before), and the budget taken is the same."""
        key = self.keys.named(caller.key)
        if key is None:
            return
        st = self._state(key)
        rate, burst = key.rate or self.s.rate_limit, key.burst or self.s.rate_burst
        mine: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        st.asking.append(mine)
        try:
            async with st.rate_lock:  # this process's groups in turn; replicas race by CAS
                if not mine.done():  # not decided with an earlier group: decide this one
                    group = [f for f in st.asking if not f.done()]
                    st.asking = []
                    deciding = asyncio.ensure_future(self._decide(key, st, group, rate, burst))
                    try:
                        await asyncio.shield(deciding)
                    except asyncio.CancelledError:
                        # Its client left mid-decision: the write may have landed, so the
                        # group is decided here, once, before the turn passes on.
                        await deciding
                        raise
        except BaseException:
            mine.cancel()  # gone (the client left) before it was decided: it takes nothing
            raise
        wait = mine.result()  # Denied(503) for the whole group if KV could not be read
        if wait > 0:
            AUTH.labels("rate_limited").inc()
            raise Denied(429, f"key {key.name!r} is over its rate limit of "
                         f"{rate:g} requests/s (burst {burst})",
                         retry_after=max(1, math.ceil(wait)))

    async def _decide(self, key: ApiKey, st: KeyState, group: list[asyncio.Future[float]],
                      rate: float, burst: int) -> None:
        """Each request of ``group`` let through or told how long to wait, with one
        compare-and-set for all of them (none where the last mark seen refuses them
        all: the stored one is no earlier)."""
        waits: list[float] = []

        def take(cur: RateMark | None) -> RateMark | None:
            waits.clear()
            tat, now = (cur.tat if cur else 0.0), time.time()
            for _ in group:
                tat, wait = gcra(tat, now, rate, burst)
                waits.append(wait)
            return RateMark(tat=tat) if 0.0 in waits else None

        try:
            if st.mark is None or take(st.mark[0]) is not None:
                st.mark = await self.rates.move(key.name, take, expect=st.mark)
        except Exception as exc:  # whatever failed: no budget read, no request
            st.mark = None
            _log.warning("auth.rates_unavailable", key=key.name, error=describe(exc))
            for fut in group:
                if not fut.done():  # one whose client left meanwhile is cancelled
                    fut.set_exception(Denied(503, f"the rate limit of key {key.name!r} "
                                             f"cannot be read (KV {KV_RATES}): "
                                             f"{describe(exc)}", retry_after=1))
        else:
            for fut, wait in zip(group, waits, strict=True):
                if not fut.done():
                    fut.set_result(wait)
        finally:  # cut short (the process stopping): the next turn decides the others
            st.asking[:0] = [f for f in group if not f.done()]

    @contextlib.asynccontextmanager
    async def stream(self, caller: Caller) -> AsyncIterator[None]:
        """Hold one of the caller's SSE streams while the body runs, or ``Denied(429)``."""
        key = self.keys.named(caller.key)
        if key is None:
            yield
            return
        st = self._state(key)
        limit = key.max_streams or self.s.max_streams_per_key
        others = -1  # the other replicas' open streams, when they refuse this one

        def opened(cur: SseHolds | None) -> SseHolds | None:
            nonlocal others
            now = time.time()
            others = (cur or SseHolds()).open_streams(now, but=self.replica)
            if others + st.streams >= limit:
                return None
            others = -1
            return self._holds(cur, now, st.streams + 1)

        async with st.sse_lock:  # this process's opens and closes of the key in turn
            if st.streams < limit:
                await self._write_holds(key.name, st, opened)
            if others >= 0 or st.streams >= limit:
                AUTH.labels("stream_limited").inc()
                raise Denied(429, f"key {key.name!r} has {max(others, 0) + st.streams} "
                             f"event streams open ({st.streams} through this gateway); "
                             f"the limit is {limit}", retry_after=1)
            st.streams += 1
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew())
        try:
            yield
        finally:
            st.streams -= 1  # what the renewer writes next, whatever becomes of this write
            await asyncio.shield(self._write_count(key.name, st))

    def _holds(self, cur: SseHolds | None, now: float, count: int) -> SseHolds:
        """``cur`` with this replica's count set (dropped at 0) and renewed, and the
        counts whose lease ran out dropped."""
        held = {r: h for r, h in (cur.held if cur else {}).items()
                if h.until > now and r != self.replica}
        if count:
            held[self.replica] = SseHold(count=count, until=now + self.s.stream_lease)
        return SseHolds(held=held)

    async def _write_holds(self, name: str, st: KeyState, fn: Any) -> None:
        """Move the key's ``SseHolds`` by ``fn`` from the last one seen, or
        ``Denied(503)`` if KV ``sse`` cannot be reached (no stream opens uncounted)."""
        try:
            st.sse_mark = await self.sse.move(name, fn, expect=st.sse_mark)
        except Exception as exc:
            st.sse_mark = None
            _log.warning("auth.sse_unavailable", key=name, error=describe(exc))
            raise Denied(503, f"the open event streams of key {name!r} cannot be counted "
                         f"(KV {KV_SSE}): {describe(exc)}", retry_after=1) from None

    def _mine(self, st: KeyState) -> SseHold | None:
        """This replica's count of the key as last written or read."""
        return st.sse_mark[0].held.get(self.replica) if st.sse_mark else None

    async def _write_count(self, name: str, st: KeyState) -> None:
        """Write this replica's count of the key as it is now, renewed (after a stream
        closed, and by the renewer); failing (logged), the next write or the count's
        lease ends it."""

        def fn(cur: SseHolds | None) -> SseHolds | None:
            if st.streams == 0 and (cur is None or self.replica not in cur.held):
                return None  # nothing of this replica's to write
            return self._holds(cur, time.time(), st.streams)

        async with st.sse_lock:
            with contextlib.suppress(Denied):
                await self._write_holds(name, st, fn)

    async def _renew(self) -> None:
        """Renew this replica's counts every third of ``stream_lease`` while it has any
        written; ends when none is left (the next stream opened starts it again)."""
        every = self.s.stream_lease / 3
        while True:
            await asyncio.sleep(every)  # the lease's clock, not a wait for an event
            left = False
            for name, st in list(self.state.items()):
                if not st.streams and self._mine(st) is None:
                    continue
                await self._write_count(name, st)
                left = left or bool(st.streams) or self._mine(st) is not None
            if not left:
                return

    @contextlib.asynccontextmanager
    async def run_limit(self, caller: Caller) -> AsyncIterator[int | None]:
        """The caller's limit of unfinished runs (None: the open caller has none), for the
        body to submit within (``runs.submit_run(max_unfinished=...)``), one submission
        per key at a time in this process. The body's ``TooManyRuns`` becomes
        ``Denied(429)`` naming the unfinished runs."""
        key = self.keys.named(caller.key)
        if key is None:
            yield None
            return
        st = self._state(key)
        async with st.run_lock:
            try:
                yield key.max_runs or self.s.max_runs_per_key
            except TooManyRuns as exc:
                AUTH.labels("run_limited").inc()
                raise Denied(429, str(exc), retry_after=60) from None


class Guard:
    """The ASGI middleware: the key and scope of every request (``RULES``), the rate of
    its key and, for an SSE stream, its key's open streams (``Limits``, shared with the
    job service)."""

    def __init__(self, app: Any, keys: Keyring, limits: Limits) -> None:
        self.app = app
        self.keys = keys
        self.limits = limits

    @classmethod
    def wrap(cls, app: Any, keys: Keyring, limits: Limits) -> Any:
        """``app`` behind a Guard, or ``app`` itself when no keys are configured."""
        if not keys:
            _log.warning("auth.disabled", reason="TANDEM_API_KEYS is empty: the API is open")
            return app
        _log.info("auth.enabled", keys=len(keys.by_hash))
        return cls(app, keys, limits)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        need = needs(method, path)
        if need == PUBLIC:
            await self.app(scope, receive, send)
            return
        async with contextlib.AsyncExitStack() as held:
            try:
                caller = self.keys.check(_presented(scope), need, f"{method} {path}")
                await self.limits.admit(caller)
                if method == "GET" and SSE.fullmatch(path):
                    await held.enter_async_context(self.limits.stream(caller))
            except Denied as exc:
                await _refuse(send, path, exc)
                return
            AUTH.labels("ok").inc()
            scope.setdefault("state", {})["caller"] = caller
            await self.app(scope, receive, send)


async def _refuse(send: Any, path: str, exc: Denied) -> None:
    _log.info("auth.refused", status=exc.status, path=path, why=exc.message)
    if exc.status == 401:
        await _reply(send, 401, f"{exc.message}: send 'Authorization: Bearer <key>'",
                     {"www-authenticate": 'Bearer realm="tandem"'})
    else:
        headers = {"retry-after": str(exc.retry_after)} if exc.retry_after else {}
        await _reply(send, exc.status, exc.message, headers)


def _presented(scope: dict[str, Any]) -> str:
    headers = dict(scope.get("headers") or [])
    auth = headers.get(b"authorization", b"").decode("latin-1").strip()
    if auth:
        return bearer(auth)
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


async def _reply(send: Any, status: int, detail: str, headers: dict[str, str] | None = None
                 ) -> None:
    body = json.dumps({"detail": detail}).encode()
    hdrs = [(b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]
    hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def document(app: Any) -> None:
    """Declare the bearer key in the app's OpenAPI (docs, clients, the fuzzer)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["ApiKey"] = {
            "type": "http", "scheme": "bearer",
            "description": "An API key (tandem security api-key); scopes generate, train, "
            "admin. Not required when the gateway runs without keys."}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                if needs(method.upper(), path) == PUBLIC:
                    continue
                op["security"] = [{"ApiKey": []}]
                responses = op.setdefault("responses", {})
                for code, what in (("401", "No or an unknown API key"),
                                   ("403", "The key lacks the scope"),
                                   ("429", "Over the key's rate or concurrency limit")):
                    responses.setdefault(code, {"description": what})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
