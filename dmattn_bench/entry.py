"""The eager entry: a call without gradient whose arguments ran before, served by one C++ call.

The native module (`dmattn_kernels.runtime.native`) holds it; once the module loads, `_connect`
keys plans by its tensor signature and hands it the dispatcher, the registry and the launch
stream, so that it answers None (and the call takes the Python path) whenever the dispatch state
or the overrides changed since it learned a call.
"""

from __future__ import annotations

from contextlib import contextmanager

from dmattn_kernels.runtime import native

# `ENTRY(*flash_dmattn_func's arguments)`: the call as one C++ call, or None. None while no
# module is loaded or the path is switched off.
ENTRY = None


def _connect(loaded) -> None:
    global ENTRY
    from dmattn_bench import dispatch, plan, registry
    from dmattn_kernels.runtime import launch_context

    plan.use_tensor_layouts(loaded.signature)
    loaded.configure(dispatch.DISPATCHER, registry, launch_context, launch_context.launch_stream, dispatch.ENV_VAR)
    ENTRY = loaded.entry


native.on_load(_connect)


def load() -> None:
    """Loads (or builds) the native module, wiring the entry."""
    native.module()


def learn(program, *arguments) -> bool:
    """Has the entry run `program` (a `native.Program`, or None: nothing to learn) for later calls
    keyed as `arguments` (`flash_dmattn_func`'s, in order); whether it will."""
    loaded = native.loaded()
    return program is not None and loaded is not None and loaded.learn(program, *arguments)


@contextmanager
def switched_off():
    """Plans built inside launch from Python and key calls as Python does (an in-process A/B of
    the two paths; `plan.clear()` first so that no plan built outside is reused)."""
    global ENTRY
    from dmattn_bench import plan

    entry = ENTRY
    with native.disabled() as before:
        ENTRY = None
        plan.use_tensor_layouts(plan.python_tensor_layouts)
        try:
            yield
        finally:
            ENTRY = entry
            if before is not None:
                plan.use_tensor_layouts(before.signature)
