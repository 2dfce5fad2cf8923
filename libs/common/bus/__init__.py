"""tandem.common.bus: one NATS connection per process, typed publish, typed pull consumers.

One concern per module:

============  ===========================================================================
``connect``   ``Bus`` (connect, provision, KV, dead-letter, drain), ``synced``, domains
``publish``   the pipelined JetStream publish: ``publish``, ``publish_once``, ``send``...
``pull``      the fetch of a durable pull consumer, one timer per fetch
``consumer``  ``Consumer`` (decode, handle, settle) and ``Poller``, the one pull loop
``acks``      the acknowledgement policy and its table (last delivery kept for the DLQ)
``kv``        ``TypedKV`` (compare-and-set), ``watch``/``snapshot``, ``KeyWatch``/``MapWatch``
``headers``   every header name, once; the trace context they carry
``retry``     which errors are transient, and retrying through them
============  ===========================================================================

Import from here: the names below are the bus's public API. The bus must not import a
service, nor anything above ``tandem.common``.
"""

from tandem.common.bus.acks import AckPolicy, DeadHook, delivered_count
from tandem.common.bus.connect import Bus, DomainJetStream, synced
from tandem.common.bus.consumer import Consumer, Delivery, Poller
from tandem.common.bus.headers import EXPECTED_LAST, MSG_ID, TRACEPARENT
from tandem.common.bus.kv import KeyWatch, MapWatch, TypedKV, Watch, snapshot, watch
from tandem.common.bus.retry import describe, no_room, retry_transient, transient

__all__ = [
    "EXPECTED_LAST",
    "MSG_ID",
    "TRACEPARENT",
    "AckPolicy",
    "Bus",
    "Consumer",
    "DeadHook",
    "Delivery",
    "DomainJetStream",
    "KeyWatch",
    "MapWatch",
    "Poller",
    "TypedKV",
    "Watch",
    "delivered_count",
    "describe",
    "no_room",
    "retry_transient",
    "snapshot",
    "synced",
    "transient",
    "watch",
]
