"""Read an MDS export back through ``streaming.StreamingDataset``, as training does, in a
spawned child process.

``StreamingDataset`` keeps the shared memory of every instance (and of every earlier
instance it probed for a free name) open until its process exits, so a test session that
read exports in-process would run out of file descriptors. The child returns the samples
and ends; images come back as the exact bytes the dataset decoded, reopened with Pillow
(``format`` is ``"JPEG"`` for a JPEG column, as it is in the child).
"""

from __future__ import annotations

import io
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

_IMAGE = "__mds_read_image__"


def _encode(value):
    from PIL import Image

    if isinstance(value, Image.Image):
        fp = getattr(value, "fp", None)
        if isinstance(fp, io.BytesIO):
            return (_IMAGE, fp.getvalue())
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return (_IMAGE, buf.getvalue())
    return value


def _decode(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _IMAGE:
        from PIL import Image

        return Image.open(io.BytesIO(value[1]))
    return value


def _read(local, remote, split, env):
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    os.environ.update(env)
    clean_stale_shared_memory()
    ds = StreamingDataset(local=local, remote=remote, split=split, shuffle=False, batch_size=1)
    return [{k: _encode(v) for k, v in ds[i].items()} for i in range(len(ds))]


def read_mds(local: str, *, split: str | None = None, remote: str | None = None,
             env: dict[str, str] | None = None) -> list[dict]:
    """Every sample of the export at `local` (or streamed from `remote` into `local`), in
    order; `env` is added to the child's environment (S3 endpoint and credentials)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        samples = pool.submit(_read, str(local), remote, split, dict(env or {})).result()
    return [{k: _decode(v) for k, v in s.items()} for s in samples]
