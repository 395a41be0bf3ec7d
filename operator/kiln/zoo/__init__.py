"""The model zoo: trained models with their metrics, graphs and producing jobs.

Modules, imported by name (``from kiln.zoo import records, store``):

  * `store`: the `ObjectStore` protocol and its two implementations, `DirStore` (a local
    directory, the embedded default ``./.kiln/zoo``) and `S3Store` (MinIO or any S3 server),
    plus `open_store(uri)`. Never imports torch. The code lives in `objectstore` (protocol,
    errors, key rules), `dirstore` and `s3store`; `store` re-exports their names, so callers
    import `store` only.
  * `records`: the zoo layout on top of a store (``models/<id>/weights.safetensors``,
    ``graph.json``, ``meta.json``). The `ZooRecord` metadata type and its checked JSON form
    live in `metajson`, re-exported by `records`.
  * `index`: `ZooIndex`, parent search over all records (exhaustive below 1,000 compatible
    models, k-medoids clusters above), with `indextypes` (its settings and results,
    re-exported by `index`), `prepared` (records' graphs as arrays, fingerprints),
    `scorecache` (one query's scoring through the LRU score cache), `scoring` (process-pool
    scoring with a deadline) and `cluster` (CLARA-style k-medoids and the clustered search).

Callers: the trainer registers finished models and loads warm-start parents; the operator and
the local runner list records to pick parents; the CLI shows them.

This package imports nothing here on purpose, so ``kiln.zoo.store`` stays free of torch.
"""
