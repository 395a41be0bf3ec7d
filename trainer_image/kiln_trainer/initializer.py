"""``python -m kiln_trainer.initializer``: download a job's sources before its trainer starts.

Reads the job as the trainer does (``--job`` or ``KILN_JOB``), makes each s3:// or hf:// source
local (`kiln.zoo.sources.fetch`, into ``$KILN_DATA_CACHE``) and writes the manifest
``$KILN_SOURCES`` the trainer reads. A pod's init container; `kiln run` runs it first too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln import api, contract
from kiln.zoo import sources
from kiln.zoo import store as zoo_store
from kiln_trainer import events, runtime

_log = logging.getLogger("kiln_trainer.initializer")


def initialize(job: api.TrainingJob, environ: Mapping[str, str]) -> sources.Manifest:
    """Fetch every source of `job` (`sources.job_sources`) and write the manifest.

    Raises:
        sources.SourceError: a source cannot be made local, or ``$KILN_SOURCES`` is unset.
        zoo_store.StoreUnavailable: an S3 server did not answer.
    """
    manifest = environ.get(contract.Env.SOURCES)
    if not manifest:
        raise sources.SourceError(f"{contract.Env.SOURCES} is not set; the initializer writes "
                                  "its manifest there")
    fetched = []
    for field, uri, secret in sources.job_sources(job.spec):
        got = sources.fetch(uri, field=field, secret=secret, environ=environ,
                            cache=sources.cache_root(environ))
        _log.info("%s.uri %s: %s %s", field, uri,
                  "downloaded to" if got.downloaded else "found in the cache at", got.path)
        fetched.append(got)
    result = sources.Manifest(tuple(fetched))
    result.write(Path(manifest))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run `initialize`; returns the exit code (`kiln.contract`'s EXIT_*), a failure's message
    in the termination log as the trainer writes it."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    emit = events.EventWriter(sys.stdout, termination_log=events.TERMINATION_LOG)
    try:
        args = contract.parse_trainer_args(argv, os.environ)
        initialize(runtime.load_job(args.job_file, os.environ.get(contract.Env.JOB)),
                   os.environ)
    except (api.InvalidSpec, sources.SourceError, zoo_store.StoreMisconfigured) as exc:
        return _fail(emit, str(exc), contract.EXIT_INVALID)
    except zoo_store.StoreUnavailable as exc:
        return _fail(emit, f"store unavailable: {exc}", contract.EXIT_STORE_UNAVAILABLE)
    return contract.EXIT_OK


def _fail(emit: events.EventWriter, message: str, code: int) -> int:
    print(f"kiln_trainer.initializer: error: {message}", file=sys.stderr)
    emit.failure(message)
    return code


if __name__ == "__main__":
    sys.exit(main())
