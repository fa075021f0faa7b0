"""A standalone reward service over gRPC: copy this file, replace `score`, run it, and point slipstream at it with
`slipstream reward --rm-type remote_grpc --rm-grpc-addr HOST:PORT`.

It implements slipstream.v1.RewardService (protos/slipstream/v1/reward.proto) with plain grpcio; the only
slipstream import is the generated stubs, which you can also generate yourself from the .proto file.

Run: python grpc_server.py --port 50060
"""

import argparse
import re
from concurrent import futures

import grpc

from slipstream.v1 import reward_pb2, reward_pb2_grpc


def score(prompt: str, response: str, label: str) -> dict:
    """Edit me. Here: 1 if the last number in the response equals the label, minus a small length penalty."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response)
    correct = bool(numbers) and label.strip() != "" and float(numbers[-1]) == float(label)
    length_penalty = min(len(response) / 10_000, 0.1)
    return {"score": float(correct) - length_penalty, "correct": float(correct)}


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def Score(self, request, context):
        results = []
        for item in request.items:
            response = item.response.decode("utf-8", errors="replace")
            try:
                parts = score(item.prompt, response, item.label)
                results.append(reward_pb2.RewardResult(item_id=item.item_id, reward=parts["score"], details=parts))
            except Exception as e:  # one bad item must not fail the batch
                results.append(reward_pb2.RewardResult(item_id=item.item_id, error=True, error_message=str(e)))
        return reward_pb2.ScoreResponse(results=results)

    def ScoreGroup(self, request, context):
        return self.Score(request, context)

    def ListRewardFunctions(self, request, context):
        function = reward_pb2.RewardFunctionInfo(name="last_number", description=score.__doc__)
        return reward_pb2.ListRewardFunctionsResponse(functions=[function])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50060)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)])
    reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"reward server listening on {args.host}:{port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
