"""The ``roxxel pack --map`` function of the example: text -> byte-level token ids.

Byte-level tokens need no vocabulary file and no download: a document's token ids are its
UTF-8 bytes (0..255), followed by 0 as an end-of-document marker (NUL never occurs in text).
"""

from __future__ import annotations

from typing import Any

import numpy as np

END_OF_DOCUMENT = 0


def to_tokens(record: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """``{"text": str}`` -> ``{"tokens": uint8 array}``; None drops an empty document.

    >>> to_tokens({"text": "hi"})["tokens"].tolist()
    [104, 105, 0]
    """
    data = record["text"].encode("utf-8")
    if not data:
        return None
    tokens = np.frombuffer(data + bytes([END_OF_DOCUMENT]), dtype=np.uint8)
    return {"tokens": tokens}
