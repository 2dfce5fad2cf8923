"""The connection: one NATS client per process with JetStream, as ``Bus``.

``Bus.connect`` reconnects without end and logs connection changes (a permission the
server refuses is named, with the subject); ``Bus.drain`` flushes and closes within a
timeout and is safe to call twice; ``synced`` waits until the server has everything a
connection sent before it (nats-py's ``flush`` alone does not). Across a JetStream
domain (a GPU cluster's leaf node reaching the control plane), ``DomainJetStream`` sends
KV writes where the server expects them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.kv import KeyValue

from tandem.common import log, metrics, subjects
from tandem.common.bus.acks import LetterTooLarge
from tandem.common.bus.consumer import Consumer, Delivery
from tandem.common.bus.headers import MSG_ID
from tandem.common.bus.kv import TypedKV
from tandem.common.bus.publish import Publishing
from tandem.common.events import DeadLetter, decode, encode, struct_replace
from tandem.common.permissions import SERVICE_ROLES, violation
from tandem.common.settings import Settings
from tandem.common.streams import ConsumerSpec, Spec, provision

E = TypeVar("E")
_log = log.get("tandem.bus")


async def synced(nc: NATS, timeout: float = 10.0) -> None:
    """Return once the server has processed every command ``nc`` sent before the call
    (a SUB another connection's publish must find, a PUB another must have seen).

    nats-py 2.16's ``flush`` writes its PING straight to the socket, ahead of commands
    still in the client's pending buffer (a SUB made just before), so its PONG says
    nothing about them: the server may answer it, then another connection's request
    finds no subscriber. While the first flush waits, the client's flusher writes the
    pending commands; the second PING goes behind them, so its PONG covers them.
    """
    await nc.flush(timeout)
    await nc.flush(timeout)


class DomainJetStream(JetStreamContext):
    """JetStream in another domain (the control plane, reached through a leaf node), or
    under an API prefix (another account's, imported).

    API calls go to ``$JS.<domain>.API`` (nats-py does that). KV writes must too, as
    ``$JS.<domain>.API.$KV.<bucket>.<key>``: the server does not carry ``$KV.>`` across
    a leaf connection between domains. nats-py 2.16 still writes to the bare ``$KV``
    subject (nats.py issue #1010, fixed upstream after 2.16 by matching nats.go's
    ``putPre``), so this does the same here. Reads and watches keep the bare subjects,
    which are the stream's own.
    """

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> PubAck:
        if subject.startswith("$KV."):
            subject = f"{self._prefix}.{subject}"
        return await super().publish(subject, *args, **kwargs)


# Of a dead letter's room (the server's max_payload), what its NATS headers may take
# (traceparent, Nats-Msg-Id: about 150 bytes), with a margin.
LETTER_HEADROOM = 1024
REASON_MOST = 4096  # characters of a reason kept in a letter that must be cut


def fitting(letter: DeadLetter, max_payload: int) -> DeadLetter:
    """``letter`` as it can be published under ``max_payload``: as it is if it fits;
    else with only the start of its body, its reason saying so with the body's length
    and sha256 (and, if even the rest is too large, without the original headers and
    with the reason cut). Raises ``LetterTooLarge`` if nothing fits."""
    room = max_payload - LETTER_HEADROOM
    if len(encode(letter)) <= room:
        return letter
    data = letter.data
    digest = hashlib.sha256(data).hexdigest()

    def cut(kept: int, headers: dict[str, str], reason: str) -> DeadLetter:
        return struct_replace(letter, data=data[:kept], headers=headers, reason=(
            f"{reason} [dead letter cut: it holds the first {kept} of the body's "
            f"{len(data)} bytes (sha256 {digest}); the whole would exceed max_payload "
            f"{max_payload}]"))

    headers, reason = letter.headers, letter.reason
    # Measured with the count at its widest (the body's length): the note never grows.
    rest = len(encode(cut(0, headers, reason))) + len(str(len(data)))
    if rest > room:  # the headers or the reason alone are too large: leave them out
        headers, reason = {}, f"{reason[:REASON_MOST]} [its headers left out]"
        rest = len(encode(cut(0, headers, reason))) + len(str(len(data)))
    kept = min(len(data), max(0, (room - rest) // 4 * 3))  # base64: 4 bytes per 3
    out = cut(kept, headers, reason)
    size = len(encode(out))
    if size > room:
        raise LetterTooLarge(size, max_payload)
    return out


def connect_options(settings: Settings) -> dict[str, Any]:
    """The ``nats.connect`` options that say who connects and how: user and password,
    credentials file, TLS (CA, and this client's certificate for mutual TLS) and inbox
    prefix, from ``TANDEM_NATS_*``. Every connection uses these: ``Bus.connect``,
    ``tandem.client`` and the CLI."""
    opts: dict[str, Any] = {}
    if settings.nats_user:
        opts["user"] = settings.nats_user
        opts["password"] = (
            settings.nats_password.get_secret_value() if settings.nats_password else ""
        )
    if settings.nats_creds:
        opts["user_credentials"] = settings.nats_creds
    if settings.nats_inbox_prefix:
        opts["inbox_prefix"] = settings.nats_inbox_prefix
    elif settings.nats_user in SERVICE_ROLES:  # its role's own (permissions: _Grants)
        opts["inbox_prefix"] = subjects.service_inbox(settings.nats_user)
    if settings.nats_tls_ca:
        import ssl

        opts["tls"] = ssl.create_default_context(cafile=settings.nats_tls_ca)
        if settings.nats_tls_cert:  # mutual TLS: this client's certificate
            opts["tls"].load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
    return opts


class Bus(Publishing):
    """A connected NATS client with JetStream, shared by a process's loops.

    Its publishing verbs (``publish``, ``publish_once``, ``publish_many``, ``send``,
    ``emit``) come from ``publish.Publishing``.
    """

    def __init__(self, nc: NATS, service: str, js_domain: str | None = None,
                 js_prefix: str | None = None) -> None:
        """``js_domain`` or ``js_prefix`` (an account importing the control plane's
        JetStream API under a prefix): where JetStream lives, if not in this account."""
        self.nc = nc
        if js_prefix is not None:
            self.js: JetStreamContext = DomainJetStream(nc, prefix=js_prefix)
            self.api_prefix = js_prefix
        elif js_domain is not None:
            self.js = DomainJetStream(nc, domain=js_domain)
            self.api_prefix = f"$JS.{js_domain}.API"
        else:
            self.js = nc.jetstream()
            self.api_prefix = "$JS.API"
        self.service = service
        # Run after each reconnect: what a core subscription missed while the connection
        # was away is read again by whoever needs it (a KV watch or a consumer does not).
        self.reconnected: list[Callable[[], Awaitable[None]]] = []
        self._hooks: set[asyncio.Future[None]] = set()
        self._kv: dict[str, KeyValue] = {}
        self._typed: dict[tuple[str, type], TypedKV[Any]] = {}
        self._acks = None  # the pipelined publish's inbox, made on the first send

    @classmethod
    async def connect(cls, settings: Settings, service: str, **options: Any) -> Bus:
        """Connect with endless reconnects; connection changes are logged."""
        lg = log.get("tandem.bus", service=service)

        async def on_error(exc: Exception) -> None:
            denied = violation(exc)
            if denied is not None:  # least privilege at work, or a missing grant
                lg.error("nats.permission_denied", operation=denied.operation,
                         subject=denied.subject, user=settings.nats_user or "",
                         hint="refused by the server: see tandem.common.permissions")
                return
            lg.warning("nats.error", error=repr(exc))

        async def on_disconnect() -> None:
            lg.warning("nats.disconnected")

        made: list[Bus] = []

        async def on_reconnect() -> None:
            # Host and port only: the URL's netloc holds user:password when the
            # credentials are written into TANDEM_NATS_URL.
            url = nc.connected_url
            lg.info("nats.reconnected", url=f"{url.hostname}:{url.port}" if url else "")
            if made:
                made[0]._reconnected_now()

        opts: dict[str, Any] = dict(
            servers=settings.nats_servers,
            name=f"tandem-{service}-{settings.cluster}-{settings.node}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=3,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **connect_options(settings),
        )
        opts.update(options)
        nc = await nats.connect(**opts)
        made.append(cls(nc, service, settings.nats_js_domain, settings.nats_js_api_prefix))
        return made[0]

    def _reconnected_now(self) -> None:
        """Each ``reconnected`` hook, as a task of its own (nats-py awaits its callback
        inside its reconnect: a request made there could wait on itself)."""
        for hook in list(self.reconnected):
            task = asyncio.ensure_future(hook())
            self._hooks.add(task)
            task.add_done_callback(self._hook_done)

    def _hook_done(self, task: asyncio.Future[None]) -> None:
        self._hooks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.warning("nats.reconnected_hook_failed", service=self.service,
                         error=repr(task.exception()))

    async def provision(self, specs: Sequence[Spec]) -> list[str]:
        created = await provision(self.js, specs)
        if created:
            _log.info("bus.provisioned", created=created)
        return created

    # ---------------------------------------------------------------------- request/reply

    async def request(self, subject: str, event: Any, reply_type: type[E], *,
                      timeout: float = 2.0) -> E:
        """Core NATS request/reply, typed both ways: ``event`` encoded, the reply decoded
        as ``reply_type`` (``EventDecodeError`` if it is not one). No responders and no
        reply within ``timeout`` raise nats' errors, which ``retry.transient`` accepts."""
        msg = await self.nc.request(subject, encode(event), timeout=timeout)
        return decode(msg.data, reply_type)

    # ------------------------------------------------------------------------ consuming

    def consumer(self, spec: ConsumerSpec, event_type: type[E],
                 handler: Callable[[Delivery[E]], Awaitable[None]] | None = None,
                 **options: Any) -> Consumer[E]:
        """A ``Consumer`` of ``spec``: ``handler`` per delivery, or ``fetch_handler=``
        for whole fetches."""
        return Consumer(self, spec, event_type, handler, **options)

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def typed(self, bucket: str, event_type: type[E]) -> TypedKV[E]:
        """Bucket ``bucket`` holding ``event_type`` values, written through this bus."""
        key = (bucket, event_type)
        if key not in self._typed:
            self._typed[key] = TypedKV(await self.kv(bucket), event_type, self, bucket)
        return self._typed[key]

    async def dead_letter(self, msg: Msg, reason: str, consumer: str = "") -> None:
        """Copy ``msg`` to ``dlq.<stream>`` with ``reason``; idempotent per stream seq.

        A letter that would not fit the connection's ``max_payload`` (its body is base64
        in the letter, a third larger) keeps only the start of the body, with the body's
        length and sha256 in its reason (``fitting``). Raises ``LetterTooLarge`` if even
        that cannot fit: no retry would ever send it."""
        md = msg.metadata
        stream = md.stream or "unknown"
        letter = fitting(DeadLetter(
            stream=stream, subject=msg.subject, seq=md.sequence.stream,
            num_delivered=md.num_delivered, reason=reason, data=bytes(msg.data),
            headers={k: v for k, v in (msg.headers or {}).items()}, consumer=consumer,
        ), self.nc.max_payload)
        await self.publish(subjects.dlq(stream), letter,
                           msg_id=f"dlq-{stream}-{md.sequence.stream}", retry_for=10.0)
        metrics.DEAD_LETTERS.labels(stream, reason.split(":")[0][:40]).inc()
        # msg_id: what the publisher named the message by (a generation's task id), the
        # one handle an operator has to find what became of it.
        _log.warning("bus.dead_letter", stream=stream, subject=msg.subject,
                     seq=md.sequence.stream, msg_id=(msg.headers or {}).get(MSG_ID, ""),
                     reason=reason)

    async def synced(self) -> None:
        """``synced`` on this bus's connection."""
        await synced(self.nc)

    async def drain(self, timeout: float = 5.0) -> None:
        """Flush and close within ``timeout`` seconds; safe to call twice.

        While the server is unreachable a drain could wait forever on the reconnect
        loop, so past the timeout the connection is simply closed: anything unsent was
        never acknowledged, so no caller believes it was delivered.
        """
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), timeout)
