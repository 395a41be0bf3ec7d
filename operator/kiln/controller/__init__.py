"""The Kubernetes operator (kopf): TrainingJob handlers, pods, status, metrics.

The only package that imports kopf (DESIGN.md section 2). Filled in by the operator issue.
"""
