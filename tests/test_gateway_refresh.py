"""A key made a moment ago: the gateway's re-read for it must have ended before the key is looked up again.

Found running the suite on PostgreSQL on a loaded machine: a request with a new key
got 401 when the gateway's periodic read began during the wait before the key's own
re-read, and the key was looked up before that read had ended.
"""

import asyncio
import time

from gateway import routes
from gateway.app import KEY_MISS_REFRESH_S, Gateway


def test_a_read_that_began_while_a_new_key_waited_is_waited_for_before_the_key_is_looked_up_again():
    gateway = Gateway()

    def slow_read() -> routes.Table:
        time.sleep(KEY_MISS_REFRESH_S)  # a read that ends after the key's wait is over
        return routes.Table(keys={"digest-of-the-new-key": object()})

    gateway._read_table = slow_read

    async def scene() -> None:
        loop = asyncio.get_running_loop()
        gateway._last_refresh_start = time.monotonic()  # a read just began: the new key waits its turn
        asked = time.monotonic()
        # The periodic read begins during that wait, after the key was asked for.
        loop.call_later(KEY_MISS_REFRESH_S / 2, lambda: asyncio.ensure_future(gateway.refresh()))
        await gateway.refresh_since(asked)
        assert "digest-of-the-new-key" in gateway.table.keys

    asyncio.run(scene())
    gateway._db.shutdown()
