"""The tests' warm interpreter: ``python tests/zygote.py FD`` is a :mod:`lifeguard.forkserver`
that has imported what the child programs import (mlflow, its sqlite store and MLflow's context
providers, git, psutil), and runs each forked child's program as ``python PROGRAM ARGS`` (or
``python -m MODULE ARGS``: the lifeguard CLI's sweeps) would: in ``__main__``'s namespace,
emptied, as the interpreter's top level. One frame differs: the program's top level runs under
this script's, so a traceback shows that frame first and
lifeguard's ``ending`` judges this frame as the bottom of the stack (conftest.py sends a program
whose top level raises SystemExit itself to a cold start). conftest.py decides which children
may be forked (see ``Scenario.run``); a child program that must start cold (the import order
under test, an interpreter flag, an environment read at startup) is exec'd as before.
"""

import sys

from lifeguard import demo, forkserver


def _preload() -> None:
    demo.default_signals()  # a fresh interpreter's dispositions, whatever pytest's worker has
    demo._preload()


def _become(request: dict[str, object]) -> tuple[object, dict[str, object]]:
    """This module's namespace, emptied and made the program's, and the program's code: what
    ``python PROGRAM`` gives the program's top level, or ``python -m MODULE`` (argv ``["-m",
    MODULE, ...]``) its module's."""
    import importlib.machinery
    import os

    if sys.argv[0] == "-m":
        return _become_module(sys.argv[1])
    path = os.path.abspath(str(sys.argv[0]))  # CPython's __file__ for a script, since 3.9
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    namespace = globals()
    # The dunders the interpreter gave this script are the ones it gives any script; the
    # program's own __file__ and loader replace ours, and its docstring (if any) is set by
    # its code.
    fresh = {key: value for key, value in namespace.items() if key.startswith("__")}
    fresh.update(
        __doc__=None,
        __file__=path,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    if "__annotations__" in fresh:
        fresh["__annotations__"] = {}
    namespace.clear()
    namespace.update(fresh)
    return code, namespace


def _become_module(module: str) -> tuple[object, dict[str, object]]:
    """``python -m MODULE ARGS``: what CPython's main does, through the same runpy function.
    argv becomes ``["-m", ARGS...]`` (runpy puts the module's path in its place), the working
    directory heads sys.path, and the module runs in ``__main__``'s namespace, emptied."""
    import os

    del sys.argv[1]
    sys.path[0] = os.getcwd()
    namespace = globals()
    fresh = {key: value for key, value in namespace.items() if key.startswith("__")}
    namespace.clear()
    namespace.update(fresh)
    code = compile(f"__import__('runpy')._run_module_as_main({module!r})", "<zygote: -m>", "exec")
    return code, namespace


request = forkserver.serve(int(sys.argv[1]), _preload)
if not request:
    raise SystemExit(0)
# A forked child. One statement: `exec` and `_become` are looked up before the namespace empties.
exec(*_become(request))
