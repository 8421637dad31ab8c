"""Checks of command-line values that several commands share: the same mistake gets the same
message and exit code in each."""

from __future__ import annotations

from typing import Iterable

import click

INTERPRETER_DTYPES = "the Triton interpreter on this machine runs fp32 and fp16"


def reject_bf16_without_gpu(dtypes: Iterable[str], has_gpu: bool, param_hint: str = "--dtype") -> None:
    """bf16 on a machine without a CUDA GPU is a usage error (exit 2): the interpreter has no bf16
    arithmetic. `param_hint` names where the bf16 came from (`--dtype`, or a `--workloads` file).

    Raises:
        click.BadParameter: bf16 among `dtypes` and no GPU.
    """
    if has_gpu or "bf16" not in dtypes:
        return
    if param_hint == "--dtype":
        raise click.BadParameter(f"bf16 needs a CUDA GPU; {INTERPRETER_DTYPES}", param_hint=param_hint)
    raise click.BadParameter(f"its bf16 workloads need a CUDA GPU; {INTERPRETER_DTYPES} (pass --dtype fp32 or "
                             "--dtype fp16)", param_hint=param_hint)
