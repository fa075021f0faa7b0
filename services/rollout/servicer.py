"""gRPC face of the rollout service: translates RolloutService requests to the domain code and back.

The RPCs answer UNIMPLEMENTED until the rollout issue lands.
"""

from slipstream.v1 import rollout_pb2_grpc


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    pass
