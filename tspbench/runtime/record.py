"""Run records: provenance (hardware, versions, commit, time) and atomic JSON writes."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def git_commit() -> str | None:
    """The commit of the tspbench checkout that produced a number (None outside a checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def versions(backend: str | None) -> dict[str, Any]:
    try:
        import flash_attn

        fa = flash_attn.__version__
    except ImportError:
        fa = None
    nccl = None
    if backend == "nccl" and torch.cuda.is_available():
        try:  # RCCL on ROCm reports through the same call
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flash_attn": fa,
        "backend": backend,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "nccl": nccl,
    }


def hardware(device: torch.device, world_size: int) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return {
        "device_type": device.type,
        "device_name": name,
        "device_count": world_size,
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
    }


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` so that ``path`` is either absent/old or complete, never partial, with the
    permissions an ordinary write would give (mkstemp's 0600 would hide results from a group on
    a shared file system)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Strict JSON: NaN or infinity is a bug upstream, never written (strict parsers reject it)."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


def record_written(path: str | os.PathLike, record: dict, who: str) -> bool:
    """Write a run's record; if the file system refuses it (full, gone read-only), say so in
    one line with the status it would have had, and return False (the caller exits 1): the
    record is made in memory first, so nothing half-written is left."""
    try:
        write_json(path, record)
        return True
    except OSError as e:
        print(
            f"tspbench: error: {who}: cannot write the record {str(path)!r} ({e.strerror}); "
            f"its status was {record.get('status')}",
            file=sys.stderr,
            flush=True,
        )
        return False


def interrupted_path(out: str) -> str:
    """Where a pipeline cell's record goes when a signal interrupts it: beside ``out``, so that
    no record at ``out`` looks final and the next run of the pipeline redoes the cell."""
    return str(Path(out).with_suffix(".interrupted.json"))


def check_out(path: str, cell: bool = False) -> None:
    """Refuse a record path before anything runs (:func:`probe_file`; for a pipeline ``cell``
    the interrupted record's name is probed too): ConfigError naming ``--out``."""
    from tspbench.core.config import ConfigError

    extra = [Path(interrupted_path(path)).name] if cell else []
    try:
        probe_file(path, ".json", extra)
    except ConfigError as e:
        raise ConfigError(f"--out={e}") from None


def probe_file(path: str, suffix: str | None = None, also: list[str] | None = None) -> None:
    """Refuse an output file that cannot be written, before anything runs: the suffix, an
    existing directory there, a parent that is a file, and a probe write, in its directory, of
    the files :func:`write_atomic` will create (the longest names: its temporary file, and
    ``also``), so permissions, name length and read-only or full file systems fail now and not
    after the work. ConfigError: ``'path': why``."""
    from tspbench.core.config import ConfigError

    if suffix and not path.endswith(suffix):
        raise ConfigError(f"{path!r}: must name a {suffix} file")
    target = Path(path)
    try:
        if target.is_dir():
            raise ConfigError(f"{path!r}: is a directory")
        parent = target.resolve().parent
        _no_file_above(path, parent)
        _probe_write(parent, [target.name, *(also or [])])
    except OSError as e:
        raise ConfigError(f"{path!r}: cannot write there ({e.strerror})") from None


def probe_dir(path: str) -> None:
    """Refuse an output folder that cannot take files, before anything runs: a file there or
    above it, and a probe write inside it (made if missing). ConfigError: ``'path': why``."""
    from tspbench.core.config import ConfigError

    target = Path(path)
    try:
        if target.exists() and not target.is_dir():
            raise ConfigError(f"{path!r}: is a file, not a folder")
        _no_file_above(path, target.resolve())
        _probe_write(target.resolve(), ["tspbench-probe"])
    except OSError as e:
        raise ConfigError(f"{path!r}: cannot write there ({e.strerror})") from None


def _probe_write(folder: Path, names: list[str]) -> None:
    """Create and remove a file for each name in ``folder``, and remove the folders made for it:
    a refusal later (another argument, a failed check) leaves nothing behind."""
    made = [up for up in (folder, *folder.parents) if not up.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for name in names:
            fd, probe = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
            os.close(fd)
            os.unlink(probe)
    finally:
        for up in made:  # deepest first
            try:
                up.rmdir()
            except OSError:
                pass  # something else put a file there meanwhile: keep it


def _no_file_above(path: str, where: Path) -> None:
    from tspbench.core.config import ConfigError

    for up in (where, *where.parents):
        if up.exists():
            if not up.is_dir():
                raise ConfigError(f"{path!r}: {up} is not a directory")
            return


def check_record(path: str) -> dict[str, Any]:
    """The record at ``path`` if it is valid against its schema (ConfigError naming where not)."""
    import jsonschema

    from tspbench.core.config import ConfigError, read_input
    from tspbench.runtime.registry import schema

    text = read_input(path, "record", max_bytes=2**24)  # a FIFO, a device, a binary file

    def refuse(constant: str) -> None:
        raise ValueError(f"non-finite number {constant}")

    try:
        rec = json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"record {path!r}: not readable JSON ({e})") from None
    try:
        jsonschema.validate(rec, schema("record.schema.json"))
    except jsonschema.ValidationError as e:
        where = ".".join(map(str, e.absolute_path)) or "(top level)"
        raise ConfigError(f"record {path!r}: {where}: {e.message}") from None
    return rec
