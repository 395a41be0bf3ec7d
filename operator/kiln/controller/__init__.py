"""The Kubernetes operator (kopf): TrainingJob handlers, pods, status, placement, metrics.

The only package that imports kopf (DESIGN.md section 2). Modules, one idea each:

    main             `kiln operator` / ``python -m kiln.controller``: options, `run`, `main`
    settings         `Options`: every knob, with units and defaults
    handlers         the kopf handlers (thin adapters) and their registration
    services         what the handlers share (on kopf's memo)
    admission        validate, choose the warm-start parent, queue
    parents          warm-start decisions off the event loop, cached, on one zoo index
    placement_loop   the queue and the loop that plans it and starts jobs
    cluster          device pools, free devices and running jobs from nodes and pods
    lifecycle        launch, pod events, restarts, the end, suspension, deletion
    housekeeping     per-job TTL, deadline and progress checks
    progress         reading a trainer's metrics into status.progress
    policy           runPolicy decisions: exit codes, backoff, deadline, TTL, cleanup
    pods             the trainer pod as data, and what a pod says about its trainer
    status           conditions, phase and merge patches (pure)
    jobs             the one status writer (per-job locks) and event poster
    kube             a minimal async API client with the operator's credentials
    rbac             the (verb, resource) pairs the operator needs, as RBAC rules
    metrics          the operator's Prometheus metrics (kiln_*)
"""
