"""trainer.dist's leaving protocol on a real torch TCPStore: the store host (rank 0 without
torchrun) returns only once every other rank said its group is gone, or after the bound."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from trainer.dist import DistEnv, _leave_together, wait_for_store


def test_the_store_host_leaves_after_the_others():
    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, world_size=3, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=30))
    clients = [TCPStore("127.0.0.1", host.port, world_size=3, is_master=False, timeout=timedelta(seconds=30))
               for _ in range(2)]

    def late(rank: int, delay: float) -> None:
        time.sleep(delay)
        _leave_together(clients[rank - 1], DistEnv(rank=rank, world_size=3), timeout_s=30)

    threads = [threading.Thread(target=late, args=(r, 0.5 * r)) for r in (1, 2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    _leave_together(host, DistEnv(rank=0, world_size=3), timeout_s=30)
    waited = time.monotonic() - start
    for t in threads:
        t.join()
    assert 1.0 <= waited < 10, waited


def test_a_rank_that_never_says_so_bounds_the_wait():
    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=30))
    start = time.monotonic()
    _leave_together(host, DistEnv(rank=0, world_size=2), timeout_s=1)
    assert 0.9 <= time.monotonic() - start < 10


def test_a_rank_finds_the_store_once_it_listens_and_joins_it():
    """`wait_for_store` polls rank 0's port (torch's own client retries after ~0.5 s): it
    returns once the store listens, and the store still serves the clients after the probe."""
    import socket

    from torch.distributed import TCPStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stores = []
    host = threading.Timer(0.3, lambda: stores.append(TCPStore("127.0.0.1", port, world_size=2, is_master=True,
                                                                 wait_for_workers=False, timeout=timedelta(seconds=30))))
    host.start()
    assert wait_for_store("127.0.0.1", port, timeout_s=30)
    host.join()
    client = TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "v")
    assert stores[0].get("k") == b"v"


def test_nobody_listening_bounds_the_store_wait():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert not wait_for_store("127.0.0.1", port, timeout_s=0.5)
    assert 0.4 <= time.monotonic() - start < 10
