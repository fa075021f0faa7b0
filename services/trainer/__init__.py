"""The trainer: Megatron-core actor, slime's algorithms, HF checkpoints in and out, and its control RPC."""
