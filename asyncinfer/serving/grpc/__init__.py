"""The KServe v2 gRPC endpoint: ``inference.GRPCInferenceService`` over an ``InferenceService``.

Needs the ``serve`` extra (grpcio, protobuf). ``grpc_service.proto`` is the service definition;
``grpc_service_pb2.py`` and ``grpc_service_pb2_grpc.py`` are generated from it by
``python -m asyncinfer.serving.grpc.regenerate`` and shipped.
"""
from __future__ import annotations

from .server import InferenceServicer, start_grpc_server, status_code

__all__ = ["InferenceServicer", "start_grpc_server", "status_code"]
