"""The reward service: built-in verifiers, custom reward functions and remote reward models."""
