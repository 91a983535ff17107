"""Reading the text table nccl-tests prints into a profile's collective table.

nccl-tests (github.com/NVIDIA/nccl-tests, ``src/common.cu``) prints one line per size::

    #       size         count      type   redop    root     time   algbw   busbw #wrong ...
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)
         1048576        262144     float     sum      -1    36.52   28.71   50.25      0 ...

(older versions print no ``redop`` / ``root`` columns for all_gather; the out-of-place
``time algbw busbw`` come first, then the in-place ones). Comment lines start with ``#``.
This reader takes the out-of-place columns of every data line: ``size`` (B), ``time``
(µs), ``algbw`` and ``busbw`` (GB/s), the units of :mod:`pipeline.costmodel.profile`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parse_nccl_tests"]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_nccl_tests(text: str, source: str = "input") -> list[dict[str, Any]]:
    """The rows ``{size, time_us, algbw, busbw}`` of an nccl-tests output, in file order.

    Raises:
        ValueError: one line naming the line that is neither a comment nor a data line,
            or an output with no data line.
    """
    rows = []
    for no, line in enumerate(text.splitlines(), 1):
        tokens = line.split()
        if not tokens or tokens[0].startswith("#"):
            continue
        size, count = _number(tokens[0]), _number(tokens[1]) if len(tokens) > 1 else None
        if size is None or count is None or len(tokens) < 6:
            raise ValueError(f"{source}:{no}: {line.strip()!r} is not an nccl-tests data line "
                             "(size count type [redop root] time algbw busbw ...)")
        rest = tokens[3:]
        if _number(rest[0]) is None:  # redop
            rest = rest[1:]
        nums = [_number(t) for t in rest]
        # the values after the type come in groups of 4 (time algbw busbw #wrong,
        # out-of-place then in-place); one more in front is the root column
        if len(rest) % 4 == 1:
            rest, nums = rest[1:], nums[1:]
        if len(nums) < 3 or any(v is None for v in nums[:3]):
            raise ValueError(f"{source}:{no}: {line.strip()!r}: expected time algbw busbw "
                             "after the type")
        rows.append({"size": int(size), "time_us": float(nums[0]), "algbw": float(nums[1]),
                     "busbw": float(nums[2])})
    if not rows:
        raise ValueError(f"{source}: no nccl-tests data line")
    return rows
