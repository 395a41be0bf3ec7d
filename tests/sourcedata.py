"""Sources for the tests of `spec.model.pretrained.uri` and `spec.dataset.uri`: a tiny
pretrained language model as a Hugging Face directory with its tokenizer.json, and an S3
bucket (moto) holding it beside the test corpus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import minio
import safetensors.torch
import tokenizers
from tokenizers import models as tokenizer_models
from tokenizers import pre_tokenizers, trainers

from kiln import api, models

CORPUS = Path(__file__).resolve().parent / "data" / "corpus"
MODEL = {"architecture": "char_transformer", "inputShape": [8],
         "args": {"depth": 1, "width": 16, "heads": 2}}


def pretrained(folder: Path) -> Path:
    """MODEL's weights as a Hugging Face-format directory (config.json, model.safetensors),
    with a word-level tokenizer.json trained on the corpus (fewer tokens than its 256
    outputs)."""
    folder.mkdir(parents=True)
    model = models.build(api.ModelSpec.model_validate(MODEL))
    safetensors.torch.save_model(model, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "char_transformer"}))
    tokenizer = tokenizers.Tokenizer(tokenizer_models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(p) for p in sorted(CORPUS.glob("*.txt"))],
                    trainers.WordLevelTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def upload_sources(s3: Any, bucket: str, scratch: Path) -> minio.Minio:
    """`pretrained` at ``s3://bucket/models/lm`` and the corpus at ``s3://bucket/corpus``."""
    client = minio.Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key,
                         secure=False)
    client.make_bucket(bucket)
    for prefix, folder in (("models/lm", pretrained(scratch / "lm")), ("corpus", CORPUS)):
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.fput_object(bucket, f"{prefix}/{file.relative_to(folder).as_posix()}",
                               str(file))
    return client


def secret_data(s3: Any) -> dict[str, str]:
    """The keys of a secretRef's Secret for the S3 server `s3`."""
    return {"endpoint": s3.endpoint, "accessKey": s3.access_key, "secretKey": s3.secret_key}
