"""The gRPC API: grpc.aio server, auth interceptor, error mapping and servicers over the domain layer."""
