"""A minimal RGB canvas and PNG writer, so the loss curve exists even where
matplotlib is not installed. Lines, filled rectangles and a 3x5 pixel font for
digits and a few letters -- enough for axes labels."""

from __future__ import annotations

import struct
import zlib

Color = tuple[int, int, int]

# 3x5 glyphs, one string of 15 bits per character (rows top to bottom).
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "e": "000111111100111", "l": "110010010010111", "o": "000111101101111", "s": "000111110011111",
    "t": "010111010010011", "p": "000111101111100", "v": "000101101101010", "a": "000011101101111",
    "r": "000111100100100", "i": "010000010010010", "n": "000111101101101", " ": "000000000000000",
    "f": "011010111010010", "g": "000111101111001", "d": "001111101101111", "+": "000010111010000",
    "w": "000101101111101",
}


class Canvas:
    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def pixel(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x:3 * x + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.rows[y][3 * x:3 * x + 3] = bytes(color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, thick: int = 1) -> None:
        """Sampled at every pixel step along the longer axis (no gaps)."""
        steps = max(1, int(max(abs(x1 - x0), abs(y1 - y0))))
        for i in range(steps + 1):
            x = round(x0 + (x1 - x0) * i / steps)
            y = round(y0 + (y1 - y0) * i / steps)
            self.rect(x - thick // 2, y - thick // 2, x + (thick - 1) // 2, y + (thick - 1) // 2, color)

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 2) -> None:
        """Left-top anchored; characters without a glyph are skipped as spaces."""
        for char in text:
            bits = _GLYPHS.get(char, _GLYPHS[" "])
            for index, bit in enumerate(bits):
                if bit == "1":
                    gx, gy = index % 3, index // 3
                    self.rect(x + gx * scale, y + gy * scale, x + gx * scale + scale - 1,
                              y + gy * scale + scale - 1, color)
            x += 4 * scale

    @staticmethod
    def text_width(text: str, scale: int = 2) -> int:
        return len(text) * 4 * scale - scale

    def png_bytes(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)  # filter type 0 on every row
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9))
                + _chunk(b"IEND", b""))


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
