"""gRPC face of the reward service: translates RewardService requests to `Scorer` calls and the results back."""

from services.reward.core import Scorer
from slipstream.v1 import reward_pb2, reward_pb2_grpc


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    async def Score(self, request, context):
        results = await self.scorer.score(list(request.items), request.rm_type, request.timeout_seconds)
        return reward_pb2.ScoreResponse(results=results)

    async def ScoreGroup(self, request, context):
        results = await self.scorer.score(list(request.items), request.rm_type, request.timeout_seconds, group=True)
        return reward_pb2.ScoreResponse(results=results)

    async def ListRewardFunctions(self, request, context):
        functions = [
            reward_pb2.RewardFunctionInfo(name=n, group=g, description=d) for n, g, d in self.scorer.functions()
        ]
        return reward_pb2.ListRewardFunctionsResponse(functions=functions)
