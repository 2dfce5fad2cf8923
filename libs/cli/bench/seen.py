"""``python -m tandem.cli.bench.seen <nats url> <n>``: when the n-th task success was written.

The serve bench's one clock for the end of a drain, the same for Tandem's worker and for
the protocol floor: a process of its own (so its work is neither side's CPU) subscribes
to every record write (``$KV.tasks.*``), prints ``ready`` once the server has the
subscription, then prints the wall-clock time (``time.time()``) at which it saw the
n-th write that says ``succeeded`` and exits. Writes are told apart by a byte search
(``tasks.says_succeeded``), not decoded, so it keeps up with the fastest side.
"""

from __future__ import annotations

import asyncio
import sys
import time

import nats

from tandem.common import subjects
from tandem.common.bus import synced
from tandem.common.tasks import says_succeeded


async def main(url: str, n: int) -> None:
    nc = await nats.connect(url, name="tandem-bench-seen")
    done = asyncio.get_running_loop().create_future()
    count = 0

    async def on(msg: object) -> None:
        nonlocal count
        if says_succeeded(msg.data):  # type: ignore[attr-defined]
            count += 1
            if count == n and not done.done():
                done.set_result(time.time())

    await nc.subscribe(subjects.TASK_RECORD.wildcard, cb=on)
    await synced(nc)  # the subscription is on the server before "ready"
    print("ready", flush=True)
    print(f"{await done:.6f}", flush=True)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
