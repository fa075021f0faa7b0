"""Generated protobuf and gRPC stubs for the `slipstream.v1` contracts (`make protos` regenerates them)."""
