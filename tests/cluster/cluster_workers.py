"""Worker classes the cluster tests start on Ray actors and under torchrun (importable by both)."""

from __future__ import annotations

import os
import socket
import sys
import time

from megarl.cluster import Worker


class EchoWorker(Worker):
    """Reports its identity and environment; can raise, hang or die on request."""

    def __init__(self, tag: str = "", fail_rank: int | None = None) -> None:
        self.tag = tag
        print(f"EchoWorker {self.role} rank {self.rank} init tag={tag}", flush=True)
        if self.rank == fail_rank:
            raise RuntimeError(f"cannot build {self.role} rank {self.rank}")

    def identity(self) -> dict:
        """Rank, sizes, rendezvous env and host of this worker."""
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGARL_ROLE",
                "MEGARL_TEST_ENV", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "role": self.role, "tag": self.tag, "pid": os.getpid(),
                "hostname": socket.gethostname(), "niceness": os.nice(0),
                "env": {k: os.environ.get(k) for k in keys}}

    def echo(self, *args, **kwargs) -> tuple:
        """The arguments this rank received, with its rank."""
        return (self.rank, args, kwargs)

    def fail_on(self, rank: int, message: str) -> int:
        """Raise ValueError(message) on ``rank``; the others return their rank."""
        if self.rank == rank:
            _inner_failure(message)
        return self.rank

    def stuck_on(self, rank: int, release: str, limit_s: float = 120.0) -> int:
        """Block on ``rank`` until the file ``release`` exists (a stand-in for a stuck collective
        that the test lets go once it has looked at it); the others return at once."""
        if self.rank == rank:
            deadline = time.monotonic() + limit_s
            while not os.path.exists(release):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{release} was not created within {limit_s:.0f} s")
                time.sleep(0.05)
        return self.rank

    def exit_on(self, rank: int, block_s: float) -> int:
        """Rank ``rank`` prints a last words line and dies with os._exit(3); others block."""
        if self.rank == rank:
            print(f"last words of {self.role} rank {rank}", flush=True)
            print("stderr line before dying", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(block_s)
        return self.rank

    def all_reduce(self, backend: str = "gloo") -> list[float]:
        """Join the role's gloo group and all-reduce (sum) the tensor [rank+1, 10*(rank+1)]."""
        import torch
        import torch.distributed as dist

        self.init_distributed(backend=backend, timeout_s=60)
        tensor = torch.tensor([self.rank + 1.0, 10.0 * (self.rank + 1)])
        dist.all_reduce(tensor)
        return [dist.get_rank(), dist.get_world_size()] + tensor.tolist()


def _inner_failure(message: str) -> None:
    raise ValueError(message)
