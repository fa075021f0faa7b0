"""Assembles the reward service: the worker pool, remote reward models if configured, and the servicer."""

from services.common.clients import Credentials
from services.common.config import ConfigError
from services.common.errors import StartupError
from services.common.server import Service, Servicer
from services.reward import preflight
from services.reward.config import RewardConfig
from services.reward.core import Scorer
from services.reward.isolation import WorkerPool
from services.reward.remote import Backoff, GrpcRewardModel, HttpRewardModel
from services.reward.servicer import RewardServicer
from services.reward.verifiers import DEFAULT_RM_TYPE, imports_of


async def build(config: RewardConfig) -> Service:
    try:  # fail at start, in one sentence, rather than on every item
        trl_style = preflight.check(config)
    except ConfigError as e:
        raise StartupError(str(e)) from None
    backoff = Backoff(config.rm_max_retries, config.rm_retry_backoff_s)
    http = HttpRewardModel(config.rm_url, backoff, config.rm_remote_timeout_s) if config.rm_url else None
    remote = None
    if config.rm_grpc_addr:
        worker = Credentials.of(config, "worker")
        remote = GrpcRewardModel(config.rm_grpc_addr, backoff, config.rm_remote_timeout_s, worker)
    types = {config.rm_type or DEFAULT_RM_TYPE, *config.eval_rm_types().values()}
    if config.custom_rm_path:  # a custom function may verify with math-verify, as slime's do
        types.add("math")
    pool = WorkerPool(config.num_workers, config.reward_worker_memory_mb, config.custom_rm_path, imports_of(types))
    await pool.warm()
    scorer = Scorer(config, pool, http, remote, trl_style)
    return Service("reward", config, [Servicer.of(RewardServicer(scorer))], on_stop=[scorer.close])
