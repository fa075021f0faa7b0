"""The trainer's main loop, on every rank: build the model (and the frozen reference), resume, then for each step
take this data-parallel rank's part of the batch from the buffer, train on it, commit the step, and save on the
interval. Rank 0 also answers the control surface (`TrainerService`); its requests reach every rank at the next step
boundary, so a save or a stop is collective."""

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

from services.buffer import dataplane
from services.common.clients import Credentials, open_channel
from services.common.redis_connection import open_redis
from services.trainer import checkpoint, data_parallel
from services.trainer.actor import Actor, Groups
from services.trainer.config import TrainerConfig
from slipstream import samples
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc

log = logging.getLogger(__name__)

BATCH_WAIT_S = 60.0
BATCH_POLL_S = 2.0  # how long rank 0 waits for a batch before it looks at control requests again
RESYNC_CHECK_S = 10.0  # waiting for a batch this long, rank 0 asks whether every engine serves the policy


@dataclass
class Control:
    """What rank 0's control surface asks for, and what it reports. Written by the gRPC thread, read by the loop."""

    stop: bool = False
    save_after_stop: bool = False
    save_now: str | None = None  # a folder ("" for --save)
    phase: str = "starting"
    step: int = 0
    policy_version: int = 0
    world_size: int = 1
    last_metrics: dict = field(default_factory=dict)
    saved: list = field(default_factory=list)  # (path, step) of every save, newest last
    save_answers: list = field(default_factory=list)  # per save_now request: (path, step), or why it failed


PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16


def _rollout_times(groups, since: float, until: float) -> dict[str, float]:
    """Of the time the trainer waited for the batch (unix times `since` to `until`), the seconds during which some of
    its groups were being generated, and those during which some were being scored and none generated (unions of
    their intervals on the gateway's clock, the same machine's in a local run): the rollout and reward parts."""

    def union(spans):
        total, end = 0.0, since
        for a, b in sorted(spans):
            b = min(b, until)
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    t = [g.timings for g in groups if "scored" in g.timings]
    generating = union((x["leased"], x["generated"]) for x in t)
    busy = union([(x["leased"], x["generated"]) for x in t] + [(x["generated"], x["scored"]) for x in t])
    return {"rollout_s": generating, "reward_s": busy - generating} if t else {}  # scoring while none generates


def _tied_embedding_group(shape):
    """The first and last pipeline stages of this rank's pipeline, where a tied embedding has its two copies."""
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if not shape.tie_word_embeddings or stages == 1 or not parallel_state.is_rank_in_embedding_group():
        return None
    return parallel_state.get_embedding_group()


def mfu(shape, tokens_per_s_per_gpu: float, lengths: list[int]) -> float:
    """Model FLOPs utilisation with the PaLM count: 6 N + 12 L H Q S per token (S the mean sequence length)."""
    name = torch.cuda.get_device_name()
    peak = next((p for key, p in PEAK_TFLOPS.items() if key in name), None)
    if peak is None:
        return float("nan")
    h, q = shape.hidden_size, shape.head_dim
    params = (1 if shape.tie_word_embeddings else 2) * shape.vocab_size * h + shape.num_layers * (
        h * q * (2 * shape.num_attention_heads + 2 * shape.num_query_groups) + 3 * h * shape.ffn_hidden_size
    )
    seq = sum(lengths) / max(1, len(lengths))
    flops = 6 * params + 12 * shape.num_layers * shape.num_attention_heads * q * seq
    return tokens_per_s_per_gpu * flops / (peak * 1e12)


class Trainer:
    def __init__(self, config: TrainerConfig, control: Control | None = None):
        from megatron.core import parallel_state

        from services.trainer.models import load_gpt_model
        from services.trainer.parallel import init_parallel

        self.config, self.control = config, control or Control()
        self.info = init_parallel(
            config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.seed,
            ep_size=config.expert_model_parallel_size, etp_size=config.expert_tensor_parallel_size,
        )  # fmt: skip
        dtype = torch.bfloat16 if config.bf16 else torch.float32
        settings = {"sequence_parallel": config.sequence_parallel}
        for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(config, name) is not None:
                settings[name] = getattr(config, name)
        if config.replays_routing:
            settings["moe_enable_routing_replay"] = True
        if config.recompute_activations:
            settings.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.model, self.gpt = load_gpt_model(config.hf_checkpoint, dtype=dtype, **settings)
        if config.replays_routing and not self.gpt.shape.num_experts:
            raise ValueError(f"routing replay replays the experts' routing: {config.hf_checkpoint} has no experts "
                             "(a dense model); drop --use-routing-replay / --use-rollout-routing-replay")  # fmt: skip
        if self.gpt.shape.num_experts and config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
            raise ValueError("an MoE model trains with tensor parallelism only under sequence parallelism (megatron's "
                             "MoE layer splits the tokens over the TP ranks): add --sequence-parallel")  # fmt: skip
        reference = None
        if config.use_kl_loss or config.kl_coef:
            reference, _ = load_gpt_model(config.hf_checkpoint, dtype=dtype)
            reference.eval().requires_grad_(False)
        self.ddp, self.optimizer, self.scheduler = data_parallel.build(self.model, config, config.lr)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        config.batch_sizes(self.dp_size).check()
        ep_rank = parallel_state.get_expert_model_parallel_rank() if config.expert_model_parallel_size > 1 else None
        self.shard = checkpoint.shard_name(self.tp_rank, self.pp_rank, ep_rank)
        # With the distributed optimizer each data-parallel rank also writes its own optimizer shard.
        self.optimizer_shard = None
        if config.use_distributed_optimizer:
            self.optimizer_shard = checkpoint.optimizer_shard_name(self.shard, self.dp_rank)
        # One rank of each shard writes it: replica 0's, and with experts those holding replica 0's experts.
        self.writes_checkpoint = self.dp_rank == 0 or (
            ep_rank is not None and parallel_state.get_expert_data_parallel_rank() == 0
        )
        local_vocab = self.gpt.shape.padded_vocab_size // self.info.tp_size
        groups = Groups(
            dp=parallel_state.get_data_parallel_group(), tp=parallel_state.get_tensor_model_parallel_group(),
            tp_rank=self.tp_rank, vocab_start=self.tp_rank * local_vocab if self.info.tp_size > 1 else None,
            vocab_size=self.gpt.shape.vocab_size, model_parallel=parallel_state.get_model_parallel_group(),
            expert_model_parallel=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
            embedding=_tied_embedding_group(self.gpt.shape),
        )  # fmt: skip
        self.actor = Actor(config, self.model, self.optimizer, self.scheduler, groups, reference, ddp=self.ddp)
        if config.advantage_estimator == "ppo":
            self.actor.critic = self._critic(config, dtype, settings, groups)
        self.step, self.policy_version = 0, 0
        self.uncommitted: list[int] = []  # steps trained but not yet covered by a checkpoint (with --save)
        self.channel = open_channel(config.buffer_addr, Credentials.of(config, "trainer"))
        self.buffer = buffer_pb2_grpc.BufferServiceStub(self.channel)
        # The batches' arrays, values of megabytes: read a megabyte at a time (a third faster than redis-py's 64 KiB).
        self.redis = open_redis(config.redis, Path(".")).client(socket_read_size=1 << 20) if config.redis.url else None
        self.layout_checked = False  # the data plane's layout in the buffer's Redis, at the first keys read
        if config.load:
            self._resume(Path(config.load))
        self.weights = None
        # The ranks of data-parallel replica 0 gather the weights for the senders (each pipeline stage's first rank);
        # with expert parallelism the experts live on every data-parallel rank, so every rank takes part; colocated,
        # every rank hands its copy to the engines on its GPU.
        all_ranks = config.expert_model_parallel_size > 1 or (config.colocate and self.info.world_size > 1)
        if config.colocate and self.info.world_size != int(os.environ.get("LOCAL_WORLD_SIZE", self.info.world_size)):
            raise ValueError("--colocate hands tensors over by CUDA IPC, within one node: run the trainer on one node")
        if config.rollout_addr and (self.dp_rank == 0 or all_ranks):
            from services.trainer.models import hf_weights_of
            from services.trainer.weight_sync import WeightSender

            model_parallel = self.info.tp_size * config.pipeline_model_parallel_size > 1
            peers = parallel_state.get_model_parallel_group() if model_parallel else None
            peers = dist.group.WORLD if all_ranks else peers
            sender = self.dp_rank == 0 and self.tp_rank == 0
            stages = config.pipeline_model_parallel_size > 1
            senders = parallel_state.get_pipeline_model_parallel_group() if sender and stages else None
            self.weights = WeightSender(
                config, lambda: hf_weights_of(self.model, self.gpt), sender=sender, peers=peers, senders=senders
            )
        self.writer = self._tensorboard()
        self.last_step_end, self.last_step_unix = time.perf_counter(), time.time()
        self.control.world_size = self.info.world_size

    @staticmethod
    def _critic(config: TrainerConfig, dtype, settings: dict, groups: Groups):
        from services.trainer.critic import Critic, load_critic

        model, _ = load_critic(config.hf_checkpoint, dtype, **settings)
        ddp, optimizer, scheduler = data_parallel.build(model, config, config.critic_lr or config.lr)
        return Critic(config, model, optimizer, scheduler, groups, ddp=ddp)

    def _state(self) -> dict:
        parts = {"": (self.model, self.optimizer, self.scheduler)}
        if self.actor.critic is not None:
            parts["critic_"] = (self.actor.critic.model, self.actor.critic.optimizer, self.actor.critic.scheduler)
        return {f"{prefix}{name}": part for prefix, (m, o, s) in parts.items()
                for name, part in (("model", m), ("optimizer", o), ("scheduler", s))}  # fmt: skip

    # Resume and save

    def _resume(self, path: Path) -> None:
        if not path.exists() or not any(path.iterdir()):  # slime's idiom: --load the --save folder from the start
            log.info("nothing to resume in %s yet: starting from --hf-checkpoint", path)
            return
        if checkpoint.latest_step(path) is None:  # an HF folder: start from its weights
            from services.trainer.models import SafetensorsWeights, load_hf_weights

            load_hf_weights(self.model, self.gpt, SafetensorsWeights(path))
            if hasattr(self.optimizer, "reload_model_params"):  # its float32 masters were copied from the start
                self.optimizer.reload_model_params()
            log.info("started from the HF weights in %s", path)
            return
        state = checkpoint.load(path, self.shard, own=self.optimizer_shard)
        for name, part in self._state().items():
            if name not in state:
                raise ValueError(f"checkpoint {path} has no {name}: was it saved with another --advantage-estimator "
                                 "or with --use-distributed-optimizer?")  # fmt: skip
            part.load_state_dict(state[name])
        self.step, self.policy_version = state["step"], state["policy_version"]
        log.info("resumed from %s at step %d (policy version %d)", path, self.step, self.policy_version)
        if dist.get_rank() == 0:  # what the buffer holds from steps after the checkpoint is generated again
            request = buffer_pb2.RewindRequest(step=self.step, policy_version=self.policy_version)
            returned = self.buffer.Rewind(request, timeout=60).num_returned_groups
            log.info("the buffer rewound to step %d: %d groups go back to the prompts", self.step, returned)

    def save(self, folder: str | None = None) -> Path:
        root = Path(folder or self.config.save or "")
        if not str(root):
            raise ValueError("nowhere to save: pass --save, or give a path")
        state = {name: part.state_dict() for name, part in self._state().items()}
        state["policy_version"] = self.policy_version
        own = None
        if self.optimizer_shard:  # this rank's shards of the actor's (and critic's) distributed optimizer
            own = (self.optimizer_shard, {name: state.pop(name) for name in list(state) if name.endswith("optimizer")})
        path = checkpoint.save(root, self.step, state, self.shard, writes=self.writes_checkpoint, own=own)
        if self.config.save_hf:
            from services.trainer.export import export_hf_checkpoint

            export_hf_checkpoint(self.model, self.gpt, self.config.hf_checkpoint, self.config.save_hf)
        self.control.saved.append((str(path), self.step))
        if not folder or Path(folder) == Path(self.config.save or ""):
            self._commit(self.uncommitted)  # a resume from this checkpoint no longer needs these steps' groups
        return path

    def _commit(self, steps: list[int]) -> None:
        if dist.get_rank() == 0 and not self.config.load_debug_rollout_data:
            for step in steps:
                # wait_for_ready: a buffer that is restarting answers once it is back (its state is in Redis)
                self.buffer.CommitBatch(buffer_pb2.CommitBatchRequest(step=step), timeout=60, wait_for_ready=True)
        steps.clear()

    # The loop

    def run(self) -> None:
        c = self.config
        try:
            if self.weights is not None and self.policy_version > 0:  # resumed: the engines still have the start
                self.weights.sync(self.policy_version)
            while c.num_rollout is None or self.step < c.num_rollout:
                reply = self._next_batch()
                if reply is None:
                    break
                self.train_step(reply)
                if c.save and c.save_interval and self.step % c.save_interval == 0:
                    self.save()
            if c.save and (not self.control.saved or self.control.saved[-1][1] != self.step):
                self.save()
        finally:
            self.control.phase = "stopped"
            self.channel.close()
            if self.weights is not None:
                self.weights.close()

    def train_step(self, reply: buffer_pb2.GetBatchResponse) -> dict:
        batch = self.actor.hooks.batch(list(reply.groups), self.config.n_samples_per_prompt)
        self.control.phase = "train"
        if self.config.colocate and self.weights is not None:
            self.weights.release()  # the engines' GPU memory is the trainer's until the sync after this step
        started = time.perf_counter()
        steps = self.actor.train_rollout(batch, rollout=self.step)
        # With --save, a step's groups are deleted once a checkpoint covers it: a resume trains them again.
        self.uncommitted.append(self.step)
        if not self.config.save:
            self._commit(self.uncommitted)
        trained = time.perf_counter()
        self.step += 1
        self.policy_version += 1
        if self.config.rollout_addr:
            if self.weights is not None and self.step % self.config.update_weights_interval == 0:
                self.control.phase = "sync"
                self.weights.sync(self.policy_version)  # the gateway's commit tells the buffer the version
        elif dist.get_rank() == 0 and not self.config.load_debug_rollout_data:  # no engines: the trainer's version
            request = buffer_pb2.SetPolicyVersionRequest(version=self.policy_version)
            self.buffer.SetPolicyVersion(request, timeout=60, wait_for_ready=True)
        now = time.perf_counter()
        metrics = {**steps[-1], "reward": float(batch.scored_rewards_B.mean()), "train_s": trained - started,
                   "sync_s": now - trained, "step_s": now - self.last_step_end, "wait_s": started - self.last_step_end,
                   "response_length": sum(batch.response_lengths()) / len(batch),
                   **_rollout_times(reply.groups, self.last_step_unix, time.time() - (now - started))}  # fmt: skip
        metrics["samples_per_s"] = len(batch) * max(1, self.dp_size) / metrics["step_s"]
        self.last_step_end, self.last_step_unix = now, time.time()
        if torch.cuda.is_available() and "tokens_per_s" in metrics:
            metrics["mfu"] = mfu(self.gpt.shape, metrics["tokens_per_s"] / self.info.world_size, batch.lengths())
        self._record(reply, metrics)
        self._log(metrics, skip_scalars=dist.get_rank() == 0 and self.actor.hooks.log_rollout(
            self.step - 1, list(reply.groups), metrics))  # fmt: skip
        return metrics

    def _saved_batch(self) -> buffer_pb2.GetBatchResponse:
        """This rank's part of a batch saved by --save-debug-rollout-data; none left stops the run."""
        path = Path(self.config.load_debug_rollout_data.format(rollout_id=self.step))
        if not path.exists():
            log.info("no saved batch %s: the run ends", path)
            self.control.stop = True
            return buffer_pb2.GetBatchResponse()
        reply = buffer_pb2.GetBatchResponse.FromString(path.read_bytes())
        mine = list(reply.groups)[self.dp_rank :: self.dp_size]
        del reply.groups[:]
        reply.groups.extend(mine)
        return reply

    def _record(self, reply: buffer_pb2.GetBatchResponse, metrics: dict) -> None:
        """One line of --steps-file per step (rank 0 writes its own groups; with DP > 1, each rank's line has its
        part of the batch)."""
        if not self.config.steps_file or self.tp_rank != 0 or self.pp_rank != 0:
            return
        path = Path(self.config.steps_file)
        if self.dp_rank:
            path = path.with_name(f"{path.stem}.dp{self.dp_rank}{path.suffix}")
        line = {"step": self.step - 1, "policy_version": self.policy_version, "time": time.time(),
                "groups": [g.group_id for g in reply.groups], "metrics": metrics}  # fmt: skip
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def _next_batch(self) -> buffer_pb2.GetBatchResponse | None:
        """This rank's part of the step's batch, or None when asked to stop. Rank 0 asks the buffer and decides for
        all ranks (with the control requests), so that every rank waits, saves or stops at the same point."""
        c = self.control
        waited_since = time.monotonic()
        while True:
            c.phase = "waiting_batch"
            reply = self._get_batch(BATCH_POLL_S) if dist.get_rank() == 0 else None
            resync = reply is None and self._engines_lag(waited_since)
            decision = [reply is not None, c.stop, c.save_after_stop, c.save_now, resync]
            c.save_now = None
            if dist.get_world_size() > 1:
                dist.broadcast_object_list(decision, src=0)
            ready, stop, save_after_stop, save_now, resync = decision
            if resync and self.weights is not None:  # an engine came back with old weights: it gets the policy
                c.phase = "sync"
                self.weights.sync(self.policy_version)
                waited_since = time.monotonic()
            if save_now is not None:
                self._save_asked(save_now)
            if stop:
                if save_after_stop:
                    self.save()
                return None
            if ready:
                return reply if reply is not None else self._get_batch(BATCH_WAIT_S)  # built now: answered at once

    def _save_asked(self, folder: str) -> None:
        """A save asked for over gRPC (SaveCheckpoint): a failure to write it (a full disk, a permission) is that
        request's answer, and training goes on (checkpoint.save raises it on every rank alike)."""
        try:
            path = self.save(folder or None)
        except OSError as e:
            log.error("the checkpoint asked for was not written: %s", e)
            self.control.save_answers.append(str(e))
            return
        self.control.save_answers.append((str(path), self.step))

    def _engines_lag(self, waited_since: float) -> bool:
        """Rank 0, while it waits for a batch: does a healthy engine serve other weights than the policy's (it
        restarted, or a sync failed)? Generation for this step may wait on it (synchronous training), so it gets the
        weights now rather than at the next step's sync. Asked every RESYNC_CHECK_S of waiting."""
        if self.weights is None or not self.weights.coordinator or self.policy_version == 0 or self.config.colocate:
            return False
        if time.monotonic() - waited_since < RESYNC_CHECK_S:
            return False
        lagging = self.weights.lagging(self.policy_version)
        if lagging:
            log.warning("engines %s do not serve version %d: sending it again", ", ".join(lagging), self.policy_version)
        return bool(lagging)

    def _get_batch(self, wait_s: float) -> buffer_pb2.GetBatchResponse | None:
        if self.config.load_debug_rollout_data:
            return self._saved_batch()
        request = buffer_pb2.GetBatchRequest(
            step=self.step, dp_rank=self.dp_rank, dp_size=self.dp_size, timeout_seconds=wait_s,
            arrays_from_redis=self.redis is not None,
        )  # fmt: skip
        try:
            reply = self.buffer.GetBatch(request, timeout=wait_s + 30)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise
            # not enough groups yet, or the buffer is down or restarting: its state is in Redis, so wait for it
            log.log(logging.WARNING if e.code() == grpc.StatusCode.UNAVAILABLE else logging.DEBUG,
                    "step %d: waiting for the buffer (%s)", self.step, e.details())  # fmt: skip
            return None
        # The groups come without their arrays: they are in the reply, or read here from Redis (two hops, not four).
        # One GET a group: for values of megabytes, twice as fast as an MGET or a pipeline of them (BENCHMARKS.md).
        if reply.arrays_keys and not self.layout_checked:  # another layout stops the trainer
            ns = dataplane.namespace_of(reply.arrays_keys[0])
            dataplane.check_layout(ns, self.redis.get(dataplane.layout_key(ns)))
            self.layout_checked = True
        arrays = [self.redis.get(key) for key in reply.arrays_keys] if reply.arrays_keys else reply.arrays
        samples.put_batch_arrays(reply.groups, arrays)
        del reply.arrays[:], reply.arrays_keys[:]
        return reply

    def _log(self, metrics: dict, skip_scalars: bool = False) -> None:
        c = self.control
        c.step, c.policy_version, c.last_metrics = self.step, self.policy_version, metrics
        if dist.get_rank() != 0:
            return
        log.info(
            "step %d: reward %.3f, loss %.4f, clipfrac %.3f, grad norm %.3f, %.0f tokens/s",
            self.step, metrics["reward"], metrics.get("loss", 0.0), metrics.get("pg_clipfrac", 0.0),
            metrics.get("grad_norm", 0.0), metrics.get("tokens_per_s", metrics.get("critic/tokens_per_s", 0.0)),
        )  # fmt: skip
        if self.writer is not None and not skip_scalars:
            for name, value in metrics.items():
                self.writer.add_scalar(f"train/{name}", value, self.step)
            self.writer.flush()

    def _tensorboard(self):
        if not self.config.tensorboard_dir or self.info.rank != 0:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(self.config.tensorboard_dir)
