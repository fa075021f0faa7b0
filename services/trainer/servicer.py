"""gRPC face of the trainer service: translates TrainerService requests to the domain code and back.

The RPCs answer UNIMPLEMENTED until the trainer issue lands.
"""

from slipstream.v1 import trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    pass
