"""``python -m grader update --from DIR``: bring a newer edition into this copy of the workbook.

Files the learner did not change are replaced; files they changed stay, and the new version goes
beside them as ``<name>.new`` (grader/publishing/edition.py writes them).
"""

from __future__ import annotations

import sys
from pathlib import Path

from grader.publishing import edition
from kernels.loader import ROOT


def main(*, source: str) -> int:
    """Take the edition in the folder ``source`` into this copy; 2 when either is not an edition."""
    new = edition.read(Path(source))
    if new is None:
        print(f"{source} holds no edition ({edition.MANIFEST})", file=sys.stderr)
        return 2
    mine = edition.read(ROOT)
    if mine is None:
        print("this copy is not a learner's edition (no edition.json): nothing to update", file=sys.stderr)
        return 2
    wanted = {rel: data for rel, data in edition.on_disk(Path(source), new).items() if rel in new["files"]}
    changes = edition.write(ROOT, wanted, {k: v for k, v in new.items() if k != "files"})
    print(f"edition {mine['version']} -> {new['version']}: {len(changes)} change(s)")
    return 0
