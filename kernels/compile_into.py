"""One compiler run whose product lands whole or not at all, for the kernels' cubins
(`cuda.build`) and the native launch module (`runtime.native`): the compiler writes a scratch file
beside the target, which is renamed into place only once it succeeded, so an interrupted or
concurrent build never leaves half a file where a loader looks.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


class CompileFailed(Exception):
    """The compiler timed out or failed; the message says which (its first error line)."""


def compile_into(target: Path, command: list[str], timeout_s: float) -> Path:
    """Runs `command`, whose output argument is `target`'s path, on a scratch path instead, then
    renames the product to `target` and returns it.

    Raises:
        CompileFailed: "timed out after N s", or the compiler's first error line (its exit
            status where it printed none).
    """
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / target.name
        command = [str(output) if part == str(target) else part for part in command]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise CompileFailed(f"timed out after {timeout_s} s") from None
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise CompileFailed(errors[0] if errors else str(done.returncode))
        os.replace(output, target)
    return target
