"""Build a small lakeshard root with the code of commit e8761af (main before the
architecture refactor): curate + dedup over an image folder of 4 photos."""
import os
import sys
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

out = Path(sys.argv[1]).resolve()
src = out / "source"
src.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)
base = (rng.random((80, 96, 3)) * 255).astype("uint8")
Image.fromarray(base).save(src / "a.png")
Image.fromarray(base).save(src / "b.png")                    # exact duplicate of a
grad = np.tile(np.linspace(0, 255, 96, dtype="uint8"), (80, 1))
Image.fromarray(np.stack([grad, grad[::-1], grad], -1)).save(src / "c.png")
Image.fromarray(base[:40, :40]).save(src / "d.png")           # 40x40: flagged too_small
(src / "a.txt").write_text("random noise, first copy")
(src / "c.txt").write_text("a colour gradient")
t = 1_700_000_000
for i, p in enumerate(sorted(src.iterdir())):
    os.utime(p, (t + i, t + i))
cfg = {
    "storage": {"root": str(out / "root")},
    "spark": {"master": "local[2]", "jars_dir": "/work/main/.jars",
              "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}},
    "sources": [{"name": "photos", "kind": "image_folder", "path": str(src)}],
    "run": {"stages": ["curate", "dedup"], "report": False, "lock": True},
}

(out / "lakeshard.yaml").write_text(yaml.safe_dump(cfg))
