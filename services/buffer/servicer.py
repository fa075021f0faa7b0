"""gRPC face of the buffer: translates BufferService requests to `Buffer` calls and the results back."""

from google.protobuf.timestamp_pb2 import Timestamp

from services.buffer.core import TRAIN, Buffer, LeasedGroup
from slipstream.samples import varint
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc

_BLOCKED = {
    None: buffer_pb2.LEASE_BLOCK_UNSPECIFIED,
    "backpressure": buffer_pb2.LEASE_BLOCK_BACKPRESSURE,
    "staleness": buffer_pb2.LEASE_BLOCK_STALENESS,
    "exhausted": buffer_pb2.LEASE_BLOCK_EXHAUSTED,
}


_FIELDS = buffer_pb2.GetBatchResponse.DESCRIPTOR.fields_by_name


def _repeated_bytes(field: str, payloads: list[bytes]) -> bytes:
    """Wire encoding of a repeated message (or bytes) field from already serialized messages."""
    tag = varint(_FIELDS[field].number << 3 | 2)  # wire type 2: length-delimited
    return b"".join(tag + varint(len(payload)) + payload for payload in payloads)


def _timestamp(ms: int) -> Timestamp:
    stamp = Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def _lease(leased: LeasedGroup, buffer: Buffer) -> buffer_pb2.Lease:
    deadline = _timestamp(leased.deadline_ms)
    upload_key = buffer.store.upload_key(leased.lease_id)
    namespace = buffer.store.ns if leased.group.dataset == TRAIN and buffer.dynamic_filter is None else ""
    return buffer_pb2.Lease(
        lease_id=leased.lease_id,
        group=leased.group,
        deadline=deadline,
        upload_key=upload_key,
        submit_namespace=namespace,
    )


class BufferServicer(buffer_pb2_grpc.BufferServiceServicer):
    def __init__(self, buffer: Buffer):
        self.buffer = buffer

    async def LeasePrompts(self, request, context):
        result = await self.buffer.lease(request.max_groups, request.lease_seconds, request.dataset)
        return buffer_pb2.LeasePromptsResponse(
            leases=[_lease(leased, self.buffer) for leased in result.leases],
            policy_version=result.policy_version,
            blocked=_BLOCKED[result.blocked],
        )

    async def ExtendLease(self, request, context):
        deadline, extended, expired = await self.buffer.extend(list(request.lease_ids), request.lease_seconds)
        stamp = _timestamp(deadline)
        return buffer_pb2.ExtendLeaseResponse(
            leases=[buffer_pb2.Lease(lease_id=lid, deadline=stamp) for lid in extended], expired=expired
        )

    async def ReleaseLease(self, request, context):
        await self.buffer.release(request.lease_id, list(request.partial_samples))
        return buffer_pb2.ReleaseLeaseResponse()

    async def SubmitGroup(self, request, context):
        accepted, duplicate, reason = await self.buffer.submit(request.lease_id, request.group, request.arrays_in_redis)
        return buffer_pb2.SubmitGroupResponse(accepted=accepted, duplicate=duplicate, filtered_reason=reason)

    async def GetBatch(self, request, context):
        dp_size = request.dp_size or 1  # unset means one data-parallel rank
        part = await self.buffer.get_batch(
            request.step, request.dp_rank, dp_size, request.timeout_seconds, request.arrays_from_redis
        )
        head = buffer_pb2.GetBatchResponse(
            step=request.step,
            num_tokens=part.num_tokens,
            total_groups=part.total_groups,
            policy_version=part.policy_version,
            arrays_keys=part.arrays_keys if request.arrays_from_redis else [],
        )
        # The groups' and arrays' stored bytes are spliced in: a batch is megabytes, and parsing it only to
        # serialize it again would cost more than moving it.
        return (
            head.SerializeToString() + _repeated_bytes("groups", part.payloads) + _repeated_bytes("arrays", part.arrays)
        )

    async def CommitBatch(self, request, context):
        return buffer_pb2.CommitBatchResponse(num_deleted_groups=await self.buffer.commit(request.step))

    async def SetPolicyVersion(self, request, context):
        return buffer_pb2.SetPolicyVersionResponse(version=await self.buffer.set_policy_version(request.version))

    async def Rewind(self, request, context):
        returned = await self.buffer.rewind(request.step, request.policy_version)
        return buffer_pb2.RewindResponse(num_returned_groups=returned)

    async def GetState(self, request, context):
        return buffer_pb2.BufferState(**await self.buffer.state())
