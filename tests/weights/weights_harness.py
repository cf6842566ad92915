"""Engine processes for the weight-transport tests: real processes, real transports.

``EnginePair`` spawns engine processes once; each holds a state dict behind a
:class:`StateDictReceiver` and a :class:`WeightUpdateEndpoint`, and answers the protocol's
messages over a pipe, plus two test-only ones: ``setup`` (replace the state dict with zeros of
the given specs) and ``dump`` (send the state dict, or the named tensors of it, back). Every engine process first joins a
default process group of its own, as an SGLang engine has one, so the weight-update group is
shown to live next to it. :func:`engine_tensors` reads what an embedded engine holds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.multiprocessing as mp

from megarl.weights import TensorSpec, dtype_name
from megarl.weights.links import PipeLink


def spec_json(specs: list[TensorSpec]) -> list[dict[str, Any]]:
    """Specs as JSON-ready dicts."""
    return [{"name": s.name, "shape": list(s.shape), "dtype": dtype_name(s.dtype)} for s in specs]


def engine_main(conn: Any, engine_index: int) -> None:
    """An engine process: a default group of its own, then serve the update protocol."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from megarl.weights import StateDictReceiver, WeightUpdateEndpoint, parse_dtype
    from megarl.weights.links import serve

    torch.set_num_threads(1)
    store_dir = tempfile.mkdtemp(prefix=f"engine{engine_index}-")
    store_file = os.path.join(store_dir, "store")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    state: dict[str, torch.Tensor] = {}
    endpoint = WeightUpdateEndpoint(StateDictReceiver(state))

    def handle(message: dict[str, Any]) -> dict[str, Any]:
        if message["op"] == "setup":
            state.clear()
            for spec in message["specs"]:
                state[spec["name"]] = torch.zeros(spec["shape"], dtype=parse_dtype(spec["dtype"]))
            endpoint.receiver = StateDictReceiver(state)
            return {"ok": True}
        if message["op"] == "dump":
            names = message.get("names") or list(state)
            return {"ok": True, "state": {k: state[k].clone() for k in names if k in state},
                    "weight_version": endpoint.weight_version,
                    "default_group_size": dist.get_world_size()}
        return endpoint.handle(message)

    serve(conn, handle)
    dist.destroy_process_group()
    shutil.rmtree(store_dir, ignore_errors=True)


class EnginePair:
    """``count`` engine processes and a :class:`PipeLink` to them."""

    def __init__(self, count: int = 2, timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(count)]
        self.procs = [ctx.Process(target=engine_main, args=(child, i), daemon=True)
                      for i, (_, child) in enumerate(pipes)]
        for proc in self.procs:
            proc.start()
        self.link = PipeLink([parent for parent, _ in pipes], timeout_s=timeout_s)

    def call(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """Send one message to every engine and return the replies."""
        replies = self.link.post([message] * len(self.link))()
        assert all(r["ok"] for r in replies), replies
        return replies

    def setup(self, specs: list[TensorSpec], engine: int | None = None) -> None:
        """Give every engine (or only engine ``engine``) a zero state dict of these specs."""
        message = {"op": "setup", "specs": spec_json(specs)}
        others = {"op": "dump", "names": ["-"]} if engine is not None else message
        messages = [message if engine in (None, i) else others for i in range(len(self.link))]
        replies = self.link.post(messages)()
        assert all(r["ok"] for r in replies), replies

    def dump(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        """Every engine's state dict (or the named tensors of it) and weight version."""
        return self.call({"op": "dump", "names": names})

    def close(self) -> None:
        """Stop the engine processes."""
        try:
            self.link.post([{"op": "shutdown"}] * len(self.link))()
        finally:
            for proc in self.procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()


def engine_tensors(url: str, names: list[str]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Every named weight an embedded engine at ``url`` holds (whole, as float32), and its
    weight version, read over HTTP."""
    from megarl.rollout.sglang.client import SGLangClient

    async def read():
        client = SGLangClient([url])
        try:
            values = {n: torch.tensor((await client.get_weights_by_name(n, 1 << 20))[0])
                      for n in names}
            return values, (await client.get_weight_version())[0]
        finally:
            await client.close()

    return asyncio.run(read())
