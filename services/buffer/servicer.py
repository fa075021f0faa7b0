"""gRPC face of the buffer: translates BufferService requests to the domain store and back.

The RPCs answer UNIMPLEMENTED until the buffer's store lands.
"""

from slipstream.v1 import buffer_pb2_grpc


class BufferServicer(buffer_pb2_grpc.BufferServiceServicer):
    pass
