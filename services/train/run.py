"""`slipstream train`: starts the services as child processes (or joins running ones), starts the rollout once the
trainer is ready, shows each step, evaluates on the interval, and stops every child on the way out — at the end,
on Ctrl-C, or when one of them fails, saying which and where its log is."""

import asyncio
import json
import logging
import os
import secrets
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc

from services.common.auth import ROLES
from services.common.clients import PLAINTEXT, Credentials, health_status, open_channel
from services.common.config import AuthConfig, ConfigError
from services.common.errors import STOPPED, StartupError
from services.common.launch import Child, gpu_ids, num_gpus, start, stop
from services.common.logs import setup_logging
from services.common.processes import PORT_RANGE_ENV, free_port, port_range_share
from services.common.redis_connection import open_redis
from services.train import report, wandb_log
from services.train.help import full_help, short_help
from services.train.options import JOIN, SERVICES, Plan, check_joined, parse
from services.train.stall import LOG_PREFIX, RunStalled, StallWatch, last_error
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger("slipstream.train")

JOIN_S = 5.0  # a service the run joins answers its health check within this
POLL_S = 0.2
STALL_CHECK_S = 2.0


class ChildFailed(Exception):
    pass


class Interrupted(Exception):
    """Ctrl-C or SIGTERM, raised where the launcher polls. A KeyboardInterrupt raised inside whatever library code
    runs at that moment could leave the library in a bad state, and under `python -m` makes the interpreter end by
    SIGINT even when caught (CPython's flag for string-evaluated code, which pybind11 modules use)."""


class Run:
    def __init__(self, plan: Plan):
        self.plan, self.options = plan, plan.options
        self.run_dir = plan.run_dir
        self.logs = self.run_dir / "logs"
        self.steps_file = self.run_dir / "steps.jsonl"
        self.children: list[Child] = []
        self.own_flags: list[str] = []  # what every service it starts gets (a generated token file)
        self.credentials = PLAINTEXT
        self.addr: dict[str, str] = {}
        self.channels: list[grpc.Channel] = []
        self.evals: list[dict] = []
        self._eval_pool = ThreadPoolExecutor(1)
        self._eval_pending: list[Future] = []
        self._writer = None
        self.wandb: wandb_log.WandbRun | None = None
        self._next_step: int | None = None  # --debug-rollout-only
        self.interrupted = False  # set by the signal handler, raised as Interrupted at the next poll
        self.serving = False  # every service up and the run under way
        # Disjoint port shares: the first for the ports this launcher hands out, one for each service it starts (the
        # gateway draws its engines' ports): no service can draw a port handed to another that has not bound it yet.
        self.port_shares = [port_range_share(i, 1 + len(SERVICES)) for i in range(1 + len(SERVICES))]

    # Starting

    def start(self) -> None:
        o, trainer = self.options, self.plan.configs["trainer"]
        if not trainer.load and (self.run_dir / "steps.jsonl").exists() and "buffer" not in self.plan.joined:
            raise StartupError(
                f"{self.run_dir} holds an earlier run; resume it with --load {trainer.save or '<its --save folder>'}, "
                "or start a new one with another --run-id (or remove the folder)"
            )
        self._check_gpus()
        redis = self.plan.configs["buffer"].redis
        joined = self.plan.joined
        if "buffer" in joined and redis.url:  # joining a buffer: its Redis, when given, is checked first (one sentence)
            open_redis(redis, self.run_dir)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb_log.start(self.plan)
        self._secure()
        for name, address in self.plan.joined.items():  # what it joins answers before it starts anything
            self.addr[name] = address
            self._wait_serving(name)
        # The services start together (each knows the others' addresses, and none calls another before it serves);
        # the trainer once the buffer serves, while the gateway starts its engines, unless it must find them serving:
        # a resumed trainer gives them its weights first, a colocated one shares their GPUs.
        self.addr["buffer"] = self.plan.joined.get("buffer") or self._service("buffer", [])
        if not o.debug_train_only:
            self.addr["reward"] = self.plan.joined.get("reward") or self._service("reward", [])
            # The trainer's --weight-sync-address is the one master its engines may be pointed at.
            masters = [*self.plan.configs["rollout"].allowed_weight_sync_hosts, trainer.weight_sync_address]
            own = ["--buffer-addr", self.addr["buffer"], "--reward-addr", self.addr["reward"],
                   "--engine-log-dir", str(self.logs), "--allowed-weight-sync-hosts", *masters]  # fmt: skip
            self.addr["rollout"] = self.plan.joined.get("rollout") or self._service("rollout", own)
        for name in ("buffer", "reward"):
            if name in self.addr:
                self._wait_serving(name)
        early = "rollout" in self.addr and not (o.debug_rollout_only or trainer.load or trainer.colocate)
        if "rollout" in self.addr and not early:
            self._wait_serving("rollout")
        self.buffer = buffer_pb2_grpc.BufferServiceStub(self._channel(self.addr["buffer"]))
        if "rollout" in self.addr:
            self.rollout = rollout_pb2_grpc.RolloutServiceStub(self._channel(self.addr["rollout"]))
        if o.debug_rollout_only:
            self.rollout.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=30)
            return
        own = ["--buffer-addr", self.addr["buffer"], "--tensorboard-dir", str(self.run_dir / "tensorboard"),
               "--steps-file", str(self.steps_file)]  # fmt: skip
        if "rollout" in self.addr:
            own += ["--rollout-addr", self.addr["rollout"]]
        env, gpus = {}, gpu_ids()
        if gpus and not trainer.colocate and self._launched_engines() and "rollout" not in self.plan.joined:
            first = self._launched_engines()  # the engines have the first GPUs, the trainer the next ones
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[first : first + o.actor_num_gpus_per_node])
        self.addr["trainer"] = self._service("trainer", own, nproc=o.actor_num_gpus_per_node, env=env)
        if early:
            self._wait_serving("rollout")
        self._wait_serving("trainer")
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(self._channel(self.addr["trainer"]))
        if trainer.load:  # a resumed trainer first gives the engines its weights: no sample of the old ones
            self._wait_for(lambda: self._status().phase in ("waiting_batch", "train", "stopped"), "resume")
            if step := self._status().step:
                print(f"slipstream train: resuming from step {step} ({trainer.load})", flush=True)
        if "rollout" in self.addr:
            self.rollout.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=30)

    def _secure(self) -> None:
        """The services' token file: the one given (--auth-token-file), else a new one of this run with a random
        token per role, readable by this user only. The launcher's own calls are admin's, with the services' TLS."""
        config = self.plan.configs["buffer"]
        if config.auth.token_file is None:
            path = self.run_dir / "auth-tokens"
            path.unlink(missing_ok=True)
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.writelines(f"{role} {secrets.token_urlsafe(32)}\n" for role in ROLES)
            self.own_flags += ["--auth-token-file", str(path)]
            config = config.model_copy(update={"auth": AuthConfig(token_file=path)})
        self.credentials = Credentials.of(config, "admin")

    def _check_gpus(self) -> None:
        """The engines take the first GPUs and the trainer the next ones (colocated: the same): all must exist."""
        gpus, o = num_gpus(), self.options
        if not gpus:
            return
        engines = 0 if "rollout" in self.plan.joined or o.debug_train_only else self._launched_engines()
        trainer = 0 if o.debug_rollout_only else o.actor_num_gpus_per_node
        need = max(engines, trainer) if self.plan.configs["trainer"].colocate else engines + trainer
        if need > gpus:
            raise StartupError(
                f"this run needs {need} GPUs ({engines} for the engines: --rollout-num-gpus; "
                f"{trainer} for the trainer: --actor-num-gpus-per-node) but only {gpus} are visible "
                "(CUDA_VISIBLE_DEVICES); "
                "lower them"
            )

    def _launched_engines(self) -> int:
        """GPUs (or CPU engines) of the engines the gateway launches: --rollout-num-gpus (one unless given or
        --engine-urls names running ones: options.parse)."""
        return self.plan.configs["rollout"].rollout_num_gpus

    def _service(self, name: str, own: list[str], nproc: int = 1, env: dict | None = None) -> str:
        port, host = self._free_port(), self.options.host
        flags = ["--host", host, "--port", str(port), "--log-level", self.options.log_level, *self.own_flags]
        module = ["-m", f"services.{name}"]
        if nproc > 1:
            module = [
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(nproc),
                "--master-port",
                str(self._free_port()),
                *module,
            ]
        args = [sys.executable, *module, *flags, *own, *self.plan.argv[name]]
        env = {**os.environ, **(env or {}), "SLIPSTREAM_RUN": str(self.run_dir.resolve())}  # marks the run's processes
        if share := self.port_shares[1 + list(SERVICES).index(name)]:
            env[PORT_RANGE_ENV] = share
        self.children.append(start(name, args, port, self.logs, env))
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    def _free_port(self) -> int:
        return free_port(within=self.port_shares[0])

    def _channel(self, address: str) -> grpc.Channel:
        self.channels.append(channel := open_channel(address, self.credentials))
        return channel

    def _wait_serving(self, name: str) -> None:
        with open_channel(self.addr[name], self.credentials, max_attempts=1) as channel:

            def serving() -> bool:
                try:
                    return health_status(channel, timeout_s=1.0) == "SERVING"
                except grpc.RpcError:
                    return False

            if name in self.plan.joined:  # running already: it answers at once, or the run stops at once
                flag = JOIN[name]
                where = f"its own log (in compose: `docker compose logs {name}`), or fix {flag}"
                self._wait_for(serving, f"the {name} service at {self.addr[name]} ({flag}) to serve", where, JOIN_S)
            else:
                self._wait_for(serving, f"the {name} service at {self.addr[name]} to serve")

    def _wait_for(self, ready, what: str, logs: str | None = None, limit_s: float | None = None) -> None:
        limit_s = limit_s or self.options.startup_timeout_s
        deadline = time.monotonic() + limit_s
        while not ready():
            self._check_interrupted()
            self._check_children()
            if time.monotonic() > deadline:
                flag = "" if limit_s != self.options.startup_timeout_s else " (--startup-timeout-s)"
                raise StartupError(
                    f"gave up waiting for {what} after {limit_s:.0f} s{flag}; see {logs or f'the logs in {self.logs}'}"
                )
            time.sleep(POLL_S)

    def _check_interrupted(self) -> None:
        if self.interrupted:
            raise Interrupted

    def _check_children(self, trainer_may_exit: bool = False) -> bool:
        """Raises ChildFailed when a child exited; True when the trainer finished (exit 0) and that was allowed."""
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                continue
            if child.name == "trainer" and code == 0 and trainer_may_exit:
                return True
            own = last_error(child.log_path, warnings=False) if child.log_path.exists() else None
            if code == STOPPED and own:  # the run stopped itself: its sentence says it all
                raise ChildFailed(LOG_PREFIX.sub("", own))
            exited = {c.name for c in self.children if c.proc.poll() is not None}
            # What it gave up waiting for, if anything: once all serve (a starting one does not answer yet).
            hung = [name for name in self._silent() if name not in exited] if self.serving else []
            raise ChildFailed(
                (f"the {' and the '.join(hung)} service does not answer its health check (hung?), and " if hung else "")
                + f"the {child.name} service exited with code {code}"
                + (f": {own}" if own else "")
                + f"\nits log {child.log_path} ends with:\n{child.tail(15)}"
            )
        return False

    def _status(self) -> trainer_pb2.TrainerStatus:
        try:
            return self.trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
        except grpc.RpcError:
            return trainer_pb2.TrainerStatus(phase="stopped")

    # Running

    def train(self) -> None:
        total = self.plan.configs["trainer"].num_rollout
        interval = self.options.eval_interval
        eval_sets = bool(self.plan.configs["buffer"].eval_sets()) and "rollout" in self.addr
        seen = _read_steps(self.steps_file)
        first = seen[-1]["step"] + 1 if seen else 0
        if eval_sets and first == 0:  # as slime, before training
            self._evaluate(0)
        stall = StallWatch(self.options.stall_timeout_s, self.logs, self._silent)
        self.serving = True
        with report.Progress(total, first) as progress:
            offset = self.steps_file.stat().st_size if self.steps_file.exists() else 0
            last_status, last_stall_check = 0.0, 0.0
            while True:
                self._check_interrupted()
                done = (
                    self._null_step()
                    if self.options.debug_rollout_only
                    else self._check_children(trainer_may_exit=True)
                )
                offset, lines = _tail(self.steps_file, offset)
                for line in lines:
                    progress.step(line)
                    if self.wandb is not None:
                        self.wandb.step(line)
                    if eval_sets and interval and (line["step"] + 1) % interval == 0:
                        self._evaluate(line["step"] + 1)
                for result in self._finished_evals():
                    progress.eval(result)
                if done:
                    break
                if "trainer" in self.addr and time.monotonic() - last_status > 1.0:
                    progress.phase(self._status().phase)
                    last_status = time.monotonic()
                if time.monotonic() - last_stall_check > STALL_CHECK_S:
                    stall.check(*self._progress(offset))
                    last_stall_check = time.monotonic()
                time.sleep(POLL_S)
            if eval_sets and (not self.evals or self.evals[-1]["step"] != progress.last_step + 1):
                self._evaluate(progress.last_step + 1)
            while not all(future.done() for future in self._eval_pending):
                self._check_interrupted()
                time.sleep(POLL_S)
            for result in self._finished_evals():
                progress.eval(result)
        report.finish(self.run_dir, _read_steps(self.steps_file), self.evals, self.plan)

    def _silent(self) -> list[str]:
        """The services that do not answer their health check within a few seconds."""
        silent = []
        for name, address in self.addr.items():
            with open_channel(address, self.credentials, max_attempts=1) as channel:
                try:
                    health_status(channel, timeout_s=5.0)
                except grpc.RpcError:
                    silent.append(name)
        return silent

    def _progress(self, steps_offset: int) -> tuple[tuple, str]:
        """What changes when the run moves (steps, versions, groups generated and consumed), and the trainer's phase."""
        status = self._status() if "trainer" in self.addr else trainer_pb2.TrainerStatus(phase="none")
        try:
            state = self.buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10)
        except grpc.RpcError:
            state = buffer_pb2.BufferState()
        counts = tuple(state.counters.get(name, 0) for name in ("completed", "dropped", "eval_completed"))
        moved = (
            steps_offset,
            status.step,
            status.policy_version,
            status.phase,
            state.policy_version,
            state.last_committed_step,
            counts,
        )
        return moved, status.phase

    def _null_step(self) -> bool:
        """--debug-rollout-only: takes each step's batch as the trainer would (saving it if asked) and commits it."""
        if self._next_step is None:  # where an earlier run of this folder stopped
            self._next_step = self.buffer.GetState(buffer_pb2.GetStateRequest(), timeout=30).last_committed_step + 1
        step = self._next_step
        total = self.plan.configs["buffer"].num_rollout
        if total is not None and step >= total:
            return True
        try:
            reply = self.buffer.GetBatch(buffer_pb2.GetBatchRequest(step=step, timeout_seconds=2), timeout=30)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return self._check_children()
        if self.options.save_debug_rollout_data:
            path = Path(self.options.save_debug_rollout_data.format(rollout_id=step))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(reply.SerializeToString())
        self.buffer.CommitBatch(buffer_pb2.CommitBatchRequest(step=step), timeout=30)
        self.buffer.SetPolicyVersion(buffer_pb2.SetPolicyVersionRequest(version=step + 1), timeout=30)
        self._next_step += 1
        rewards = [s.reward for g in reply.groups for s in g.samples]
        lengths = [s.response_length for g in reply.groups for s in g.samples]
        line = {
            "step": step,
            "policy_version": 0,
            "time": time.time(),
            "groups": [g.group_id for g in reply.groups],
            "metrics": {"reward": sum(rewards) / len(rewards), "response_length": sum(lengths) / len(lengths)},
        }
        with self.steps_file.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return False

    def _evaluate(self, step: int) -> None:
        def run() -> dict:
            reply = self.rollout.Evaluate(rollout_pb2.EvaluateRequest(step=step), timeout=3600)
            return {
                "step": step,
                "time": time.time(),
                "results": {
                    r.dataset: {"mean_reward": r.mean_reward, "num_samples": r.num_samples, **r.metrics}
                    for r in reply.results
                },
            }

        self._eval_pending.append(self._eval_pool.submit(run))

    def _finished_evals(self) -> list[dict]:
        done = [f for f in self._eval_pending if f.done()]
        self._eval_pending = [f for f in self._eval_pending if not f.done()]
        results = []
        for future in done:
            try:
                results.append(future.result())
            except grpc.RpcError as e:
                log.warning("evaluation failed: %s", e.details())
                continue
            self.evals.append(results[-1])
            with (self.run_dir / "eval.jsonl").open("a") as f:
                f.write(json.dumps(results[-1]) + "\n")
            self._tensorboard(results[-1])
            if self.wandb is not None:
                self.wandb.evaluation(results[-1])
        return results

    def _tensorboard(self, result: dict) -> None:
        """Each evaluation's scalars, as TensorBoard's own writer writes them (torch's, which the trainer uses,
        would cost the launcher an import of torch)."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self._writer is None:
            self._writer = EventFileWriter(str(self.run_dir / "tensorboard"))
        values = [
            Summary.Value(tag=f"eval/{name}/{key}", simple_value=value)
            for name, metrics in result["results"].items()
            for key, value in metrics.items()
        ]
        self._writer.add_event(Event(wall_time=time.time(), step=result["step"], summary=Summary(value=values)))
        self._writer.flush()

    # Stopping

    def stop(self, exit_code: int = 0) -> None:
        self._eval_pool.shutdown(wait=False, cancel_futures=True)
        if self._writer is not None:
            self._writer.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code)
        for channel in self.channels:
            channel.close()
        # The trainer first (it may be in a sync with the gateway), then the gateway (its engines with it), then the
        # reward service and the buffer (its Redis flushes on the way out).
        asyncio.run(stop(list(reversed(self.children)), grace_s=30.0))


def _tail(path: Path, offset: int) -> tuple[int, list[dict]]:
    if not path.exists():
        return offset, []
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a line being written is read next time
    return offset + end, [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _read_steps(path: Path) -> list[dict]:
    return _tail(path, 0)[1]


def main(argv: list[str] | None = None) -> int:
    setup_logging("info")
    argv = list(argv or [])
    if any(a in ("-h", "--help", "--help-all") for a in argv):  # the flags to set first, on one screen; or all
        print(full_help() if "--help-all" in argv else short_help())
        return 0
    check = "--check" in argv  # validate every service's settings and what they must agree on, start nothing
    try:
        plan = parse([a for a in argv if a != "--check"])
        if check:
            check_joined(plan)
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"slipstream train: error: {line}", file=sys.stderr)
        return 2
    if check:
        print("slipstream train: the settings are valid")
        return 0
    return execute(plan)


def execute(plan: Plan) -> int:
    run = Run(plan)

    def on_signal(signum, frame):
        run.interrupted = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    code = 1  # an error that gets past the handlers below
    try:
        run.start()
        run.train()
        code = 0
    except (Interrupted, KeyboardInterrupt):
        print("slipstream train: interrupted; stopping every service", file=sys.stderr)
        code = 130
    except (ChildFailed, StartupError, RunStalled) as e:
        print(f"slipstream train: {e}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave children behind
        run.stop(code)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return code
