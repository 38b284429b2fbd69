"""Just enough PNG decoding to look at a screenshot's pixels (8-bit RGB or RGBA, not interlaced)."""

import struct
import zlib

import numpy as np


def pixels(path):
    """The image as a (height, width, 3) uint8 array."""
    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, idat, width = 8, b"", 0
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset : offset + 4]), data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    raw, stride = zlib.decompress(idat), width * channels
    image = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], np.frombuffer(raw, np.uint8, stride, start + 1).copy()
        if kind == 1:  # sub: a running sum per channel
            line = np.cumsum(line.reshape(width, channels), axis=0, dtype=np.uint64).astype(np.uint8).reshape(-1)
        elif kind == 2:  # up
            line = line + previous
        elif kind in (3, 4):  # average, paeth: sequential
            out = bytearray(line.tobytes())
            for i in range(stride):
                left = out[i - channels] if i >= channels else 0
                up, corner = int(previous[i]), int(previous[i - channels]) if i >= channels else 0
                if kind == 3:
                    out[i] = (out[i] + (left + up) // 2) & 255
                else:
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    out[i] = (out[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
            line = np.frombuffer(bytes(out), np.uint8)
        image[y] = line
        previous = line
    return image.reshape(height, width, channels)[:, :, :3]
