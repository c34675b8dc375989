"""kvray's gRPC API (inference.proto, package kvray.v1) on Ray Serve's gRPC proxy.

inference_pb2*.py are generated from inference.proto (tests/unit/test_grpc_stubs.py keeps
them equal); messages.py turns its messages into the OpenAI requests the HTTP routes take
and the answers back; methods.py holds the ingress's RPC methods; serve_setup.py the Serve
instance's gRPC options. Importing this package loads no torch.
"""
