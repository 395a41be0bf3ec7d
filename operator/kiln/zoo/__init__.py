"""The model zoo: trained models with their metrics, graphs and producing jobs.

Two modules, imported by name (``from kiln.zoo import records, store``):

  * `store`: the `ObjectStore` protocol and its two implementations, `DirStore` (a local
    directory, the embedded default ``./.kiln/zoo``) and `S3Store` (MinIO or any S3 server),
    plus `open_store(uri)`. Never imports torch.
  * `records`: the zoo layout on top of a store (``models/<id>/weights.safetensors``,
    ``graph.json``, ``meta.json``), the `ZooRecord` metadata type and its JSON form.

Callers: the trainer registers finished models and loads warm-start parents; the operator and
the local runner list records to pick parents; the CLI shows them.

This package imports nothing here on purpose, so ``kiln.zoo.store`` stays free of torch.
"""
