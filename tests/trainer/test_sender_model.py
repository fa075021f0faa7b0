"""A model-based test of the trainer's side of weight sync (services/trainer/weight_sync.py): hypothesis drives a real
`WeightSender` (the disk transport: no weight group to host) against a gateway that answers over real gRPC in this
process, through random failures of each attempt: the Prepare refused (the gateway gone, or the sync aborted), a
bucket that an engine failed, that nothing answers (the watchdog's deadline) or that the gateway's death ends, and a
commit that no engine took or that the gateway's death ends. After every sync it checks the outcome against the
protocol's rules (docs/rollout.md, "The protocol in one place"): the engines serve the version exactly when the sync
says so, an engine that left costs one attempt of three and then the run, a gateway that left leaves the engines on
their version, every attempt ends committed or failed with its stream closed and its watchdog gone, a sync that fails
is aborted at the gateway, and a committed one leaves no older checkpoint folder behind.

`make test` runs a bounded number of examples; `make test-slow` runs the machine for 10 minutes."""

import json
import threading
import time
from concurrent import futures

import grpc
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from services.common.processes import free_port
from services.trainer.config import TrainerConfig
from services.trainer.weight_sync import ATTEMPTS, WeightSender
from services.weightsync.protocol import SenderPhase as Phase
from services.weightsync.protocol import WeightSyncFailed
from slipstream.v1 import rollout_pb2, rollout_pb2_grpc

TIMEOUT_S = 2.0  # the weight-sync timeout: the watchdog acts after 1.5 times as long
ENGINE = "http://engine-0"
TENSORS = 3  # of 64 floats, one a bucket
OK, LEFT, HANG, GONE, ABORTED, CRASH = "ok", "engine left", "no answer", "gateway gone", "aborted", "internal error"


class Plan:
    """How the gateway answers one attempt: its Prepare, each bucket, its commit."""

    def __init__(self, prepare: str = OK, buckets: tuple = (), commit: str = OK):
        self.prepare, self.buckets, self.commit = prepare, dict(buckets), commit

    def outcome(self) -> str:
        """What the attempt comes to: OK, LEFT (start over without the engine), GONE (start over through another
        gateway) or CRASH (give up this sync)."""
        if self.prepare != OK:
            return {GONE: GONE, ABORTED: LEFT, CRASH: CRASH}[self.prepare]
        for index in range(TENSORS):
            answer = self.buckets.get(index, OK)
            if answer != OK:
                return GONE if answer == GONE else LEFT  # a bucket nothing answers: the watchdog ends the attempt
        return {OK: OK, LEFT: LEFT, GONE: GONE}[self.commit]

    def __repr__(self) -> str:
        return f"Plan({self.prepare!r}, {self.buckets!r}, {self.commit!r})"


plans = st.builds(
    Plan,
    prepare=st.sampled_from([OK, OK, OK, GONE, ABORTED, CRASH]),
    buckets=st.dictionaries(st.integers(0, TENSORS - 1), st.sampled_from([LEFT, LEFT, HANG, GONE]), max_size=1).map(
        lambda d: tuple(d.items())
    ),
    commit=st.sampled_from([OK, OK, LEFT, GONE]),
)


class Gateway(rollout_pb2_grpc.RolloutServiceServicer):
    """The gateway's weight-sync RPCs, answering each attempt as the next plan says (all well once none is left)."""

    def __init__(self):
        self.plans: list[Plan] = []
        self.plan = Plan()
        self.committed: list[int] = []
        self.aborted: list[int] = []
        self.open_streams = 0
        self.lock = threading.Lock()

    def PrepareWeightSync(self, request, context):
        self.plan = self.plans.pop(0) if self.plans else Plan()
        self._fail(context, self.plan.prepare)
        assert request.transport == rollout_pb2.WEIGHT_TRANSPORT_DISK
        return rollout_pb2.PrepareWeightSyncResponse(
            world_size=2, engines=[rollout_pb2.EngineRank(url=ENGINE, tp_size=1)],
            transport=rollout_pb2.WEIGHT_TRANSPORT_DISK,
        )  # fmt: skip

    def SyncWeightBuckets(self, request_iterator, context):
        with self.lock:
            self.open_streams += 1
        try:
            for bucket in request_iterator:
                answer = self.plan.buckets.get(bucket.bucket_index, OK)
                if answer == HANG:
                    while context.is_active():  # until the trainer's watchdog cancels the stream
                        time.sleep(0.02)
                    return
                self._fail(context, answer)
                yield rollout_pb2.WeightBucketResult(
                    bucket_index=bucket.bucket_index,
                    engines=[rollout_pb2.EngineResult(url=ENGINE, success=answer == OK, message=answer)],
                )
        finally:
            with self.lock:
                self.open_streams -= 1

    def CommitWeightSync(self, request, context):
        self._fail(context, self.plan.commit)
        if self.plan.commit == OK:
            self.committed.append(request.version)
        success = self.plan.commit == OK
        return rollout_pb2.CommitWeightSyncResponse(
            engines=[rollout_pb2.EngineResult(url=ENGINE, success=success, message=self.plan.commit)]
        )

    def AbortWeightSync(self, request, context):
        self.aborted.append(request.version)
        return rollout_pb2.AbortWeightSyncResponse()

    @staticmethod
    def _fail(context, answer: str) -> None:
        codes = {GONE: grpc.StatusCode.UNAVAILABLE, ABORTED: grpc.StatusCode.ABORTED, CRASH: grpc.StatusCode.INTERNAL}
        if answer in codes:  # gone for the whole attempt: gRPC's own retries of the call are told not to try again
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "-1"),))
            context.abort(codes[answer], f"the test's gateway: {answer}")


def expected(plans: list[Plan]) -> bool | None:
    """The sync's result by the protocol's rules: True (served), False (the engines keep their version) or None
    (WeightSyncFailed: no engine could take the weights, attempt after attempt)."""
    for attempt in range(1, ATTEMPTS + 1):
        outcome = (plans[attempt - 1] if attempt <= len(plans) else Plan()).outcome()
        if outcome == OK:
            return True
        if outcome in (LEFT, GONE) and attempt < ATTEMPTS:
            continue
        return None if outcome == LEFT else False
    raise AssertionError("unreachable")


class SenderMachine(RuleBasedStateMachine):
    def __init__(self, tmp):
        super().__init__()
        self.gateway = Gateway()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(self.gateway, self.server)
        port = free_port()
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        checkpoint = tmp / "checkpoint"
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        self.disk = tmp / "weights"
        self.config = TrainerConfig(
            rollout_addr=f"127.0.0.1:{port}", update_weight_transport="disk", update_weight_disk_dir=str(self.disk),
            weight_sync_timeout_s=TIMEOUT_S, update_weight_buffer_size=300, hf_checkpoint=str(checkpoint),
        )  # fmt: skip
        self.weights = [(f"w{i}", torch.full((64,), float(i))) for i in range(TENSORS)]
        self.sender = WeightSender(self.config, lambda: iter(self.weights), sender=True)
        assert self.sender.sync(1)  # the first sync learns the buckets' layout (and imports what the disk takes)
        self.version = 1

    @rule(plans=st.lists(plans, max_size=ATTEMPTS))
    def sync(self, plans):
        self.version += 1
        version, want = self.version, expected(plans)
        self.gateway.plans = list(plans)
        started = time.monotonic()
        try:
            result = self.sender.sync(version)
        except WeightSyncFailed:
            result = None
        took = time.monotonic() - started
        assert result is want, f"version {version}: {plans} came to {result}, the rules say {want}"
        assert (self.gateway.committed[-1:] == [version]) is (result is True)  # served exactly when it says so
        assert (version in self.gateway.aborted) is (result is not True)  # a failed sync is aborted at the gateway
        attempt = self.sender.attempt
        assert attempt.phase is (Phase.COMMITTED if result else Phase.FAILED) and attempt.stream is None
        # every wait had its deadline: the watchdog's for each attempt, the gateway-left pauses (1 s, 2 s) between
        assert took < ATTEMPTS * (TIMEOUT_S * 1.5 * 3 + 3) + 10, f"version {version} took {took:.1f} s"
        if result:  # the engines loaded it: no checkpoint folder of this version or an older one is left
            assert not [p.name for p in self.disk.iterdir()], sorted(p.name for p in self.disk.iterdir())

    @invariant()
    def nothing_of_an_ended_sync_is_left(self):
        assert not [t for t in threading.enumerate() if t.name == "weight-sync-watchdog"]
        deadline = time.monotonic() + 10  # the gateway's side of a cancelled stream ends on its own thread
        while self.gateway.open_streams and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.gateway.open_streams == 0

    def teardown(self):
        self.sender.close()
        self.server.stop(None)


def run_machine(tmp_path_factory, **limits) -> None:
    run_state_machine_as_test(
        lambda: SenderMachine(tmp_path_factory.mktemp("sender")),
        settings=settings(deadline=None, suppress_health_check=list(HealthCheck), database=None, **limits),
    )


def test_random_failures_of_each_attempt_end_as_the_protocol_says(tmp_path_factory):
    run_machine(tmp_path_factory, max_examples=6, stateful_step_count=3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_random_failures_of_each_attempt_for_ten_minutes(tmp_path_factory):
    end = time.monotonic() + 600
    while time.monotonic() < end:
        run_machine(tmp_path_factory, max_examples=50, stateful_step_count=8)
