"""gRPC face of the reward service: translates RewardService requests to the domain code and back.

The RPCs answer UNIMPLEMENTED until the reward issue lands.
"""

from slipstream.v1 import reward_pb2_grpc


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    pass
