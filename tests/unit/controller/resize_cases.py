"""A job the placement loop's resize tests move: compute-heavy enough (by its FLOP estimate)
that 2 GPUs run it clearly faster than 1."""

from __future__ import annotations

from kiln import api

NODE = "gpu-a"


def heavy_job(name: str) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"model": {"architecture": "small_cnn", "args": {}, "inputShape": [3, 64, 64]},
                 "training": {"epochs": 20, "batchSize": 512},
                 "dataset": {"name": "torchvision", "torchvisionClass": "CIFAR10",
                             "path": "/nonexistent"}}})
