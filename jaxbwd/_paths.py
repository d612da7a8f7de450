"""Output paths checked before any work: the command line and the bench scripts refuse a path
that cannot be written at once, not after minutes of timing or compiling."""
from __future__ import annotations

import os
from typing import Optional


def unwritable(path: str) -> Optional[str]:
    """Why ``path`` cannot be written, or None. A new file is tried by creating it (and
    removing it again), an existing regular file by opening it for appending (nothing is
    written): permissions alone do not tell, e.g. as root. Anything else already there (a
    link to nowhere, a pipe) is left untouched and to the write itself."""
    if os.path.isdir(path):
        return "is a folder, not a file"
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return "its folder does not exist"
    try:
        if not os.path.lexists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            os.remove(path)
        elif os.path.isfile(path) and not os.path.islink(path):
            with open(path, "a"):
                pass
    except FileExistsError:  # created by someone else meanwhile: theirs, not ours to remove
        return None
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    return None
