"""LoRA jobs through `kiln run` on the bundled digits: on a base model (trained by the trainer's
loop in this process), an adapter (only the adapter stored, naming its base), a second adapter
job continuing the first, and `kiln zoo export` merging an adapter into its base.

Subprocesses get OMP_NUM_THREADS=1: tiny models train fastest on one thread on 2 cores.
"""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import clirun
import pytest
import torch
import yaml
from safetensors.torch import load_file

from kiln import api, models
from kiln.models import lora
from kiln.zoo import records, store

MODEL: dict[str, Any] = {"architecture": "small_cnn", "args": {"depth": 2, "width": 32}, "inputShape": [1, 8, 8]}
PEFT: dict[str, Any] = {"method": "lora", "rank": 2, "alpha": 4.0, "targetModules": ["blocks.0.0", "head.2"]}


def _job(path: Path, name: str, **spec: Any) -> Path:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": {"model": MODEL, "training": {
               "epochs": 1, "batchSize": 64,
               "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}}, **spec}}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _lora_job(path: Path, name: str, parent: str) -> Path:
    job = _job(path, name, warmStart={"parent": parent})
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["training"]["peft"] = PEFT  # freezing stays at its default (on): LoRA turns it off
    job.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return job


def _run(job: Path, cwd: Path) -> clirun.Done:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("KILN_ZOO", None)
    done = clirun.kiln("run", str(job), "--zoo", "zoo", cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _by_job(zoo: store.ObjectStore) -> dict[str, records.ZooRecord]:
    return {r.job_name: r for r in records.list_records(zoo)}


def test_lora_adapter_registers_on_its_base_continues_and_exports_merged(tmp_path: Path) -> None:
    from kiln_trainer import loop

    zoo = store.DirStore(tmp_path / "zoo")
    base_job = _job(tmp_path / "base.yaml", "digits-base", freezing={"enabled": False})
    loop.main(api.parse_job(yaml.safe_load(base_job.read_text())), zoo_uri=str(zoo.root),
              checkpoint_dir=tmp_path / "checkpoints", out=io.StringIO(), termination_log=None)
    base = _by_job(zoo)["digits-base"]
    assert base.base is None and base.adapter is None

    first = _run(_lora_job(tmp_path / "lora.yaml", "digits-lora", base.id), tmp_path)
    adapter = _by_job(zoo)["digits-lora"]
    # lineage: the adapter names its base (the parent it started from) and its settings
    assert adapter.base == base.id and adapter.parent == base.id
    assert adapter.adapter == {**PEFT, "dropout": 0.0}
    assert "freezing off: a LoRA job trains only its adapter" in first.stdout + first.stderr
    assert adapter.validation_accuracy is not None and adapter.validation_accuracy > 0.5
    # only the adapter's tensors (and the batch-norm buffers) are stored, a fraction of the base
    stored = records.load_weights(zoo, adapter)
    base_weights = records.load_weights(zoo, base)
    buffers = {k for k in base_weights if k.endswith(("running_mean", "running_var",
                                                      "num_batches_tracked"))}
    assert {k for k in stored if "lora_" not in k} == buffers
    assert {k.rsplit(".", 2)[0] for k in stored if "lora_" in k} == set(PEFT["targetModules"])
    adapter_bytes = (zoo.root / "models" / adapter.id / "weights.safetensors").stat().st_size
    base_bytes = (zoo.root / "models" / base.id / "weights.safetensors").stat().st_size
    assert adapter_bytes * 5 < base_bytes
    assert adapter.num_params < base.num_params / 5
    meta = json.loads((zoo.root / "models" / adapter.id / "meta.json").read_text())
    assert meta["schema_version"] == records.SCHEMA_VERSION and meta["base"] == base.id

    # a second LoRA job continues that adapter on the same base
    second = _run(_lora_job(tmp_path / "lora2.yaml", "digits-lora2", adapter.id), tmp_path)
    again = _by_job(zoo)["digits-lora2"]
    assert again.base == base.id and again.parent == adapter.id
    assert f"continuing adapter {adapter.id}" in second.stdout + second.stderr

    # export merges the adapter into its base: a whole model that loads without peft
    out = tmp_path / "merged"
    exported = clirun.kiln("zoo", "export", adapter.id, "--out", str(out), "--zoo", "zoo",
                           cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    merged = load_file(str(out / "weights.safetensors"))
    assert set(merged) == set(base_weights)
    exported_meta = json.loads((out / "meta.json").read_text())
    assert "base" not in exported_meta or exported_meta["base"] is None
    assert base.id in exported_meta["source"] and adapter.id in exported_meta["source"]
    spec = api.ModelSpec.model_validate(MODEL)
    plain = models.build(spec)
    plain.load_state_dict(merged)
    with_adapter = models.build(spec)
    with_adapter.load_state_dict(base_weights)
    lora.attach(with_adapter, api.PeftSpec.model_validate(PEFT))
    lora.load_adapter(with_adapter, stored)
    inputs = torch.randn(16, 1, 8, 8)
    with torch.no_grad():
        expected = with_adapter.eval()(inputs)
        assert not torch.allclose(expected, models.build(spec).eval()(inputs))
        torch.testing.assert_close(plain.eval()(inputs), expected, rtol=1e-4, atol=1e-5)
    # ... and it imports into another zoo as a whole model, where jobs can warm-start from it
    imported = clirun.kiln("zoo", "import", str(out), "--zoo", "other", cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert records.verify_record(store.DirStore(tmp_path / "other"), adapter.id).base is None



def test_a_stopped_lora_job_resumes_its_adapter_from_the_checkpoint(tmp_path: Path) -> None:
    from kiln.warmstart import decision, graph
    from kiln_trainer import jobcontext, loop

    zoo = store.DirStore(tmp_path / "zoo")
    spec = api.ModelSpec.model_validate(MODEL)
    torch.manual_seed(0)
    base = records.write_record(zoo, records.ZooRecord(
        id=records.ZooModelId("small_cnn-0000000b"), architecture="small_cnn",
        args=MODEL["args"], input_shape=(1, 8, 8), modality="image", task="classification",
        dataset="digits", metric_name="validation_accuracy", metric_value=0.9, num_params=1,
        created_time="2026-11-30T00:00:00Z", job_name="base", job_spec={}),
        models.build(spec).state_dict(), graph.to_json(decision.model_graph(spec)))
    doc = yaml.safe_load(_lora_job(tmp_path / "lora.yaml", "digits-lora", base.id).read_text())
    doc["spec"]["freezing"] = {"enabled": False}
    job = api.parse_job(doc)
    stop = threading.Event()
    stop.set()  # stops after the first step, with a checkpoint
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(jobcontext.Interrupted):
        loop.main(job, zoo_uri=str(zoo.root), checkpoint_dir=checkpoints, stop=stop,
                  out=io.StringIO(), termination_log=None)
    out = io.StringIO()
    result = loop.main(job, zoo_uri=str(zoo.root), checkpoint_dir=checkpoints, out=out,
                       termination_log=None)
    assert "resumed from" in out.getvalue() and result["resumed_from_epoch"] == 0
    adapter = records.read_record(zoo, result["zoo_model"])
    assert adapter.base == base.id and adapter.parent == base.id
    assert all("lora_" in k or "running" in k or "num_batches" in k
               for k in records.load_weights(zoo, adapter))
