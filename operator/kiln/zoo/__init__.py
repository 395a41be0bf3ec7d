"""The model zoo as storage: object stores (`store`) and the records in them (`records`).

Trained models with their metrics, architecture graphs and producing jobs. Storage only: no
parent search, no models; ``kiln.zoo.store`` never imports torch.
"""
