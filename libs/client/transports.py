"""The two transports of ``tandem.client``: the NATS job service and the HTTP API.

Both speak the same contract (``tandem.common.jobs``: a ``GenerationRequest`` or a
``RunConfig`` in, the accepted record out, ``JobError`` with the HTTP status and the
API's ``detail`` on refusal), so every method means the same on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
JOBS = "tandem.jobs"  # the job service's subject prefix (tandem.common.subjects.JOBS)
PROGRESS = "gen.progress"  # + .<task>: each denoising step (subjects.GEN_PROGRESS)
WRITTEN = "tasks.written"  # + .<task>: a write of the record, headers only (TASK_WRITTEN)


class JobError(Exception):
    """A refused request: ``status`` as HTTP gives it (the job service's error code too)
    and ``detail``, the API's message or, for 422, one entry per bad field;
    ``retry_after``: the seconds the service asks to wait (429, 503), else None."""

    def __init__(self, status: int, detail: Any, retry_after: str | None = None) -> None:
        self.status = status
        self.detail = detail
        try:
            self.retry_after = float(retry_after) if retry_after else None
        except ValueError:  # an HTTP date: not what Tandem sends, not worth failing on
            self.retry_after = None
        text = detail if isinstance(detail, str) else "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}"
            for d in detail) if isinstance(detail, list) else json.dumps(detail)
        super().__init__(f"{status}: {text}")


class Client:
    """What both transports offer. ``generate`` and ``train`` take the API's bodies as
    keyword arguments (``model="digits", class_label=3``); ``idempotency_key`` makes a
    retry return the first task instead of a second one."""

    retry_for = 30.0  # seconds ``generate`` goes on trying through a gateway that is away
    patience = 120.0  # seconds a follow reads on through a gateway that is away

    async def generate(self, *, idempotency_key: str | None = None,
                       **request: Any) -> dict[str, Any]:
        """Queue a generation; the accepted record. A submission whose answer never came
        (a gateway killed mid-request, none serving for a moment, a 503) is sent again
        for ``retry_for`` seconds under the same Idempotency-Key (one made for the call
        when none is given), so it is queued once however often it is sent."""
        from tandem.common.backoff import Backoff, retry

        key = idempotency_key or uuid.uuid4().hex
        return await retry(lambda: self._generate(key, request), Backoff(0.5, max_delay=4.0),
                           when=self._unanswered, within=self.retry_for)

    async def _generate(self, key: str, request: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _unanswered(self, exc: BaseException) -> bool:
        """Whether ``exc`` leaves a submission's fate unknown or refused for now only."""
        return isinstance(exc, JobError) and exc.status in (502, 503, 504)

    async def status(self, task_id: str) -> dict[str, Any]:
        raise NotImplementedError

    async def _status_patiently(self, task_id: str) -> dict[str, Any]:
        """``status`` read again while unanswered (as ``generate``: a gateway restarting,
        none serving for a moment, a 503) for ``patience`` seconds: a follow's reads, so
        that ``wait`` and ``events`` ride out a rolling restart of the gateways."""
        from tandem.common.backoff import Backoff, retry

        return await retry(lambda: self.status(task_id), Backoff(0.5, max_delay=4.0),
                           when=self._unanswered, within=self.patience)

    async def cancel(self, task_id: str) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, task_id: str) -> AsyncIterator[dict[str, Any]]:
        """``{"event": "state" | "progress" | "final", ...}`` until the task ends."""
        raise NotImplementedError

    async def train(self, **config: Any) -> dict[str, Any]:
        """Submit a training run (a ``RunConfig``); its view: ``run_id``, ``state`` and,
        while pending, ``waiting`` (the coordinator it waits for)."""
        raise NotImplementedError

    async def run(self, run_id: str) -> dict[str, Any]:
        raise NotImplementedError

    async def cancel_run(self, run_id: str) -> dict[str, Any]:
        raise NotImplementedError

    async def models(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- shared by both

    async def wait(self, task_id: str, timeout: float | None = None) -> dict[str, Any]:
        """The task's final record (succeeded, failed or cancelled)."""
        async with asyncio.timeout(timeout):
            async for event in self.events(task_id):
                if event["event"] == "final":
                    return event["record"]
        return await self._status_patiently(task_id)

    async def wait_run(self, run_id: str, timeout: float | None = None,
                       poll: float = 1.0) -> dict[str, Any]:
        """The run's record once it has finished (polled: runs take minutes)."""
        async with asyncio.timeout(timeout):
            while True:
                rec = await self.run(run_id)
                if rec["state"] in TERMINAL:
                    return rec
                await asyncio.sleep(poll)  # a run's state changes every few seconds

    async def images(self, record: dict[str, Any]) -> list[bytes]:
        """The PNGs of a succeeded task, from its presigned URLs."""
        async with httpx.AsyncClient(timeout=60) as http:
            out = []
            for ref in record.get("images", []):
                r = await http.get(ref["url"])
                r.raise_for_status()
                out.append(r.content)
            return out

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class NatsClient(Client):
    """Over the NATS job service (``tandem.jobs.*``, request/reply) and the task's own
    subjects: ``gen.progress.<task>`` (each step) and ``tasks.written.<task>`` (each
    stored write of its record, headers only: the record itself, every tenant's, is for
    services; a client reads its own through the job service, which checks its owner).

    A write heard is a wake-up to read the record (``status``), never the record; none
    is heard while the connection is away, so while nothing is heard for ``recheck``
    seconds the record is read again: a final write that was missed ends the follow
    within ``recheck``."""

    def __init__(self, nc: Any, api_key: str | None = None, timeout: float = 10.0,
                 recheck: float = 5.0) -> None:
        self.nc = nc
        self.api_key = api_key
        self.timeout = timeout
        self.recheck = recheck

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, timeout: float = 10.0,
                      recheck: float = 5.0, **options: Any) -> NatsClient:
        """Connect as ``TANDEM_NATS_USER``/``_PASSWORD``/``_CREDS``/``_TLS_CA``/
        ``_INBOX_PREFIX`` say (``tandem.common.bus.connect.connect_options``, as every
        service does). The first connect makes three tries of 2 s at most each,
        then raises ``ConnectionError`` naming the URL and the last failure (refused,
        no answer, the server's own refusal); once connected, the connection comes back
        by itself without end. Errors are not printed. ``options`` go to
        ``nats.connect`` over these."""
        import nats
        from nats.errors import AuthorizationError, Error, NoServersError

        from tandem.common.bus.connect import connect_options
        from tandem.common.settings import Settings, load

        failures: list[BaseException] = []

        def refused(exc: BaseException) -> bool:  # nats-py raises a plain Error for it
            return (isinstance(exc, AuthorizationError)
                    or "authorization violation" in str(exc).lower())

        async def quiet(exc: Exception) -> None:  # said once, by the error raised below
            # NOTE: a refused login is what to say, not the reset of a retry after it.
            # (The server closes at once, so a try can also end in a reset alone: then
            # only "cannot reach" can be said.)
            if not any(refused(f) for f in failures):
                failures[:] = [exc]

        opts: dict[str, Any] = dict(connect_options(load(Settings, "tandem.client")),
                                    connect_timeout=2, reconnect_time_wait=0.5,
                                    max_reconnect_attempts=2, error_cb=quiet)
        opts.update(options)
        try:
            nc = await nats.connect(url, **opts)
        except (OSError, TimeoutError, Error) as exc:
            last = failures[-1] if failures and isinstance(exc, NoServersError) else exc
            why = str(last).strip() or ("no answer" if isinstance(last, TimeoutError)
                                        else type(last).__name__)
            if refused(last):
                raise ConnectionError(
                    f"NATS at {url} refused the login ({why}): check TANDEM_NATS_USER and "
                    "TANDEM_NATS_PASSWORD, or TANDEM_NATS_CREDS") from None
            raise ConnectionError(f"cannot reach NATS at {url}: {why}") from None
        if "max_reconnect_attempts" not in options:
            # nats-py has one limit for the first connect and for reconnects: once
            # connected, reconnect without end (a follow reads the record again after).
            nc.options["max_reconnect_attempts"] = -1
        return cls(nc, api_key, timeout, recheck)

    async def request(self, endpoint: str, body: Any,
                      headers: dict[str, str] | None = None) -> Any:
        hdrs = dict(headers or {})
        if self.api_key:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        from nats.errors import NoRespondersError

        try:
            msg = await self.nc.request(f"{JOBS}.{endpoint}", json.dumps(body).encode(),
                                        timeout=self.timeout, headers=hdrs or None)
        except NoRespondersError:  # NATS is there, no gateway serving tandem-jobs on it
            raise JobError(503, f"no gateway serves the job service ({JOBS}.{endpoint}) on "
                           "this NATS: start one (tandem dev up), or point the URL at a "
                           "NATS where one runs") from None
        data = json.loads(msg.data) if msg.data else {}
        got = msg.headers or {}
        code = got.get("Nats-Service-Error-Code")
        if code:
            raise JobError(int(code), data.get("detail", got.get("Nats-Service-Error", "")),
                           got.get("Retry-After"))
        return data

    async def _generate(self, key: str, request: dict[str, Any]) -> dict[str, Any]:
        return await self.request("generate", request, {"Idempotency-Key": key})

    def _unanswered(self, exc: BaseException) -> bool:
        from nats.errors import TimeoutError as NatsTimeout

        return isinstance(exc, NatsTimeout) or super()._unanswered(exc)

    async def status(self, task_id: str) -> dict[str, Any]:
        return await self.request("status", {"id": task_id})

    async def cancel(self, task_id: str) -> dict[str, Any]:
        return await self.request("cancel", {"id": task_id})

    async def train(self, **config: Any) -> dict[str, Any]:
        return await self.request("train", config)

    async def run(self, run_id: str) -> dict[str, Any]:
        return await self.request("status", {"run_id": run_id})

    async def cancel_run(self, run_id: str) -> dict[str, Any]:
        return await self.request("cancel", {"run_id": run_id})

    async def models(self) -> list[dict[str, Any]]:
        return (await self.request("models", {}))["models"]

    async def events(self, task_id: str) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        async def on(msg: Any) -> None:
            if msg.subject.startswith("gen."):
                queue.put_nowait(("progress", json.loads(msg.data)))
            else:
                queue.put_nowait(("written", None))

        # Subscribed before the record is read: no change can fall between the two.
        subs = [await self.nc.subscribe(f"{subject}.{task_id}", cb=on)
                for subject in (PROGRESS, WRITTEN)]
        try:
            record = await self._status_patiently(task_id)
            state = record["state"]
            yield {"event": "state", "state": state, "cluster": record["cluster"],
                   "worker": record["worker"]}
            while state not in TERMINAL:
                try:
                    kind, data = await asyncio.wait_for(queue.get(), self.recheck)
                except TimeoutError:  # nothing heard: read the record (see the class)
                    record = await self._status_patiently(task_id)
                    if record["state"] in TERMINAL:
                        state = record["state"]
                    continue
                if kind == "progress":
                    if state == "queued":  # its first step: it runs (written later)
                        state = "running"
                        yield {"event": "state", "state": state, "cluster": record["cluster"],
                               "worker": ""}
                    yield {"event": "progress", **data}
                    continue
                record = await self._status_patiently(task_id)  # written: as stored
                if record["state"] != state:
                    state = record["state"]
                    if state not in TERMINAL:
                        yield {"event": "state", "state": state,
                               "cluster": record.get("cluster", ""),
                               "worker": record.get("worker", "")}
            yield {"event": "final", "record": record}
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()


class HttpClient(Client):
    """Over the gateway's HTTP API (progress by Server-Sent Events).

    A follow whose event stream breaks (the gateway restarts, a proxy hangs up) or ends
    without the final event reads the task's status every ``recheck`` seconds until it
    has ended, then gives the final event: the task runs on without the stream. While
    the gateway cannot be reached or answers 502-504, it keeps trying for ``patience``
    seconds, then raises the last error."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0,
                 verify: Any = True, recheck: float = 2.0, patience: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                                      verify=verify)
        self.recheck = recheck
        self.patience = patience

    async def _call(self, method: str, path: str, want: int = 200, **kw: Any) -> Any:
        r = await self.http.request(method, path, **kw)
        if r.status_code != want:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise JobError(r.status_code, detail, r.headers.get("retry-after"))
        return r.json()

    async def _generate(self, key: str, request: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", "/v1/generations", 202, json=request,
                                headers={"Idempotency-Key": key})

    def _unanswered(self, exc: BaseException) -> bool:
        return isinstance(exc, httpx.TransportError) or super()._unanswered(exc)

    async def status(self, task_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/generations/{task_id}")

    async def cancel(self, task_id: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/v1/generations/{task_id}")

    async def train(self, **config: Any) -> dict[str, Any]:
        return await self._call("POST", "/v1/training-runs", 202, json=config)

    async def run(self, run_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/training-runs/{run_id}")

    async def cancel_run(self, run_id: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/v1/training-runs/{run_id}")

    async def models(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/v1/models"))["models"]

    async def events(self, task_id: str) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self.http.stream("GET", f"/v1/generations/{task_id}/events",
                                        timeout=None) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise JobError(r.status_code, r.json().get("detail", r.text))
                kind = ""
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if kind == "final":
                            yield {"event": "final", "record": data}
                            return
                        yield {"event": kind, **data}
        except httpx.TransportError:
            pass  # the stream broke: the task goes on without it (see the class)
        yield {"event": "final", "record": await self._ended(task_id)}

    async def _ended(self, task_id: str) -> dict[str, Any]:
        """The task's record once it has ended, read every ``recheck`` seconds."""
        while True:
            record = await self._status_patiently(task_id)
            if record["state"] in TERMINAL:
                return record
            await asyncio.sleep(self.recheck)  # polling: no stream to wait on

    async def close(self) -> None:
        await self.http.aclose()


async def connect(url: str, api_key: str | None = None, **options: Any) -> Client:
    """A client for ``url``: ``nats://`` (or ``tls://``) uses the job service,
    ``http(s)://`` the gateway's HTTP API; the same interface either way."""
    if url.startswith(("nats://", "tls://", "ws://", "wss://")):
        return await NatsClient.connect(url, api_key, **options)
    if url.startswith(("http://", "https://")):
        return HttpClient(url, api_key, **options)
    raise ValueError(f"tandem.client: {url!r} is neither nats:// nor http(s)://")
