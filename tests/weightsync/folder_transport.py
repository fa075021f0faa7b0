"""A transport of the tests' own, plugged in as a new one is: this module and a line in the factory's table (the
test adds the line). It is the disk transport under another name and WeightTransport (a number rollout.proto does not
name: its enums are open), each sync a checkpoint folder the engines load at the commit."""

from services.weightsync import disk

KIND = 99


class Gateway(disk.Gateway):
    kind, name = KIND, "folder"


class Sender(disk.Sender):
    shard = "folder"  # its shards' names: folder-<group>-NNNNN.safetensors
