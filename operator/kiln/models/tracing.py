"""One process-wide lock for torch code that changes global state while it runs.

torch.fx and torch.export patch `nn.Module.__call__` (and more) for the whole process while they
trace, and FlopCounterMode registers global module hooks: a forward pass or a second trace in
another thread meanwhile breaks (fx: "module is not installed as a submodule"). Hold `LOCK`
around every trace, and around every forward pass in a process that may trace in another thread.
"""

from __future__ import annotations

import threading

# Reentrant: a traced forward pass may itself run code that takes it.
LOCK = threading.RLock()
