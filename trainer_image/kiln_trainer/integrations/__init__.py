"""Kiln's levers for training loops people already have: `hf` for the Hugging Face `Trainer`,
`lightning` for PyTorch Lightning.

Each integration is a thin callback over `kiln_trainer.jobcontext.JobContext`; its extra
installs the framework (``pip install 'kiln-operator[hf]'``, ``[lightning]``).
"""
