"""The Kubernetes operator (kopf): TrainingJob handlers, pods, status, placement, metrics.

The only package that imports kopf. `main` runs it; `handlers` maps kopf's causes to the
domain steps in `admission`, `lifecycle` and `housekeeping`.
"""
