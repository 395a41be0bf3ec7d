"""Data-parallel training: process groups, DDP and FSDP wrapping, batch sharding, replica checks."""
