"""Kiln jobs on a cluster from the terminal and Python: the `kiln.Client` behind `kiln submit`,
`ls`, `get`, `logs`, `wait` and `delete`, and the views they print. The one package that talks
to a cluster as its user (the operator's own client is `kiln.controller.kube`).
"""
