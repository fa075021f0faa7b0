"""The trainer's main loop, on every rank: assemble its parts (`assembly.py`), resume, then for each step
take this data-parallel rank's part of the batch from the buffer, train on it, commit the step, and save on the
interval. Rank 0 also answers the control surface (`TrainerService`); its requests reach every rank at the next step
boundary, so a save or a stop is collective."""

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

from services.buffer import dataplane
from services.trainer import assembly, checkpoint, data_parallel, reward_failures, token_budget
from services.trainer.actor import VOCAB_CHUNK, Actor
from services.trainer.config import TrainerConfig
from services.trainer.megatron_import import import_megatron
from services.trainer.metrics import StepLog, mfu, rollout_times, shown_samples
from services.trainer.parallel import control_group
from slipstream import samples
from slipstream.v1 import buffer_pb2

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


class Trainer:
    """The training loop on this rank, assembled from its parts (`assembly.py`) in the order they depend on."""

    def __init__(self, config: TrainerConfig, control: Control | None = None):
        import_megatron()  # before any part of the trainer imports it
        self.config, self.control = config, control or Control()
        self.info = assembly.parallel_layout(config)
        self.model, self.gpt = assembly.load_policy(config)
        reference = assembly.load_reference(config)
        self.ddp, self.optimizer, self.scheduler = data_parallel.build(self.model, config, config.optimizer)
        self.shards = assembly.checkpoint_shards(config, self.info)
        groups = assembly.process_groups(self.info, self.gpt.shape)
        self.actor = Actor(config, self.model, self.optimizer, self.scheduler, groups, reference, ddp=self.ddp)
        hidden = self.actor.from_hidden
        self.actor.budget_chosen = token_budget.resolve(config, self.gpt, self.model, hidden, VOCAB_CHUNK)
        self.actor.critic = assembly.load_critic(config, groups)
        self.actor.teacher = assembly.load_teacher(config, self.shards.model)
        self.channel, self.buffer = assembly.buffer_client(config)
        self.redis = assembly.data_plane(config)
        self.layout_checked = False  # the data plane's layout in the buffer's Redis, at the first keys read
        self.step, self.policy_version = 0, 0
        self.uncommitted: list[int] = []  # steps trained but not yet covered by a checkpoint (with --save)
        if config.load:
            self._resume(Path(config.load))
        self.weights = assembly.weight_sender(config, self.info, self.model, self.gpt)
        if config.colocate:
            keep = "free" if config.offload_rollout else "keep (--no-offload-rollout)"
            log.info("colocated: the engines %s their GPU memory while this trainer trains", keep)
        self.metrics = StepLog(config, self.info)
        self.last_step_end, self.last_step_unix = time.perf_counter(), time.time()
        self.control.world_size = self.info.world_size

    def _state(self) -> dict:
        parts = {"": (self.model, self.optimizer, self.scheduler)}
        if self.actor.critic is not None:
            parts["critic_"] = (self.actor.critic.model, self.actor.critic.optimizer, self.actor.critic.scheduler)
        return {
            f"{prefix}{name}": part
            for prefix, (m, o, s) in parts.items()
            for name, part in (("model", m), ("optimizer", o), ("scheduler", s))
        }

    # Resume and save

    def _resume(self, path: Path) -> None:
        if not path.exists() or not any(path.iterdir()):  # slime's idiom: --load the --save folder from the start
            log.info("nothing to resume in %s yet: starting from --hf-checkpoint", path)
            return
        if self.config.lora_rank and (path / "adapter_config.json").exists():  # a peft folder: continue its adapters
            from services.trainer import lora

            lora.load_adapter(self.model, self.gpt.shape, lora.settings_of(self.config), path)
            if hasattr(self.optimizer, "reload_model_params"):  # its float32 masters were copied from the start
                self.optimizer.reload_model_params()
            log.info("started from the LoRA adapters in %s (a new optimizer state)", path)
            return
        if checkpoint.latest_step(path) is None:  # an HF folder: start from its weights
            from services.trainer.models import SafetensorsWeights, load_hf_weights

            load_hf_weights(self.model, self.gpt, SafetensorsWeights(path))
            if hasattr(self.optimizer, "reload_model_params"):  # its float32 masters were copied from the start
                self.optimizer.reload_model_params()
            log.info("started from the HF weights in %s", path)
            return
        state = checkpoint.load(path, self.shards.model, own=self.shards.optimizer)
        for name, part in self._state().items():
            if name not in state:
                raise ValueError(
                    f"checkpoint {path} has no {name}: was it saved with another --advantage-estimator "
                    "or with --use-distributed-optimizer?"
                )
            part.load_state_dict(state[name])
        self.step, self.policy_version = state["step"], state["policy_version"]
        log.info("resumed from %s at step %d (policy version %d)", path, self.step, self.policy_version)
        self.control.step, self.control.policy_version = self.step, self.policy_version  # the launcher says it
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
        if self.shards.optimizer:  # this rank's shards of the actor's (and critic's) distributed optimizer
            own = (self.shards.optimizer, {name: state.pop(name) for name in list(state) if name.endswith("optimizer")})
        path = checkpoint.save(root, self.step, state, self.shards.model, writes=self.shards.writes, own=own)
        if self.config.save_hf:
            self.save_hf()
        self.control.saved.append((str(path), self.step))
        if not folder or Path(folder) == Path(self.config.save or ""):
            self._commit(self.uncommitted)  # a resume from this checkpoint no longer needs these steps' groups
        return path

    def save_hf(self) -> None:
        """--save-hf: the model as an HF folder (with LoRA, its adapters as a peft folder); at each checkpoint, or
        without --save at the end of the run."""
        if self.config.lora_rank:
            from services.trainer import lora

            lora.save_adapter(self.model, self.gpt.shape, lora.settings_of(self.config), self.config.hf_checkpoint,
                              self.config.save_hf)  # fmt: skip
        else:
            from services.trainer.export import export_hf_checkpoint

            export_hf_checkpoint(self.model, self.gpt, self.config.hf_checkpoint, self.config.save_hf)
        log.info("the model of step %d written to %s (--save-hf)", self.step, self.config.save_hf)

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
            elif c.save_hf and not c.save:
                self.save_hf()
        finally:
            self.control.phase = "stopped"
            self.channel.close()
            if self.weights is not None:
                self.weights.close()

    def train_step(self, reply: buffer_pb2.GetBatchResponse) -> dict:
        batch = self.actor.hooks.batch(list(reply.groups), self.config.n_samples_per_prompt)
        failures = reward_failures.gather(self.info.dp_rank, len(batch), batch.reward_failures)
        if failures.over(self.config.max_reward_failures):
            raise failures.stop(self.step, self.config.max_reward_failures, self._give_back())
        self.control.phase = "train"
        if self.config.colocate and self.config.offload_rollout and self.weights is not None:
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
        metrics = {
            **steps[-1],
            "reward": float(batch.scored_rewards_B.mean()),
            **failures.metrics(),
            "train_s": trained - started,
            "sync_s": now - trained,
            "step_s": now - self.last_step_end,
            "wait_s": started - self.last_step_end,
            "response_length": sum(batch.response_lengths()) / len(batch),
            **rollout_times(reply.groups, self.last_step_unix, time.time() - (now - started)),
        }
        metrics["samples_per_s"] = len(batch) * max(1, self.info.dp_size) / metrics["step_s"]
        self.last_step_end, self.last_step_unix = now, time.time()
        if torch.cuda.is_available() and "tokens_per_s" in metrics:
            metrics["mfu"] = mfu(self.gpt.shape, metrics["tokens_per_s"] / self.info.world_size, batch.lengths())
        groups = [g.group_id for g in reply.groups]
        samples = shown_samples(reply.groups, self.config.log_samples)
        self.metrics.record(self.step - 1, self.policy_version, groups, metrics, reward_errors=failures.firsts(),
                            samples=samples)  # fmt: skip
        self.metrics.show_samples(self.step - 1, samples)
        custom = dist.get_rank() == 0 and self.actor.hooks.log_rollout(self.step - 1, list(reply.groups), metrics)
        c = self.control
        c.step, c.policy_version, c.last_metrics = self.step, self.policy_version, metrics
        self.metrics.report(self.step, metrics, scalars=not custom)
        return metrics

    def _give_back(self) -> str:
        """Before a run stops on its rewards: the step's groups (and every leased one) go back to the buffer's prompts,
        and with --save a checkpoint covers every step trained. What to do next, said in the stop's sentence."""
        if self.config.save and (not self.control.saved or self.control.saved[-1][1] != self.step):
            self.save()
        if dist.get_rank() == 0 and not self.config.load_debug_rollout_data:
            request = buffer_pb2.RewindRequest(step=self.step, policy_version=self.policy_version)
            self.buffer.Rewind(request, timeout=60)
        if self.config.save:
            return f"its groups are back in the buffer: fix the reward, then run again with --load {self.config.save}"
        return "its groups are back in the buffer, but nothing was saved (no --save): fix the reward and start again"

    def _saved_batch(self) -> buffer_pb2.GetBatchResponse:
        """This rank's part of a batch saved by --save-debug-rollout-data; none left stops the run."""
        path = Path(self.config.load_debug_rollout_data.format(rollout_id=self.step))
        if not path.exists():
            log.info("no saved batch %s: the run ends", path)
            self.control.stop = True
            return buffer_pb2.GetBatchResponse()
        reply = buffer_pb2.GetBatchResponse.FromString(path.read_bytes())
        mine = list(reply.groups)[self.info.dp_rank :: self.info.dp_size]
        del reply.groups[:]
        reply.groups.extend(mine)
        return reply

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
                dist.broadcast_object_list(decision, src=0, group=control_group())
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
            step=self.step,
            dp_rank=self.info.dp_rank,
            dp_size=self.info.dp_size,
            timeout_seconds=wait_s,
            arrays_from_redis=self.redis is not None,
        )
        try:
            reply = self.buffer.GetBatch(request, timeout=wait_s + 30)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise
            # not enough groups yet, or the buffer is down or restarting: its state is in Redis, so wait for it
            log.log(
                logging.WARNING if e.code() == grpc.StatusCode.UNAVAILABLE else logging.DEBUG,
                "step %d: waiting for the buffer (%s)",
                self.step,
                e.details(),
            )
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
