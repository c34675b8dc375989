"""kvray's environment switches, in one table: each one's name, default, reader and purpose.

Every `KVRAY_*` variable that kvray reads is an entry of `SWITCHES`. Python code reads one
only through its accessor below, when the reader needs it (a reader that reads once keeps
the value; one that reads per call calls again); the HAProxy switches are read by
cluster/haproxy_nosplice.sh, which the table documents. A top-level module, so that kernels/ can
read its switches without importing the layers above it. docs/configuration.md shows the
table (docs/draw_configuration.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    reader: str
    """The layer and module that read it."""
    description: str
    to_ranks: bool = False
    """Forwarded to the processes of an actor group's ranks, also on a cluster whose nodes
    were started without it."""

    def value(self) -> str:
        """The current value, the default where unset or empty."""
        return os.environ.get(self.name) or self.default


TORCH_KERNELS = Switch(
    "KVRAY_TORCH_KERNELS",
    "0",
    "kernels (kernels/__init__.py, on import and by read_kernel_switch)",
    "1: the torch reference kernels on every device, a GPU too (the oracle path).",
    to_ranks=True,
)
PDL = Switch(
    "KVRAY_PDL",
    "1",
    "kernels (kernels/pdl.py, once per device)",
    "0: Triton kernels launch without programmatic dependent launch (comparison runs).",
)
NCCL_ONLY = Switch(
    "KVRAY_NCCL_ONLY",
    "0",
    "engine (engine/distributed.py, when a tensor-parallel group starts)",
    "1: every tensor-parallel all-reduce goes to NCCL, never the peer-memory all-reduce.",
    to_ranks=True,
)
PROFILE_STEPS = Switch(
    "KVRAY_PROFILE_STEPS",
    "",
    "engine (engine/observability/step_profiler.py, when a rank's worker starts)",
    "FIRST:LAST:DIR: every rank profiles its steps FIRST..LAST-1 into DIR/rank{R}.{txt,json}.",
    to_ranks=True,
)
HOP_TRACE = Switch(
    "KVRAY_HOP_TRACE",
    "",
    "engine (engine/observability/hop_trace.py, on import); bench/serve.py (once)",
    "DIR: each process appends its requests' hop timestamps to DIR/<pid>.log (bench/hops.py).",
)
MODELS = Switch(
    "KVRAY_MODELS",
    "",
    "engine (engine/models/registry.py, at every lookup)",
    "Arch=package.module:Class,...: adds or overrides model classes by architecture name.",
)
HAPROXY_BINARY = Switch(
    "KVRAY_HAPROXY_BINARY",
    "haproxy",
    "cluster (cluster/haproxy_nosplice.sh; cluster/topology.py sets the bundled one)",
    "The HAProxy that Serve's direct ingress runs (without kernel splicing).",
)
HAPROXY_BUSY_POLLING = Switch(
    "KVRAY_HAPROXY_BUSY_POLLING",
    "0",
    "cluster (cluster/haproxy_nosplice.sh)",
    "1: HAProxy's busy-polling (its threads never sleep in the poller; one busy CPU each).",
)
COMMIT = Switch(
    "KVRAY_COMMIT",
    "",
    "bench (bench/common.py)",
    "The commit that benchmark results record, in place of `git rev-parse` of the tree.",
)

SWITCHES: tuple[Switch, ...] = (
    TORCH_KERNELS,
    PDL,
    NCCL_ONLY,
    PROFILE_STEPS,
    HOP_TRACE,
    MODELS,
    HAPROXY_BINARY,
    HAPROXY_BUSY_POLLING,
    COMMIT,
)

FORWARDED_TO_RANKS: tuple[str, ...] = tuple(s.name for s in SWITCHES if s.to_ranks)
"""The names that reach a group's ranks from the process that starts them."""


def torch_kernels() -> bool:
    return TORCH_KERNELS.value() == "1"


def pdl() -> bool:
    return PDL.value() != "0"


def nccl_only() -> bool:
    return NCCL_ONLY.value() == "1"


def profile_steps() -> str | None:
    """The "FIRST:LAST:DIR" spec, parsed by engine/observability/step_profiler.py."""
    return PROFILE_STEPS.value() or None


def hop_trace_folder() -> str | None:
    return HOP_TRACE.value() or None


def model_plugins() -> str:
    """The raw plugin list, parsed by engine/models/registry.py."""
    return MODELS.value()


def commit() -> str | None:
    return COMMIT.value() or None
