"""``tandem.client``: submit and follow Tandem jobs from Python, over NATS or HTTP.

One interface, two transports, chosen by the URL::

    async with await connect("nats://127.0.0.1:4222") as tandem:   # or http://...:8000
        task = await tandem.generate(model="digits", class_label=3, steps=20)
        async for event in tandem.events(task["id"]):                # state, progress...
            ...
        record = await tandem.wait(task["id"])                       # the final record
        pngs = await tandem.images(record)
        run = await tandem.train(steps=50)      # any cluster's trainer coordinator
        print(run["state"], run["waiting"])     # pending: what it waits for
        await tandem.cancel_run(run["run_id"])

A run may name its ``cluster``; only a trainer coordinator of that cluster claims it (on
``tandem dev up`` the one trainer is cluster ``control``'s, not ``east``'s or ``west``'s).
While no coordinator has claimed it, ``waiting`` says which one it waits for, and that
none has ever started there when so.

``SyncClient`` wraps either for code without an event loop. A refusal raises
``JobError`` with the HTTP status and the API's ``detail`` (a 422 names each field), the
same from both transports. The CLI (``tandem generate``, ``tandem train submit``) and
the demo use this client: there is one client code path.
"""

from tandem.client.sync import SyncClient
from tandem.client.transports import Client, HttpClient, JobError, NatsClient, connect

__all__ = ["Client", "HttpClient", "JobError", "NatsClient", "SyncClient", "connect"]
