"""Where an engine's ranks run: one placement-group bundle per rank, bundle index = rank.

The one owner of the bundles and the strategy. Inside a Serve replica the group already
exists (Serve made it from the deployment's options, cluster/deployments.py, which ask
here); an offline engine makes its own (`place_ranks`). A group of one pipeline stage is
packed strictly on one node (its tensor-parallel ranks all-reduce every layer); a group of
several stages is packed as tightly as the cluster allows and may span nodes (the
stage-to-stage hand-off crosses the network once a step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

PLACEMENT_TIMEOUT_S = 120.0

GPU_RANK_CPUS = 1.0
"""CPUs a GPU rank's bundle holds beside its GPU."""

REPLICA_CPU_RANK_CPUS = 0.25
"""A Serve replica's CPUs per rank without GPUs: a fraction, so that several CPU replicas
share a small machine."""


@dataclass
class RankPlacement:
    placement_group: PlacementGroup
    bundles: list[dict[str, float]]
    """One per rank, in rank order (bundle index = rank)."""
    owned: bool
    """True when this process created the group and must remove it."""

    def release(self, timeout_s: float = 10.0) -> None:
        """Remove an owned group and wait until Ray has taken it back, so that the next
        group sees its resources free."""
        if not self.owned:
            return
        self.owned = False
        held = sum(b.get("CPU", 0.0) for b in self.bundles)
        expected = ray.available_resources().get("CPU", 0.0) + held
        remove_placement_group(self.placement_group)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            removed = placement_group_table(self.placement_group).get("state") == "REMOVED"
            # The cluster's view of free resources catches up a moment after the removal.
            if removed and ray.available_resources().get("CPU", 0.0) >= expected - 1e-3:
                return
            time.sleep(0.05)


def cpu_share(world_size: int) -> float:
    """CPUs per rank of an offline CPU-only group: an equal share of the cluster's free
    CPUs, at most 1, so a group of more ranks than cores still fits (tests, laptops)."""
    free = ray.available_resources().get("CPU", 0.0)
    share = min(1.0, free / world_size)
    # Ray accounts resources in units of 1e-4; round down so the bundles sum to <= free.
    share = math.floor(share * 1e4) / 1e4
    if share <= 0:
        raise RuntimeError(
            f"no free CPUs in the Ray cluster for {world_size} ranks "
            f"(available: {ray.available_resources()})"
        )
    return share


def replica_cpus_per_rank(device: str, num_cpus: float | None) -> float:
    """A Serve replica's CPUs per rank: `num_cpus` if given, else GPU_RANK_CPUS beside each
    GPU and REPLICA_CPU_RANK_CPUS without one. Fixed when the app is built, before the
    cluster's nodes are known (an autoscaling cluster may have none yet)."""
    if num_cpus is not None:
        return num_cpus
    return GPU_RANK_CPUS if device == "cuda" else REPLICA_CPU_RANK_CPUS


def rank_bundles(world_size: int, device: str, cpus_per_rank: float) -> list[dict[str, float]]:
    """One bundle per rank: a GPU and `cpus_per_rank` CPUs on CUDA, the CPUs alone without."""
    bundle = {"CPU": cpus_per_rank, "GPU": 1.0} if device == "cuda" else {"CPU": cpus_per_rank}
    return [dict(bundle) for _ in range(world_size)]


def placement_strategy(pipeline_parallel_size: int) -> str:
    return "STRICT_PACK" if pipeline_parallel_size == 1 else "PACK"


def place_ranks(world_size: int, pipeline_parallel_size: int, device: str) -> RankPlacement:
    """The current placement group (inside a Serve replica) or a new one of world_size bundles."""
    current = get_current_placement_group()
    if current is not None:
        bundles = list(current.bundle_specs)
        if len(bundles) < world_size:
            raise ValueError(
                f"the current placement group has {len(bundles)} bundles; "
                f"tensor_parallel_size x pipeline_parallel_size = {world_size} needs one per rank"
            )
        if device == "cuda" and any(b.get("GPU", 0) < 1 for b in bundles[:world_size]):
            raise ValueError("every placement-group bundle needs {'GPU': 1} to run on CUDA")
        return RankPlacement(current, bundles[:world_size], owned=False)
    cpus = GPU_RANK_CPUS if device == "cuda" else cpu_share(world_size)
    bundles = rank_bundles(world_size, device, cpus)
    strategy = placement_strategy(pipeline_parallel_size)
    group = placement_group(bundles, strategy=strategy, name="")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster could not place {world_size} ranks of {bundles[0]} ({strategy}) "
            f"within {PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})"
        )
    return RankPlacement(group, bundles, owned=True)
