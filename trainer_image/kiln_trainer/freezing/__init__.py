"""Layer freezing in the trainer (Egeria, EuroSys'23; DESIGN.md section 5).

Modules:
    partition: the model's natural blocks, their parameters and FLOPs, the block-output
        extractor, and the prefix/suffix split at a boundary. Built on `splitting` (torch.fx
        tracing with blocks as leaves, checks, parameter ownership, the cut) and `flops`
        (forward/backward FLOPs per block); `partition` re-exports `Split`, `Unpartitionable`.
    plasticity: the SP loss, EMA smoothing and the windowed convergence detector.
    convergence: per-block convergence across reference cycles (slope and peak tests).
    settings: the policy's knobs resolved from a job, and the fixed probe batch.
    quantization: the int8 (static or dynamic, else fp32) copy of a block extractor.
    reference: the reference model in its own CPU process, quantized with `quantization`.
    cache: the fp16 frozen-prefix output cache (RAM, or a memory-mapped file) and prefetcher.
    controller: `Freezer`, the policy that ties them together around any training loop.

Callers: `kiln_trainer.loop` (through `kiln_trainer.freezing.setup`); users' own loops (README,
"Layer freezing", "In your own loop").
"""
