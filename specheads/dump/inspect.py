"""``inspect_store``: manifest summary plus a check of every shard (sha256, shapes, row offsets).

Used by ``specheads dump --inspect DIR``; also ``python -m specheads.dump.inspect DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specheads.dump.store import (
    MANIFEST,
    PROGRESS_DIR,
    ShardArrays,
    file_sha256,
    read_manifest,
    shard_problems,
)
from specheads.errors import DumpError


def inspect_store(root, *, check_sha: bool = True) -> dict:
    """A report dict: ``ok``, ``manifest`` summary, per-shard checks, stray files."""
    root = Path(root)
    m = read_manifest(root)
    if m is None:
        raise DumpError(f"no dump at {root} (manifest.json missing)")
    report: dict = {
        "dir": str(root),
        "complete": bool(m.get("complete")),
        "format_version": m.get("format_version"),
        "target": m["target"],
        "aux_layer_ids": m["aux_layer_ids"],
        "dtype": m["dtype"],
        "max_length": m.get("max_length"),
        "shard_tokens": m.get("shard_tokens"),
        "counts": m.get("counts", {}),
        "shards": [],
        "problems": [],
    }
    if not report["complete"]:
        report["problems"].append("dump incomplete: rerun the same `specheads dump` command to finish it")
    for rec in m.get("shards", []):
        path = root / rec["file"]
        entry = {"file": rec["file"], "rows": rec["rows"], "tokens": rec["tokens"], "bytes": rec["bytes"],
                 "problems": []}
        if not path.is_file():
            entry["problems"].append("missing")
        else:
            size = path.stat().st_size
            if size != rec["bytes"]:
                entry["problems"].append(f"size {size} bytes, manifest says {rec['bytes']} (truncated or altered)")
            if check_sha:
                digest = file_sha256(path)
                if digest != rec["sha256"]:
                    entry["problems"].append(f"sha256 mismatch ({digest[:12]}… vs manifest {rec['sha256'][:12]}…)")
            try:
                entry["problems"] += shard_problems(ShardArrays(path), rec, m)
            except DumpError as e:
                entry["problems"].append(str(e))
        entry["ok"] = not entry["problems"]
        report["shards"].append(entry)
        report["problems"] += [f"{rec['file']}: {p}" for p in entry["problems"]]
    recs = m.get("shards", [])
    expect = 0
    for rec in recs:
        if rec["row_start"] != expect:
            report["problems"].append(f"{rec['file']}: row range starts at {rec['row_start']}, expected {expect}")
        expect = rec["row_end"]
    if m.get("complete") and expect != report["counts"].get("rows"):
        report["problems"].append(f"shards cover {expect} rows, the manifest counts {report['counts'].get('rows')}")
    listed = {r["file"] for r in recs} | {MANIFEST}
    stray = sorted(p.name for p in root.iterdir() if p.name not in listed and p.name != PROGRESS_DIR)
    report["stray_files"] = stray
    report["ok"] = not report["problems"]
    return report


def format_report(r: dict) -> str:
    t = r["target"]
    c = r["counts"]
    lines = [
        f"dump {r['dir']}  ({'complete' if r['complete'] else 'INCOMPLETE'}, format v{r['format_version']})",
        f"  target      {t.get('name')}  config_hash {t.get('config_hash')}  {t.get('model_type')}  "
        f"L={t.get('num_layers')} H={t.get('hidden_size')} V={t.get('vocab_size')}",
        f"  aux layers  {r['aux_layer_ids']} (HF hidden-state index)   dtype {r['dtype']}   max_length {r['max_length']}",
        f"  counts      {c.get('rows', '?')} rows, {c.get('tokens', '?')} tokens, {c.get('masked_tokens', '?')} "
        f"masked, {c.get('shards', '?')} shards, {c.get('bytes', 0) / 1e6:.1f} MB",
        "",
        "  | shard | rows | tokens | MB | check |",
        "  |---|---:|---:|---:|---|",
    ]
    for s in r["shards"]:
        lines.append(f"  | {s['file']} | {s['rows']} | {s['tokens']} | {s['bytes'] / 1e6:.2f} | "
                     f"{'ok' if s['ok'] else '; '.join(s['problems'])} |")
    if r["stray_files"]:
        lines.append(f"  stray files: {', '.join(r['stray_files'])}")
    lines.append("")
    lines.append("OK" if r["ok"] else "PROBLEMS:\n" + "\n".join(f"  - {p}" for p in r["problems"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specheads.dump.inspect")
    ap.add_argument("dir")
    ap.add_argument("--no-sha", action="store_true", help="skip the sha256 check (faster)")
    a = ap.parse_args(argv)
    try:
        r = inspect_store(a.dir, check_sha=not a.no_sha)
    except DumpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(r))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
