"""Minimal, stdlib-only reader of a GGUF file's token list, and a GPT-2
byte-level decoder for it. Used to turn golden token ids into text without
asking the server under test."""

from __future__ import annotations

import struct

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_tokens(path: str) -> list[str]:
    """Return `tokenizer.ggml.tokens` of the GGUF file at `path`."""
    with open(path, "rb") as f:

        def rd(fmt: str):
            fmt = "<" + fmt
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def rstr() -> str:
            return f.read(rd("Q")).decode("utf-8", "replace")

        def value(t: int):
            if t == 8:
                return rstr()
            if t == 9:
                et, n = rd("I"), rd("Q")
                return [value(et) for _ in range(n)]
            return rd(_SCALARS[t])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        rd("I")  # version
        rd("Q")  # tensor count
        for _ in range(rd("Q")):
            key, t = rstr(), rd("I")
            v = value(t)
            if key == "tokenizer.ggml.tokens":
                return v
    raise ValueError(f"{path}: no tokenizer.ggml.tokens")


def _byte_decoder() -> dict[str, int]:
    # The GPT-2 bytes_to_unicode table, inverted.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def decode(tokens: list[str], ids: list[int]) -> str:
    """Byte-level BPE decode of `ids` (strict UTF-8: the ids must end on a
    character boundary)."""
    data = bytearray()
    for i in ids:
        data.extend(_BYTE_DECODER[ch] for ch in tokens[i])
    return data.decode("utf-8")
