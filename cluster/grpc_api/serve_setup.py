"""The Serve instance's gRPC options for kvray's service, and the build-time check that a
running Serve instance has them.

Serve takes gRPC options once, when it starts (`serve.start(grpc_options=...)`, or a Serve
config file's top-level `grpc_options`): its proxies then serve the listed servicers on
that port for every app, calling the method of the app's ingress named like the RPC. The
app key `grpc_port` says which port the app expects: `kvray serve --grpc-port` starts Serve
with it; an app built while no Serve instance runs (`serve run serve_app:build_app
grpc_port=9000`) starts one with it; one built on a running instance checks that it
serves kvray's service on that port.
"""

from __future__ import annotations

from typing import Any

SERVICER_FUNCTION = "cluster.grpc_api.inference_pb2_grpc.add_InferenceServiceServicer_to_server"
"""What Serve's `grpc_servicer_functions` must list for kvray.v1.InferenceService."""


def grpc_options(port: int) -> dict[str, Any]:
    """Serve's gRPC options for kvray's service on `port` (server reflection is on by
    default in Ray 2.60: grpcurl lists and describes the service)."""
    return {"port": port, "grpc_servicer_functions": [SERVICER_FUNCTION]}


def ensure_serve_grpc(port: int) -> None:
    """Start Serve with kvray's gRPC service on `port` if no Serve instance runs; if one
    does, ValueError naming grpc_port unless it serves the service on that port."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    # Not connected to Ray (`serve run serve_app:build_app ...` builds the app first): no
    # Serve instance is known, and asking for one would connect to Ray without a namespace.
    client = None
    if ray.is_initialized():
        client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        if not ray.is_initialized():
            ray.init(namespace="serve")  # RAY_ADDRESS, as `serve run` reads it, or a local Ray
        serve.start(grpc_options=grpc_options(port))
        return
    running = ray.get(client._controller.get_grpc_config.remote())
    if running.port == port and SERVICER_FUNCTION in running.grpc_servicer_functions:
        return
    serving = (
        f"serves gRPC on port {running.port} with {running.grpc_servicer_functions}"
        if running.grpc_servicer_functions
        else "serves no gRPC"
    )
    raise ValueError(
        f"grpc_port={port}: the running Serve instance {serving}. Serve takes its gRPC "
        "options when it starts: start it with grpc_options "
        f"{grpc_options(port)} (`kvray serve --grpc-port {port}`, or the top-level "
        "`grpc_options` of a Serve config file), or leave grpc_port unset"
    )
