"""Stands in for `megarl train` in the launcher tests: same arguments, proves the Ray cluster works.

    python ray_probe.py --config CONFIG [a.b.c=value ...]

Loads the config with megarl's own loader (so every override the launcher passes must be a real
field), connects to ``ray.address`` (or starts a local Ray with ``ray.num_cpus`` when it is null,
as the trainer does), runs one remote task per CPU slot, and writes ``probe.json`` (the resolved
fields, the nodes, the task results) and a one-row ``metrics.jsonl`` into ``trainer.output_dir``.
When ``trainer.output_dir`` holds a file named ``hold``, it then waits until that file is removed,
keeping its launcher's Ray up (a Ray job inherits the cluster's environment, so this is not an
environment variable).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import ray

from megarl.config import load_config
from megarl.metrics.trackers import JsonlTracker


@ray.remote(num_cpus=1)
def square(x: int) -> dict:
    """x squared, with the host, PID and niceness of the Ray worker that computed it."""
    return {"value": x * x, "host": socket.gethostname(), "pid": os.getpid(),
            "niceness": os.nice(0)}


def main(argv: list[str]) -> int:
    """Parse like `megarl train`, run the remote tasks, write probe.json and metrics.jsonl."""
    parser = argparse.ArgumentParser(prog="ray_probe")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg, _ = load_config(args.config, args.overrides)

    if cfg.ray.address is None:
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, logging_level="ERROR")
    else:
        ray.init(address=cfg.ray.address, logging_level="ERROR")
    nodes = [n for n in ray.nodes() if n["Alive"]]
    cluster_cpus = int(ray.cluster_resources().get("CPU", 0))
    results = ray.get([square.remote(i) for i in range(max(cluster_cpus, 1))])
    ray.shutdown()

    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "argv": argv,
        "config": {
            "resources.device": cfg.resources.device,
            "resources.train_pool.nnodes": cfg.resources.train_pool.nnodes,
            "resources.train_pool.gpus_per_node": cfg.resources.train_pool.gpus_per_node,
            "ray.address": cfg.ray.address,
            "ray.num_cpus": cfg.ray.num_cpus,
        },
        "nodes": [{"ip": n["NodeManagerAddress"], "host": n["NodeManagerHostname"],
                   "cpus": n["Resources"].get("CPU", 0)} for n in nodes],
        "results": results,
        "driver_pid": os.getpid(),
        "driver_niceness": os.nice(0),
    }
    # whole or absent: the tests wait for this file to appear, then read it
    (out / "probe.json.tmp").write_text(json.dumps(report, indent=1))
    (out / "probe.json.tmp").replace(out / "probe.json")
    tracker = JsonlTracker(out)
    tracker.log({"probe/nodes": len(nodes), "probe/cluster_cpus": cluster_cpus,
                 "probe/sum_of_squares": sum(r["value"] for r in results)}, step=1)
    tracker.close()
    print(f"ray_probe: {len(nodes)} node(s), {cluster_cpus} CPUs, {len(results)} tasks ran; "
          f"wrote {out / 'probe.json'}", flush=True)
    while (out / "hold").exists():
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
