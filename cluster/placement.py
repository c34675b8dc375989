"""Where a replica's ranks run: one placement-group bundle per rank.

Inside a Serve replica the group already exists (Serve made it from the deployment's
`placement_group_bundles`); an offline `LLM` makes its own. A group that fits on one node
is packed there strictly (tensor-parallel collectives stay on one host); a larger one is
packed as tightly as the cluster allows, spanning nodes (pipeline stages cross the network
once per step, tensor-parallel ranks every layer).
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
    """CPUs per rank of a CPU-only group: an equal share of the cluster's free CPUs, at
    most 1, so a group of more ranks than cores still fits (tests, laptops)."""
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


def rank_bundles(world_size: int, device: str) -> list[dict[str, float]]:
    if device == "cuda":
        return [{"GPU": 1.0, "CPU": 1.0}] * world_size
    return [{"CPU": cpu_share(world_size)}] * world_size


def fits_one_node(bundles: list[dict[str, float]]) -> bool:
    """Whether some alive node has, in total, every resource the bundles ask for together."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        if all(have.get(key, 0.0) + 1e-6 >= value for key, value in need.items()):
            return True
    return False


def placement_strategy(bundles: list[dict[str, float]]) -> str:
    return "STRICT_PACK" if fits_one_node(bundles) else "PACK"


def place_ranks(world_size: int, device: str) -> RankPlacement:
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
    bundles = rank_bundles(world_size, device)
    group = placement_group(bundles, strategy=placement_strategy(bundles), name="")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster could not place {world_size} ranks of {bundles[0]} within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})"
        )
    return RankPlacement(group, bundles, owned=True)
