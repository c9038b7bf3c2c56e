"""A .zst file's decompressed bytes that keeps every readable byte before damage."""

from __future__ import annotations

import io

import pyarrow as pa


class ZstdRaw(io.RawIOBase):
    """The decompressed bytes of a .zst file, by pyarrow's zstd codec (pyarrow is a dependency; the
    `zstandard` package that fsspec would need is not).

    pyarrow drops what it decoded in a read that then hits damage. So after an error the file is read
    again up to where the last good read ended, then one byte at a time: every readable byte comes out
    before the error is raised.
    """

    def __init__(self, opener):
        self._opener = opener  # () -> binary file of the compressed bytes
        self._raw = opener()
        self._stream = self._decompressor(self._raw)
        self._pos = 0  # decompressed bytes delivered
        self._tail: bytes | None = None  # recovered after damage
        self._error: OSError | None = None

    @staticmethod
    def _decompressor(raw):
        return pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self._tail is None:
            try:
                data = self._stream.read(len(buf))
            except OSError as err:
                self._tail, self._error = self._readable_tail(), err
        if self._tail is not None:
            if not self._tail:
                raise self._error
            data, self._tail = self._tail[: len(buf)], self._tail[len(buf) :]
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def _readable_tail(self) -> bytes:
        """The bytes after those delivered that decode before the damage."""
        tail, done = bytearray(), 0
        with self._opener() as raw:
            stream = self._decompressor(raw)
            try:
                while done < self._pos:  # decoded before, so they decode again
                    chunk = stream.read(min(1 << 20, self._pos - done))
                    if not chunk:
                        break
                    done += len(chunk)
                while done == self._pos and (byte := stream.read(1)):
                    tail += byte
            except OSError:
                pass
        return bytes(tail) if done == self._pos else b""

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()
