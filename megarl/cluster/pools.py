"""Resource pools: Ray placement groups for the train pool and the rollout pool.

A pool of ``nnodes x per_node`` slots is one STRICT_PACK placement group per node, each of
``per_node`` bundles: ``{"GPU": 1, "CPU": k}`` on GPU, ``{"CPU": k}`` on CPU (one process per
slot). Slots are ordered by (node IP, placement group, bundle index); the worker group refines the
order within a node by GPU index once its actors report which GPU Ray gave them, so ranks are
deterministic. When the rollout engines are colocated with training, both roles share one pool
and every worker group on it takes ``1 / max_colocate_count`` of each bundle.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megarl.cluster.errors import PoolSchedulingError
from megarl.cluster.worker import Device

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from megarl.config.schema import ResourcesConfig

logger = logging.getLogger(__name__)

TRAIN_POOL = "train_pool"
ROLLOUT_POOL = "rollout_pool"


@dataclass(frozen=True)
class Slot:
    """One bundle of a pool: where a worker of each group on the pool runs."""

    pg_index: int
    """Index of its placement group in the pool (ordered by node IP)."""
    bundle_index: int
    """Bundle index inside that placement group."""
    node_id: str
    """Ray node id of the bundle."""
    node_ip: str
    """IP of that node."""


def ip_sort_key(ip: str) -> tuple[int, int | str]:
    """Sort key of an IP address (numeric, IPv4 before IPv6; other strings last)."""
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return (9, ip)
    return (parsed.version, int(parsed))


@dataclass
class ResourcePool:
    """A set of scheduled placement-group bundles that worker groups are started on."""

    name: str
    """``train_pool``, ``rollout_pool`` or another name used in messages."""
    device: Device
    """``cuda`` (GPU bundles) or ``cpu`` (CPU bundles)."""
    bundle: dict[str, float]
    """Resources of one bundle."""
    placement_groups: list[PlacementGroup]
    """One STRICT_PACK placement group per node, ordered by node IP."""
    slots: list[Slot]
    """Every bundle, in rank order."""
    max_colocate_count: int = 1
    """Worker groups that may share this pool; each takes this fraction of every bundle."""

    @property
    def world_size(self) -> int:
        """Number of slots (GPUs, or CPU worker processes)."""
        return len(self.slots)

    def worker_resources(self) -> dict[str, float]:
        """The share of one bundle that one worker of one group requests."""
        return {k: v / self.max_colocate_count for k, v in self.bundle.items()}

    def remove(self) -> None:
        """Release the placement groups (workers on them must be stopped first)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []
        self.slots = []


def resolve_device(device: Literal["auto", "cpu", "cuda"]) -> Device:
    """``auto`` becomes ``cuda`` when the Ray cluster has GPUs, else ``cpu``."""
    if device != "auto":
        return device
    import ray

    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def create_resource_pool(
    name: str,
    nnodes: int,
    per_node: int,
    device: Device,
    *,
    cpus_per_bundle: float = 1.0,
    max_colocate_count: int = 1,
    timeout_s: float = 120.0,
) -> ResourcePool:
    """Schedule one STRICT_PACK placement group per node and order its bundles into slots.

    Raises :class:`PoolSchedulingError` naming the pool, the bundles asked for and the
    resources Ray has when the groups are not scheduled within ``timeout_s``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if nnodes < 1 or per_node < 1:
        raise ValueError(f"{name}: nnodes={nnodes} and per_node={per_node} must be >= 1")
    bundle = {"GPU": 1.0, "CPU": cpus_per_bundle} if device == "cuda" else {"CPU": cpus_per_bundle}
    if not _fits_some_node(bundle, per_node):
        raise PoolSchedulingError(_unschedulable_message(name, nnodes, per_node, bundle, None))
    pgs = [placement_group([dict(bundle) for _ in range(per_node)], strategy="STRICT_PACK")
           for _ in range(nnodes)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise PoolSchedulingError(_unschedulable_message(
            name, nnodes, per_node, bundle, (len(ready), timeout_s)))
    slots_by_pg = [_pg_slots(pg) for pg in pgs]
    order = sorted(range(nnodes), key=lambda i: (ip_sort_key(slots_by_pg[i][0].node_ip), i))
    placement_groups = [pgs[i] for i in order]
    slots = [Slot(new_index, s.bundle_index, s.node_id, s.node_ip)
             for new_index, i in enumerate(order) for s in slots_by_pg[i]]
    if device == "cuda" and nnodes > 1 and len({s.node_id for s in slots}) < nnodes:
        logger.warning("%s: %d per-node placement groups landed on only %d nodes",
                       name, nnodes, len({s.node_id for s in slots}))
    return ResourcePool(name, device, bundle, placement_groups, slots, max_colocate_count)


def _pg_slots(pg: PlacementGroup) -> list[Slot]:
    """The bundles of a scheduled placement group with their node ids and IPs."""
    import ray
    from ray.util.placement_group import placement_group_table

    node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    return [Slot(-1, b, bundle_nodes[b], node_ips.get(bundle_nodes[b], "?"))
            for b in sorted(bundle_nodes)]


def _fits_some_node(bundle: dict[str, float], per_node: int) -> bool:
    """Whether any alive node has, in total, room for ``per_node`` bundles."""
    import ray

    return any(all(n["Resources"].get(k, 0.0) >= v * per_node for k, v in bundle.items())
               for n in ray.nodes() if n.get("Alive"))


def _unschedulable_message(
    name: str, nnodes: int, per_node: int, bundle: dict[str, float],
    waited: tuple[int, float] | None,
) -> str:
    """Why the pool is not scheduled: ``waited`` = (groups ready, timeout), None = never fits."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node_lines = "; ".join(
        f"{n['NodeManagerAddress']}: " + _fmt({k: v for k, v in n["Resources"].items()
                                               if k in ("CPU", "GPU")})
        for n in nodes)
    available = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    kind = "gpus_per_node" if "GPU" in bundle else "gpus_per_node (CPU worker processes)"
    what = (f"placement groups not scheduled within {waited[1]:g} s ({waited[0]} of {nnodes} "
            f"ready)" if waited else "no node of the Ray cluster can ever hold one node's share")
    return (
        f"{name}: {what}: asked for {nnodes} node(s) x {per_node} bundles of {_fmt(bundle)} "
        f"(STRICT_PACK, i.e. {per_node} bundles on one node). Ray has {len(nodes)} node(s): "
        f"{per_node_lines}; available now: {_fmt(available)}. "
        f"fix: lower resources.{name}.nnodes or resources.{name}.{kind}, free resources held "
        "by other jobs or pools, or give Ray more (ray.num_cpus, more nodes)"
    )


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def create_pools(
    resources: ResourcesConfig,
    *,
    colocate: bool,
    cpus_per_bundle: float = 1.0,
    max_colocate_count: int = 1,
    timeout_s: float = 120.0,
) -> dict[str, ResourcePool]:
    """The train pool and the rollout pool (one shared pool object when ``colocate``)."""
    device = resolve_device(resources.device)
    train, rollout = resources.train_pool, resources.rollout_pool
    if not colocate and rollout is None:
        raise ValueError("resources.rollout_pool is null but rollout.colocate=false: set "
                         "resources.rollout_pool.nnodes and .gpus_per_node, or "
                         "rollout.colocate=true")
    common = {"cpus_per_bundle": cpus_per_bundle, "max_colocate_count": max_colocate_count,
              "timeout_s": timeout_s}
    train_pool = create_resource_pool(TRAIN_POOL, train.nnodes, train.gpus_per_node, device,
                                      **common)
    if colocate:
        if rollout is not None:
            logger.warning("resources.rollout_pool is ignored: rollout.colocate=true runs the "
                           "rollout engines on the train pool")
        return {TRAIN_POOL: train_pool, ROLLOUT_POOL: train_pool}
    try:
        rollout_pool = create_resource_pool(ROLLOUT_POOL, rollout.nnodes, rollout.gpus_per_node,
                                            device, **common)
    except PoolSchedulingError:
        train_pool.remove()
        raise
    return {TRAIN_POOL: train_pool, ROLLOUT_POOL: rollout_pool}
