"""Layer freezing in the trainer (Egeria, EuroSys'23; DESIGN.md section 5).

Modules:
    partition: the model's natural blocks, their parameters and FLOPs, the block-output
        extractor, and the prefix/suffix split at a boundary (torch.fx).
    plasticity: the SP loss, EMA smoothing and the windowed convergence detector.
    reference: the quantized reference model in its own CPU process.
    cache: the fp16 frozen-prefix output cache (RAM, or a memory-mapped file) and prefetcher.
    controller: `Freezer`, the policy that ties them together around any training loop.

Callers: `kiln_trainer.loop`; users' own loops (README, "Use freezing in your own loop").
"""
