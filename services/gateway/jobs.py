"""The job service on NATS: ``tandem-jobs``, a ``nats.micro`` service in the gateway.

Programs that already speak NATS (schedulers, notebooks, other services) submit and
follow jobs by request/reply, with JSON bodies, on ``tandem.jobs.<endpoint>``:

==========  ====================================  =======================================
endpoint    request body                          reply
==========  ====================================  =======================================
generate    a ``GenerationRequest``               the accepted record: id, state, cluster,
                                                  seed, record / progress subjects
train       a ``RunConfig``                       the run's record and its status subject
cancel      ``{"id": task}`` or ``{"run_id": r}``  the record after the cancel
status      ``{"id": task}`` or ``{"run_id": r}``  the record (as ``GET`` over HTTP)
models      ``{}``                                the model registry (as ``GET /v1/models``)
==========  ====================================  =======================================

It lives in the gateway because it is the gateway's other door: the same ``Gateway``
(``accept``: ``jobs.check_request``, routing, the record, the publish) and the same
training functions answer both, so a job is validated, recorded, owned and made
idempotent exactly as over HTTP, within the same per-key limits (``auth.Limits``: one
request bucket and one count of unfinished runs per key across both doors). Headers:
``Authorization: Bearer <key>`` where the gateway has keys (the same keys, scopes and
ownership as HTTP), ``Idempotency-Key`` on ``generate``. An error answers with the
service API's headers (``Nats-Service-Error``, ``Nats-Service-Error-Code``: the HTTP
status; ``Retry-After`` on a 429) and the HTTP API's body (``{"detail": ...}``; a 422
names each bad field). ``$SRV.PING``, ``$SRV.INFO`` (each
endpoint with its subject and the JSON Schema of its request in ``metadata``) and
``$SRV.STATS`` answer as for any NATS service; every gateway joins one queue group.

Header names are read without regard to case, as over HTTP. A request is answered only
on an inbox (``subjects.is_inbox``): one whose reply subject names anything else, or
none, is dropped unserved, since its answer would be published with the gateway's own
permissions (a reply of ``$KV.tasks.<id>`` wrote over another tenant's task record).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.micro.request import Request
from nats.micro.service import Service, ServiceConfig
from pydantic import ValidationError

from tandem.common import log, subjects, tracing
from tandem.common.bus import describe
from tandem.common.errors import InvalidToken
from tandem.common.jobs import (
    TOKEN,
    Caller,
    GenerationRequest,
    JobRefused,
    Problem,
    pydantic_problems,
)
from tandem.common.runs import RunConfig
from tandem.gateway.auth import ANY_KEY, Denied, Keyring, Limits, Scope, bearer
from tandem.gateway.generations import Gateway
from tandem.gateway.schemas import json_safe
from tandem.gateway.training import (
    cancel_training,
    run_answer,
    run_view,
    submit_training,
    training_run,
)

_log = log.get("tandem.gateway.jobs")

NAME = "tandem-jobs"
STATUS_ATTRIBUTE = "tandem.jobs.status"  # on a request's span: its answer's HTTP status
# The job service's contract, semver: docs/bus-api.md, "Versions", lists each change.
VERSION = "2.0.0"
PREFIX = subjects.JOBS.template.rsplit(".", 1)[0]  # tandem.jobs
Auth = Callable[[str], Awaitable[Caller]]  # the needed scope -> the caller, or raises Denied
Handler = Callable[[Any, dict[str, str], Auth], Awaitable[dict[str, Any]]]
_WHICH = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": TOKEN, "description": "a generation's task id"},
    "run_id": {"type": "string", "pattern": TOKEN, "description": "a training run's id"}},
    "oneOf": [{"required": ["id"]}, {"required": ["run_id"]}], "additionalProperties": False}


class JobService:
    """The endpoints, bound to a gateway; ``start`` on a connection, ``stop`` to leave.

    ``max_body``: the largest request body, as the HTTP door's (``MAX_BODY_BYTES``); a
    larger one is refused before it is read, so a flood of big bodies costs little."""

    def __init__(self, gw: Gateway, keys: Keyring, limits: Limits,
                 max_body: int = 64 * 1024, train_clusters: Sequence[str] = ()) -> None:
        self.gw = gw
        self.train_clusters = train_clusters
        self.keys = keys
        self.limits = limits
        self.max_body = max_body
        self.service: Service | None = None

    async def start(self, nc: Any) -> None:
        svc = self.service = _InboxOnly(nc, ServiceConfig(
            name=NAME, version=VERSION, queue_group=NAME,
            description="Submit, follow and cancel Tandem jobs (generation, training)."))
        await svc.start()
        group = svc.add_group(name=PREFIX)
        endpoints: list[tuple[str, Handler, dict[str, Any]]] = [
            ("generate", self.generate, GenerationRequest.model_json_schema()),
            ("train", self.train, RunConfig.model_json_schema()),
            ("cancel", self.cancel, _WHICH),
            ("status", self.status, _WHICH),
            ("models", self.models, {"type": "object"}),
        ]
        for name, handler, schema in endpoints:
            await group.add_endpoint(name=name, handler=self._serve(name, handler), metadata={
                "request_schema": json.dumps(schema, separators=(",", ":")),
                "doc": (handler.__doc__ or "").strip().splitlines()[0]})
        _log.info("jobs.started", service=NAME, subjects=[subjects.jobs(n) for n, *_ in
                                                           endpoints])

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None

    # ------------------------------------------------------------------------ serving

    def _serve(self, name: str, handler: Handler) -> Callable[[Request], Awaitable[None]]:
        async def serve(req: Request) -> None:
            if not answerable(req._msg, subjects.jobs(name)):
                return
            headers = {k.lower(): v for k, v in (req.headers or {}).items()}

            async def auth(need: str) -> Caller:
                caller = self.keys.check(
                    bearer(headers.get("authorization") or headers.get("x-api-key", "")),
                    need, subjects.jobs(name))
                await self.limits.admit(caller)  # the key's one rate, shared with HTTP
                return caller

            # The request's server span (as the HTTP door's): what it publishes (a
            # generation's task) descends from it, under the caller's trace if it sent one.
            with tracing.server_span(f"{NAME}/{name}", headers, attributes={
                    "rpc.system": "nats", "rpc.service": NAME, "rpc.method": name,
                    "messaging.destination.name": subjects.jobs(name)}) as span:
                try:
                    if len(req.data or b"") > self.max_body:
                        raise JobRefused(413, f"the request body is {len(req.data)} bytes, "
                                         f"over the {self.max_body} this service takes "
                                         "(TANDEM_MAX_BODY_BYTES)")
                    try:
                        body = json.loads(req.data) if req.data else {}
                    except ValueError as exc:
                        raise JobRefused(400, f"the request body is not JSON: {exc}") from None
                    except RecursionError:
                        raise JobRefused(400, "the request body nests arrays or objects too "
                                              "deeply to be read") from None
                    reply = await handler(body, headers, auth)
                except Denied as exc:
                    await self._refuse(req, name, JobRefused(exc.status, exc.message,
                                                             retry_after=exc.retry_after), span)
                except JobRefused as exc:
                    await self._refuse(req, name, exc, span)
                except NatsError as exc:  # past the retry window: the HTTP door's 503 too
                    await self._refuse(req, name, JobRefused(
                        503, f"the message bus (NATS) failed to serve {name}: "
                             f"{describe(exc)}; try again", retry_after=1), span)
                except Exception:  # a bug: the documented body, not nats.micro's bare repr
                    ref = uuid.uuid4().hex[:12]
                    _log.exception("jobs.failed", endpoint=name, ref=ref)
                    await self._refuse(req, name, JobRefused(
                        500, f"the gateway failed to serve {name} (logged as {ref})"), span)
                else:
                    if span is not None:
                        span.set_attribute(STATUS_ATTRIBUTE, 200)
                    await req.respond(msgspec.json.encode(reply))

        return serve

    async def _refuse(self, req: Request, name: str, exc: JobRefused, span: Any = None) -> None:
        if span is not None:  # an error on the gateway's side (5xx) fails its span
            span.set_attribute(STATUS_ATTRIBUTE, exc.status)
            if exc.status >= 500:
                tracing.fail(span, f"{exc.status} {HTTPStatus(exc.status).phrase}")
        extra = {"Retry-After": str(max(1, int(exc.retry_after)))} if exc.retry_after else None
        # json_safe: a 422 echoes what was sent, which may hold a lone surrogate.
        await req.respond_error(str(exc.status), json_safe(str(exc)),
                                msgspec.json.encode(json_safe(exc.body())), headers=extra)
        # nats.micro counts an error only when a handler raises, and then answers with no
        # body; this answers with the HTTP API's body, so it counts the error itself.
        # $SRV.STATS answers anyone: its last error names the status, never the detail
        # (a 422 echoes what another tenant sent).
        for endpoint in self.service._endpoints if self.service else []:
            if endpoint._name == name:
                endpoint._num_errors += 1
                endpoint._last_error = f"{exc.status} {HTTPStatus(exc.status).phrase}"

    # ---------------------------------------------------------------------- endpoints

    async def generate(self, body: Any, headers: dict[str, str], auth: Auth) -> dict[str, Any]:
        """Queue a generation (a GenerationRequest); the accepted record."""
        caller = await auth(Scope.generate)
        try:
            req = GenerationRequest.model_validate(body)
        except ValidationError as exc:
            raise JobRefused.invalid(pydantic_problems(exc)) from None
        key = headers.get("idempotency-key")
        if key is not None and not 1 <= len(key) <= 255:
            raise JobRefused.invalid([Problem("Idempotency-Key", "1 to 255 characters")],
                                     "header")
        sub = await self.gw.accept(req, key, caller)
        return {**sub.accepted(), "replayed": sub.replayed}

    async def train(self, body: Any, headers: dict[str, str], auth: Auth) -> dict[str, Any]:
        """Submit a training run (a RunConfig); the run's record."""
        rec = await submit_training(self.gw.bus, body, await auth(Scope.train), self.limits,
                                    self.train_clusters)
        return await run_answer(self.gw.bus, rec, self.train_clusters)

    async def cancel(self, body: Any, headers: dict[str, str], auth: Auth) -> dict[str, Any]:
        """Cancel a generation ({"id"}) or a training run ({"run_id"}); its record."""
        kind, job_id = _which(body)
        if kind == "run_id":
            return run_view(await cancel_training(self.gw.bus, job_id, await auth(Scope.train)))
        return self.gw.view(await self.gw.cancel(job_id, await auth(Scope.generate)))

    async def status(self, body: Any, headers: dict[str, str], auth: Auth) -> dict[str, Any]:
        """A generation's ({"id"}) or a training run's ({"run_id"}) record."""
        kind, job_id = _which(body)
        if kind == "run_id":
            rec = await training_run(self.gw.bus, job_id, await auth(Scope.train))
            return await run_answer(self.gw.bus, rec, self.train_clusters)
        rec = await self.gw.record(job_id, await auth(Scope.generate))
        if rec is None:
            raise JobRefused(404, f"no task {job_id!r}")
        return self.gw.view(rec)


    async def models(self, body: Any, headers: dict[str, str], auth: Auth) -> dict[str, Any]:
        """The model registry: what each model takes, and where it is loaded."""
        await auth(ANY_KEY)
        return {"models": await self.gw.models()}


def answerable(msg: Msg, what: str) -> bool:
    """Whether ``msg``'s reply subject is an inbox to answer on (``subjects.is_inbox``);
    if not, the request is dropped unserved, and logged."""
    if subjects.is_inbox(msg.reply):
        return True
    _log.warning("jobs.unanswerable", subject=what, reply=(msg.reply or "")[:120],
                 why="a request is answered on an inbox only (_INBOX.<...>)")
    return False


class _InboxOnly(Service):
    """nats.micro's service, whose own ``$SRV`` verbs answer on inboxes only too."""

    async def _handle_ping_request(self, msg: Msg) -> None:
        if answerable(msg, msg.subject):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg: Msg) -> None:
        if answerable(msg, msg.subject):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg: Msg) -> None:
        if answerable(msg, msg.subject):
            await super()._handle_stats_request(msg)


def _which(body: Any) -> tuple[str, str]:
    """``("id", task)`` or ``("run_id", run)`` from a cancel or status body (``_WHICH``);
    422 naming the field when the id is not one any job could have (``"a.b"``)."""
    if not isinstance(body, dict):
        raise JobRefused(422, 'the body is {"id": <task>} or {"run_id": <run>}')
    given = [k for k in ("id", "run_id") if k in body]
    unknown = sorted(set(body) - {"id", "run_id"})
    if len(given) != 1 or unknown or not isinstance(body[given[0]], str):
        problems = [Problem(k, "not a field of this request") for k in unknown] or [
            Problem("id", 'give exactly one of "id" (a task) or "run_id" (a run), a string')]
        raise JobRefused.invalid(problems)
    kind, job_id = given[0], body[given[0]]
    try:
        subjects.token(job_id, "task id" if kind == "id" else "run id")
    except InvalidToken as exc:
        raise JobRefused.invalid([Problem(kind, exc.reason, job_id)]) from None
    return kind, job_id
