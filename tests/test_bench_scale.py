"""bench/scale.py's records: deterministic, keys r000000000.., planted exact copies with
their original's very bytes, near copies within dedup's threshold of their original
(dHash computed here with numpy, not by the bench), and the +1 % file's copies naming
old records; plain records' dHashes are their designed BCH(63, 30) codewords (the code's
generator and distance checked here from its definition). No Spark: the nights are the
bench's own business."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scale_data  # noqa: E402


def _dhash(data: bytes) -> int:
    from PIL import Image

    g = np.asarray(Image.open(io.BytesIO(data)).convert("L").resize(
        (9, 8), Image.Resampling.BILINEAR, reducing_gap=2.0), dtype=np.int16)
    return int("".join("1" if b else "0" for b in (g[:, 1:] > g[:, :-1]).flatten()), 2)


def test_generated_files_plant_copies(tmp_path):
    written = scale_data.write_files(tmp_path / "a", 7, 0, 400, 150, 0, 0.1, workers=1)
    again = scale_data.write_files(tmp_path / "b", 7, 0, 400, 150, 0, 0.1, workers=2)
    assert [w["rows"] for w in written] == [150, 150, 100]
    rows = {}
    for w, w2 in zip(written, again, strict=True):
        table = pq.read_table(w["path"])
        assert table.equals(pq.read_table(w2["path"]))  # deterministic from the seed
        rows.update(zip(table["key"].to_pylist(), table["image"].to_pylist(), strict=True))
    assert sorted(rows) == [f"r{i:09d}" for i in range(400)]
    exact = [p for w in written for p in w["copies"]["exact"]]
    near = [p for w in written for p in w["copies"]["near"]]
    assert len(exact) > 10 and len(near) > 10
    copies = {c for c, _ in exact + near}
    for copy, original in exact:
        assert original < copy and original not in copies
        assert rows[f"r{copy:09d}"] == rows[f"r{original:09d}"]
    for copy, original in near:
        assert original < copy and original not in copies
        a, b = rows[f"r{copy:09d}"], rows[f"r{original:09d}"]
        assert a != b and (_dhash(a) ^ _dhash(b)).bit_count() <= 4
    plain = sorted(set(range(400)) - copies)
    hashes = np.array([_dhash(rows[f"r{i:09d}"]) for i in plain], dtype=np.uint64)
    nearest = min(int(np.bitwise_count(hashes[i + 1:] ^ h).min())
                  for i, h in enumerate(hashes[:-1]))
    assert nearest > 8  # no two plain records are near copies by accident
    more = scale_data.write_files(tmp_path / "a", 7, 400, 430, 30, 3, 0.25, old_below=400,
                                  old_rate=0.1, workers=1)
    added = more[0]["copies"]["exact"] + more[0]["copies"]["near"]
    assert Path(more[0]["path"]).name == "part-00003.parquet"
    assert added and all(o < 400 and o not in copies for _, o in added)


def _gf2_mod(a: int, m: int) -> int:
    while a.bit_length() >= m.bit_length():
        a ^= m << (a.bit_length() - m.bit_length())
    return a


def _gf2_clmul(a: int, b: int) -> int:
    out = 0
    while b:
        if b & 1:
            out ^= a
        a, b = a << 1, b >> 1
    return out


def _gf64_eval(poly: int, k: int) -> int:
    """The binary polynomial `poly` at a^k in GF(64) = GF(2)[x] / (x^6 + x + 1)."""
    a = _gf2_mod(1 << k, 0b1000011)
    x, acc = 1, 0
    for bit in range(poly.bit_length()):
        if poly >> bit & 1:
            acc ^= x
        x = _gf2_mod(_gf2_clmul(x, a), 0b1000011)
    return acc


def test_plain_records_carry_designed_codewords():
    g = scale_data._bch_generator()
    assert g.bit_length() - 1 == 33 and _gf2_mod(1 << 63 | 1, g) == 0  # g | x^63 + 1
    rng = np.random.default_rng(3)
    words = [scale_data.bch_codeword(int(m)) for m in rng.integers(1, 2**30, 3000)]
    # BCH with designed distance 13: a^1..a^12 are zeros of every codeword.
    assert all(_gf64_eval(w, k) == 0 for w in words[:20] for k in range(1, 13))
    assert min(w.bit_count() for w in words) >= 13  # the code's minimum distance
    designs = [scale_data.design_hash(5, i) for i in range(40)]
    assert min((a ^ b).bit_count() for k, a in enumerate(designs)
               for b in designs[k + 1:]) >= 13
    for i in range(8):
        data = scale_data.record_bytes(5, scale_data.Plan(i, "plain"))
        assert _dhash(data) == designs[i]
