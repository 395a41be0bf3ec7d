"""A simulated Kubernetes cluster for the operator's end-to-end tests and benchmark.

DESIGN.md section 7: the API server is kmock's `KubernetesEmulator` served over real HTTP;
pods "run" because a test kubelet starts each pod's container command as a local process.

Modules:
    emulator: the emulator in a background thread, its request log, a kubeconfig for it.
    client: a small synchronous HTTP client for tests, and `wait_until` (poll, deadline).
    kubelet: the test kubelet: binds pods to their planned node, runs their containers as
        local processes, patches pod status (phase, exit code, termination message), and
        injects faults (kill a trainer with a chosen signal).
    operator_process: starts and stops the real operator, ``python -m kiln.controller``.
    scenario: tiny jobs, waiting for a job's status, reading the operator's events.
    usage: the (verb, group, resource) calls the operator made, for the Helm RBAC test.

Imported by tests/e2e and bench/operator.py (which adds tests/ to sys.path). Needs the
``test`` extra (kmock).
"""
