"""AG News as Zhang, Zhao & LeCun (2015) feed it to their character CNN.

The file: CSV, fields `label,title,description`, labels 1..4 (World, Sports, Business,
Sci/Tech). The copy in shared/data has a header row; the authors' own `train.csv`/`test.csv`
have none, so both are accepted (a first row whose first field is a label is data).

The encoding (paper, section 2.2, and the authors' Torch code, "Crepe"):
- text = title + " " + description, kept verbatim. The file marks line breaks with a single
  backslash ("a second\\team"); it stays a backslash, which is in the alphabet. Crepe turned the
  two characters `\\n` into a newline, but in this data that mangles words ("\\network"), so
  we do not.
- ASCII upper case counts as lower case; every character outside the alphabet (space included,
  and all non-ASCII) becomes index PAD = 70, an all-zero column after one-hot.
- Backwards: position j holds character len-1-j, so the end of the text sits at the start of
  the input. Crepe keeps the *last* `length` characters when a text is longer (it walks from
  the end); we do the same. Shorter texts are padded with PAD at the end.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from scalelab.errors import UsageError

# The paper's alphabet, verbatim: 26 letters, 10 digits, 33 "other characters" and the newline,
# 70 entries. The paper's list holds '-' twice (index 36 and 59); as in Crepe, whose dictionary
# is filled in order so the later entry wins, '-' encodes as 59 and channel 36 is never set.
# We keep the duplicate so the input has the paper's 70 channels at the paper's positions.
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-,;.!?:'\"/\\|_@#$%^&*~`+-=<>()[]{}\n"
assert len(ALPHABET) == 70
PAD = len(ALPHABET)  # 70: not in the alphabet, or padding -> all-zero column
LENGTH = 1014  # the paper's input length l0
LABELS = ("1", "2", "3", "4")
HEADER = ["label", "title", "description"]


def _lookup_table() -> np.ndarray:
    """Code point (0..127) -> alphabet index; PAD for the rest. Upper case maps as lower."""
    table = np.full(128, PAD, dtype=np.uint8)
    for index, char in enumerate(ALPHABET):  # later duplicates overwrite, as in Crepe
        table[ord(char)] = index
        table[ord(char.upper())] = index
    return table


_TABLE = _lookup_table()


def quantize(texts: list[str], length: int = LENGTH) -> np.ndarray:
    """Texts -> (N, length) uint8 alphabet indices, backwards, padded with PAD (see module doc)."""
    out = np.full((len(texts), length), PAD, dtype=np.uint8)
    for row, text in enumerate(texts):
        tail = text[-length:] if length else ""  # the last `length` characters, as Crepe
        codes = np.frombuffer(tail.encode("utf-32-le"), dtype="<u4")[::-1]
        known = codes < 128
        out[row, : len(codes)] = np.where(known, _TABLE[np.where(known, codes, 0)], PAD)
    return out


def read_agnews(path: str | Path) -> tuple[list[str], np.ndarray]:
    """(texts, labels) from an AG News CSV: texts title + " " + description, labels 0..3."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file (AG News CSV with fields {','.join(HEADER)})")
    texts: list[str] = []
    labels: list[int] = []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            first = True
            for row in reader:
                if not row:  # a blank line, e.g. at the end of the file
                    continue
                if first and row[0].strip() not in LABELS:
                    _check_header(path, reader.line_num, row)
                    first = False
                    continue
                first = False
                label, text = _parse_row(path, reader.line_num, row)
                labels.append(label)
                texts.append(text)
    except (csv.Error, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: not a readable UTF-8 CSV file ({err})") from None
    if not texts:
        raise UsageError(f"{path}: no data rows")
    return texts, np.array(labels, dtype=np.int64)


def _check_header(path: Path, line: int, row: list[str]) -> None:
    if [field.strip().lower() for field in row] != HEADER:
        raise UsageError(
            f"{path}, line {line}: neither the header {','.join(HEADER)} nor a row with label 1..4"
        )


def _parse_row(path: Path, line: int, row: list[str]) -> tuple[int, str]:
    """(label 0..3, text); line is where the record ends (a quoted field may span lines)."""
    if len(row) != 3:
        raise UsageError(
            f"{path}, line {line}: expected 3 fields ({','.join(HEADER)}), got {len(row)}"
        )
    label = row[0].strip()
    if label not in LABELS:
        raise UsageError(f"{path}, line {line}: label {row[0]!r} is not one of 1, 2, 3, 4")
    return int(label) - 1, f"{row[1]} {row[2]}"
