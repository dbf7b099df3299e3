"""A fast GGUF header parser over a memory map.

gguf.GGUFReader builds a numpy view per element of every array, which costs ~10-15 s on a
262K-token vocabulary at every start. Here the header is walked once with struct, string arrays are
decoded in one pass and numeric arrays become single numpy views: the demo model's header parses in
well under a second. Tensor data stays in the memory map; `tensor_data` returns the raw bytes view
that `engine.quants` dequantizes.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<base>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf spec): id -> struct format for scalars
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF we can read; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy/torch order (slowest first), the reverse of ggml's ne
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in its file
    nbytes: int
    part: int = 0  # which file of a split GGUF holds it


def split_parts(model: Path) -> list[Path]:
    """All files of a split GGUF (`-00001-of-00003.gguf` ...), or just the file itself."""
    match = _SPLIT.match(model.name)
    if not match:
        return [model]
    count = int(match["n"])
    return [model.with_name(f"{match['base']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """Header, metadata and tensor table of a GGUF model, with its data memory-mapped. A split model
    (`-00001-of-0000N.gguf`) is opened from any of its parts: metadata from the first, tensors from all."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        parts = split_parts(self.path)
        self._open(parts[0])
        self._bufs = [self._buf]
        for i, part in enumerate(parts[1:], start=1):
            other = GGUFFile.__new__(GGUFFile)
            other._open(part)
            self._bufs.append(other._buf)
            for name, info in other.tensors.items():
                self.tensors[name] = TensorInfo(name, info.shape, info.qtype, info.offset, info.nbytes, part=i)
        self.parts = parts

    def _open(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{path}: cannot open: {exc}") from exc
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{path}: truncated or corrupt GGUF header ({exc})") from exc

    # -- parsing -------------------------------------------------------------------------------

    def _read(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._buf):
            raise GGUFError(f"{self.path}: truncated GGUF header at byte {self._pos}")
        value = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return value[0] if len(value) == 1 else value

    def _string(self) -> str:
        n = self._read("<Q")
        raw = bytes(self._buf[self._pos : self._pos + n])
        if len(raw) != n:
            raise GGUFError(f"{self.path}: truncated string at byte {self._pos}")
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """A string array in one tight loop: a vocabulary is ~260K of them, read at every start."""
        buf, pos, end, out = self._buf, self._pos, len(self._buf), []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"{self.path}: truncated string array at byte {pos}")
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > end:
                raise GGUFError(f"{self.path}: truncated string at byte {pos}")
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._read("<IQ")
            if etype == _STRING:
                return self._strings(count)
            if etype in _NUMPY:
                arr = np.frombuffer(self._buf, dtype=_NUMPY[etype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr
            return [self._value(etype) for _ in range(count)]
        if vtype in _SCALAR:
            return self._read("<" + _SCALAR[vtype])
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_kv = self._read("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            ne = [self._read("<Q") for _ in range(n_dims)]
            raw_type, rel = self._read("<IQ")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type {raw_type}") from None
            infos.append((name, ne, qtype, rel))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, qtype, rel in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_el = int(np.prod(ne)) if ne else 1
            nbytes = n_el // block * type_size
            offset = data_start + rel
            if offset + nbytes > len(self._buf):
                raise GGUFError(f"{self.path}: truncated: tensor {name} ends past the end of the file")
            self.tensors[name] = TensorInfo(name, tuple(reversed(ne)), qtype, offset, nbytes)

    # -- access ---------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """`{arch}.{suffix}`, e.g. arch_key("block_count")."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor's bytes as uint8 rows, `[..., row_bytes]` (a read-only view of the map)."""
        info = self.tensors[name]
        raw = np.frombuffer(self._bufs[info.part], dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return raw.reshape(*info.shape[:-1], info.nbytes // rows)

    def tensor_data(self, name: str) -> np.ndarray:
        """A tensor's data: its float dtype (F32, F16) shaped like torch, else `tensor_bytes`."""
        info = self.tensors[name]
        if info.qtype == GGMLQuantizationType.F32:
            return self.tensor_bytes(name).view(np.float32).reshape(info.shape)
        if info.qtype == GGMLQuantizationType.F16:
            return self.tensor_bytes(name).view(np.float16).reshape(info.shape)
        return self.tensor_bytes(name)
