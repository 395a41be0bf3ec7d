"""A simulated Kubernetes cluster for the operator's end-to-end tests and benchmark.

The API server is kmock's `KubernetesEmulator` served over real HTTP; pods "run" because a test
kubelet starts each pod's container command as a local process. Needs the ``test`` extra.
"""

