"""Assembles the reward service: the worker pool, remote reward models if configured, and the servicer."""

from services.common.clients import Credentials
from services.common.errors import StartupError
from services.common.plugins import PluginError, load_callable
from services.common.server import Service, Servicer
from services.reward.config import RewardConfig
from services.reward.core import Scorer
from services.reward.isolation import WorkerPool
from services.reward.remote import Backoff, GrpcRewardModel, HttpRewardModel
from services.reward.servicer import RewardServicer
from services.reward.verifiers import IMPORTS, RM_TYPES, is_known


async def build(config: RewardConfig) -> Service:
    if config.custom_rm_path:
        try:  # fail at start, in one sentence, rather than on every item
            load_callable(config.custom_rm_path, "--custom-rm-path")
        except PluginError as e:
            raise StartupError(str(e)) from None
    else:
        _check_rm_type("--rm-type", config.rm_type)
        for name, rm_type in config.eval_rm_types().items():
            _check_rm_type(f"--eval-config set {name!r}: rm_type", rm_type)
    backoff = Backoff(config.rm_max_retries, config.rm_retry_backoff_s)
    http = HttpRewardModel(config.rm_url, backoff, config.rm_remote_timeout_s) if config.rm_url else None
    remote = None
    if config.rm_grpc_addr:
        worker = Credentials.of(config, "worker")
        remote = GrpcRewardModel(config.rm_grpc_addr, backoff, config.rm_remote_timeout_s, worker)
    warm = tuple(IMPORTS[t] for t in {config.rm_type, *config.eval_rm_types().values()} if t in IMPORTS)
    pool = WorkerPool(config.num_workers, config.reward_worker_memory_mb, config.custom_rm_path, warm)
    await pool.warm()
    scorer = Scorer(config, pool, http, remote)
    return Service("reward", config, [Servicer.of(RewardServicer(scorer))], on_stop=[scorer.close])


def _check_rm_type(what: str, rm_type: str) -> None:
    if not is_known(rm_type):
        raise StartupError(f"{what} {rm_type!r} is unknown; use one of {', '.join(RM_TYPES)}, or pass --custom-rm-path")
